// Fused LM head + cross-entropy on CUDA, chunked over tokens: for each chunk of at most
// chunk_tokens rows, one GEMM makes fp32 logits [n, V], one kernel turns each row into its loss and
// (for backward) grad_scale · (softmax - onehot) in the GEMM input dtype, and two GEMMs give dx for the
// chunk and accumulate dw. Only one chunk of logits exists at a time, never the [T, V] matrix.
//
// The row kernel is memory-bound: a chunk of 4096 rows of Llama 3's 128,256 logits is 2.1 GB of f32.
// On sm_90 a cluster of up to 8 CTAs holds one row in registers (cross_entropy_rows_cluster_kernel),
// so the logits are read once; the CTAs exchange their (max, sum) through distributed shared memory.
// Elsewhere (older GPUs, a vocabulary not a multiple of 4 or too large for 8 CTAs) one block per row
// reads it twice (cross_entropy_rows_kernel).
#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <type_traits>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

constexpr int kThreads = 512;

// The gradient factor: read from device memory when `at` is set (CrossEntropyParams::grad_scale_from,
// what a replayed CUDA graph sees change), else the value the launch was given.
struct GradScale {
  const float* at;
  float value;
  __device__ __forceinline__ float get() const { return at != nullptr ? *at : value; }
};

// One block per row r of the chunk: lse = log Σ_v exp(logits[r, v]);
// losses[row0 + r] = lse - logits[r, label] (0 when ignored);
// dlogits[r, v] = grad_scale · (exp(logits[r, v] - lse) - [v == label]) (0 when ignored).
template <class G>
__global__ void cross_entropy_rows_kernel(const float* logits, int64_t V, const int32_t* labels, int64_t label_stride,
                                          int64_t row0, int32_t ignore_index, float* losses, int64_t loss_stride,
                                          G* dlogits, GradScale scale) {
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
  const float grad_scale = scale.get();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    float d = 0.0f;
    if (valid) d = grad_scale * (expf(l[v] - lse) - (v == label ? 1.0f : 0.0f));
    g[v] = from_float<G>(d);
  }
}

// ---- one row per cluster, held in registers -----------------------------------------------------

constexpr int kClusterThreads = 512;
constexpr int kMaxClusterCtas = 8;  // the portable cluster size
// Only the sm_90 body of the cluster kernel uses these: defined for that pass alone, the others
// (the host's, older GPUs') would warn that they are unused.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// Row r of the chunk is handled by the cluster of CTAs blockIdx.x / ranks; CTA `rank` holds the row's
// elements [rank · S, (rank + 1) · S), S = kClusterThreads · E, E per thread in groups of 4
// (thread t's group i starts at rank · S + 4 · (i · kClusterThreads + t): coalesced 16-byte loads).
// Each CTA reduces its slice to (max, Σ exp(x - max)), publishes it in shared memory, and after a
// cluster barrier every CTA combines all ranks' pairs in rank order, so each computes the same lse.
// Outputs as cross_entropy_rows_kernel's. V must be a multiple of 4 and at most ranks · S.
template <int E, class G>
__global__ void __launch_bounds__(kClusterThreads)
    cross_entropy_rows_cluster_kernel(const float* logits, int64_t V, const int32_t* labels, int64_t label_stride,
                                      int64_t row0, int32_t ignore_index, float* losses, int64_t loss_stride,
                                      G* dlogits, GradScale scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(E % 4 == 0, "groups of 4 elements");
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ float red[32];
  __shared__ float2 part;  // this CTA's (max, Σ exp(x - max)) over its slice
  __shared__ float row_lse;
  const int rank = static_cast<int>(cluster.block_rank()), ranks = static_cast<int>(cluster.num_blocks());
  const int64_t r = blockIdx.x / ranks;
  const float* l = logits + r * V;
  const int64_t slice = static_cast<int64_t>(rank) * kClusterThreads * E;

  float x[E];
#pragma unroll
  for (int i = 0; i < E / 4; ++i) {
    const int64_t v = slice + 4 * (static_cast<int64_t>(i) * kClusterThreads + threadIdx.x);
    float (&x4)[4] = *reinterpret_cast<float(*)[4]>(&x[4 * i]);
    if (v < V) {
      load4(l + v, x4);
    } else {
      x4[0] = x4[1] = x4[2] = x4[3] = -INFINITY;
    }
  }
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < E; ++i) m = fmaxf(m, x[i]);
  m = block_max(m, red);
  // x becomes exp(x - m) (0 past V): the gradients below scale it by exp(m - lse) instead of taking a
  // second exponential of every element.
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    x[i] = m == -INFINITY ? 0.0f : exp2f((x[i] - m) * kLog2e);  // a slice wholly past V adds nothing
    s += x[i];
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) part = make_float2(m, s);
  cluster.sync();  // every rank's part is published

  // Warp 0 combines the ranks' parts in the same lane order in every CTA: identical lse everywhere.
  if (threadIdx.x < 32) {
    const float2 p =
        threadIdx.x < ranks ? *cluster.map_shared_rank(&part, threadIdx.x) : make_float2(-INFINITY, 0.0f);
    const float m_all = warp_max(p.x);
    const float s_all = warp_sum(p.x == -INFINITY ? 0.0f : p.y * exp2f((p.x - m_all) * kLog2e));
    if (threadIdx.x == 0) row_lse = m_all + logf(s_all);
  }
  __syncwarp();              // the .aligned barrier below wants warp 0 converged again
  cluster_arrive_release();  // done reading the other ranks' shared memory
  __syncthreads();
  const float lse = row_lse;
  const int32_t label = labels[(row0 + r) * label_stride];
  const bool valid = label != ignore_index;
  if (rank == 0 && threadIdx.x == 0) losses[(row0 + r) * loss_stride] = valid ? lse - l[label] : 0.0f;
  if (dlogits != nullptr) {
    G* g = dlogits + r * V;
    const float grad_scale = scale.get();
    const float to_p = exp2f((m - lse) * kLog2e);  // exp(x - lse) = exp(x - m) · exp(m - lse)
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
      const int64_t v = slice + 4 * (static_cast<int64_t>(i) * kClusterThreads + threadIdx.x);
      if (v >= V) continue;
      float d[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        d[j] = valid ? grad_scale * (x[4 * i + j] * to_p - (v + j == label ? 1.0f : 0.0f)) : 0.0f;
      }
      store4(g + v, d);
    }
  }
  cluster_wait_acquire();  // no rank leaves while another may still read its part
