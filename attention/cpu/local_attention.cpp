// CPU reference of local block attention (attention/local_attention.h): the block forward, the row
// dot product delta = rowsum(dO ⊙ O), the block backward and the LSE merge. Every distributed
// schedule (ring, zigzag, distflash, burst) is made of these four, and the CUDA path is tested
// against them, so they are written for exactness first and speed second.
//
// Templated on the storage type T (float or double). Every sum (dot products, the softmax row sum,
// the output and gradient accumulators, the merge) is computed in double, for f32 too, on top of the
// row-max subtraction. Why not float with max-subtraction: that keeps exp() from overflowing, but a
// float row sum still loses ~sqrt(Tk) ulps, and the f32 path is what the cuDNN kernels and the f32
// ring schedules are compared with. With double accumulation an f32 result is within one f32 rounding
// of the exact value of its f32 inputs, whatever the key count and however the keys were split into
// blocks, so a comparison measures the other side's error, not ours. The cost is acceptable: the CPU
// path is the reference and the small-model demo, not the fast path.
//
// Layout [tokens, heads, head_dim]; q/k/v are usually strided views into the fused QKV output
// ([T, (Hq + 2·Hkv)·D], stride[0] = (Hq + 2·Hkv)·D), so rows are addressed through Tensor::stride
// and only the last dimension must be unit-stride. GQA/MQA: query head h reads KV head h / (Hq/Hkv);
// K and V are never expanded, and the backward sums the query heads of a group into their KV head.

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/backends.h"

namespace longtrain::attn::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A float tensor of this call: `ndim` dims on the CPU, f32 or f64 (the dtype of the call's first
// tensor), unit-stride last dimension, and memory behind it when it has elements.
void check_float_tensor(const char* op, const char* name, const Tensor& t, int ndim, DType dtype) {
  LT_CHECK(t.ndim == ndim, "{}: {} must have {} dims, got {}", op, name, ndim, t.describe());
  LT_CHECK(t.device == Device::cpu, "{}: {} is {}; the CPU backend needs host tensors", op, name, t.describe());
  LT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64,
           "{}: {} is {}; the CPU reference computes in f32 or f64 (bf16 attention runs on CUDA)", op, name,
           t.describe());
  LT_CHECK(t.dtype == dtype, "{}: {} is {} but the other tensors are {}; on CPU every float tensor of a call "
           "shares one dtype", op, name, t.describe(), dtype_name(dtype));
  LT_CHECK(t.stride[ndim - 1] == 1 || t.shape[ndim - 1] <= 1,
           "{}: {} {} has stride {} in its last dimension; it must be unit-stride", op, name, t.describe(),
           t.stride[ndim - 1]);
  LT_CHECK(t.data != nullptr || t.numel() == 0, "{}: {} {} has no memory", op, name, t.describe());
}

// The geometry of one (Q block, K/V block) pair.
struct Geometry {
  int64_t Tq, Tk;   // query and key tokens of the block
  int64_t Hq, Hkv;  // query and KV heads
  int64_t D;        // head_dim
  int64_t group;    // Hq / Hkv: query heads per KV head
};

// q [Tq, Hq, D], k and v [Tk, Hkv, D]; the checks every op on a block pair starts with.
Geometry check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, BlockMask mask) {
  check_float_tensor(op, "q", q, 3, q.dtype);
  check_float_tensor(op, "k", k, 3, q.dtype);
  check_float_tensor(op, "v", v, 3, q.dtype);
  Geometry g{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), 0};
  LT_CHECK(k.size(2) == g.D && v.size(2) == g.D,
           "{}: head_dim differs between q {}, k {} and v {}; all three must share head_dim (the last dim)", op,
           q.describe(), k.describe(), v.describe());
  check_same_shape(k, v, fmt::format("{}: k and v", op).c_str());
  LT_CHECK(g.Hkv > 0 && g.Hq % g.Hkv == 0,
           "{}: q {} has Hq = {} heads, not a multiple of the Hkv = {} KV heads of k {}; GQA/MQA needs "
           "n_heads % n_kv_heads == 0", op, q.describe(), g.Hq, g.Hkv, k.describe());
  g.group = g.Hq / g.Hkv;
  LT_CHECK(mask != BlockMask::causal_diagonal || g.Tq == g.Tk,
           "{}: mask causal_diagonal needs a square diagonal block (Tq == Tk), but q is {} and k is {}; use "
           "BlockMask::none for an off-diagonal block", op, q.describe(), k.describe());
  return g;
}

