// CUDA AdamW update, Σx², dtype conversion and fill over flat ranges (twins of kernels/cpu/optimizer.cpp).
//
// - adamw_update does the CPU reference's arithmetic in the same order, in double, with every
//   operation rounded on its own (__dmul_rn, __dadd_rn, ...: no fused multiply-adds), so a GPU step
//   gives the CPU's master weights, moments and bf16 parameters bit for bit. The kernel is bound by
//   memory (28 bytes per bf16 parameter with f32 master weights), not by the double arithmetic.
// - sum_squares is deterministic: a grid whose size depends only on the element count, each thread
//   summing a fixed grid-stride set of elements in double, a fixed-order tree in each block, then one
//   block adding the per-block partials in block order. Same input, same bits, on any run.
// - convert rounds to bf16 to nearest even (as the CPU's bf16 does).
// - fill rounds the value on the host (the CPU's bf16 and casts) and writes its bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;          // consecutive elements per thread (16-byte f32 / 8-byte bf16 accesses)
constexpr int64_t kMaxSumBlocks = 1024;  // partial sums of sum_squares; the second pass is one block of 1024

// Elements [4i, 4i + 4) of a flat range, vectorised when the caller guarantees 4-element alignment.
template <class T> struct Vec4;
template <> struct Vec4<float> {
  __device__ static void load(const float* p, float (&v)[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  }
  __device__ static void store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <> struct Vec4<__nv_bfloat16> {
  __device__ static void load(const __nv_bfloat16* p, float (&v)[4]) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  }
  __device__ static void store(__nv_bfloat16* p, const float (&v)[4]) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 x;
    x.x = *reinterpret_cast<uint32_t*>(&a);
    x.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = x;
  }
};

// Loads/stores the (up to) 4 elements starting at i; `vec` = all 4 exist and the pointer is aligned.
template <class T> __device__ __forceinline__ void load_4(const T* p, int64_t i, int64_t n, bool vec, float (&v)[4]) {
  if (vec) {
    Vec4<T>::load(p + i, v);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = i + k < n ? to_float(p[i + k]) : 0.0f;
  }
}
template <class T> __device__ __forceinline__ void store_4(T* p, int64_t i, int64_t n, bool vec, const float (&v)[4]) {
  if (vec) {
    Vec4<T>::store(p + i, v);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k < n) p[i + k] = from_float<T>(v[k]);
  }
}

template <class D, class S>
__global__ void convert_kernel(D* dst, const S* src, int64_t n, bool aligned) {
  for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * kPerThread; i < n;
       i += (int64_t)gridDim.x * blockDim.x * kPerThread) {
    const bool vec = aligned && i + kPerThread <= n;
    float v[4];
    load_4(src, i, n, vec, v);
    store_4(dst, i, n, vec, v);
  }
}

// Every element := bits (the value already in the element's dtype): a kernel argument, so a queued or
// captured fill writes the value it was given, whatever the host does next.
template <class U>
__global__ void fill_bits_kernel(U* p, int64_t n, U bits) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = bits;
}

// The CPU reference's constants, computed on the host in double exactly as it computes them.
struct AdamWArgs {
  double lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, inv_bias_correction1,
      inv_sqrt_bias_correction2, grad_scale;
};

// One element, in the order of kernels/cpu/optimizer.cpp's adamw_loop, each operation rounded alone.
__device__ __forceinline__ void adamw_element(float& w, float& m, float& v, float grad, const AdamWArgs& a) {
  const double g = __dmul_rn(static_cast<double>(grad), a.grad_scale);
  const double mi = __dadd_rn(__dmul_rn(a.beta1, static_cast<double>(m)), __dmul_rn(a.one_minus_beta1, g));
  const double vi =
      __dadd_rn(__dmul_rn(a.beta2, static_cast<double>(v)), __dmul_rn(__dmul_rn(a.one_minus_beta2, g), g));
  m = static_cast<float>(mi);
  v = static_cast<float>(vi);
  double wi = static_cast<double>(w);
  // One division and one square root per element: the bias corrections are per-step constants.
  const double denom = __dadd_rn(__dmul_rn(__dsqrt_rn(vi), a.inv_sqrt_bias_correction2), a.eps);
  const double update =
      __dadd_rn(__dmul_rn(a.weight_decay, wi), __ddiv_rn(__dmul_rn(mi, a.inv_bias_correction1), denom));
  wi = __dsub_rn(wi, __dmul_rn(a.lr, update));
  w = static_cast<float>(wi);
}

