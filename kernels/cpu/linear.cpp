// CPU linear layer (no bias) through OpenBLAS: y = x · Wᵀ with W in the PyTorch/HF [out, in] layout.
// Row-major views with any row stride work (lda = stride[0]), so a GEMM can read or write a column
// slice of a fused buffer in place.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "kernels/cpu/blas_gemm.h"

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

// C [M, N] = A' · B' + beta · C (kernels/cpu/blas_gemm.h).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  longtrain::cpu::blas_gemm("linear", trans_a, trans_b, M, N, K, T(1), A, lda, B, ldb, beta, C, ldc);
}

// The leading dimension BLAS reads a row-major [rows, cols] view with: its row stride. A single row
// has no meaningful stride, but BLAS still wants ld >= max(1, cols).
int64_t leading_dim(const Tensor& t) { return t.shape[0] <= 1 ? std::max<int64_t>(1, t.shape[1]) : t.stride[0]; }

// Every named tensor must be a 2-d row-major view of `dtype` whose rows do not overlap.
void check_matrix(const char* op, const char* name, const Tensor& t, DType dtype) {
  LT_CHECK(t.ndim == 2, "{}: {} must be 2-d, got {}", op, name, t.describe());
  LT_CHECK(t.dtype == dtype, "{}: {} {} must have dtype {} like the other operands", op, name, t.describe(),
           dtype_name(dtype));
  LT_CHECK(t.shape[1] <= 1 || t.stride[1] == 1, "{}: {} {} must be unit-stride in its last dimension (stride {})",
           op, name, t.describe(), t.stride[1]);
  LT_CHECK(t.shape[0] <= 1 || t.stride[0] >= t.shape[1],
           "{}: {} {} has row stride {} < {} columns: its rows overlap", op, name, t.describe(), t.stride[0],
           t.shape[1]);
}

void check_float_dtype(const char* op, const Tensor& t) {
  LT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): x {}", op, dtype_name(t.dtype),
           t.describe());
}

template <class T>
void linear_forward_impl(const Tensor& y, const Tensor& x, const Tensor& w) {
  // y [T, N] = x [T, K] · w [N, K]ᵀ
  const int64_t n_tokens = x.shape[0], K = x.shape[1], N = w.shape[0];
  gemm<T>(false, true, n_tokens, N, K, x.ptr<T>(), leading_dim(x), w.ptr<T>(), leading_dim(w), T(0), y.ptr<T>(),
          leading_dim(y));
}

template <class T>
void linear_backward_impl(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                          GradWrite dw_write) {
  // dx [T, K] = dy [T, N] · w [N, K]          (overwritten; skipped when dx is empty)
  // dw [N, K] += dy [T, N]ᵀ · x [T, K]        (accumulated, or overwritten: beta = 0 never reads dw;
  //                                             skipped when dw is empty)
  const int64_t n_tokens = x.shape[0], K = x.shape[1], N = w.shape[0];
  if (!dx.empty())
    gemm<T>(false, false, n_tokens, K, N, dy.ptr<T>(), leading_dim(dy), w.ptr<T>(), leading_dim(w), T(0),
            dx.ptr<T>(), leading_dim(dx));
  if (dw.empty()) return;
  gemm<T>(true, false, N, K, n_tokens, dy.ptr<T>(), leading_dim(dy), x.ptr<T>(), leading_dim(x),
          dw_write == GradWrite::overwrite ? T(0) : T(1), dw.ptr<T>(), leading_dim(dw));
}

}  // namespace

void linear_forward(Tensor y, Tensor x, Tensor w) {
  const char* op = "linear_forward";
  check_float_dtype(op, x);
  check_matrix(op, "x", x, x.dtype);
  check_matrix(op, "w", w, x.dtype);
  check_matrix(op, "y", y, x.dtype);
  LT_CHECK(w.shape[1] == x.shape[1] && y.shape[0] == x.shape[0] && y.shape[1] == w.shape[0],
           "{}: shapes disagree: y {}, x {}, w {} (expected y [T, N], x [T, K], w [N, K])", op, y.describe(),
           x.describe(), w.describe());
  if (x.dtype == DType::f32) return linear_forward_impl<float>(y, x, w);
  return linear_forward_impl<double>(y, x, w);
}

void linear_residual_forward(Tensor y, Tensor x, Tensor w, Tensor residual) {
  const char* op = "linear_residual_forward";
  check_float_dtype(op, x);
  check_matrix(op, "x", x, x.dtype);
  check_matrix(op, "w", w, x.dtype);
  check_matrix(op, "y", y, x.dtype);
  check_matrix(op, "residual", residual, x.dtype);
  LT_CHECK(w.shape[1] == x.shape[1] && y.shape[0] == x.shape[0] && y.shape[1] == w.shape[0] &&
               residual.shape[0] == y.shape[0] && residual.shape[1] == y.shape[1],
           "{}: shapes disagree: y {}, x {}, w {}, residual {} (expected y and residual [T, N], x [T, K], w [N, K])",
           op, y.describe(), x.describe(), w.describe(), residual.describe());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const int64_t rows = y.shape[0], cols = y.shape[1];
    if (y.data != residual.data) {  // y := residual, then the GEMM adds into it with beta = 1
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(residual.ptr<T>() + r * residual.stride[0], cols, y.ptr<T>() + r * y.stride[0]);
    } else {
      LT_CHECK(rows <= 1 || y.stride[0] == residual.stride[0], "{}: y {} and residual {} share memory with different strides",
               op, y.describe(), residual.describe());
    }
    gemm<T>(false, true, rows, cols, x.shape[1], x.ptr<T>(), leading_dim(x), w.ptr<T>(), leading_dim(w), T(1),
            y.ptr<T>(), leading_dim(y));
  };
  if (x.dtype == DType::f32) return run(0.0f);
  return run(0.0);
}

void linear_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, GradWrite dw_write) {
  const char* op = "linear_backward";
  check_float_dtype(op, x);
  check_matrix(op, "x", x, x.dtype);
  check_matrix(op, "w", w, x.dtype);
  check_matrix(op, "dy", dy, x.dtype);
  LT_CHECK(!dx.empty() || !dw.empty(), "{}: dx and dw are both empty: nothing to compute", op);
  LT_CHECK(w.shape[1] == x.shape[1] && dy.shape[0] == x.shape[0] && dy.shape[1] == w.shape[0],
           "{}: shapes disagree: dy {}, x {}, w {} (expected dy [T, N], x [T, K], w [N, K])", op, dy.describe(),
           x.describe(), w.describe());
  if (!dw.empty()) {
    check_matrix(op, "dw", dw, x.dtype);
    LT_CHECK(dw.shape[0] == w.shape[0] && dw.shape[1] == w.shape[1], "{}: dw {} must have the shape of w {}", op,
             dw.describe(), w.describe());
  }
  if (!dx.empty()) {
    check_matrix(op, "dx", dx, x.dtype);
    LT_CHECK(dx.shape[0] == x.shape[0] && dx.shape[1] == x.shape[1], "{}: dx {} must have the shape of x {}", op,
             dx.describe(), x.describe());
  }
  if (x.dtype == DType::f32) return linear_backward_impl<float>(dx, dw, dy, x, w, dw_write);
  return linear_backward_impl<double>(dx, dw, dy, x, w, dw_write);
}

}  // namespace longtrain::ops::cpu