// A per-row statistic (lse, delta) of a [T, H, D] tensor (q, o): [T, H].
void check_row_stat(const char* op, const char* name, const Tensor& t, const char* rows_name, const Tensor& rows) {
  check_float_tensor(op, name, t, 2, rows.dtype);
  LT_CHECK(t.size(0) == rows.size(0) && t.size(1) == rows.size(1), "{}: {} is {}, expected [{}, {}] for {} {}", op,
           name, t.describe(), rows.size(0), rows.size(1), rows_name, rows.describe());
}

// A tensor with exactly the shape of `like` (o like q, dk like k, ...).
void check_like(const char* op, const char* name, const Tensor& t, const char* like_name, const Tensor& like) {
  check_float_tensor(op, name, t, like.ndim, like.dtype);
  bool same = true;
  for (int d = 0; d < like.ndim; ++d) same = same && t.shape[d] == like.shape[d];
  LT_CHECK(same, "{}: {} is {} but must have the shape of {} {}", op, name, t.describe(), like_name,
           like.describe());
}

// Strided element access; the last dimension is unit-stride (checked above).
template <class T>
struct Rows3 {  // [T, H, D]
  T* p;
  int64_t s0, s1;
  explicit Rows3(const Tensor& t) : p(t.ptr<std::remove_const_t<T>>()), s0(t.stride[0]), s1(t.stride[1]) {}
  T* row(int64_t t, int64_t h) const { return p + t * s0 + h * s1; }  // the D values of (token t, head h)
};
template <class T>
struct Rows2 {  // [T, H]
  T* p;
  int64_t s0;
  explicit Rows2(const Tensor& t) : p(t.ptr<std::remove_const_t<T>>()), s0(t.stride[0]) {}
  T& at(int64_t t, int64_t h) const { return p[t * s0 + h]; }
};

template <class T>
double dot(const double* a, const T* b, int64_t n) {
  double s = 0.0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * static_cast<double>(b[d]);
  return s;
}

template <class T>
void load(double* dst, const T* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<double>(src[d]);
}

// Keys visible to query i: [0, visible_keys).
int64_t visible_keys(BlockMask mask, int64_t i, int64_t Tk) {
  return mask == BlockMask::causal_diagonal ? i + 1 : Tk;
}