// The no-decay ranges of one launch, in its kernel arguments (2 KB: a call with more ranges is split
// into several launches at range boundaries; a Llama has two per layer).
constexpr int kMaxNoDecay = 128;
struct NoDecay {
  int count;
  int64_t begin[kMaxNoDecay], end[kMaxNoDecay];
};

// The first range that ends after element i (count when none does).
__device__ __forceinline__ int first_range_ending_after(const NoDecay& nd, int64_t i) {
  int lo = 0, hi = nd.count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (nd.end[mid] <= i)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// The weight decay of element e; r is the first range ending after an earlier element, advanced.
__device__ __forceinline__ double decay_of(const NoDecay& nd, int& r, int64_t e, double weight_decay) {
  while (r < nd.count && nd.end[r] <= e) ++r;
  return r < nd.count && e >= nd.begin[r] ? 0.0 : weight_decay;
}

// w (f32 master, or the f32 parameter itself when lowp is null), m, v f32; grad G; lowp receives w
// rounded to P. Four elements per thread per iteration: eight (two groups) measured 20% slower on an
// H200 (10.4 against 8.6 ms for 1.1B parameters), the double arithmetic's registers costing occupancy.
template <class P, class G>
__global__ void adamw_kernel(P* lowp, float* w, float* m, float* v, const G* grad, int64_t n, AdamWArgs a,
                             const __grid_constant__ NoDecay nd, bool aligned) {
  for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * kPerThread; i < n;
       i += (int64_t)gridDim.x * blockDim.x * kPerThread) {
    const bool vec = aligned && i + kPerThread <= n;
    float wv[4], mv[4], vv[4], gv[4];
    load_4(w, i, n, vec, wv);
    load_4(m, i, n, vec, mv);
    load_4(v, i, n, vec, vv);
    load_4(grad, i, n, vec, gv);
    int r = nd.count == 0 ? 0 : first_range_ending_after(nd, i);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      AdamWArgs ak = a;
      if (nd.count != 0) ak.weight_decay = decay_of(nd, r, i + k, a.weight_decay);
      adamw_element(wv[k], mv[k], vv[k], gv[k], ak);
    }
    store_4(w, i, n, vec, wv);
    store_4(m, i, n, vec, mv);
    store_4(v, i, n, vec, vv);
    if (lowp != nullptr) store_4(lowp, i, n, vec, wv);
  }
}

// Σ over the block in double, fixed order; the result is valid in thread 0.
__device__ __forceinline__ double block_sum_double(double x, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < nwarps ? shared[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

// partial[blockIdx.x] = Σ x² (SQUARES) or Σ x over this block's grid-stride share.
template <class T, bool SQUARES = true>
__global__ void sum_squares_partial_kernel(double* partial, const T* x, int64_t n, bool aligned) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * kPerThread; i < n;
       i += (int64_t)gridDim.x * blockDim.x * kPerThread) {
    float v[4];
    load_4(x, i, n, aligned && i + kPerThread <= n, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += SQUARES ? static_cast<double>(v[k]) * static_cast<double>(v[k]) : v[k];
  }
  acc = block_sum_double(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// *result (+)= Σ partial[0 .. count) (one block of kMaxSumBlocks threads: thread b takes partial b).
__global__ void sum_partials_double_kernel(double* result, const double* partial, int64_t count,
                                           bool accumulate = false) {
  __shared__ double shared[32];
  const double x = threadIdx.x < count ? partial[threadIdx.x] : 0.0;
  const double s = block_sum_double(x, shared);
  if (threadIdx.x == 0) *result = accumulate ? *result + s : s;
}

void check_flat(const char* op, const Tensor& t, int64_t n, const char* name) {
  LT_CHECK(t.device == Device::cuda, "{}: {} must be a CUDA tensor, got {}", op, name, t.describe());
  LT_CHECK(t.is_contiguous() && t.numel() == n, "{}: {} must be contiguous with {} elements; got {}", op, name, n,
           t.describe());
  check_float(t, op, name);
}

bool aligned4(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data) % (4 * dtype_size(t.dtype)) == 0; }

unsigned grid_for(int64_t n) { return blocks_for((n + kPerThread - 1) / kPerThread, kThreads, 65535LL * 8); }

}  // namespace

void convert(Tensor dst, Tensor src) {
  const char* op = "convert";
  LT_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(),
           "{}: {} from {} (same element count, both contiguous)", op, dst.describe(), src.describe());
  LT_CHECK(dst.device == Device::cuda && src.device == Device::cuda, "{}: {} from {}: both must be CUDA tensors", op,
           dst.describe(), src.describe());
  const int64_t n = src.numel();
  if (n == 0) return;
  const bool aligned = aligned4(dst) && aligned4(src);
  dispatch_float(dst.dtype, op, [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_float(src.dtype, op, [&](auto stag) {
      using S = typename decltype(stag)::type;
      convert_kernel<D, S><<<grid_for(n), kThreads, 0, cuda_stream()>>>(static_cast<D*>(dst.data),
                                                                        static_cast<const S*>(src.data), n, aligned);
    });
  });
  LT_CUDA_LAUNCH_CHECK("convert_kernel");
}

