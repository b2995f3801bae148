// RMSNorm on CUDA: a block per row (or two rows per block step, below), fp32 statistics. The backward's dw is reduced
// deterministically: each block keeps fp32 partial sums for its rows in shared memory, writes them
// to a [blocks, C] buffer, and a second kernel adds the blocks in a fixed order.
#include <algorithm>
#include <cstdint>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

constexpr int kThreads = 256;

// y [T, C] = x * rstd * w ; rstd [T] = 1 / sqrt(mean(x^2) + eps)
template <class T, class W>
__global__ void rmsnorm_forward_kernel(T* y, int64_t y_rs, float* rstd, int64_t rstd_stride, const T* x,
                                       int64_t x_rs, const W* w, int64_t C, float eps) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_rs;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float v = to_float(xr[c]);
    ss += v * v;
  }
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row * rstd_stride] = r;
  T* yr = y + row * y_rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) yr[c] = from_float<T>(to_float(xr[c]) * r * to_float(w[c]));
}

// For the rows of this block: n = x * rstd, dn = dy * w,
//   dx += rstd * (dn - n * mean(dn * n)),   partial[block, c] = Σ_rows dy * n.
template <class T, class W>
__global__ void rmsnorm_backward_kernel(T* dx, int64_t dx_rs, float* partial, const T* dy, int64_t dy_rs,
                                        const T* x, int64_t x_rs, const W* w, const float* rstd,
                                        int64_t rstd_stride, int64_t rows, int64_t C) {
  extern __shared__ float dw_acc[];  // [C]
  __shared__ float red[32];
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dw_acc[c] = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_rs;
    const T* dyr = dy + row * dy_rs;
    const float r = rstd[row * rstd_stride];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += to_float(dyr[c]) * to_float(w[c]) * to_float(xr[c]);
    dot = block_sum(dot, red) * r / static_cast<float>(C);  // mean(dn * n)
    T* dxr = dx + row * dx_rs;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = to_float(dyr[c]);
      const float n = to_float(xr[c]) * r;
      dxr[c] = from_float<T>(to_float(dxr[c]) + r * (g * to_float(w[c]) - n * dot));
      dw_acc[c] += g * n;  // each thread owns its columns: no race
    }
  }
  float* out = partial + static_cast<int64_t>(blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[c] = dw_acc[c];
}

// The same two kernels over N consecutive columns per thread (16-byte accesses: N = 8 bf16 or 4 f32;
// N = 4 bf16 where rows are aligned only to 4), for rows whose columns, strides and base addresses are
// multiples of N elements (vector_width). Scalar 2-byte accesses held the norms well below the H200's
// bandwidth: at 8K tokens of the 1.1B shape 46 backward calls took 8.2 ms (with the old partial sums
// below) against about 1.3 ms of DRAM traffic; 2.8 ms with 8-byte accesses.
template <class T, class W, int N>
__global__ void rmsnorm_forward_vec_kernel(T* y, int64_t y_rs, float* rstd, int64_t rstd_stride, const T* x,
                                            int64_t x_rs, const W* w, int64_t C, float eps) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_rs;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x * N; c < C; c += blockDim.x * N) {
    float v[N];
    load_n<N>(xr + c, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ss += v[k] * v[k];
  }
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[row * rstd_stride] = r;
  T* yr = y + row * y_rs;
  for (int64_t c = threadIdx.x * N; c < C; c += blockDim.x * N) {
    float v[N], wv[N], out[N];
    load_n<N>(xr + c, v);
    load_n<N>(w + c, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = v[k] * r * wv[k];
    store_n<N>(yr + c, out);
  }
}

template <class T, class W, int N>
__global__ void rmsnorm_backward_vec_kernel(T* dx, int64_t dx_rs, float* partial, const T* dy, int64_t dy_rs,
                                             const T* x, int64_t x_rs, const W* w, const float* rstd,
                                             int64_t rstd_stride, int64_t rows, int64_t C) {
  extern __shared__ float dw_acc[];  // [C]
  __shared__ float red[32];
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dw_acc[c] = 0.0f;
  __syncthreads();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * x_rs;
    const T* dyr = dy + row * dy_rs;
    const float r = rstd[row * rstd_stride];
    float dot = 0.0f;
    for (int64_t c = threadIdx.x * N; c < C; c += blockDim.x * N) {
      float g[N], wv[N], v[N];
      load_n<N>(dyr + c, g);
      load_n<N>(w + c, wv);
      load_n<N>(xr + c, v);
#pragma unroll
      for (int k = 0; k < N; ++k) dot += g[k] * wv[k] * v[k];
    }
    dot = block_sum(dot, red) * r / static_cast<float>(C);  // mean(dn * n)
    T* dxr = dx + row * dx_rs;
    for (int64_t c = threadIdx.x * N; c < C; c += blockDim.x * N) {
      float g[N], wv[N], v[N], d[N];
      load_n<N>(dyr + c, g);
      load_n<N>(w + c, wv);
      load_n<N>(xr + c, v);
      load_n<N>(dxr + c, d);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float n = v[k] * r;
        d[k] += r * (g[k] * wv[k] - n * dot);
        dw_acc[c + k] += g[k] * n;  // each thread owns its columns: no race
      }
      store_n<N>(dxr + c, d);
    }
  }
  __syncthreads();
  float* out = partial + static_cast<int64_t>(blockIdx.x) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[c] = dw_acc[c];
}