#else
  __trap();  // no sm_90 code: cluster_elements_per_thread never launches this
#endif
}

// A launch of `ctas` CTAs of kClusterThreads in clusters of `ranks` on the compute stream; the config
// points at `attribute`, which must outlive it.
cudaLaunchConfig_t cluster_config(unsigned ctas, unsigned ranks, cudaLaunchAttribute& attribute) {
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = ranks;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kClusterThreads);
  config.stream = cuda_stream();
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

template <int E, class G>
bool cluster_kernel_schedulable() {
  auto kernel = cross_entropy_rows_cluster_kernel<E, G>;
  cudaFuncAttributes attr{};
  // Built from sm_90 code (PTX for an older architecture, compiled for this GPU at load time, would
  // have an empty body), and a cluster of the most CTAs fits on the GPU (not under an SM limit, say).
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || attr.ptxVersion < 90 || attr.binaryVersion < 90) {
    return false;
  }
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = cluster_config(kMaxClusterCtas, kMaxClusterCtas, attribute);
  int clusters = 0;
  return cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
}

// The smallest per-thread count E (8, 16, 32 or 64) whose cluster of at most 8 CTAs covers V, or 0 where
// the cluster kernel does not apply (V not a multiple of 4, too large, no sm_90 GPU or code, or no room
// for the cluster).
int cluster_elements_per_thread(int64_t V) {
  static const std::array<bool, 4> usable = [] {
    std::array<bool, 4> ok{};
    int dev = 0, major = 0;
    const bool sm90 = cudaGetDevice(&dev) == cudaSuccess &&
                      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                      major >= 9;
    if (sm90) {
      ok = {cluster_kernel_schedulable<8, float>() && cluster_kernel_schedulable<8, __nv_bfloat16>(),
            cluster_kernel_schedulable<16, float>() && cluster_kernel_schedulable<16, __nv_bfloat16>(),
            cluster_kernel_schedulable<32, float>() && cluster_kernel_schedulable<32, __nv_bfloat16>(),
            cluster_kernel_schedulable<64, float>() && cluster_kernel_schedulable<64, __nv_bfloat16>()};
      if (!(ok[0] && ok[1] && ok[2] && ok[3])) {  // slower, not wrong: say so once
        std::fprintf(stderr,
                     "longtrain: cross-entropy rows on clusters of CTAs (8/16/32/64 logits a thread): %s/%s/%s/%s on "
                     "this sm_%d GPU; one block per row elsewhere\n",
                     ok[0] ? "yes" : "no", ok[1] ? "yes" : "no", ok[2] ? "yes" : "no", ok[3] ? "yes" : "no",
                     major * 10);
      }
    }
    (void)cudaGetLastError();  // a refused query leaves nothing behind for the next launch check
    return ok;
  }();
  if (V <= 0 || V % 4 != 0) return 0;
  const int per_thread[4] = {8, 16, 32, 64};
  for (int i = 0; i < 4; ++i) {
    if (V <= static_cast<int64_t>(kMaxClusterCtas) * kClusterThreads * per_thread[i]) {
      return usable[i] ? per_thread[i] : 0;
    }
  }
  return 0;
}

