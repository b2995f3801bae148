// Linear layers (no bias) on cuBLASLt: bf16 (or f32) inputs, fp32 accumulation, the weight gradient
// accumulated in place with beta = 1. Row-major [T, K] tensors are column-major K×T matrices to
// cuBLAS, so every product below is written in its column-major form.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

#define LT_CUBLAS_CHECK(expr)                                                                         \
  do {                                                                                                \
    cublasStatus_t st_ = (expr);                                                                      \
    LT_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "{} failed: {} ({})", #expr, cublasLtGetStatusName(st_),   \
             cublasLtGetStatusString(st_));                                                           \
  } while (0)

namespace longtrain::cuda_util {

using ops::GemmAlgoPolicy;
using ops::GemmChoice;

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what llm.c and PyTorch give cuBLASLt on Hopper
// Under auto: how many of the heuristic's answers are measured, and in how many timed rounds (after one
// untimed round, whose runs may load a kernel's module). A call that may run repeatedly into its output
// (gemm_call_repeatable) runs all 6 · 3 = 18 trial runs at once; the others (accumulating in place) run
// once per call, and a model's per-layer GEMMs end their 18 inside the first step of a 22-layer model.
constexpr int kGemmCandidates = 6;
constexpr int kGemmTimedRounds = 2;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    default: LT_FAIL("gemm: dtype {} is not supported (bf16 or f32)", dtype_name(t));
  }
}

// Largest power of two <= 256 dividing both the address and the leading dimension in bytes.
uint32_t alignment(const void* p, int64_t ld, DType t) {
  uint64_t v = reinterpret_cast<uint64_t>(p) | static_cast<uint64_t>(ld * dtype_size(t));
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a >>= 1;
  return a;
}

// The last element: the policy the plan was made under (a plan made under heuristic has one algorithm).
using GemmKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                           uint32_t, uint32_t, uint32_t, uint32_t, bool, int>;

// One CUDA event pair around a timed trial call.
struct GemmTiming {
  cudaEvent_t start = nullptr, end = nullptr;
  int candidate = 0;
};

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;  // the heuristic's answers in its order
  std::string shape;                        // for the log and gemm_choices()
  // The trial under auto: runs issued so far (several a call where it may rerun), their timings, and
  // the decision (algos' index).
  int calls = 0;
  std::vector<GemmTiming> timings;
  std::optional<int> chosen;
};

struct Gemms {
  std::mutex mutex;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  int trials_pending = 0;
  int64_t trial_calls = 0;  // calls run as part of a trial, ever (ops::gemm_trial_calls)
  std::vector<GemmChoice> choices;
  // Plans live as long as the process: descriptors are tiny, and destroying them at exit would race
  // the CUDA runtime's own teardown.
  std::map<GemmKey, GemmPlan> plans;
};

// The handle and workspace are made by the first GEMM (under the mutex), not here: gemm_choices and
// gemm_trials_pending run without a GPU too.
Gemms& gemms() {
  static Gemms* g = new Gemms;
  return *g;
}

void init_handle_locked(Gemms& g) {
  if (g.handle != nullptr) return;
  LT_CUBLAS_CHECK(cublasLtCreate(&g.handle));
  g.workspace = scratch(Scratch::cublas_workspace, kWorkspaceBytes);
}

GemmPlan make_plan(cublasLtHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                   int64_t lda, int64_t ldb, int64_t ldc, int64_t ldd, DType ab, DType d, uint32_t align_a,
                   uint32_t align_b, uint32_t align_c, uint32_t align_d, bool accumulate, int candidates) {
  GemmPlan p;
  LT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Stored shapes: A is k×m when transposed, else m×k; B is n×k when transposed, else k×n.
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(ab), trans_a ? k : m, trans_a ? m : k, lda));
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(ab), trans_b ? n : k, trans_b ? k : n, ldb));
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(d), m, n, ldc));
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, cuda_type(d), m, n, ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = kWorkspaceBytes;
  LT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                       sizeof(align_a)));
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                       sizeof(align_b)));
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                       sizeof(align_c)));
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                       sizeof(align_d)));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(candidates));
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref, candidates,
                                                     results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  LT_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
           "cuBLASLt has no algorithm for m={} n={} k={} (lda={} ldb={} ldc={} ldd={}, {} inputs, {} output, "
           "transa={} transb={}, alignments {}/{}/{}/{} bytes, accumulate={}): {}",
           m, n, k, lda, ldb, ldc, ldd, dtype_name(ab), dtype_name(d), trans_a, trans_b, align_a, align_b, align_c,
           align_d, accumulate, cublasLtGetStatusString(st));
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[static_cast<size_t>(i)];
    if (r.state == CUBLAS_STATUS_SUCCESS) p.algos.push_back(r.algo);
  }
  LT_CHECK(!p.algos.empty(), "cuBLASLt's heuristic answered m={} n={} k={} with no usable algorithm", m, n, k);
  p.shape = fmt::format("m={} n={} k={}{}{} {} in, {} out{}", m, n, k, trans_a ? " A^T" : "", trans_b ? " B^T" : "",
                        dtype_name(ab), dtype_name(d), accumulate ? ", beta 1" : "");
  if (p.algos.size() == 1) p.chosen = 0;
  return p;
}

