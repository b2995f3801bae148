// Rotary position embedding on CUDA, in place on a strided [T, H, D] view (rotate-half convention).
// The angle pos · inv_freq[i] is formed and reduced in double precision: at positions of 10^5 to
// 10^6 an fp32 angle is off by tenths of a radian, which would make long-context RoPE wrong.
// The inverse frequencies (RoPE scaling's table, or theta^(-2i/D)) are computed on the host in double
// and passed by value as a kernel argument (D/2 <= 256 doubles: 2 KiB of the 4 KiB argument space),
// so a call needs no device buffer and no copy. cos and sin are scaled by the attention factor.
// One thread owns one (token, i) pair and rotates it in every head, so each sin/cos is computed once;
// rope_apply, the model's path, takes them from a per-step table, 4 pairs and 4 heads a thread.
#include <cmath>
#include <cstdint>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

struct InvFreqTable {
  double v[kMaxRopeHalfDim];
};

// (a, b) rotated by the angle whose cos and sin are c and s, every product and sum rounded on its own
// (no fused multiply-add), so every kernel below rotates to the same bits whatever the compiler fuses.
__device__ __forceinline__ void rotate_pair(float a, float b, float c, float s, float& x0, float& x1) {
  x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  x1 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// sign = +1: forward rotation by +angle; sign = -1: the transpose (rotation by -angle).
template <class T>
__global__ void rope_kernel(T* x, int64_t t_stride, int64_t h_stride, const int32_t* positions, int64_t pos_stride,
                            int64_t n_tokens, int64_t n_heads, int half, InvFreqTable inv_freq, double attention_factor,
                            float sign) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y;
  if (t >= n_tokens) return;
  const double pos = static_cast<double>(positions[t * pos_stride]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(pos * inv_freq.v[i], &s, &c);
    const float cf = static_cast<float>(attention_factor * c), sf = sign * static_cast<float>(attention_factor * s);
    T* base = x + t * t_stride + i;
    for (int64_t h = 0; h < n_heads; ++h) {
      T* p = base + h * h_stride;
      float x0, x1;
      rotate_pair(to_float(p[0]), to_float(p[half]), cf, sf, x0, x1);
      p[0] = from_float<T>(x0);
      p[half] = from_float<T>(x1);
    }
  }
}

dim3 rope_block(int half) {
  const int tx = half >= 128 ? 128 : (half >= 64 ? 64 : 32);
  return dim3(tx, 256 / tx);
}

// The checks of the positions (one per row of `rows`: x or the table) and of the parameters for head
// dim D, and the inverse frequencies the kernels take by value: the scaled table, or theta^(-2i/D).
InvFreqTable checked_inverse_frequencies(const char* op, const Tensor& positions, const char* rows_name,
                                         const Tensor& rows, int64_t D, const RopeParams& p) {
  LT_CHECK(positions.device == Device::cuda && positions.ndim == 1, "{}: positions must be a 1-d CUDA tensor, got {}",
           op, positions.describe());
  check_dtype(positions, DType::i32, op, "positions");
  LT_CHECK(positions.size(0) == rows.size(0), "{}: positions {} must have one entry per token of {} {}", op,
           positions.describe(), rows_name, rows.describe());
  LT_CHECK(D % 2 == 0, "{}: head dim {} must be even", op, D);
  LT_CHECK(p.theta > 0.0, "{}: rope theta must be positive, got {}", op, p.theta);
  LT_CHECK(D / 2 <= kMaxRopeHalfDim, "{}: head dim {} is above the {} RoPE supports", op, D, 2 * kMaxRopeHalfDim);
  LT_CHECK(p.inv_freq.empty() || static_cast<int64_t>(p.inv_freq.size()) == D / 2,
           "{}: the inverse-frequency table has {} entries; head dim {} needs {}", op, p.inv_freq.size(), D, D / 2);
  LT_CHECK(std::isfinite(p.attention_factor) && p.attention_factor > 0.0,
           "{}: the RoPE attention factor must be finite and > 0, got {}", op, p.attention_factor);
  InvFreqTable table{};
  for (int64_t i = 0; i < D / 2; ++i)
    table.v[i] = p.inv_freq.empty() ? std::pow(p.theta, -2.0 * i / static_cast<double>(D)) : p.inv_freq[i];
  return table;
}

