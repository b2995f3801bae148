// CPU residual add, y += x, on views of any shape up to 4-d (strided rows allowed, the last
// dimension unit-stride).
#include <algorithm>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

// The view as exactly 4 dims (leading extents of 1), so one loop nest covers every rank.
struct View4 {
  int64_t shape[4];
  int64_t stride[4];
};

View4 as_4d(const Tensor& t) {
  View4 v{{1, 1, 1, 1}, {0, 0, 0, 0}};
  const int pad = 4 - t.ndim;
  for (int d = 0; d < t.ndim; ++d) {
    v.shape[pad + d] = t.shape[d];
    v.stride[pad + d] = t.stride[d];
  }
  return v;
}

template <class T>
void add_inplace_impl(const Tensor& y, const Tensor& x) {
  const View4 vy = as_4d(y), vx = as_4d(x);
  T* yp = y.ptr<T>();
  const T* xp = x.ptr<T>();
  for (int64_t a = 0; a < vy.shape[0]; ++a)
    for (int64_t b = 0; b < vy.shape[1]; ++b)
      for (int64_t c = 0; c < vy.shape[2]; ++c) {
        T* yr = yp + a * vy.stride[0] + b * vy.stride[1] + c * vy.stride[2];
        const T* xr = xp + a * vx.stride[0] + b * vx.stride[1] + c * vx.stride[2];
        for (int64_t d = 0; d < vy.shape[3]; ++d) yr[d] += xr[d];
      }
}

}  // namespace

void add_inplace(Tensor y, Tensor x) {
  LT_CHECK(y.ndim == x.ndim && std::equal(y.shape.begin(), y.shape.begin() + y.ndim, x.shape.begin()),
           "add_inplace: y {} and x {} must have the same shape", y.describe(), x.describe());
  LT_CHECK(y.dtype == x.dtype, "add_inplace: y {} and x {} must have the same dtype", y.describe(), x.describe());
  LT_CHECK(y.dtype == DType::f32 || y.dtype == DType::f64,
           "add_inplace: dtype {} is not supported by the CPU backend (use f32 or f64): y {}", dtype_name(y.dtype),
           y.describe());
  if (y.ndim > 0) {
    const int last = y.ndim - 1;
    LT_CHECK(y.shape[last] <= 1 || (y.stride[last] == 1 && x.stride[last] == 1),
             "add_inplace: the last dimension must be unit-stride (y {} stride {}, x {} stride {})", y.describe(),
             y.stride[last], x.describe(), x.stride[last]);
  }
  if (y.dtype == DType::f32) return add_inplace_impl<float>(y, x);
  return add_inplace_impl<double>(y, x);
}

}  // namespace longtrain::ops::cpu