// After a shape's last trial call: wait for it, take each candidate's fastest call, decide, log.
void decide(Gemms& g, GemmPlan& p) {
  LT_CUDA_CHECK(cudaEventSynchronize(p.timings.back().end));
  std::vector<double> best(p.algos.size(), 1e300);
  for (const GemmTiming& t : p.timings) {
    float ms = 0.0f;
    LT_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.end));
    best[static_cast<size_t>(t.candidate)] = std::min(best[static_cast<size_t>(t.candidate)], static_cast<double>(ms));
    LT_CUDA_CHECK(cudaEventDestroy(t.start));
    LT_CUDA_CHECK(cudaEventDestroy(t.end));
  }
  p.timings.clear();
  const int chosen = static_cast<int>(std::min_element(best.begin(), best.end()) - best.begin());
  p.chosen = chosen;
  --g.trials_pending;
  GemmChoice c{p.shape, chosen, static_cast<int>(p.algos.size()), best[static_cast<size_t>(chosen)], best[0]};
  std::fprintf(stderr, "longtrain: gemm %s: cuBLASLt algorithm %d of %d (%.3f ms; the heuristic's first %.3f ms)\n",
               c.shape.c_str(), c.chosen + 1, c.candidates, c.chosen_ms, c.heuristic_ms);
  g.choices.push_back(std::move(c));
}

// [first, last) byte addresses of a matrix (empty for a matrix without elements).
std::pair<uintptr_t, uintptr_t> byte_range(const MatrixBytes& m) {
  LT_CHECK(m.rows >= 0 && m.cols >= 0 && m.ld >= m.rows && m.elem_size > 0,
           "gemm: a {}x{} matrix with leading dimension {} and {}-byte elements", m.rows, m.cols, m.ld, m.elem_size);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(m.data);
  if (m.rows == 0 || m.cols == 0) return {begin, begin};
  return {begin, begin + static_cast<uintptr_t>(((m.cols - 1) * m.ld + m.rows) * static_cast<int64_t>(m.elem_size))};
}

bool overlap(const MatrixBytes& x, const MatrixBytes& y) {
  const auto [x0, x1] = byte_range(x);
  const auto [y0, y1] = byte_range(y);
  return x0 < x1 && y0 < y1 && x0 < y1 && y0 < x1;
}

}  // namespace

bool gemm_call_repeatable(const MatrixBytes& a, const MatrixBytes& b, const MatrixBytes& c, const MatrixBytes& d,
                          bool reads_c) {
  return !overlap(d, a) && !overlap(d, b) && !(reads_c && overlap(d, c));
}

int gemm_trial_length(int candidates) {
  LT_CHECK(candidates >= 1, "gemm trial: {} candidates", candidates);
  return candidates * (1 + kGemmTimedRounds);
}

int gemm_trial_runs(int candidates, int calls_done, bool repeatable) {
  const int length = gemm_trial_length(candidates);
  LT_CHECK(calls_done >= 0 && calls_done < length, "gemm trial: run {} is not in the trial's {}", calls_done, length);
  return repeatable ? length - calls_done : 1;
}

std::vector<GemmChoice> gemm_choices() {
  Gemms& g = gemms();
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.choices;
}

int gemm_trials_pending() {
  Gemms& g = gemms();
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.trials_pending;
}

