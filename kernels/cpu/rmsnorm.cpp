// CPU reference for RMSNorm. Sums over the channel dimension are accumulated in double for both
// float and double tensors, so the f32 path is as close to exact as its storage allows (it is the
// oracle the CUDA kernels are compared with).
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

bool last_dim_unit_stride(const Tensor& t) {
  return t.ndim > 0 && (t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1);
}

// x, y (or dx, dy) [T, C]; w [C]; rstd [T]; every float tensor of one dtype.
void check_rmsnorm(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> rows,
                   const Tensor& w, const Tensor& rstd) {
  const Tensor& x = *rows.begin()->second;
  LT_CHECK(x.ndim == 2 && w.ndim == 1 && rstd.ndim == 1,
           "{}: expected x [T, C], w [C], rstd [T]; got x {}, w {}, rstd {}", op, x.describe(), w.describe(),
           rstd.describe());
  LT_CHECK(w.shape[0] == x.shape[1] && rstd.shape[0] == x.shape[0],
           "{}: shapes disagree: x {}, w {}, rstd {} (expected x [T, C], w [C], rstd [T])", op, x.describe(),
           w.describe(), rstd.describe());
  for (auto [name, t] : rows) {
    LT_CHECK(t->ndim == 2 && t->shape[0] == x.shape[0] && t->shape[1] == x.shape[1],
             "{}: {} {} must have the shape of x {}", op, name, t->describe(), x.describe());
    LT_CHECK(t->dtype == x.dtype, "{}: {} {} and x {} must have the same dtype", op, name, t->describe(),
             x.describe());
    LT_CHECK(last_dim_unit_stride(*t), "{}: {} {} must be unit-stride in its last dimension (stride {})", op,
             name, t->describe(), t->stride[1]);
  }
  LT_CHECK(w.dtype == x.dtype && rstd.dtype == x.dtype,
           "{}: w {} and rstd {} must have the dtype of x {}", op, w.describe(), rstd.describe(), x.describe());
  LT_CHECK(last_dim_unit_stride(w) && last_dim_unit_stride(rstd),
           "{}: w and rstd must be contiguous (strides {} and {})", op, w.stride[0], rstd.stride[0]);
  LT_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): x {}", op, dtype_name(x.dtype),
           x.describe());
}

template <class T>
void rmsnorm_forward_impl(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) {
  // y [T, C], rstd [T], x [T, C], w [C]
  const int64_t n_tokens = x.shape[0], C = x.shape[1];
  const T* xp = x.ptr<T>();
  const T* wp = w.ptr<T>();
  T* yp = y.ptr<T>();
  T* rp = rstd.ptr<T>();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* xt = xp + t * x.stride[0];
    T* yt = yp + t * y.stride[0];
    double sum_sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sum_sq += static_cast<double>(xt[c]) * xt[c];
    const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(C) + eps);
    for (int64_t c = 0; c < C; ++c) yt[c] = static_cast<T>(static_cast<double>(xt[c]) * r * wp[c]);
    rp[t] = static_cast<T>(r);
  }
}

template <class T>
void rmsnorm_backward_impl(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                           const Tensor& rstd, GradWrite dw_write) {
  // dx [T, C] (+=), dw [C] (+= or =), dy [T, C], x [T, C], w [C], rstd [T]
  // With y_c = w_c x_c r and r = (mean(x²) + eps)^(-1/2), dr/dx_j = -r³ x_j / C, so
  //   dx_j = r w_j dy_j - x_j r³ / C · Σ_c dy_c w_c x_c,   dw_c = Σ_t dy_c x_c r.
  const int64_t n_tokens = x.shape[0], C = x.shape[1];
  const T* dyp = dy.ptr<T>();
  const T* xp = x.ptr<T>();
  const T* wp = w.ptr<T>();
  const T* rp = rstd.ptr<T>();
  T* dxp = dx.ptr<T>();
  T* dwp = dw.ptr<T>();
  std::vector<double> dw_sum(static_cast<size_t>(C), 0.0);  // Σ_t in double, added to dw once
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* dyt = dyp + t * dy.stride[0];
    const T* xt = xp + t * x.stride[0];
    T* dxt = dxp + t * dx.stride[0];
    const double r = rp[t];
    double dot = 0.0;  // Σ_c dy_c w_c x_c
    for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(dyt[c]) * wp[c] * xt[c];
    const double k = dot * r * r * r / static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      dxt[c] += static_cast<T>(r * wp[c] * dyt[c] - k * xt[c]);
      dw_sum[c] += static_cast<double>(dyt[c]) * xt[c] * r;
    }
  }
  for (int64_t c = 0; c < C; ++c)
    dwp[c] = dw_write == GradWrite::overwrite ? static_cast<T>(dw_sum[c]) : dwp[c] + static_cast<T>(dw_sum[c]);
}

}  // namespace

void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  check_rmsnorm("rmsnorm_forward", {{"x", &x}, {"y", &y}}, w, rstd);
  LT_CHECK(eps >= 0.0, "rmsnorm_forward: eps must be >= 0 (model.norm_eps), got {}", eps);
  if (x.dtype == DType::f32) return rmsnorm_forward_impl<float>(y, rstd, x, w, eps);
  return rmsnorm_forward_impl<double>(y, rstd, x, w, eps);
}

void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd, GradWrite dw_write) {
  check_rmsnorm("rmsnorm_backward", {{"x", &x}, {"dx", &dx}, {"dy", &dy}}, w, rstd);
  LT_CHECK(dw.ndim == 1 && dw.shape[0] == w.shape[0] && dw.dtype == x.dtype && last_dim_unit_stride(dw),
           "rmsnorm_backward: dw {} must be a contiguous tensor of the shape of w {} and the dtype of x {}",
           dw.describe(), w.describe(), x.describe());
  if (x.dtype == DType::f32) return rmsnorm_backward_impl<float>(dx, dw, dy, x, w, rstd, dw_write);
  return rmsnorm_backward_impl<double>(dx, dw, dy, x, w, rstd, dw_write);
}

}  // namespace longtrain::ops::cpu