void rope(const char* op, Tensor x, Tensor positions, const RopeParams& p, float sign) {
  check_tensor(x, 3, op, "x");
  check_float(x, op, "x");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const InvFreqTable table = checked_inverse_frequencies(op, positions, "x", x, D, p);
  if (T == 0) return;
  const int half = static_cast<int>(D / 2);
  const dim3 block = rope_block(half);
  const unsigned grid = static_cast<unsigned>((T + block.y - 1) / block.y);
  dispatch_float(x.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    rope_kernel<T_><<<grid, block, 0, cuda_stream()>>>(static_cast<T_*>(x.data), x.stride[0], x.stride[1],
                                                       static_cast<const int32_t*>(positions.data), positions.stride[0],
                                                       T, H, half, table, p.attention_factor, sign);
  });
  LT_CUDA_LAUNCH_CHECK("rope_kernel");
}

// table[t, i] = float(a · cos(angle)), table[t, half + i] = float(a · sin(angle)): the very values
// rope_kernel forms per call, so rope_apply's rotation equals rope_forward's bit for bit.
__global__ void rope_table_kernel(float* table, int64_t t_stride, const int32_t* positions, int64_t pos_stride,
                                  int64_t n_tokens, int half, InvFreqTable inv_freq, double attention_factor) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y;
  if (t >= n_tokens) return;
  const double pos = static_cast<double>(positions[t * pos_stride]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(pos * inv_freq.v[i], &s, &c);
    table[t * t_stride + i] = static_cast<float>(attention_factor * c);
    table[t * t_stride + half + i] = static_cast<float>(attention_factor * s);
  }
}

template <class T>
__global__ void rope_apply_kernel(T* x, int64_t t_stride, int64_t h_stride, const float* table, int64_t table_stride,
                                  int64_t n_tokens, int64_t n_heads, int half, float sign) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.y + threadIdx.y;
  if (t >= n_tokens) return;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float cf = table[t * table_stride + i], sf = sign * table[t * table_stride + half + i];
    T* base = x + t * t_stride + i;
    for (int64_t h = 0; h < n_heads; ++h) {
      T* p = base + h * h_stride;
      float x0, x1;
      rotate_pair(to_float(p[0]), to_float(p[half]), cf, sf, x0, x1);
      p[0] = from_float<T>(x0);
      p[half] = from_float<T>(x1);
    }
  }
}