template <int E, class G>
void launch_cluster_rows(int64_t n, const float* logits, int64_t V, const int32_t* labels, int64_t label_stride,
                         int64_t row0, int32_t ignore_index, float* losses, int64_t loss_stride, G* dlogits,
                         GradScale scale) {
  const int64_t per_cta = static_cast<int64_t>(kClusterThreads) * E;
  const unsigned ranks = static_cast<unsigned>((V + per_cta - 1) / per_cta);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = cluster_config(static_cast<unsigned>(n) * ranks, ranks, attribute);
  LT_CUDA_CHECK(cudaLaunchKernelEx(&config, cross_entropy_rows_cluster_kernel<E, G>, logits, V, labels, label_stride,
                                   row0, ignore_index, losses, loss_stride, dlogits, scale));
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
  if (!p.grad_scale_from.empty()) check_dtype(p.grad_scale_from, DType::f32, op, "grad_scale_from");
  if (T == 0) {
    if (backward && p.dw_write == GradWrite::overwrite) {  // no rows: dw = the empty sum (the GEMM's k = 0)
      gemm(false, true, C, V, 0, x.data, x.stride[0], nullptr, V, dw.data, dw.stride[0], x.dtype, dw.dtype, 1.0f,
           0.0f);
    }
    return;
  }

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
  const int cluster_e = cluster_elements_per_thread(V);

  for (int64_t row0 = 0; row0 < T; row0 += chunk) {
    const int64_t n = std::min(chunk, T - row0);
    const char* x_chunk = static_cast<const char*>(x.data) + row0 * x.stride[0] * xe;
    // logits (col-major V×n) = w (stored C×V, transposed) · x_chunkᵀ (C×n)
    gemm(true, false, V, n, C, w.data, w.stride[0], x_chunk, x.stride[0], logits, V, x.dtype, DType::f32, 1.0f, 0.0f);
    dispatch_float(x.dtype, op, [&](auto tag) {
      using G = typename decltype(tag)::type;
      float* loss_ptr = static_cast<float*>(losses.data);
      G* dlogits_ptr = static_cast<G*>(dlogits);
      const GradScale grad_scale{
          p.grad_scale_from.empty() ? nullptr : static_cast<const float*>(p.grad_scale_from.data),
          static_cast<float>(p.grad_scale)};
      auto cluster = [&](auto e) {
        launch_cluster_rows<decltype(e)::value, G>(n, logits, V, labels_ptr, labels.stride[0], row0, p.ignore_index,
                                                   loss_ptr, losses.stride[0], dlogits_ptr, grad_scale);
      };
      switch (cluster_e) {
        case 8: cluster(std::integral_constant<int, 8>{}); break;
        case 16: cluster(std::integral_constant<int, 16>{}); break;
        case 32: cluster(std::integral_constant<int, 32>{}); break;
        case 64: cluster(std::integral_constant<int, 64>{}); break;
        default:
          cross_entropy_rows_kernel<G><<<static_cast<unsigned>(n), kThreads, 0, cuda_stream()>>>(
              logits, V, labels_ptr, labels.stride[0], row0, p.ignore_index, loss_ptr, losses.stride[0], dlogits_ptr,
              grad_scale);
      }
    });
    LT_CUDA_LAUNCH_CHECK("cross_entropy_rows_kernel");
    if (!backward) continue;
    char* dx_chunk = static_cast<char*>(dx.data) + row0 * dx.stride[0] * xe;
    // dx_chunk (col-major C×n) = w (stored C×V) · dlogits (stored V×n)
    gemm(false, false, C, n, V, w.data, w.stride[0], dlogits, V, dx_chunk, dx.stride[0], x.dtype, dx.dtype, 1.0f,
         0.0f);
    // dw (col-major C×V) += x_chunk (stored C×n) · dlogitsᵀ (stored V×n, transposed); the first chunk
    // overwrites under p.dw_write (beta = 0: dw is not read)
    const bool overwrite = row0 == 0 && p.dw_write == GradWrite::overwrite;
    gemm(false, true, C, V, n, x_chunk, x.stride[0], dlogits, V, dw.data, dw.stride[0], x.dtype, dw.dtype, 1.0f,
         overwrite ? 0.0f : 1.0f);
  }
}

}  // namespace longtrain::ops::cuda