// The vector kernels with each thread's columns in registers, two rows per block iteration: a
// thread's V vectors of N columns (columns (threadIdx.x + j·kThreads)·N, j < V) of both rows are
// loaded at once (dy, x and dx in the backward, before its block sum), w is loaded once per block,
// and the backward's dw partial sums stay in registers. One row per block and step, re-reading its
// row after the block sum, left the loads of a row waiting on the sum before them: at 8K tokens of
// the 1.1B shape the backward took 53 µs a call against 27 µs of DRAM traffic, the forward 24 against
// 13. For C <= kThreads·N·V (V <= 2: 4096 bf16 columns); wider rows take the kernels above.
constexpr int kRowsPerStep = 2;

template <int N, int V>
__device__ __forceinline__ int64_t reg_column(int j) {
  return (static_cast<int64_t>(threadIdx.x) + static_cast<int64_t>(j) * kThreads) * N;
}

template <class T, class W, int N, int V>
__global__ void __launch_bounds__(kThreads) rmsnorm_forward_regs_kernel(T* y, int64_t y_rs, float* rstd,
                                                                        int64_t rstd_stride, const T* x,
                                                                        int64_t x_rs, const W* w, int64_t rows,
                                                                        int64_t C, float eps) {
  __shared__ float red[64];
  float wv[V][N];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = reg_column<N, V>(j);
    if (c < C) load_n<N>(w + c, wv[j]);
  }
  for (int64_t row0 = kRowsPerStep * static_cast<int64_t>(blockIdx.x); row0 < rows;
       row0 += kRowsPerStep * static_cast<int64_t>(gridDim.x)) {
    float v[kRowsPerStep][V][N], ss[kRowsPerStep];
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      ss[r] = 0.0f;
      const int64_t row = row0 + r;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t c = reg_column<N, V>(j);
        if (row < rows && c < C) {
          load_n<N>(x + row * x_rs + c, v[r][j]);
#pragma unroll
          for (int k = 0; k < N; ++k) ss[r] += v[r][j][k] * v[r][j][k];
        }
      }
    }
    const float2 sums = block_sum2(ss[0], ss[1], red);
    const float total[kRowsPerStep] = {sums.x, sums.y};
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      const int64_t row = row0 + r;
      if (row >= rows) continue;
      const float rs = 1.0f / sqrtf(total[r] / static_cast<float>(C) + eps);
      if (threadIdx.x == 0) rstd[row * rstd_stride] = rs;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t c = reg_column<N, V>(j);
        if (c >= C) continue;
        float out[N];
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = v[r][j][k] * rs * wv[j][k];
        store_n<N>(y + row * y_rs + c, out);
      }
    }
  }
}

template <class T, class W, int N, int V>
__global__ void __launch_bounds__(kThreads) rmsnorm_backward_regs_kernel(T* dx, int64_t dx_rs, float* partial,
                                                                         const T* dy, int64_t dy_rs, const T* x,
                                                                         int64_t x_rs, const W* w, const float* rstd,
                                                                         int64_t rstd_stride, int64_t rows,
                                                                         int64_t C) {
  __shared__ float red[64];
  float wv[V][N], acc[V][N];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = reg_column<N, V>(j);
    if (c < C) load_n<N>(w + c, wv[j]);
#pragma unroll
    for (int k = 0; k < N; ++k) acc[j][k] = 0.0f;
  }
  for (int64_t row0 = kRowsPerStep * static_cast<int64_t>(blockIdx.x); row0 < rows;
       row0 += kRowsPerStep * static_cast<int64_t>(gridDim.x)) {
    float g[kRowsPerStep][V][N], v[kRowsPerStep][V][N], d[kRowsPerStep][V][N], dot[kRowsPerStep], rs[kRowsPerStep];
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      dot[r] = 0.0f;
      const int64_t row = row0 + r;
      rs[r] = row < rows ? rstd[row * rstd_stride] : 0.0f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t c = reg_column<N, V>(j);
        if (row < rows && c < C) {
          load_n<N>(dy + row * dy_rs + c, g[r][j]);
          load_n<N>(x + row * x_rs + c, v[r][j]);
          load_n<N>(dx + row * dx_rs + c, d[r][j]);
#pragma unroll
          for (int k = 0; k < N; ++k) dot[r] += g[r][j][k] * wv[j][k] * v[r][j][k];
        }
      }
    }
    const float2 sums = block_sum2(dot[0], dot[1], red);
    const float total[kRowsPerStep] = {sums.x, sums.y};
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      const int64_t row = row0 + r;
      if (row >= rows) continue;
      const float mean_dn_n = total[r] * rs[r] / static_cast<float>(C);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int64_t c = reg_column<N, V>(j);
        if (c >= C) continue;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float n = v[r][j][k] * rs[r];
          d[r][j][k] += rs[r] * (g[r][j][k] * wv[j][k] - n * mean_dn_n);
          acc[j][k] += g[r][j][k] * n;
        }
        store_n<N>(dx + row * dx_rs + c, d[r][j]);
      }
    }
  }
  float* out = partial + static_cast<int64_t>(blockIdx.x) * C;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = reg_column<N, V>(j);
    if (c >= C) continue;