void fill(Tensor t, double value) {
  const char* op = "fill";
  LT_CHECK(t.device == Device::cuda && t.is_contiguous(), "{}: {} must be a contiguous CUDA tensor", op,
           t.describe());
  const int64_t n = t.numel();
  if (n == 0) return;
  const unsigned grid = blocks_for(n, kThreads, 65535LL * 8);
  auto launch = [&](auto bits) {
    using U = decltype(bits);
    fill_bits_kernel<U><<<grid, kThreads, 0, cuda_stream()>>>(static_cast<U*>(t.data), n, bits);
  };
  switch (t.dtype) {
    case DType::f32: {
      const float v = static_cast<float>(value);
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      launch(bits);
      break;
    }
    case DType::f64: {
      uint64_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      launch(bits);
      break;
    }
    case DType::bf16: {
      launch(bf16(static_cast<float>(value)).bits);
      break;
    }
    default: LT_FAIL("{}: expected a float tensor, got {}", op, t.describe());
  }
  LT_CUDA_LAUNCH_CHECK("fill_bits_kernel");
}

void adamw_update(Tensor param, Tensor master, Tensor m, Tensor v, Tensor grad, const AdamWParams& p) {
  const char* op = "adamw_update";
  const int64_t n = param.numel();
  check_flat(op, param, n, "param");
  check_flat(op, m, n, "m");
  check_flat(op, v, n, "v");
  check_flat(op, grad, n, "grad");
  if (!master.empty()) check_flat(op, master, n, "master");
  const Tensor& w = master.empty() ? param : master;
  LT_CHECK(w.dtype == DType::f32 && m.dtype == DType::f32 && v.dtype == DType::f32,
           "{}: the weights updated ({}) and the moments ({}, {}) must be f32 on CUDA (bf16 parameters take an f32 "
           "master copy)",
           op, w.describe(), m.describe(), v.describe());
  if (n == 0) return;
  const AdamWArgs a{p.lr,  p.beta1,        p.beta2,
                    1.0 - p.beta1, 1.0 - p.beta2, p.eps,
                    p.weight_decay, 1.0 / p.bias_correction1, 1.0 / std::sqrt(p.bias_correction2),
                    p.grad_scale};
  // Launches of at most kMaxNoDecay ranges each: launch j starts where its first range starts (the
  // first launch at 0) and ends where the next launch's does (the last at n).
  const std::vector<ElementRange>& ranges = p.no_decay;
  const size_t launches = std::max<size_t>(1, (ranges.size() + kMaxNoDecay - 1) / kMaxNoDecay);
  for (size_t j = 0; j < launches; ++j) {
    const size_t first = j * kMaxNoDecay, last = std::min(ranges.size(), first + kMaxNoDecay);
    const int64_t start = j == 0 ? 0 : ranges[first].begin, stop = j + 1 == launches ? n : ranges[last].begin;
    if (stop == start) continue;
    NoDecay nd{};
    nd.count = static_cast<int>(last - first);
    for (size_t r = first; r < last; ++r) {
      nd.begin[r - first] = ranges[r].begin - start;
      nd.end[r - first] = ranges[r].end - start;
    }
    const Tensor pj = param.narrow(0, start, stop - start), wj = w.narrow(0, start, stop - start),
                 mj = m.narrow(0, start, stop - start), vj = v.narrow(0, start, stop - start),
                 gj = grad.narrow(0, start, stop - start);
    const int64_t nj = stop - start;
    const bool aligned = aligned4(pj) && aligned4(wj) && aligned4(mj) && aligned4(vj) && aligned4(gj);
    const unsigned grid = grid_for(nj);
    dispatch_float(grad.dtype, op, [&](auto gtag) {
      using G = typename decltype(gtag)::type;
      if (master.empty()) {
        adamw_kernel<float, G><<<grid, kThreads, 0, cuda_stream()>>>(
            nullptr, static_cast<float*>(pj.data), static_cast<float*>(mj.data), static_cast<float*>(vj.data),
            static_cast<const G*>(gj.data), nj, a, nd, aligned);
        return;
      }
      dispatch_float(param.dtype, op, [&](auto ptag) {
        using P = typename decltype(ptag)::type;
        adamw_kernel<P, G><<<grid, kThreads, 0, cuda_stream()>>>(
            static_cast<P*>(pj.data), static_cast<float*>(wj.data), static_cast<float*>(mj.data),
            static_cast<float*>(vj.data), static_cast<const G*>(gj.data), nj, a, nd, aligned);
      });
    });
    LT_CUDA_LAUNCH_CHECK("adamw_kernel");
  }
}

