// CPU reference for SwiGLU on the fused gate/up GEMM output: out = silu(gate) ⊙ up, where gate is
// the first F columns of gate_up [T, 2F] and up the last F. Computed in double for float tensors too.
#include <cmath>
#include <initializer_list>
#include <utility>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

bool last_dim_unit_stride(const Tensor& t) {
  return t.ndim > 0 && (t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1);
}

// The logistic function without overflow: exp is only ever taken of a non-positive number, so a
// gate of ±1000 gives 1 or 0 instead of inf/inf = NaN.
double sigmoid(double g) {
  if (g >= 0.0) return 1.0 / (1.0 + std::exp(-g));
  const double e = std::exp(g);
  return e / (1.0 + e);
}

// half [T, F] (out or d_out) against gate_up-like [T, 2F] tensors.
void check_swiglu(const char* op, const char* half_name, const Tensor& half,
                  std::initializer_list<std::pair<const char*, const Tensor*>> fused) {
  LT_CHECK(half.ndim == 2, "{}: {} must be [T, F], got {}", op, half_name, half.describe());
  LT_CHECK(half.dtype == DType::f32 || half.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): {} {}", op,
           dtype_name(half.dtype), half_name, half.describe());
  LT_CHECK(last_dim_unit_stride(half), "{}: {} {} must be unit-stride in its last dimension (stride {})", op,
           half_name, half.describe(), half.stride[1]);
  for (auto [name, t] : fused) {
    LT_CHECK(t->ndim == 2 && t->shape[0] == half.shape[0] && t->shape[1] == 2 * half.shape[1],
             "{}: {} {} must be [T, 2F] for {} {} [T, F] (gate columns [0, F), up columns [F, 2F))", op, name,
             t->describe(), half_name, half.describe());
    LT_CHECK(t->dtype == half.dtype, "{}: {} {} and {} {} must have the same dtype", op, name, t->describe(),
             half_name, half.describe());
    LT_CHECK(last_dim_unit_stride(*t), "{}: {} {} must be unit-stride in its last dimension (stride {})", op,
             name, t->describe(), t->stride[1]);
  }
}

template <class T>
void swiglu_forward_impl(const Tensor& out, const Tensor& gate_up) {
  // out [T, F], gate_up [T, 2F]
  const int64_t n_tokens = out.shape[0], F = out.shape[1];
  const T* gu = gate_up.ptr<T>();
  T* o = out.ptr<T>();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* gate = gu + t * gate_up.stride[0];
    const T* up = gate + F;
    T* ot = o + t * out.stride[0];
    for (int64_t f = 0; f < F; ++f) {
      const double g = gate[f];
      ot[f] = static_cast<T>(g * sigmoid(g) * static_cast<double>(up[f]));
    }
  }
}

template <class T>
void swiglu_backward_impl(const Tensor& d_gate_up, const Tensor& d_out, const Tensor& gate_up, const Tensor& out) {
  // d_gate_up [T, 2F], d_out [T, F], gate_up [T, 2F], out [T, F] or empty
  // d up = d_out · silu(g);  d gate = d_out · up · silu'(g),  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
  // g and u are read before either gradient is written, so d_gate_up may alias gate_up. out is the
  // forward's expression exactly (swiglu_forward_impl), so it equals the forward's output bit for bit.
  const int64_t n_tokens = d_out.shape[0], F = d_out.shape[1];
  const T* gu = gate_up.ptr<T>();
  const T* dout = d_out.ptr<T>();
  T* dgu = d_gate_up.ptr<T>();
  T* o = out.empty() ? nullptr : out.ptr<T>();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* gate = gu + t * gate_up.stride[0];
    const T* up = gate + F;
    const T* dot = dout + t * d_out.stride[0];
    T* dgate = dgu + t * d_gate_up.stride[0];
    T* dup = dgate + F;
    T* ot = o == nullptr ? nullptr : o + t * out.stride[0];
    for (int64_t f = 0; f < F; ++f) {
      const double g = gate[f], u = up[f], d = dot[f];
      const double s = sigmoid(g);
      if (ot != nullptr) ot[f] = static_cast<T>(g * s * u);
      dgate[f] = static_cast<T>(d * u * s * (1.0 + g * (1.0 - s)));
      dup[f] = static_cast<T>(d * g * s);
    }
  }
}

}  // namespace

void swiglu_forward(Tensor out, Tensor gate_up) {
  check_swiglu("swiglu_forward", "out", out, {{"gate_up", &gate_up}});
  if (out.dtype == DType::f32) return swiglu_forward_impl<float>(out, gate_up);
  return swiglu_forward_impl<double>(out, gate_up);
}

void swiglu_backward(Tensor d_gate_up, Tensor d_out, Tensor gate_up, Tensor out) {
  const char* op = "swiglu_backward";
  check_swiglu(op, "d_out", d_out, {{"d_gate_up", &d_gate_up}, {"gate_up", &gate_up}});
  if (!out.empty()) {
    LT_CHECK(out.ndim == 2 && out.shape[0] == d_out.shape[0] && out.shape[1] == d_out.shape[1] &&
                 out.dtype == d_out.dtype && last_dim_unit_stride(out),
             "{}: out {} (the recomputed forward output) must be like d_out {}: [T, F], its dtype, unit-stride rows",
             op, out.describe(), d_out.describe());
  }
  if (d_out.dtype == DType::f32) return swiglu_backward_impl<float>(d_gate_up, d_out, gate_up, out);
  return swiglu_backward_impl<double>(d_gate_up, d_out, gate_up, out);
}

}  // namespace longtrain::ops::cpu