#pragma unroll
    for (int k = 0; k < N; ++k) out[c + k] = acc[j][k];
  }
}

// How many blocks of `kernel` run at once on the GPU (at most `cap` per SM), for the register kernels'
// grid: each block loops over its rows, so more blocks than fit would only wait.
template <class Kernel>
int64_t resident_blocks(Kernel kernel, int cap) {
  int per_sm = 0;
  LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  return static_cast<int64_t>(std::max(1, std::min(per_sm, cap))) * num_sms();
}

// Vectors per thread for the register kernels: 1 or 2, or 0 where C is too wide for them.
int reg_vectors(int64_t C, int width) {
  if (width < 4) return 0;
  const int64_t per_pass = static_cast<int64_t>(kThreads) * width;
  return C <= per_pass ? 1 : C <= 2 * per_pass ? 2 : 0;
}

// dw[c] += Σ_b partial[b, c] in a fixed order (bitwise reproducible): each of 8 warps sums the blocks
// b ≡ warp (mod 8) in order for 32 consecutive columns (coalesced), then warp 0 adds the 8 sums in
// order. One thread per column summing every block serially left 2048 threads doing ~500 dependent
// loads each per call.
constexpr int kPartialSlices = 8;
template <class G>
__global__ void sum_partials_kernel(G* dw, const float* partial, int64_t blocks, int64_t C) {
  __shared__ float slice_sum[kPartialSlices][32];
  const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * 32LL + lane;
  float acc = 0.0f;
  if (c < C)
    for (int64_t b = slice; b < blocks; b += kPartialSlices) acc += partial[b * C + c];
  slice_sum[slice][lane] = acc;
  __syncthreads();
  if (slice == 0 && c < C) {
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kPartialSlices; ++k) total += slice_sum[k][lane];
    dw[c] = from_float<G>(to_float(dw[c]) + total);
  }
}

void check_common(const char* op, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  check_tensor(x, 2, op, "x");
  check_tensor(w, 1, op, "w");
  LT_CHECK(rstd.device == Device::cuda && rstd.ndim == 1, "{}: rstd must be a 1-d CUDA tensor, got {}", op,
           rstd.describe());
  check_dtype(rstd, DType::f32, op, "rstd");
  check_float(x, op, "x");
  check_float(w, op, "w");
  LT_CHECK(w.size(0) == x.size(1), "{}: w {} must have x's {} columns", op, w.describe(), x.size(1));
  LT_CHECK(rstd.size(0) == x.size(0), "{}: rstd {} must have x's {} rows", op, rstd.describe(), x.size(0));
}

}  // namespace

