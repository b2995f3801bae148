// CPU reference for rotary position embeddings, Hugging Face's rotate-half convention: dimension i
// of the first half pairs with dimension i + D/2. In place on a [T, H, D] view that is usually the
// Q or K part of the fused QKV output, so rows are indexed through strides.
//
// Positions are global token ids and may be large (millions on long sequences): the angle
// position · inv_freq[i] is formed in double for float tensors too. In float, an angle near 10^6
// has an ulp of 0.06 rad, which would rotate the wrong way by whole degrees.
#include <cmath>
#include <vector>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

void check_rope(const char* op, const Tensor& x, const Tensor& positions, const RopeParams& p) {
  LT_CHECK(x.ndim == 3, "{}: x must be a [T, H, D] view, got {}", op, x.describe());
  LT_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): x {}", op, dtype_name(x.dtype),
           x.describe());
  LT_CHECK(x.shape[2] <= 1 || x.stride[2] == 1, "{}: x {} must be unit-stride in head_dim (stride {})", op,
           x.describe(), x.stride[2]);
  LT_CHECK(x.shape[2] % 2 == 0, "{}: head_dim must be even for rotate-half RoPE, x is {}", op, x.describe());
  LT_CHECK(positions.ndim == 1 && positions.dtype == DType::i32 && positions.shape[0] == x.shape[0],
           "{}: positions must be i32 [T] with T = {} (tokens of x {}), got {}", op, x.shape[0], x.describe(),
           positions.describe());
  LT_CHECK(positions.shape[0] <= 1 || positions.stride[0] == 1, "{}: positions {} must be contiguous (stride {})",
           op, positions.describe(), positions.stride[0]);
  LT_CHECK(p.theta > 0.0, "{}: rope theta must be > 0 (model.rope_theta), got {}", op, p.theta);
  LT_CHECK(p.inv_freq.empty() || static_cast<int64_t>(p.inv_freq.size()) == x.shape[2] / 2,
           "{}: the inverse-frequency table has {} entries; head_dim {} needs {}", op, p.inv_freq.size(), x.shape[2],
           x.shape[2] / 2);
  LT_CHECK(std::isfinite(p.attention_factor) && p.attention_factor > 0.0,
           "{}: the RoPE attention factor must be finite and > 0, got {}", op, p.attention_factor);
  const int32_t* pos = positions.ptr<int32_t>();
  for (int64_t t = 0; t < positions.shape[0]; ++t) {
    LT_CHECK(pos[t] >= 0, "{}: position {} at token index {} is negative; positions are global token ids >= 0",
             op, pos[t], t);
  }
}

// Rotates every head of every token by `direction` · angle (+1: forward, -1: the transpose) and
// scales it by the attention factor.
template <class T>
void rope_rotate(const Tensor& x, const Tensor& positions, const RopeParams& p, double direction) {
  // x [T, H, D] (strided), positions [T]
  const int64_t n_tokens = x.shape[0], H = x.shape[1], D = x.shape[2], half = D / 2;
  const int32_t* pos = positions.ptr<int32_t>();
  T* xp = x.ptr<T>();
  const double a = p.attention_factor;

  std::vector<double> inv_freq = p.inv_freq;  // the scaled table, or theta^(-2i/D)
  if (inv_freq.empty()) {
    inv_freq.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i)
      inv_freq[i] = std::pow(p.theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  }

  // cos and sin of this token's angles, kept in double: the products are rounded once, to T.
  std::vector<double> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos[t]) * inv_freq[i];
      cos_t[i] = a * std::cos(angle);
      sin_t[i] = a * direction * std::sin(angle);
    }
    for (int64_t h = 0; h < H; ++h) {
      T* v = xp + t * x.stride[0] + h * x.stride[1];
      for (int64_t i = 0; i < half; ++i) {
        const double x1 = v[i], x2 = v[i + half];
        v[i] = static_cast<T>(x1 * cos_t[i] - x2 * sin_t[i]);
        v[i + half] = static_cast<T>(x2 * cos_t[i] + x1 * sin_t[i]);
      }
    }
  }
}

}  // namespace

void rope_forward(Tensor x, Tensor positions, const RopeParams& p) {
  check_rope("rope_forward", x, positions, p);
  if (x.dtype == DType::f32) return rope_rotate<float>(x, positions, p, +1.0);
  return rope_rotate<double>(x, positions, p, +1.0);
}

// The map is a·R(angle) with R orthogonal, so its transpose (what backward applies to the gradient)
// is a·R(-angle).
void rope_backward(Tensor dx, Tensor positions, const RopeParams& p) {
  check_rope("rope_backward", dx, positions, p);
  if (dx.dtype == DType::f32) return rope_rotate<float>(dx, positions, p, -1.0);
  return rope_rotate<double>(dx, positions, p, -1.0);
}

}  // namespace longtrain::ops::cpu
