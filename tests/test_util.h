// Helpers shared by the tests: owning host tensors, seeded random fill, error norms and central
// finite differences.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <vector>

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
