// The one BLAS GEMM call of the CPU path (linear, cross-entropy and block attention): row-major, with
// the empty-sum case written out and the 32-bit limits of the CBLAS interface checked.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "runtime/error.h"

namespace longtrain::cpu {

// C [M, N] = alpha · A' · B' + beta · C, row-major; A' = A or Aᵀ, B' = B or Bᵀ as the flags say.
// `op` names the caller in errors.
template <class T>
void blas_gemm(const char* op, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
               int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "BLAS GEMM is float or double");
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: C = beta · C, written out rather than trusting every BLAS with K = 0
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  LT_CHECK(std::max({M, N, K, lda, ldb, ldc}) <= INT_MAX,
           "{}: GEMM of {}x{}x{} (leading dims {}, {}, {}) exceeds the 32-bit sizes of the BLAS interface", op, M, N,
           K, lda, ldb, ldc);
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
                static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
                static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
  }
}

}  // namespace longtrain::cpu
