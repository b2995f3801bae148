// CPU reference for rotary position embeddings, Hugging Face's rotate-half convention: dimension i
// of the first half pairs with dimension i + D/2. In place on a [T, H, D] view that is usually the
// Q or K part of the fused QKV output, so rows are indexed through strides.
//
// Positions are global token ids and may be large (millions on long sequences): the angle
// position · inv_freq[i] is formed in double for float tensors too. In float, an angle near 10^6
// has an ulp of 0.06 rad, which would rotate the wrong way by whole degrees.
#include <cmath>
#include <type_traits>
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

// The scaled table, or theta^(-2i/D), for head dim D.
std::vector<double> inverse_frequencies(const RopeParams& p, int64_t D) {
  if (!p.inv_freq.empty()) return p.inv_freq;
  std::vector<double> inv_freq(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i)
    inv_freq[i] = std::pow(p.theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
  return inv_freq;
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

  const std::vector<double> inv_freq = inverse_frequencies(p, D);

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

template <class T, class Table>
void rope_rotate_from_table(const Tensor& x, const Tensor& table, double direction) {
  const int64_t n_tokens = x.shape[0], H = x.shape[1], half = x.shape[2] / 2;
  T* xp = x.ptr<T>();
  const Table* tp = table.ptr<Table>();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const Table* c = tp + t * table.stride[0];
    const Table* s = c + half;
    for (int64_t h = 0; h < H; ++h) {
      T* v = xp + t * x.stride[0] + h * x.stride[1];
      for (int64_t i = 0; i < half; ++i) {
        // As rope_rotate: products in double of the same c and s (direction · s is exact), rounded once.
        const double x1 = v[i], x2 = v[i + half], ci = c[i], si = direction * static_cast<double>(s[i]);
        v[i] = static_cast<T>(x1 * ci - x2 * si);
        v[i + half] = static_cast<T>(x2 * ci + x1 * si);
      }
    }
  }
}

void check_table(const char* op, const Tensor& table, int64_t T, int64_t D) {
  LT_CHECK(table.ndim == 2 && table.shape[0] == T && table.shape[1] == D &&
               (table.dtype == DType::f32 || table.dtype == DType::f64) && (table.shape[1] <= 1 || table.stride[1] == 1),
           "{}: the RoPE table must be f32 or f64 [{}, {}] (cos | sin per token), unit-stride in its last dimension; got {}",
           op, T, D, table.describe());
}

}  // namespace

void rope_table(Tensor table, Tensor positions, const RopeParams& p) {
  LT_CHECK(table.ndim == 2 && table.shape[1] % 2 == 0, "rope_table: the table must be [T, D] with D even, got {}",
           table.describe());
  const int64_t T = table.shape[0], D = table.shape[1], half = D / 2;
  // check_rope's checks of the positions and parameters, through a [T, 1, D] shape of the table.
  Tensor as_x = table;
  as_x.ndim = 3;
  as_x.shape = {T, 1, D, 0};
  as_x.stride = {table.stride[0], D, 1, 0};
  check_rope("rope_table", as_x, positions, p);
  check_table("rope_table", table, T, D);
  const std::vector<double> inv_freq = inverse_frequencies(p, D);
  const int32_t* pos = positions.ptr<int32_t>();
  auto fill = [&](auto* out) {
    using Table = std::remove_pointer_t<decltype(out)>;
    for (int64_t t = 0; t < T; ++t) {
      Table* row = out + t * table.stride[0];
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos[t]) * inv_freq[i];
        row[i] = static_cast<Table>(p.attention_factor * std::cos(angle));
        row[half + i] = static_cast<Table>(p.attention_factor * std::sin(angle));
      }
    }
  };
  if (table.dtype == DType::f64) fill(table.ptr<double>());
  else fill(table.ptr<float>());
}

void rope_apply(Tensor x, Tensor table, bool inverse) {
  const char* op = inverse ? "rope_apply (inverse)" : "rope_apply";
  LT_CHECK(x.ndim == 3, "{}: x must be a [T, H, D] view, got {}", op, x.describe());
  LT_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): x {}", op, dtype_name(x.dtype),
           x.describe());
  LT_CHECK(x.shape[2] % 2 == 0 && (x.shape[2] <= 1 || x.stride[2] == 1),
           "{}: x {} must have an even, unit-stride head_dim", op, x.describe());
  check_table(op, table, x.shape[0], x.shape[2]);
  const double direction = inverse ? -1.0 : 1.0;
  if (x.dtype == DType::f32) {
    if (table.dtype == DType::f64) return rope_rotate_from_table<float, double>(x, table, direction);
    return rope_rotate_from_table<float, float>(x, table, direction);
  }
  if (table.dtype == DType::f64) return rope_rotate_from_table<double, double>(x, table, direction);
  return rope_rotate_from_table<double, float>(x, table, direction);
}

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
