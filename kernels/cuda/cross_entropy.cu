// Fused LM head + cross-entropy on CUDA, chunked over tokens: for each chunk of at most
// chunk_tokens rows, one GEMM makes fp32 logits [n, V], one kernel turns each row into its loss and
// (for backward) grad_scale · (softmax - onehot) in the GEMM input dtype, and two GEMMs give dx for the
// chunk and accumulate dw. Only one chunk of logits exists at a time, never the [T, V] matrix.
#include <algorithm>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

constexpr int kThreads = 512;

// One block per row r of the chunk: lse = log Σ_v exp(logits[r, v]);
// losses[row0 + r] = lse - logits[r, label] (0 when ignored);
// dlogits[r, v] = grad_scale · (exp(logits[r, v] - lse) - [v == label]) (0 when ignored).
template <class G>
__global__ void cross_entropy_rows_kernel(const float* logits, int64_t V, const int32_t* labels, int64_t label_stride,
                                          int64_t row0, int32_t ignore_index, float* losses, int64_t loss_stride,
                                          G* dlogits, float grad_scale) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float* l = logits + r * V;
  const int32_t label = labels[(row0 + r) * label_stride];
  const bool valid = label != ignore_index;

  // Online max / sum of exponentials per thread, then combined over the block.
  float m = -INFINITY, s = 0.0f;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = l[v];
    if (x > m) {
      s = s * expf(m - x) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  const float m_all = block_max(m, red);
  s = (m == -INFINITY) ? 0.0f : s * expf(m - m_all);
  const float lse = m_all + logf(block_sum(s, red));

  if (threadIdx.x == 0) losses[(row0 + r) * loss_stride] = valid ? lse - l[label] : 0.0f;
  if (dlogits == nullptr) return;
  G* g = dlogits + r * V;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    float d = 0.0f;
    if (valid) d = grad_scale * (expf(l[v] - lse) - (v == label ? 1.0f : 0.0f));
    g[v] = from_float<G>(d);
  }
}

}  // namespace

// losses [T] f32; x [T, C], w [V, C], labels [T] i32; dx [T, C] (optional), dw [V, C] (+=)
void lm_head_cross_entropy(Tensor losses, Tensor dx, Tensor dw, Tensor x, Tensor w, Tensor labels,
                           const CrossEntropyParams& p) {
  const char* op = "lm_head_cross_entropy";
  check_tensor(x, 2, op, "x");
  check_tensor(w, 2, op, "w");
  check_float(x, op, "x");
  LT_CHECK(w.dtype == x.dtype, "{}: w {} must have x's dtype {}", op, w.describe(), dtype_name(x.dtype));
  LT_CHECK(losses.device == Device::cuda && losses.ndim == 1, "{}: losses must be a 1-d CUDA tensor, got {}", op,
           losses.describe());
  check_dtype(losses, DType::f32, op, "losses");
  LT_CHECK(labels.device == Device::cuda && labels.ndim == 1, "{}: labels must be a 1-d CUDA tensor, got {}", op,
           labels.describe());
  check_dtype(labels, DType::i32, op, "labels");
  const int64_t T = x.size(0), C = x.size(1), V = w.size(0);
  LT_CHECK(w.size(1) == C, "{}: w {} must be [V, {}] for x {}", op, w.describe(), C, x.describe());
  LT_CHECK(labels.size(0) == T && losses.size(0) == T, "{}: labels {} and losses {} must have x's {} rows", op,
           labels.describe(), losses.describe(), T);
  const bool backward = !dx.empty();
  if (backward) {
    check_tensor(dx, 2, op, "dx");
    check_tensor(dw, 2, op, "dw");
    check_same_shape(dx, x, op);
    check_same_shape(dw, w, op);
    LT_CHECK(dx.dtype == x.dtype, "{}: dx {} must have x's dtype {}", op, dx.describe(), dtype_name(x.dtype));
    check_float(dw, op, "dw");
  }
  LT_CHECK(p.chunk_tokens > 0, "{}: chunk_tokens must be positive, got {}", op, p.chunk_tokens);
  if (T == 0) return;

  // Validate every label before any output is touched (one small synchronising read), unless the
  // caller did.
  const int32_t* labels_ptr = static_cast<const int32_t*>(labels.data);
  const int bad = p.labels_checked ? kNoBadIndex : [&] {
    int* flag = reset_bad_index_flag();
    find_bad_index(labels_ptr, labels.stride[0], T, V, p.ignore_index, flag);
    return read_bad_index_flag();
  }();
  if (bad != kNoBadIndex) {
    LT_FAIL("{}: label {} at position {} is outside the vocabulary [0, {}) and is not ignore_index {}", op,
            read_device_int(labels_ptr + bad * labels.stride[0]), bad, V, p.ignore_index);
  }

  const int64_t chunk = std::min<int64_t>(p.chunk_tokens, T);
  float* logits = static_cast<float*>(scratch(Scratch::logits, static_cast<size_t>(chunk * V) * sizeof(float)));
  void* dlogits =
      backward ? scratch(Scratch::dlogits, static_cast<size_t>(chunk * V) * dtype_size(x.dtype)) : nullptr;
  const size_t xe = dtype_size(x.dtype);

  for (int64_t row0 = 0; row0 < T; row0 += chunk) {
    const int64_t n = std::min(chunk, T - row0);
    const char* x_chunk = static_cast<const char*>(x.data) + row0 * x.stride[0] * xe;
    // logits (col-major V×n) = w (stored C×V, transposed) · x_chunkᵀ (C×n)
    gemm(true, false, V, n, C, w.data, w.stride[0], x_chunk, x.stride[0], logits, V, x.dtype, DType::f32, 1.0f, 0.0f);
    dispatch_float(x.dtype, op, [&](auto tag) {
      using G = typename decltype(tag)::type;
      cross_entropy_rows_kernel<G><<<static_cast<unsigned>(n), kThreads, 0, cuda_stream()>>>(
          logits, V, labels_ptr, labels.stride[0], row0, p.ignore_index, static_cast<float*>(losses.data),
          losses.stride[0], static_cast<G*>(dlogits), static_cast<float>(p.grad_scale));
    });
    LT_CUDA_LAUNCH_CHECK("cross_entropy_rows_kernel");
    if (!backward) continue;
    char* dx_chunk = static_cast<char*>(dx.data) + row0 * dx.stride[0] * xe;
    // dx_chunk (col-major C×n) = w (stored C×V) · dlogits (stored V×n)
    gemm(false, false, C, n, V, w.data, w.stride[0], dlogits, V, dx_chunk, dx.stride[0], x.dtype, dx.dtype, 1.0f,
         0.0f);
    // dw (col-major C×V) += x_chunk (stored C×n) · dlogitsᵀ (stored V×n, transposed)
    gemm(false, true, C, V, n, x_chunk, x.stride[0], dlogits, V, dw.data, dw.stride[0], x.dtype, dw.dtype, 1.0f,
         1.0f);
  }
}

}  // namespace longtrain::ops::cuda