int64_t gemm_trial_calls() {
  Gemms& g = gemms();
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.trial_calls;
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, const void* C, int64_t ldc, void* D, int64_t ldd, DType ab, DType d, float alpha, float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: D = beta · C; only beta 0 (overwrite) and 1 (accumulate) occur here
    LT_CHECK(beta == 1.0f || beta == 0.0f, "gemm: k = 0 with beta {}", beta);
    const size_t row_bytes = static_cast<size_t>(m) * dtype_size(d);
    if (beta == 0.0f) LT_CUDA_CHECK(cudaMemset2DAsync(D, ldd * dtype_size(d), 0, row_bytes, n, cuda_stream()));
    else if (C != D)
      LT_CUDA_CHECK(cudaMemcpy2DAsync(D, ldd * dtype_size(d), C, ldc * dtype_size(d), row_bytes, n,
                                      cudaMemcpyDeviceToDevice, cuda_stream()));
    return;
  }
  Gemms& g = gemms();
  const uint32_t align_a = alignment(A, lda, ab), align_b = alignment(B, ldb, ab), align_c = alignment(C, ldc, d),
                 align_d = alignment(D, ldd, d);
  const bool accumulate = beta != 0.0f;
  std::lock_guard<std::mutex> lock(g.mutex);
  init_handle_locked(g);
  const GemmAlgoPolicy policy = ops::gemm_algo_policy();
  GemmKey key{trans_a, trans_b, m, n, k, lda, ldb, ldc, ldd, static_cast<int>(ab), static_cast<int>(d),
              align_a, align_b, align_c, align_d, accumulate, static_cast<int>(policy)};
  auto it = g.plans.find(key);
  if (it == g.plans.end()) {
    const int candidates = policy == GemmAlgoPolicy::autotune ? kGemmCandidates : 1;
    it = g.plans.emplace(key, make_plan(g.handle, trans_a, trans_b, m, n, k, lda, ldb, ldc, ldd, ab, d, align_a,
                                        align_b, align_c, align_d, accumulate, candidates)).first;
    if (!it->second.chosen) ++g.trials_pending;
  }
  GemmPlan& plan = it->second;
  auto run = [&](int algo) {
    LT_CUBLAS_CHECK(cublasLtMatmul(g.handle, plan.desc, &alpha, A, plan.a, B, plan.b, &beta, C, plan.c, D, plan.d,
                                   &plan.algos[static_cast<size_t>(algo)], g.workspace, kWorkspaceBytes,
                                   cuda_stream()));
  };
  if (plan.chosen) {
    run(*plan.chosen);
    return;
  }
  // A trial call: the next candidates in turn (gemm_trial_runs: the whole trial where rerunning into D
  // gives the same result, else one), timed after the first round. Each run is the whole product.
  const int n_algos = static_cast<int>(plan.algos.size());
  const size_t ab_size = dtype_size(ab), d_size = dtype_size(d);
  const bool repeatable = gemm_call_repeatable({A, trans_a ? k : m, trans_a ? m : k, lda, ab_size},
                                               {B, trans_b ? n : k, trans_b ? k : n, ldb, ab_size},
                                               {C, m, n, ldc, d_size}, {D, m, n, ldd, d_size}, accumulate);
  const int runs = gemm_trial_runs(n_algos, plan.calls, repeatable);
  ++g.trial_calls;
  for (int r = 0; r < runs; ++r) {
    const int call = plan.calls++;
    const int candidate = call % n_algos;
    if (call < n_algos) {
      run(candidate);
      continue;
    }
    GemmTiming t;
    t.candidate = candidate;
    LT_CUDA_CHECK(cudaEventCreate(&t.start));
    LT_CUDA_CHECK(cudaEventCreate(&t.end));
    LT_CUDA_CHECK(cudaEventRecord(t.start, cuda_stream()));
    run(candidate);
    LT_CUDA_CHECK(cudaEventRecord(t.end, cuda_stream()));
    plan.timings.push_back(t);
  }
  if (plan.calls == gemm_trial_length(n_algos)) decide(g, plan);
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
          int64_t ldb, void* D, int64_t ldd, DType ab, DType d, float alpha, float beta) {
  gemm(trans_a, trans_b, m, n, k, A, lda, B, ldb, D, ldd, D, ldd, ab, d, alpha, beta);
}

}  // namespace longtrain::cuda_util

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

void check_linear(const char* op, const Tensor& x, const char* xn, const Tensor& w) {
  check_tensor(x, 2, op, xn);
  check_tensor(w, 2, op, "w");
  check_float(w, op, "w");
  LT_CHECK(x.dtype == w.dtype, "{}: {} {} and w {} must have the same dtype", op, xn, x.describe(), w.describe());
}

}  // namespace

