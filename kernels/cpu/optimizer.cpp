// CPU AdamW update, Σx², dtype conversion and fill over flat ranges (the reference for the CUDA versions).
#include <cmath>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {

namespace {

double load(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::f32: return static_cast<const float*>(t.data)[i];
    case DType::f64: return static_cast<const double*>(t.data)[i];
    case DType::bf16: return static_cast<float>(static_cast<const bf16*>(t.data)[i]);
    default: LT_FAIL("expected a float tensor, got {}", t.describe());
  }
}

void store(const Tensor& t, int64_t i, double v) {
  switch (t.dtype) {
    case DType::f32: static_cast<float*>(t.data)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(t.data)[i] = v; break;
    case DType::bf16: static_cast<bf16*>(t.data)[i] = bf16(static_cast<float>(v)); break;
    default: LT_FAIL("expected a float tensor, got {}", t.describe());
  }
}

void check_flat(const char* op, const Tensor& t, int64_t n, const char* name) {
  LT_CHECK(t.is_contiguous() && t.numel() == n, "{}: {} must be contiguous with {} elements; got {}", op, name, n,
           t.describe());
  LT_CHECK(t.dtype != DType::i32, "{}: {} is {}; expected a float tensor", op, name, t.describe());
}

inline double widen(float x) { return x; }
inline double widen(double x) { return x; }
inline double widen(bf16 x) { return static_cast<float>(x); }

// The update of one element, written once for every dtype combination: w is read and written in
// the master's (or param's) precision through double arithmetic.
template <class W, class G>
void adamw_loop(W* w, W* m, W* v, const G* grad, int64_t begin, int64_t end, const AdamWParams& p,
                double weight_decay, const Tensor* param_lowp) {
  // The per-step constants, computed as the CUDA backend computes them (kernels/cuda/optimizer.cu).
  const double inv_bc1 = 1.0 / p.bias_correction1, inv_sqrt_bc2 = 1.0 / std::sqrt(p.bias_correction2);
  for (int64_t i = begin; i < end; ++i) {
    const double g = widen(grad[i]) * p.grad_scale;
    const double mi = p.beta1 * static_cast<double>(m[i]) + (1.0 - p.beta1) * g;
    const double vi = p.beta2 * static_cast<double>(v[i]) + (1.0 - p.beta2) * g * g;
    m[i] = static_cast<W>(mi);
    v[i] = static_cast<W>(vi);
    double wi = static_cast<double>(w[i]);
    wi -= p.lr * (weight_decay * wi + (mi * inv_bc1) / (std::sqrt(vi) * inv_sqrt_bc2 + p.eps));
    w[i] = static_cast<W>(wi);
    if (param_lowp) store(*param_lowp, i, static_cast<double>(w[i]));
  }
}

// The runs between and inside p.no_decay, each with its weight decay.
template <class W, class G>
void adamw_ranges(W* w, W* m, W* v, const G* grad, int64_t n, const AdamWParams& p, const Tensor* param_lowp) {
  int64_t at = 0;
  for (const ElementRange& r : p.no_decay) {
    adamw_loop(w, m, v, grad, at, r.begin, p, p.weight_decay, param_lowp);
    adamw_loop(w, m, v, grad, r.begin, r.end, p, 0.0, param_lowp);
    at = r.end;
  }
  adamw_loop(w, m, v, grad, at, n, p, p.weight_decay, param_lowp);
}

}  // namespace

void convert(Tensor dst, Tensor src) {
  LT_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(),
           "convert: {} from {} (same element count, both contiguous)", dst.describe(), src.describe());
  for (int64_t i = 0; i < src.numel(); ++i) store(dst, i, load(src, i));
}

void fill(Tensor t, double value) {
  LT_CHECK(t.is_contiguous(), "fill: non-contiguous {}", t.describe());
  for (int64_t i = 0; i < t.numel(); ++i) store(t, i, value);
}

double sum_squares(Tensor x) {
  LT_CHECK(x.is_contiguous(), "sum_squares: non-contiguous {}", x.describe());
  double s = 0.0;
  if (x.dtype == DType::f32) {
    const float* p = x.ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  } else {
    for (int64_t i = 0; i < x.numel(); ++i) s += load(x, i) * load(x, i);
  }
  return s;
}

void sum_into(Tensor out, Tensor x, SumOf what, bool accumulate) {
  double s = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = load(x, i);
    s += what == SumOf::squares ? v * v : v;
  }
  double* o = out.ptr<double>();
  *o = accumulate ? *o + s : s;
}

void adamw_update(Tensor param, Tensor master, Tensor m, Tensor v, Tensor grad, const AdamWParams& p) {
  const int64_t n = param.numel();
  check_flat("adamw_update", param, n, "param");
  check_flat("adamw_update", m, n, "m");
  check_flat("adamw_update", v, n, "v");
  check_flat("adamw_update", grad, n, "grad");
  const Tensor& w = master.empty() ? param : master;
  if (!master.empty()) check_flat("adamw_update", master, n, "master");
  LT_CHECK(w.dtype == m.dtype && w.dtype == v.dtype && w.dtype != DType::bf16,
           "adamw_update: the weights updated ({}) and the moments ({}, {}) must share one f32/f64 dtype",
           w.describe(), m.describe(), v.describe());
  const Tensor* lowp = master.empty() ? nullptr : &param;
  if (w.dtype == DType::f64) {
    LT_CHECK(grad.dtype == DType::f64, "adamw_update: f64 weights take f64 gradients, got {}", grad.describe());
    adamw_ranges(w.ptr<double>(), m.ptr<double>(), v.ptr<double>(), grad.ptr<double>(), n, p, lowp);
  } else if (grad.dtype == DType::bf16) {
    adamw_ranges(w.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.ptr<bf16>(), n, p, lowp);
  } else {
    adamw_ranges(w.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.ptr<float>(), n, p, lowp);
  }
}

}  // namespace longtrain::ops::cpu