void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  const char* op = "rmsnorm_forward";
  check_common(op, x, w, rstd);
  check_tensor(y, 2, op, "y");
  check_same_shape(y, x, op);
  LT_CHECK(y.dtype == x.dtype, "{}: y {} and x {} must have the same dtype", op, y.describe(), x.describe());
  const int64_t T = x.size(0), C = x.size(1);
  if (T == 0) return;
  const int width = vector_width(C, {&y, &x, &w});
  const int vectors = reg_vectors(C, width);
  dispatch_float(x.dtype, op, [&](auto ttag) {
    using T_ = typename decltype(ttag)::type;
    dispatch_float(w.dtype, op, [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      if (vectors > 0) {
        auto kernel = width == 8 ? (vectors == 1 ? rmsnorm_forward_regs_kernel<T_, W, 8, 1>
                                                 : rmsnorm_forward_regs_kernel<T_, W, 8, 2>)
                                 : (vectors == 1 ? rmsnorm_forward_regs_kernel<T_, W, 4, 1>
                                                 : rmsnorm_forward_regs_kernel<T_, W, 4, 2>);
        const int64_t blocks = std::min((T + kRowsPerStep - 1) / kRowsPerStep, resident_blocks(kernel, 8));
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, cuda_stream()>>>(
            static_cast<T_*>(y.data), y.stride[0], static_cast<float*>(rstd.data), rstd.stride[0],
            static_cast<const T_*>(x.data), x.stride[0], static_cast<const W*>(w.data), T, C, static_cast<float>(eps));
        return;
      }
      auto kernel = width == 8   ? rmsnorm_forward_vec_kernel<T_, W, 8>
                    : width == 4 ? rmsnorm_forward_vec_kernel<T_, W, 4>
                                 : rmsnorm_forward_kernel<T_, W>;
      kernel<<<static_cast<unsigned>(T), kThreads, 0, cuda_stream()>>>(
          static_cast<T_*>(y.data), y.stride[0], static_cast<float*>(rstd.data), rstd.stride[0],
          static_cast<const T_*>(x.data), x.stride[0], static_cast<const W*>(w.data), C, static_cast<float>(eps));
    });
  });
  LT_CUDA_LAUNCH_CHECK("rmsnorm_forward_kernel");
}

void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd) {
  const char* op = "rmsnorm_backward";
  check_common(op, x, w, rstd);
  check_tensor(dx, 2, op, "dx");
  check_tensor(dy, 2, op, "dy");
  check_tensor(dw, 1, op, "dw");
  check_float(dw, op, "dw");
  check_same_shape(dx, x, op);
  check_same_shape(dy, x, op);
  check_same_shape(dw, w, op);
  LT_CHECK(dx.dtype == x.dtype && dy.dtype == x.dtype, "{}: dx {}, dy {} and x {} must have the same dtype", op,
           dx.describe(), dy.describe(), x.describe());
  const int64_t T = x.size(0), C = x.size(1);
  if (T == 0) return;

  // At most 4 blocks per SM: the memory plan's partial sums (model/memory_plan.cpp, norm_blocks).
  const int64_t max_blocks = std::min<int64_t>(T, 4LL * num_sms());
  int64_t blocks = max_blocks;
  float* partial = static_cast<float*>(scratch(Scratch::partials, static_cast<size_t>(max_blocks * C) * sizeof(float)));
  const size_t smem = static_cast<size_t>(C) * sizeof(float);
  const int width = vector_width(C, {&dx, &dy, &x, &w});
  const int vectors = reg_vectors(C, width);
  dispatch_float(x.dtype, op, [&](auto ttag) {
    using T_ = typename decltype(ttag)::type;
    dispatch_float(w.dtype, op, [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      if (vectors > 0) {
        auto kernel = width == 8 ? (vectors == 1 ? rmsnorm_backward_regs_kernel<T_, W, 8, 1>
                                                 : rmsnorm_backward_regs_kernel<T_, W, 8, 2>)
                                 : (vectors == 1 ? rmsnorm_backward_regs_kernel<T_, W, 4, 1>
                                                 : rmsnorm_backward_regs_kernel<T_, W, 4, 2>);
        blocks = std::min({(T + kRowsPerStep - 1) / kRowsPerStep, resident_blocks(kernel, 4), max_blocks});
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, cuda_stream()>>>(
            static_cast<T_*>(dx.data), dx.stride[0], partial, static_cast<const T_*>(dy.data), dy.stride[0],
            static_cast<const T_*>(x.data), x.stride[0], static_cast<const W*>(w.data),
            static_cast<const float*>(rstd.data), rstd.stride[0], T, C);
        return;
      }
      auto kernel = width == 8   ? rmsnorm_backward_vec_kernel<T_, W, 8>
                    : width == 4 ? rmsnorm_backward_vec_kernel<T_, W, 4>
                                 : rmsnorm_backward_kernel<T_, W>;
      if (smem > 48 * 1024)
        LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<static_cast<unsigned>(blocks), kThreads, smem, cuda_stream()>>>(
          static_cast<T_*>(dx.data), dx.stride[0], partial, static_cast<const T_*>(dy.data), dy.stride[0],
          static_cast<const T_*>(x.data), x.stride[0], static_cast<const W*>(w.data),
          static_cast<const float*>(rstd.data), rstd.stride[0], T, C);
    });
  });
  LT_CUDA_LAUNCH_CHECK("rmsnorm_backward_kernel");
  dispatch_float(dw.dtype, op, [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    sum_partials_kernel<G><<<static_cast<unsigned>((C + 31) / 32), 32 * kPartialSlices, 0, cuda_stream()>>>(
        static_cast<G*>(dw.data), partial, blocks, C);
  });
  LT_CUDA_LAUNCH_CHECK("sum_partials_kernel");
}

}  // namespace longtrain::ops::cuda