namespace {

// *result (+)= Σ x or Σ x² on the device, in double, in an order fixed by n alone (the grid depends on
// n only, so the same input gives the same bits on every run).
void launch_sum(const char* op, double* result, const Tensor& x, SumOf what, bool accumulate) {
  const int64_t n = x.numel();
  const int64_t per_block = static_cast<int64_t>(kThreads) * kPerThread;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(kMaxSumBlocks, (n + per_block - 1) / per_block));
  // Stream order makes reusing the shared `partials` scratch (rmsnorm_backward's) safe.
  double* partial = static_cast<double*>(scratch(Scratch::partials, kMaxSumBlocks * sizeof(double)));
  const bool aligned = aligned4(x);
  dispatch_float(x.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (what == SumOf::squares)
      sum_squares_partial_kernel<T, true><<<static_cast<unsigned>(blocks), kThreads, 0, cuda_stream()>>>(
          partial, static_cast<const T*>(x.data), n, aligned);
    else
      sum_squares_partial_kernel<T, false><<<static_cast<unsigned>(blocks), kThreads, 0, cuda_stream()>>>(
          partial, static_cast<const T*>(x.data), n, aligned);
  });
  LT_CUDA_LAUNCH_CHECK("sum_squares_partial_kernel");
  sum_partials_double_kernel<<<1, static_cast<unsigned>(kMaxSumBlocks), 0, cuda_stream()>>>(result, partial, blocks,
                                                                                          accumulate);
  LT_CUDA_LAUNCH_CHECK("sum_partials_double_kernel");
}

}  // namespace

double sum_squares(Tensor x) {
  const char* op = "sum_squares";
  LT_CHECK(x.device == Device::cuda, "{}: expected a CUDA tensor, got {}", op, x.describe());
  LT_CHECK(x.is_contiguous(), "{}: non-contiguous {}", op, x.describe());
  check_float(x, op, "x");
  if (x.numel() == 0) return 0.0;
  double* result = static_cast<double*>(scratch(Scratch::sum_result, sizeof(double)));
  launch_sum(op, result, x, SumOf::squares, /*accumulate=*/false);
  double host = 0.0;
  LT_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(double), cudaMemcpyDeviceToHost, cuda_stream()));
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  return host;
}

void sum_into(Tensor out, Tensor x, SumOf what, bool accumulate) {
  const char* op = "sum_into";
  LT_CHECK(x.device == Device::cuda && out.device == Device::cuda, "{}: expected CUDA tensors, got {} into {}", op,
           x.describe(), out.describe());
  check_float(x, op, "x");
  if (x.numel() == 0) {
    if (!accumulate) LT_CUDA_CHECK(cudaMemsetAsync(out.data, 0, sizeof(double), cuda_stream()));
    return;
  }
  launch_sum(op, static_cast<double*>(out.data), x, what, accumulate);
}

}  // namespace longtrain::ops::cuda