// rope_apply_kernel with 4 consecutive i per thread (8-byte bf16 / 16-byte f32 accesses; the model's
// fused Q/K view is 4-aligned) for 4 heads, loaded before any is stored: 8 loads in flight per thread
// where the scalar kernel issued one 2-byte load at a time. Threads run over (token, group of 4 heads,
// i / 4), i fastest; each reads its cos and sin once for its 4 heads.
template <class T>
__global__ void rope_apply_vec4_kernel(T* x, int64_t t_stride, int64_t h_stride, const float* table,
                                       int64_t table_stride, int64_t n_tokens, int64_t n_heads, int half, float sign) {
  constexpr int kHeads = 4;
  const int groups = half / 4;
  const int64_t head_groups = (n_heads + kHeads - 1) / kHeads;
  const int64_t flat = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t t = flat / (groups * head_groups);
  if (t >= n_tokens) return;
  const int64_t rest = flat % (groups * head_groups);
  const int64_t h0 = rest / groups * kHeads;
  const int i = static_cast<int>(rest % groups) * 4;
  float c[4], s[4];
  load4(table + t * table_stride + i, c);
  load4(table + t * table_stride + half + i, s);
#pragma unroll
  for (int j = 0; j < 4; ++j) s[j] *= sign;
  T* base = x + t * t_stride + h0 * h_stride + i;
  const int nh = n_heads - h0 < kHeads ? static_cast<int>(n_heads - h0) : kHeads;
  float a[kHeads][4], b[kHeads][4];
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    if (k < nh) {
      load4(base + k * h_stride, a[k]);
      load4(base + k * h_stride + half, b[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kHeads; ++k) {
    if (k >= nh) continue;
    float x0[4], x1[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) rotate_pair(a[k][j], b[k][j], c[j], s[j], x0[j], x1[j]);
    store4(base + k * h_stride, x0);
    store4(base + k * h_stride + half, x1);
  }
}

}  // namespace

void rope_table(Tensor table, Tensor positions, const RopeParams& p) {
  const char* op = "rope_table";
  check_tensor(table, 2, op, "table");
  check_dtype(table, DType::f32, op, "table");
  const int64_t T = table.size(0), D = table.size(1);
  const InvFreqTable inv = checked_inverse_frequencies(op, positions, "the table", table, D, p);
  if (T == 0) return;
  const int half = static_cast<int>(D / 2);
  const dim3 block = rope_block(half);
  rope_table_kernel<<<static_cast<unsigned>((T + block.y - 1) / block.y), block, 0, cuda_stream()>>>(
      static_cast<float*>(table.data), table.stride[0], static_cast<const int32_t*>(positions.data),
      positions.stride[0], T, half, inv, p.attention_factor);
  LT_CUDA_LAUNCH_CHECK("rope_table_kernel");
}

void rope_apply(Tensor x, Tensor table, bool inverse) {
  const char* op = inverse ? "rope_apply (inverse)" : "rope_apply";
  check_tensor(x, 3, op, "x");
  check_float(x, op, "x");
  check_tensor(table, 2, op, "table");
  check_dtype(table, DType::f32, op, "table");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  LT_CHECK(D % 2 == 0, "{}: head dim {} must be even", op, D);
  LT_CHECK(table.size(0) == T && table.size(1) == D, "{}: the table {} must be [{}, {}] for x {}", op,
           table.describe(), T, D, x.describe());
  if (T == 0) return;
  const int half = static_cast<int>(D / 2);
  const dim3 block = rope_block(half);
  const bool vec4 = half % 4 == 0 && x.stride[0] % 4 == 0 && x.stride[1] % 4 == 0 && table.stride[0] % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(x.data) % (4 * dtype_size(x.dtype)) == 0 &&
                    reinterpret_cast<uintptr_t>(table.data) % 16 == 0;
  dispatch_float(x.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    if (vec4) {
      constexpr int kThreads = 256;
      const int64_t threads = T * (half / 4) * ((H + 3) / 4);
      rope_apply_vec4_kernel<T_><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0,
                                   cuda_stream()>>>(static_cast<T_*>(x.data), x.stride[0], x.stride[1],
                                                    static_cast<const float*>(table.data), table.stride[0], T, H, half,
                                                    inverse ? -1.0f : 1.0f);
      return;
    }
    rope_apply_kernel<T_><<<static_cast<unsigned>((T + block.y - 1) / block.y), block, 0, cuda_stream()>>>(
        static_cast<T_*>(x.data), x.stride[0], x.stride[1], static_cast<const float*>(table.data), table.stride[0], T,
        H, half, inverse ? -1.0f : 1.0f);
  });
  LT_CUDA_LAUNCH_CHECK("rope_apply_kernel");
}

void rope_forward(Tensor x, Tensor positions, const RopeParams& p) { rope("rope_forward", x, positions, p, 1.0f); }

void rope_backward(Tensor dx, Tensor positions, const RopeParams& p) {
  rope("rope_backward", dx, positions, p, -1.0f);
}

}  // namespace longtrain::ops::cuda