// ---- forward -------------------------------------------------------------------------------
// For each query token i and head h (KV head g = h / group), over the visible keys j:
//   s_j = scale · q[i,h]·k[j,g];  m = max_j s_j;  l = Σ_j exp(s_j - m)
//   o[i,h] = Σ_j exp(s_j - m) v[j,g] / l;  lse[i,h] = m + log l
// A row with no visible key (only possible for an empty K/V block, Tk = 0) is the empty partial
// result (o = 0, lse = -inf) that lse_merge ignores.
template <class T>
void forward_impl(const Tensor& o_t, const Tensor& lse_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                  const Geometry& g, BlockMask mask, double scale) {
  Rows3<const T> q(q_t), k(k_t), v(v_t);
  Rows3<T> o(o_t);
  Rows2<T> lse(lse_t);
  const int64_t D = g.D;
  std::vector<double> q_row(D), acc(D), score(g.Tk);  // acc: the unnormalised output row

  for (int64_t i = 0; i < g.Tq; ++i) {
    const int64_t n_keys = visible_keys(mask, i, g.Tk);
    for (int64_t h = 0; h < g.Hq; ++h) {
      const int64_t kv = h / g.group;
      load(q_row.data(), q.row(i, h), D);
      double m = kNegInf;
      for (int64_t j = 0; j < n_keys; ++j) {
        score[j] = scale * dot(q_row.data(), k.row(j, kv), D);
        m = std::max(m, score[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double l = 0.0;  // >= 1 when n_keys > 0: the max term contributes exp(0)
      for (int64_t j = 0; j < n_keys; ++j) {
        const double p = std::exp(score[j] - m);
        l += p;
        const T* v_row = v.row(j, kv);
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<double>(v_row[d]);
      }
      T* o_row = o.row(i, h);
      if (n_keys == 0) {
        for (int64_t d = 0; d < D; ++d) o_row[d] = T(0);
        lse.at(i, h) = static_cast<T>(kNegInf);
        continue;
      }
      const double inv_l = 1.0 / l;
      for (int64_t d = 0; d < D; ++d) o_row[d] = static_cast<T>(acc[d] * inv_l);
      lse.at(i, h) = static_cast<T>(m + std::log(l));
    }
  }
}

// ---- delta ---------------------------------------------------------------------------------
template <class T>
void delta_impl(const Tensor& delta_t, const Tensor& o_t, const Tensor& d_o_t) {
  Rows3<const T> o(o_t), d_o(d_o_t);
  Rows2<T> delta(delta_t);
  const int64_t D = o_t.size(2);
  for (int64_t t = 0; t < o_t.size(0); ++t) {
    for (int64_t h = 0; h < o_t.size(1); ++h) {
      const T* o_row = o.row(t, h);
      const T* d_o_row = d_o.row(t, h);
      double s = 0.0;
      for (int64_t d = 0; d < D; ++d) s += static_cast<double>(d_o_row[d]) * static_cast<double>(o_row[d]);
      delta.at(t, h) = static_cast<T>(s);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------
// For each query token i, head h (KV head g) and visible key j, with the final lse and delta:
//   p = exp(scale · q[i,h]·k[j,g] - lse[i,h]);  dp = d_o[i,h]·v[j,g];  ds = p · (dp - delta[i,h])
//   dq[i,h] += scale · Σ_j ds · k[j,g];  dk[j,g] += scale · ds · q[i,h];  dv[j,g] += p · d_o[i,h]
// dk/dv collect contributions from every query (and every query head of the group) in a double
// buffer that is added to the outputs once, so an f32 dk/dv is rounded once per call, not per query.
// A row whose final lse is -inf saw no key anywhere: its P is 0 and nothing flows from it.
template <class T>
void backward_impl(const Tensor& dq_t, const Tensor& dk_t, const Tensor& dv_t, const Tensor& q_t, const Tensor& k_t,
                   const Tensor& v_t, const Tensor& d_o_t, const Tensor& lse_t, const Tensor& delta_t,
                   const Geometry& g, BlockMask mask, double scale) {
  Rows3<const T> q(q_t), k(k_t), v(v_t), d_o(d_o_t);
  Rows2<const T> lse(lse_t), delta(delta_t);
  Rows3<T> dq(dq_t), dk(dk_t), dv(dv_t);
  const int64_t D = g.D;
  std::vector<double> dk_acc(g.Tk * g.Hkv * D, 0.0), dv_acc(g.Tk * g.Hkv * D, 0.0);  // [Tk, Hkv, D]
  std::vector<double> q_row(D), d_o_row(D), dq_row(D);

  for (int64_t i = 0; i < g.Tq; ++i) {
    const int64_t n_keys = visible_keys(mask, i, g.Tk);
    for (int64_t h = 0; h < g.Hq; ++h) {
      const double row_lse = static_cast<double>(lse.at(i, h));
      if (row_lse == kNegInf) continue;
      const double row_delta = static_cast<double>(delta.at(i, h));
      const int64_t kv = h / g.group;
      load(q_row.data(), q.row(i, h), D);
      load(d_o_row.data(), d_o.row(i, h), D);
      std::fill(dq_row.begin(), dq_row.end(), 0.0);
      for (int64_t j = 0; j < n_keys; ++j) {
        const T* k_row = k.row(j, kv);
        const double p = std::exp(scale * dot(q_row.data(), k_row, D) - row_lse);
        const double dp = dot(d_o_row.data(), v.row(j, kv), D);
        const double ds = p * (dp - row_delta);
        double* dk_row = &dk_acc[(j * g.Hkv + kv) * D];
        double* dv_row = &dv_acc[(j * g.Hkv + kv) * D];
        for (int64_t d = 0; d < D; ++d) {
          dq_row[d] += ds * static_cast<double>(k_row[d]);
          dk_row[d] += scale * ds * q_row[d];
          dv_row[d] += p * d_o_row[d];
        }
      }
      T* dq_out = dq.row(i, h);
      for (int64_t d = 0; d < D; ++d) dq_out[d] = static_cast<T>(static_cast<double>(dq_out[d]) + scale * dq_row[d]);
    }
  }
  for (int64_t j = 0; j < g.Tk; ++j) {
    for (int64_t kv = 0; kv < g.Hkv; ++kv) {
      T* dk_out = dk.row(j, kv);
      T* dv_out = dv.row(j, kv);
      const double* dk_row = &dk_acc[(j * g.Hkv + kv) * D];
      const double* dv_row = &dv_acc[(j * g.Hkv + kv) * D];
      for (int64_t d = 0; d < D; ++d) {
        dk_out[d] = static_cast<T>(static_cast<double>(dk_out[d]) + dk_row[d]);
        dv_out[d] = static_cast<T>(static_cast<double>(dv_out[d]) + dv_row[d]);
      }
    }
  }
}

// ---- lse merge -----------------------------------------------------------------------------
// Per row: m = max(L1, L2); L = m + log(1 + exp(min - m)); O = exp(L1 - L)·O1 + exp(L2 - L)·O2.
// -inf is an empty partial result whose O is never read, so a fresh accumulator may hold anything;
// two empties give (O = 0, L = -inf). The formula is symmetric in its two inputs, so merge(a, b)
// and merge(b, a) give bit-identical results.
template <class T>
void merge_impl(const Tensor& o_acc_t, const Tensor& lse_acc_t, const Tensor& o_blk_t, const Tensor& lse_blk_t) {
  Rows3<T> o_acc(o_acc_t);
  Rows2<T> lse_acc(lse_acc_t);
  Rows3<const T> o_blk(o_blk_t);
  Rows2<const T> lse_blk(lse_blk_t);
  const int64_t D = o_acc_t.size(2);
  for (int64_t t = 0; t < o_acc_t.size(0); ++t) {
    for (int64_t h = 0; h < o_acc_t.size(1); ++h) {
      const double l1 = static_cast<double>(lse_acc.at(t, h));
      const double l2 = static_cast<double>(lse_blk.at(t, h));
      T* o1 = o_acc.row(t, h);
      const T* o2 = o_blk.row(t, h);
      if (l2 == kNegInf) {
        if (l1 == kNegInf) {
          for (int64_t d = 0; d < D; ++d) o1[d] = T(0);
        }
        continue;  // an empty block changes nothing
      }
      if (l1 == kNegInf) {
        for (int64_t d = 0; d < D; ++d) o1[d] = o2[d];
        lse_acc.at(t, h) = static_cast<T>(l2);
        continue;
      }
      const double m = std::max(l1, l2);
      const double l = m + std::log1p(std::exp(std::min(l1, l2) - m));
      const double w1 = std::exp(l1 - l);
      const double w2 = std::exp(l2 - l);
      for (int64_t d = 0; d < D; ++d) {
        o1[d] = static_cast<T>(w1 * static_cast<double>(o1[d]) + w2 * static_cast<double>(o2[d]));
      }
      lse_acc.at(t, h) = static_cast<T>(l);
    }
  }
}

}  // namespace

void attention_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, BlockMask mask, double scale) {
  const char* op = "attention_block_forward";
  const Geometry g = check_qkv(op, q, k, v, mask);
  check_like(op, "o", o, "q", q);
  check_row_stat(op, "lse", lse, "q", q);
  LT_CHECK(std::isfinite(scale), "{}: scale is {}; it must be finite (usually 1/sqrt(head_dim))", op, scale);
  if (q.dtype == DType::f64) {
    forward_impl<double>(o, lse, q, k, v, g, mask, scale);
  } else {
    forward_impl<float>(o, lse, q, k, v, g, mask, scale);
  }
}

void attention_delta(Tensor delta, Tensor o, Tensor d_o) {
  const char* op = "attention_delta";
  check_float_tensor(op, "o", o, 3, o.dtype);
  check_like(op, "d_o", d_o, "o", o);
  check_row_stat(op, "delta", delta, "o", o);
  if (o.dtype == DType::f64) {
    delta_impl<double>(delta, o, d_o);
  } else {
    delta_impl<float>(delta, o, d_o);
  }
}

void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                              Tensor lse, Tensor delta, BlockMask mask, double scale) {
  const char* op = "attention_block_backward";
  const Geometry g = check_qkv(op, q, k, v, mask);
  check_like(op, "d_o", d_o, "q", q);
  check_like(op, "dq", dq, "q", q);
  check_like(op, "dk", dk, "k", k);
  check_like(op, "dv", dv, "v", v);
  check_row_stat(op, "lse", lse, "q", q);
  check_row_stat(op, "delta", delta, "q", q);
  LT_CHECK(std::isfinite(scale), "{}: scale is {}; it must be finite (usually 1/sqrt(head_dim))", op, scale);
  if (q.dtype == DType::f64) {
    backward_impl<double>(dq, dk, dv, q, k, v, d_o, lse, delta, g, mask, scale);
  } else {
    backward_impl<float>(dq, dk, dv, q, k, v, d_o, lse, delta, g, mask, scale);
  }
}

void lse_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk) {
  const char* op = "lse_merge";
  check_float_tensor(op, "o_acc", o_acc, 3, o_acc.dtype);
  check_like(op, "o_blk", o_blk, "o_acc", o_acc);
  check_row_stat(op, "lse_acc", lse_acc, "o_acc", o_acc);
  check_row_stat(op, "lse_blk", lse_blk, "o_acc", o_acc);
  if (o_acc.dtype == DType::f64) {
    merge_impl<double>(o_acc, lse_acc, o_blk, lse_blk);
  } else {
    merge_impl<float>(o_acc, lse_acc, o_blk, lse_blk);
  }
}

}  // namespace longtrain::attn::cpu
