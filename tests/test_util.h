// Helpers shared by the tests: owning host tensors, seeded random fill, rounding to a dtype, reading
// a (device) tensor back as doubles or bytes, error norms and central finite differences.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <vector>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace longtrain::test {

// A contiguous host tensor that owns its storage.
template <class T>
struct HostTensor {
  std::vector<T> values;
  Tensor view;

  HostTensor() = default;
  explicit HostTensor(std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    values.assign(static_cast<size_t>(n), T{});
    view = Tensor(values.data(), dtype_of<T>(), shape);
  }
  HostTensor(const HostTensor& o) : values(o.values), view(o.view) { view.data = values.data(); }
  HostTensor& operator=(const HostTensor& o) {
    values = o.values;
    view = o.view;
    view.data = values.data();
    return *this;
  }
  T& operator[](size_t i) { return values[i]; }
  const T& operator[](size_t i) const { return values[i]; }
  size_t size() const { return values.size(); }
  operator Tensor() const { return view; }
};

// Fills with uniform values in [lo, hi) from a fixed seed.
template <class T>
void fill_uniform(HostTensor<T>& t, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& v : t.values) v = static_cast<T>(dist(rng));
}

// max |a - b| / max |b|: the error of a relative to the reference b, in b's scale.
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return den > 0.0 ? num / den : num;
}

// Rounds v to what `dtype` stores (bf16 round-to-nearest-even, f32, or unchanged for f64).
inline double round_to(double v, DType dtype) {
  if (dtype == DType::bf16) return static_cast<float>(bf16(static_cast<float>(v)));
  if (dtype == DType::f32) return static_cast<float>(v);
  return v;
}

inline std::vector<double> round_all(std::vector<double> v, DType dtype) {
  for (double& x : v) x = round_to(x, dtype);
  return v;
}

// The contiguous tensor t (on any device) as doubles.
inline std::vector<double> download(const Tensor& t) {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<unsigned char> host(n * dtype_size(t.dtype));
  Tensor dst = t;
  dst.data = host.data();
  dst.device = Device::cpu;
  copy(dst, t);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::bf16: out[i] = static_cast<float>(reinterpret_cast<const bf16*>(host.data())[i]); break;
      case DType::f32: out[i] = reinterpret_cast<const float*>(host.data())[i]; break;
      case DType::f64: out[i] = reinterpret_cast<const double*>(host.data())[i]; break;
      case DType::i32: out[i] = reinterpret_cast<const int32_t*>(host.data())[i]; break;
    }
  }
  return out;
}

// The raw bytes of a contiguous tensor on any device (for bitwise run-twice comparisons).
inline std::vector<unsigned char> download_bytes(const Tensor& t) {
  std::vector<unsigned char> host(t.nbytes());
  Tensor dst = t;
  dst.data = host.data();
  dst.device = Device::cpu;
  copy(dst, t);
  return host;
}

// Central differences (f(x + h e_i) - f(x - h e_i)) / 2h for every element of x, restoring x.
inline std::vector<double> finite_difference(std::vector<double>& x, const std::function<double()>& f,
                                             double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double up = f();
    x[i] = saved - h;
    double down = f();
    x[i] = saved;
    g[i] = (up - down) / (2.0 * h);
  }
  return g;
}

}  // namespace longtrain::test
