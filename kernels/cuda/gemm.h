// The one GEMM entry point of the CUDA ops (cuBLASLt; kernels/cuda/linear.cu), shared by linear and
// the fused LM head + cross-entropy.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.h"
#include "runtime/dtype.h"

namespace longtrain::cuda_util {

// ops::gemm_choices and ops::gemm_trials_pending on CUDA (kernels/ops.h says what they do; the policy
// itself is ops::gemm_algo_policy, read when a shape is first planned).
std::vector<ops::GemmChoice> gemm_choices();
int gemm_trials_pending();
int64_t gemm_trial_calls();

// The bytes a column-major matrix occupies: `cols` columns of `rows` elements, ld elements apart.
struct MatrixBytes {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  size_t elem_size = 0;
};
// Under GEMM algorithm auto: whether a call may run more than once into its D with the same result, so
// that its shape's whole trial runs inside this one call. That holds when D shares no byte with A, B
// and, where beta != 0 reads it, C. A call that adds into D (C = D, beta 1: the residual in place, a
// weight gradient accumulated) must run once per call, so its trial spreads over the shape's first
// calls. (A shape called once a step, the LM head's first loss chunk's weight gradient with beta 0,
// would otherwise keep a trial running for 18 steps.)
bool gemm_call_repeatable(const MatrixBytes& a, const MatrixBytes& b, const MatrixBytes& c, const MatrixBytes& d,
                          bool reads_c);
// A trial of `candidates` algorithms is gemm_trial_length(candidates) runs: one untimed round, then
// the timed rounds, candidate r % candidates at run r. A call `calls_done` runs into its trial makes
// gemm_trial_runs of them: the rest of the trial when repeatable, else one.
int gemm_trial_length(int candidates);
int gemm_trial_runs(int candidates, int calls_done, bool repeatable);

// Column-major D[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · D, on cuda_stream().
// A is stored k×m when trans_a (else m×k) with leading dimension lda; B likewise; D is m×n, ldd.
// A and B have dtype `ab` (bf16 or f32), D has dtype `d` (bf16 or f32; f32 with bf16 inputs is the
// weight-gradient case). Accumulation is fp32 (no TF32). Matmul descriptors, layouts and the
// algorithm (above) are cached per shape, leading dimensions, dtypes and pointer alignment.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, void* D, int64_t ldd, DType ab, DType d, float alpha, float beta);
// The same with D = alpha · op(A) · op(B) + beta · C for a C apart from D (C has D's dtype, leading
// dimension ldc): the residual add of linear_residual_forward in the GEMM's epilogue.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, const void* C, int64_t ldc, void* D, int64_t ldd, DType ab, DType d, float alpha, float beta);

}  // namespace longtrain::cuda_util