// y [T, N] = x [T, K] · w [N, K]ᵀ   ⇔   column-major yᵀ (N×T) = w (stored K×N, transposed) · xᵀ (K×T)
void linear_forward(Tensor y, Tensor x, Tensor w) {
  const char* op = "linear_forward";
  check_linear(op, x, "x", w);
  check_tensor(y, 2, op, "y");
  LT_CHECK(y.dtype == x.dtype, "{}: y {} must have x's dtype {}", op, y.describe(), dtype_name(x.dtype));
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  LT_CHECK(w.size(1) == K, "{}: w {} must be [N, {}] for x {}", op, w.describe(), K, x.describe());
  LT_CHECK(y.size(0) == T && y.size(1) == N, "{}: y {} must be [{}, {}]", op, y.describe(), T, N);
  gemm(true, false, N, T, K, w.data, w.stride[0], x.data, x.stride[0], y.data, y.stride[0], x.dtype, y.dtype, 1.0f,
       0.0f);
}

// y [T, N] = residual [T, N] + x · wᵀ: the same product with C = residual and beta = 1.
void linear_residual_forward(Tensor y, Tensor x, Tensor w, Tensor residual) {
  const char* op = "linear_residual_forward";
  check_linear(op, x, "x", w);
  check_tensor(y, 2, op, "y");
  check_tensor(residual, 2, op, "residual");
  LT_CHECK(y.dtype == x.dtype && residual.dtype == x.dtype, "{}: y {} and residual {} must have x's dtype {}", op,
           y.describe(), residual.describe(), dtype_name(x.dtype));
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  LT_CHECK(w.size(1) == K, "{}: w {} must be [N, {}] for x {}", op, w.describe(), K, x.describe());
  LT_CHECK(y.size(0) == T && y.size(1) == N, "{}: y {} must be [{}, {}]", op, y.describe(), T, N);
  check_same_shape(residual, y, op);
  LT_CHECK(residual.data != y.data || residual.stride[0] == y.stride[0],
           "{}: y {} and residual {} share memory with different strides", op, y.describe(), residual.describe());
  gemm(true, false, N, T, K, w.data, w.stride[0], x.data, x.stride[0], residual.data, residual.stride[0], y.data,
       y.stride[0], x.dtype, y.dtype, 1.0f, 1.0f);
}

// dx [T, K] = dy [T, N] · w [N, K]      ⇔  dxᵀ (K×T) = w (stored K×N) · dyᵀ (N×T)
// dw [N, K] += dyᵀ · x                 ⇔  dwᵀ (K×N) += xᵀ (K×T) · dy (stored N×T, transposed)
void linear_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, GradWrite dw_write) {
  const char* op = "linear_backward";
  check_linear(op, x, "x", w);
  check_tensor(dy, 2, op, "dy");
  LT_CHECK(!dx.empty() || !dw.empty(), "{}: dx and dw are both empty: nothing to compute", op);
  LT_CHECK(dy.dtype == x.dtype, "{}: dy {} must have x's dtype {}", op, dy.describe(), dtype_name(x.dtype));
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  LT_CHECK(w.size(1) == K, "{}: w {} must be [N, {}] for x {}", op, w.describe(), K, x.describe());
  LT_CHECK(dy.size(0) == T && dy.size(1) == N, "{}: dy {} must be [{}, {}]", op, dy.describe(), T, N);
  if (!dw.empty()) {
    check_tensor(dw, 2, op, "dw");
    check_float(dw, op, "dw");
    check_same_shape(dw, w, op);
  }
  if (!dx.empty()) {
    check_tensor(dx, 2, op, "dx");
    check_same_shape(dx, x, op);
    LT_CHECK(dx.dtype == x.dtype, "{}: dx {} must have x's dtype {}", op, dx.describe(), dtype_name(x.dtype));
    gemm(false, false, K, T, N, w.data, w.stride[0], dy.data, dy.stride[0], dx.data, dx.stride[0], x.dtype, dx.dtype,
         1.0f, 0.0f);
  }
  if (dw.empty()) return;
  // beta = 0 under overwrite: cuBLASLt does not read C (dw may hold anything, NaN included).
  gemm(false, true, K, N, T, x.data, x.stride[0], dy.data, dy.stride[0], dw.data, dw.stride[0], x.dtype, dw.dtype,
       1.0f, dw_write == GradWrite::overwrite ? 0.0f : 1.0f);
}

}  // namespace longtrain::ops::cuda
