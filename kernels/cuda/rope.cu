// Rotary position embedding on CUDA, in place on a strided [T, H, D] view (rotate-half convention).
// The angle pos · inv_freq[i] is formed and reduced in double precision: at positions of 10^5 to
// 10^6 an fp32 angle is off by tenths of a radian, which would make long-context RoPE wrong.
// The inverse frequencies (RoPE scaling's table, or theta^(-2i/D)) are computed on the host in double
// and passed by value as a kernel argument (D/2 <= 256 doubles: 2 KiB of the 4 KiB argument space),
// so a call needs no device buffer and no copy. cos and sin are scaled by the attention factor.
// One thread owns one (token, i) pair and rotates it in every head, so each sin/cos is computed once.
#include <cmath>

#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

struct InvFreqTable {
  double v[kMaxRopeHalfDim];
};

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
      const float a = to_float(p[0]), b = to_float(p[half]);
      p[0] = from_float<T>(a * cf - b * sf);
      p[half] = from_float<T>(b * cf + a * sf);
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
      const float a = to_float(p[0]), b = to_float(p[half]);
      p[0] = from_float<T>(a * cf - b * sf);
      p[half] = from_float<T>(b * cf + a * sf);
    }
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
  dispatch_float(x.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
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
