// CPU local block attention (attention/local_attention.h): the block forward, the row dot product
// delta = rowsum(dO ⊙ O), the block backward and the LSE merge. Every distributed schedule (ring,
// zigzag, distflash, burst) is made of these four, the CUDA path is tested against them in f64, and
// the CPU demo trains with them in f32, so they must be exact and fast.
//
// Forward and backward are GEMMs through OpenBLAS (sgemm for f32, dgemm for f64), one query head and
// one tile of query rows at a time, so a tile's scores [tile rows, Tk] are the only score memory:
// O(tile · Tk) per thread, never Tq × Tk.
//   forward  (head h, KV head g = h / (Hq/Hkv), query rows i of the tile, visible keys j):
//     S = scale · Q_h·K_gᵀ;  m = max_j S;  P = exp(S − m);  l = Σ_j P;  O_h = (P·V_g) / l;  LSE = m + log l
//   backward, from the final LSE and delta (given, or formed per row from the final O exactly as
//   attention_delta forms it, so both calls give the same bits):
//     P = exp(scale · Q_h·K_gᵀ − LSE);  dP = dO_h·V_gᵀ;  dS = P ⊙ (dP − delta)
//     dQ_h += scale · dS·K_g;  dK_g += scale · dSᵀ·Q_h;  dV_g += Pᵀ·dO_h   (GEMMs with beta = 1;
//     GradMode::overwrite zeroes dq/dk/dv first)
// A causal diagonal block computes, for the query tile [i0, i1), only the keys [0, i1) and masks the
// upper triangle of the tile's last square to P = 0.
//
// Precision: each dot product is a BLAS sum in the storage type (float accumulation for f32, as on
// the GPU's fp32 paths), taken after the row max is subtracted; softmax row sums are taken in double.
// f64 results are within ~1e-15 relative of the exact value and are what the tests and the CUDA path
// compare against; f32 results within ~1e-6 for rows of hundreds of keys. exp of float is our own
// vectorised polynomial (exp_lanes below, within 1.01 ulp), because glibc's expf is a scalar call (it is
// vectorised only under -ffast-math) and cost as much as all the GEMMs; f64 uses std::exp.
//
// Threads (attention/cpu/work_items.h): the forward's items are (query head, query tile) pairs; the
// backward's are KV heads, each walking its query tiles and query heads in a fixed order, so dK/dV are
// accumulated in the same order whatever the thread count. Every item writes outputs no other item
// writes, and every GEMM runs single-threaded inside its item, so results are bit-identical for any
// number of threads. On the 2-core demo machine (T = 256, 8 query / 4 KV heads, head_dim 32, f32,
// causal) forward + backward take ~1.5-2.3 ms per call instead of the per-row double loops' ~35 ms.
//
// Layout [tokens, heads, head_dim]; q/k/v are usually strided views into the fused QKV output
// ([T, (Hq + 2·Hkv)·D], stride[0] = (Hq + 2·Hkv)·D): one head's rows are a row-major matrix with
// leading dimension stride[0], which is what the GEMMs read and write (dq/dk/dv likewise in the fused
// dQKV buffer). Only the last dimension must be unit-stride. GQA/MQA: query head h reads KV head
// h / (Hq/Hkv); K and V are never expanded, and the backward sums the query heads of a group into
// their KV head.

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/blas_gemm.h"

#include "attention/backends.h"
#include "attention/cpu/work_items.h"

// The vector helpers below (namespace lanes) return vectors by value between always-inline functions
// of this file; GCC's warning that such a call's ABI would differ without AVX is irrelevant to them.
// GCC reports it at the end of the file, so it is silenced for the whole file.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace longtrain::attn::cpu {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A float tensor of this call: `ndim` dims on the CPU, f32 or f64 (the dtype of the call's first
// tensor), unit-stride last dimension, token rows that do not overlap (one head's rows are read and
// written as a matrix), and memory behind it when it has elements.
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
  LT_CHECK(ndim != 3 || t.shape[0] <= 1 || t.stride[0] >= t.shape[2],
           "{}: {} {} has token stride {} < head_dim {}: its token rows overlap; pass a view whose rows are "
           "at least head_dim apart", op, name, t.describe(), t.stride[0], t.shape[2]);
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
  T* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  Rows3() = default;
  explicit Rows3(const Tensor& t) : p(t.ptr<std::remove_const_t<T>>()), s0(t.stride[0]), s1(t.stride[1]) {}
  T* row(int64_t t, int64_t h) const { return p + t * s0 + h * s1; }  // the D values of (token t, head h)
};
template <class T>
struct Rows2 {  // [T, H]
  T* p = nullptr;
  int64_t s0 = 0;
  Rows2() = default;
  explicit Rows2(const Tensor& t) : p(t.ptr<std::remove_const_t<T>>()), s0(t.stride[0]) {}
  T& at(int64_t t, int64_t h) const { return p[t * s0 + h]; }
};

// One head's token rows as a row-major matrix [T, D] for BLAS: leading dimension = the token stride.
// A single row has no meaningful stride, but BLAS still wants ld >= max(1, D).
int64_t leading_dim(const Tensor& t) {
  return t.shape[0] <= 1 ? std::max<int64_t>(1, t.shape[2]) : t.stride[0];
}

// ---- GEMM ----------------------------------------------------------------------------------

// C [M, N] = alpha · A' · B' + beta · C (kernels/cpu/blas_gemm.h).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  longtrain::cpu::blas_gemm("attention", trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// ---- softmax rows of a score tile ------------------------------------------------------------
// A score tile is [rows, ld] (ld >= n_keys); the GEMM fills its first n_keys columns. Row r sees the
// first visible(r) of them: all n_keys without a mask, i0 + r + 1 in a causal diagonal block; the
// others are masked and must come out 0 so the following GEMMs ignore them.
struct TileRows {
  int64_t rows, ld, n_keys;
  int64_t visible0, step;  // visible(r) = min(n_keys, visible0 + step·r)
  int64_t visible(int64_t r) const { return std::min(n_keys, visible0 + step * r); }
};

// Forward: s[r, j] := exp(s[r, j] - m_r) for the visible j and 0 for the masked ones, where m_r is the
// row max over the visible scores; m[r] := m_r and l[r] := Σ_j s[r, j] (taken in double).
// Backward: p holds scores and ds holds dP on entry; for the visible j of a row whose lse is not -inf,
//   p[r, j] := exp(p[r, j] - lse_r);  ds[r, j] := p[r, j] · (ds[r, j] - delta_r);
// everything else is set to 0 (a row with lse = -inf saw no key anywhere and contributes nothing).
//
// f64: plain loops and std::exp. f32: the loops are written with GCC/Clang vector types, W lanes at a
// time (16-byte vectors everywhere, 32-byte AVX2+FMA vectors where the CPU has them, chosen once per
// process), with exp computed by exp_lanes below instead of glibc's scalar expf, which on its own cost
// about as much as all the GEMMs. Each row's result depends only on the row (and the CPU), never on
// the thread that computes it.

void softmax_forward_tile_scalar(double* s, const TileRows& t, double* m, double* l) {
  for (int64_t r = 0; r < t.rows; ++r) {
    double* row = s + r * t.ld;
    const int64_t n = t.visible(r);  // >= 1
    double row_max = kNegInf;
    for (int64_t j = 0; j < n; ++j) row_max = std::max(row_max, row[j]);
    double sum = 0.0;  // >= 1: the max term contributes exp(0)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - row_max);
      sum += row[j];
    }
    std::fill(row + n, row + t.n_keys, 0.0);
    m[r] = row_max;
    l[r] = sum;
  }
}

void softmax_backward_tile_scalar(double* p, double* ds, const TileRows& t, const double* lse, const double* delta) {
  for (int64_t r = 0; r < t.rows; ++r) {
    double* p_r = p + r * t.ld;
    double* ds_r = ds + r * t.ld;
    const int64_t n = lse[r] == kNegInf ? 0 : t.visible(r);
    for (int64_t j = 0; j < n; ++j) {
      p_r[j] = std::exp(p_r[j] - lse[r]);
      ds_r[j] = p_r[j] * (ds_r[j] - delta[r]);
    }
    std::fill(p_r + n, p_r + t.n_keys, 0.0);
    std::fill(ds_r + n, ds_r + t.n_keys, 0.0);
  }
}

namespace lanes {

#define LT_LANES_INLINE inline __attribute__((always_inline))

template <int W>
struct Vec;
template <>
struct Vec<4> {  // 16 bytes: SSE2 on every x86-64, NEON on arm64
  using F = float __attribute__((vector_size(16)));
  using I = int32_t __attribute__((vector_size(16)));
  using D = double __attribute__((vector_size(16)));  // half of the lanes, in double
};
template <>
struct Vec<8> {  // 32 bytes: AVX2
  using F = float __attribute__((vector_size(32)));
  using I = int32_t __attribute__((vector_size(32)));
  using D = double __attribute__((vector_size(32)));
};

template <int W>
LT_LANES_INLINE typename Vec<W>::F splat(float x) {
  return typename Vec<W>::F{} + x;
}
template <int W>
LT_LANES_INLINE typename Vec<W>::F load(const float* p) {
  typename Vec<W>::F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int W>
LT_LANES_INLINE void store(float* p, const typename Vec<W>::F& v) {
  std::memcpy(p, &v, sizeof v);
}
// The first `count` (< W) values at p, the other lanes `fill`.
template <int W>
LT_LANES_INLINE typename Vec<W>::F load_partial(const float* p, int64_t count, float fill) {
  typename Vec<W>::F v = splat<W>(fill);
  for (int64_t l = 0; l < count; ++l) v[l] = p[l];
  return v;
}
template <int W>
LT_LANES_INLINE void store_partial(float* p, const typename Vec<W>::F& v, int64_t count) {
  for (int64_t l = 0; l < count; ++l) p[l] = v[l];
}

// exp of every lane. Cody-Waite range reduction x = n·ln2 + r with |r| <= ln2/2, Cephes' polynomial
// for exp(r), and 2^n applied as two exact power-of-two factors so that every n from the clamp range
// gives normal factors (results into the subnormal range and overflow to +inf come out right).
// Within 1.01 ulp of the exact exp at every float in [-104, 1.5] (checked exhaustively against double
// exp, for the 16-byte and the AVX2+FMA lanes); exp(-inf) = 0, exp(+inf) = +inf, and NaN stays NaN
// (the clamps compare false for it).
template <int W>
LT_LANES_INLINE typename Vec<W>::F exp_lanes(const typename Vec<W>::F& x) {
  using F = typename Vec<W>::F;
  using I = typename Vec<W>::I;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo; n·kLn2Hi is exact
  constexpr float kRound = 12582912.0f;                              // 1.5·2^23: adding it rounds to an integer
  F xc = x < -110.0f ? splat<W>(-110.0f) : x;                        // below: exp rounds to 0 anyway
  xc = xc > 89.0f ? splat<W>(89.0f) : xc;                            // above: exp overflows to +inf anyway
  const F n = (xc * kLog2e + kRound) - kRound;                       // round(x / ln 2)
  const F r = (xc - n * kLn2Hi) - n * kLn2Lo;
  const F poly = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                  1.6666665459e-1f) * r + 5.0000001201e-1f;
  const F exp_r = poly * (r * r) + r + 1.0f;
  const I n_int = __builtin_convertvector(n, I);
  const I n1 = n_int >> 1, n2 = n_int - n1;  // 2^n = 2^n1 · 2^n2, each in [-80, 65]
  return exp_r * reinterpret_cast<F>((n1 + 127) << 23) * reinterpret_cast<F>((n2 + 127) << 23);
}

// lo/hi += the lanes of v converted to double.
template <int W>
LT_LANES_INLINE void accumulate(typename Vec<W>::D& lo, typename Vec<W>::D& hi, const typename Vec<W>::F& v) {
  using D = typename Vec<W>::D;
  if constexpr (W == 4) {
    lo += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1), D);
    hi += __builtin_convertvector(__builtin_shufflevector(v, v, 2, 3), D);
  } else {
    lo += __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), D);
    hi += __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), D);
  }
}

template <int W>
LT_LANES_INLINE void softmax_forward_tile(float* s, const TileRows& t, float* m, double* l) {
  using F = typename Vec<W>::F;
  using D = typename Vec<W>::D;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < t.rows; ++r) {
    float* row = s + r * t.ld;
    const int64_t n = t.visible(r);  // >= 1
    F max_lanes = splat<W>(neg_inf);
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const F x = load<W>(row + j);
      max_lanes = max_lanes < x ? x : max_lanes;
    }
    if (j < n) {
      const F x = load_partial<W>(row + j, n - j, neg_inf);
      max_lanes = max_lanes < x ? x : max_lanes;
    }
    float row_max = neg_inf;
    for (int l = 0; l < W; ++l) row_max = row_max < max_lanes[l] ? max_lanes[l] : row_max;

    D lo = {}, hi = {};
    for (j = 0; j + W <= n; j += W) {
      const F e = exp_lanes<W>(load<W>(row + j) - row_max);
      store<W>(row + j, e);
      accumulate<W>(lo, hi, e);
    }
    if (j < n) {  // the lanes past n hold exp(-inf) = 0
      const F e = exp_lanes<W>(load_partial<W>(row + j, n - j, neg_inf) - row_max);
      store_partial<W>(row + j, e, n - j);
      accumulate<W>(lo, hi, e);
    }
    double sum = 0.0;
    for (int l = 0; l < W / 2; ++l) sum += lo[l];
    for (int l = 0; l < W / 2; ++l) sum += hi[l];
    std::fill(row + n, row + t.n_keys, 0.0f);
    m[r] = row_max;
    l[r] = sum;
  }
}

template <int W>
LT_LANES_INLINE void softmax_backward_tile(float* p, float* ds, const TileRows& t, const float* lse,
                                           const float* delta) {
  using F = typename Vec<W>::F;
  for (int64_t r = 0; r < t.rows; ++r) {
    float* p_r = p + r * t.ld;
    float* ds_r = ds + r * t.ld;
    const int64_t n = lse[r] == -std::numeric_limits<float>::infinity() ? 0 : t.visible(r);
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const F e = exp_lanes<W>(load<W>(p_r + j) - lse[r]);
      store<W>(p_r + j, e);
      store<W>(ds_r + j, e * (load<W>(ds_r + j) - delta[r]));
    }
    if (j < n) {
      const F e = exp_lanes<W>(load_partial<W>(p_r + j, n - j, 0.0f) - lse[r]);
      store_partial<W>(p_r + j, e, n - j);
      store_partial<W>(ds_r + j, e * (load_partial<W>(ds_r + j, n - j, 0.0f) - delta[r]), n - j);
    }
    std::fill(p_r + n, p_r + t.n_keys, 0.0f);
    std::fill(ds_r + n, ds_r + t.n_keys, 0.0f);
  }
}

#undef LT_LANES_INLINE

}  // namespace lanes

void softmax_forward_tile_x4(float* s, const TileRows& t, float* m, double* l) {
  lanes::softmax_forward_tile<4>(s, t, m, l);
}
void softmax_backward_tile_x4(float* p, float* ds, const TileRows& t, const float* lse, const float* delta) {
  lanes::softmax_backward_tile<4>(p, ds, t, lse, delta);
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void softmax_forward_tile_avx2(float* s, const TileRows& t, float* m, double* l) {
  lanes::softmax_forward_tile<8>(s, t, m, l);
}
__attribute__((target("avx2,fma"))) void softmax_backward_tile_avx2(float* p, float* ds, const TileRows& t,
                                                                     const float* lse, const float* delta) {
  lanes::softmax_backward_tile<8>(p, ds, t, lse, delta);
}
bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

void softmax_forward_tile(double* s, const TileRows& t, double* m, double* l) {
  softmax_forward_tile_scalar(s, t, m, l);
}
void softmax_forward_tile(float* s, const TileRows& t, float* m, double* l) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return softmax_forward_tile_avx2(s, t, m, l);
#endif
  softmax_forward_tile_x4(s, t, m, l);
}
void softmax_backward_tile(double* p, double* ds, const TileRows& t, const double* lse, const double* delta) {
  softmax_backward_tile_scalar(p, ds, t, lse, delta);
}
void softmax_backward_tile(float* p, float* ds, const TileRows& t, const float* lse, const float* delta) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return softmax_backward_tile_avx2(p, ds, t, lse, delta);
#endif
  softmax_backward_tile_x4(p, ds, t, lse, delta);
}

// ---- query tiles ---------------------------------------------------------------------------

// Rows of a query tile. Large enough that the GEMMs run near OpenBLAS's peak and a tile's fixed costs
// (GEMM calls, packing K and V) are spread over many rows; small enough that a causal diagonal tile
// wastes little work on its masked triangle, that there are enough (head, tile) items to keep the
// threads busy, and that the score tile [rows, Tk] fits in L2 for the lengths the CPU trains at.
constexpr int64_t kTileRows = 64;

struct Tiles {
  int64_t rows;   // query rows per tile (the last tile may have fewer)
  int64_t count;  // tiles covering Tq
  int64_t first(int64_t tile) const { return tile * rows; }
  int64_t size(int64_t tile, int64_t Tq) const { return std::min(rows, Tq - tile * rows); }
};

Tiles query_tiles(int64_t Tq) {
  const int64_t rows = std::max<int64_t>(1, std::min(Tq, kTileRows));
  return {rows, (Tq + rows - 1) / rows};
}

// Below this many multiply-adds per GEMM pass over the block (Hq · Tq · keys · D, about 40 µs on one
// core) a call runs on the calling thread alone: waking a helper costs more than it saves. Decode
// steps of generation and the tests' small blocks stay single-threaded; the demo's blocks do not.
constexpr double kParallelMinMacs = 2e6;

int block_workers(const Geometry& g, BlockMask mask, int64_t n_items) {
  const double keys_per_row = mask == BlockMask::causal_diagonal ? 0.5 * static_cast<double>(g.Tk) : g.Tk;
  const double macs = static_cast<double>(g.Hq) * static_cast<double>(g.Tq) * keys_per_row * static_cast<double>(g.D);
  return macs < kParallelMinMacs ? 1 : work_threads(n_items);
}

// The score tile's row stride: Tk rounded up to 16 elements, so every row starts 64-byte aligned.
int64_t score_stride(int64_t Tk) { return (Tk + 15) / 16 * 16; }

// The rows of query tile [i0, i0 + rows): the keys it computes (all of them, or for a causal diagonal
// block those up to its last row) and the keys each row sees.
TileRows tile_rows(BlockMask mask, int64_t i0, int64_t rows, int64_t Tk, int64_t ld) {
  if (mask == BlockMask::causal_diagonal) return {rows, ld, i0 + rows, i0 + 1, 1};
  return {rows, ld, Tk, Tk, 0};
}

// ---- forward -------------------------------------------------------------------------------
// Work item = (query head h, query tile). For the tile's rows i and its keys j (KV head g = h / group):
//   S [rows, keys] = scale · Q_h[tile] · K_g[keys]ᵀ                    (GEMM)
//   per row: m = max_j S (visible j);  P = exp(S - m), 0 where masked;  l = Σ_j P;  lse = m + log l
//   O_h[tile] [rows, D] = P · V_g[keys] [keys, D]                      (GEMM, straight into o)
//   O_h[tile] row i /= l_i
// A block without keys (Tk = 0) is the empty partial result (o = 0, lse = -inf) that lse_merge ignores.
template <class T>
void forward_impl(const Tensor& o_t, const Tensor& lse_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                  const Geometry& g, BlockMask mask, double scale) {
  Rows3<const T> q(q_t), k(k_t), v(v_t);
  Rows3<T> o(o_t);
  Rows2<T> lse(lse_t);
  const int64_t D = g.D;
  if (g.Tq == 0) return;
  if (g.Tk == 0) {
    for (int64_t i = 0; i < g.Tq; ++i) {
      for (int64_t h = 0; h < g.Hq; ++h) {
        std::fill(o.row(i, h), o.row(i, h) + D, T(0));
        lse.at(i, h) = static_cast<T>(kNegInf);
      }
    }
    return;
  }
  const int64_t ld_q = leading_dim(q_t), ld_k = leading_dim(k_t), ld_v = leading_dim(v_t), ld_o = leading_dim(o_t);
  const Tiles tiles = query_tiles(g.Tq);
  const int64_t ld_s = score_stride(g.Tk);
  const int64_t n_items = g.Hq * tiles.count;
  const int workers = block_workers(g, mask, n_items);
  struct Scratch {
    std::vector<T> s;       // [tiles.rows, ld_s]: scores, then P
    std::vector<T> m;       // [tiles.rows]: row maxima
    std::vector<double> l;  // [tiles.rows]: row sums
  };
  std::vector<Scratch> scratch(static_cast<size_t>(workers));

  run_work_items(n_items, workers, [&](int64_t item, int worker) {
    // Tiles from the last: under a causal mask the later tiles see more keys, and starting with the
    // largest items keeps the threads evenly loaded at the end.
    const int64_t tile = tiles.count - 1 - item / g.Hq, h = item % g.Hq, kv = h / g.group;
    const int64_t i0 = tiles.first(tile);
    const TileRows t = tile_rows(mask, i0, tiles.size(tile, g.Tq), g.Tk, ld_s);
    Scratch& w = scratch[static_cast<size_t>(worker)];
    if (w.s.empty()) {
      w.s.resize(static_cast<size_t>(tiles.rows * ld_s));
      w.m.resize(static_cast<size_t>(tiles.rows));
      w.l.resize(static_cast<size_t>(tiles.rows));
    }

    // S [rows, n_keys] = scale · Q_h [rows, D] · K_g [n_keys, D]ᵀ, then P in place.
    gemm<T>(false, true, t.rows, t.n_keys, D, static_cast<T>(scale), q.row(i0, h), ld_q, k.row(0, kv), ld_k, T(0),
            w.s.data(), ld_s);
    softmax_forward_tile(w.s.data(), t, w.m.data(), w.l.data());
    // O_h [rows, D] = P [rows, n_keys] · V_g [n_keys, D], then normalised row by row.
    gemm<T>(false, false, t.rows, D, t.n_keys, T(1), w.s.data(), ld_s, v.row(0, kv), ld_v, T(0), o.row(i0, h), ld_o);
    for (int64_t r = 0; r < t.rows; ++r) {
      const double l = w.l[r];  // >= 1: the row max contributes exp(0)
      lse.at(i0 + r, h) = static_cast<T>(static_cast<double>(w.m[r]) + std::log(l));
      const double inv_l = 1.0 / l;
      T* o_r = o.row(i0 + r, h);
      for (int64_t d = 0; d < D; ++d) o_r[d] = static_cast<T>(static_cast<double>(o_r[d]) * inv_l);
    }
  });
}

// ---- delta ---------------------------------------------------------------------------------
// One row's Σ_d d_o·o in double, rounded to T once: attention_delta and a backward given O both use
// it, which is what makes their gradients bit-identical.
template <class T>
T row_delta(const T* o_row, const T* d_o_row, int64_t D) {
  double s = 0.0;
  for (int64_t d = 0; d < D; ++d) s += static_cast<double>(d_o_row[d]) * static_cast<double>(o_row[d]);
  return static_cast<T>(s);
}

template <class T>
void delta_impl(const Tensor& delta_t, const Tensor& o_t, const Tensor& d_o_t) {
  Rows3<const T> o(o_t), d_o(d_o_t);
  Rows2<T> delta(delta_t);
  const int64_t D = o_t.size(2);
  for (int64_t t = 0; t < o_t.size(0); ++t)
    for (int64_t h = 0; h < o_t.size(1); ++h) delta.at(t, h) = row_delta(o.row(t, h), d_o.row(t, h), D);
}

// t := 0 over a [T, H, D] view (GradMode::overwrite).
template <class T>
void zero_rows(const Tensor& t_t) {
  Rows3<T> t(t_t);
  for (int64_t i = 0; i < t_t.size(0); ++i)
    for (int64_t h = 0; h < t_t.size(1); ++h) std::fill(t.row(i, h), t.row(i, h) + t_t.size(2), T(0));
}

// ---- backward ------------------------------------------------------------------------------
// Work item = KV head g. For each query tile (in order) and each query head h of the group (in order),
// with the final lse and delta of the tile's rows (delta read, or formed from the rows of the final O):
//   P  [rows, keys] = exp(scale · Q_h[tile] · K_g[keys]ᵀ - lse), 0 where masked   (GEMM + exp)
//   dP [rows, keys] = dO_h[tile] · V_g[keys]ᵀ                                   (GEMM)
//   dS = P ⊙ (dP - delta)
//   dQ_h[tile] += scale · dS · K_g[keys];  dK_g[keys] += scale · dSᵀ · Q_h[tile];
//   dV_g[keys] += Pᵀ · dO_h[tile]
// The three updates are GEMMs with beta = 1 into the outputs (strided views into dQKV buffers are
// fine). One item owns all of dK_g and dV_g and adds to them in a fixed order, and its dQ rows belong
// to its own query heads, so the result does not depend on the thread count.
// A row whose final lse is -inf saw no key anywhere: its P and dS are 0 and nothing flows from it.
template <class T>
void backward_impl(const Tensor& dq_t, const Tensor& dk_t, const Tensor& dv_t, const Tensor& q_t, const Tensor& k_t,
                   const Tensor& v_t, const Tensor& d_o_t, const Tensor& lse_t, const Tensor& o_t,
                   const Tensor& delta_t, const Geometry& g, BlockMask mask, double scale, GradMode mode) {
  if (mode == GradMode::overwrite) {
    zero_rows<T>(dq_t);
    zero_rows<T>(dk_t);
    zero_rows<T>(dv_t);
  }
  if (g.Tq == 0 || g.Tk == 0) return;
  const bool from_o = o_t.ndim != 0;
  Rows3<const T> q(q_t), k(k_t), v(v_t), d_o(d_o_t);
  Rows2<const T> lse(lse_t);
  // Exactly one of them is read: the rows of O that delta is formed from, or delta itself.
  Rows3<const T> o;
  Rows2<const T> delta;
  if (from_o) {
    o = Rows3<const T>(o_t);
  } else {
    delta = Rows2<const T>(delta_t);
  }
  Rows3<T> dq(dq_t), dk(dk_t), dv(dv_t);
  const int64_t D = g.D;
  const int64_t ld_q = leading_dim(q_t), ld_k = leading_dim(k_t), ld_v = leading_dim(v_t);
  const int64_t ld_do = leading_dim(d_o_t), ld_dq = leading_dim(dq_t), ld_dk = leading_dim(dk_t),
                ld_dv = leading_dim(dv_t);
  const Tiles tiles = query_tiles(g.Tq);
  const int64_t ld_s = score_stride(g.Tk);
  const T t_scale = static_cast<T>(scale);
  const int workers = block_workers(g, mask, g.Hkv);
  struct Scratch {
    std::vector<T> p, ds;         // [tiles.rows, ld_s] each: scores, then P; dP, then dS
    std::vector<T> lse, delta;    // [tiles.rows]: the tile's rows of lse and delta for one head
  };
  std::vector<Scratch> scratch(static_cast<size_t>(workers));

  run_work_items(g.Hkv, workers, [&](int64_t kv, int worker) {
    Scratch& w = scratch[static_cast<size_t>(worker)];
    if (w.p.empty()) {
      w.p.resize(static_cast<size_t>(tiles.rows * ld_s));
      w.ds.resize(static_cast<size_t>(tiles.rows * ld_s));
      w.lse.resize(static_cast<size_t>(tiles.rows));
      w.delta.resize(static_cast<size_t>(tiles.rows));
    }
    T* p = w.p.data();
    T* ds = w.ds.data();
    for (int64_t tile = 0; tile < tiles.count; ++tile) {
      const int64_t i0 = tiles.first(tile);
      const TileRows t = tile_rows(mask, i0, tiles.size(tile, g.Tq), g.Tk, ld_s);
      for (int64_t h = kv * g.group; h < (kv + 1) * g.group; ++h) {
        for (int64_t r = 0; r < t.rows; ++r) {
          w.lse[r] = lse.at(i0 + r, h);
          w.delta[r] = from_o ? row_delta(o.row(i0 + r, h), d_o.row(i0 + r, h), D) : delta.at(i0 + r, h);
        }
        // S [rows, n_keys] = scale · Q_h · K_gᵀ (into p);  dP [rows, n_keys] = dO_h · V_gᵀ (into ds)
        gemm<T>(false, true, t.rows, t.n_keys, D, t_scale, q.row(i0, h), ld_q, k.row(0, kv), ld_k, T(0), p, ld_s);
        gemm<T>(false, true, t.rows, t.n_keys, D, T(1), d_o.row(i0, h), ld_do, v.row(0, kv), ld_v, T(0), ds, ld_s);
        softmax_backward_tile(p, ds, t, w.lse.data(), w.delta.data());
        // dQ_h [rows, D] += scale · dS [rows, n_keys] · K_g [n_keys, D]
        gemm<T>(false, false, t.rows, D, t.n_keys, t_scale, ds, ld_s, k.row(0, kv), ld_k, T(1), dq.row(i0, h), ld_dq);
        // dK_g [n_keys, D] += scale · dSᵀ [n_keys, rows] · Q_h [rows, D]
        gemm<T>(true, false, t.n_keys, D, t.rows, t_scale, ds, ld_s, q.row(i0, h), ld_q, T(1), dk.row(0, kv), ld_dk);
        // dV_g [n_keys, D] += Pᵀ [n_keys, rows] · dO_h [rows, D]
        gemm<T>(true, false, t.n_keys, D, t.rows, T(1), p, ld_s, d_o.row(i0, h), ld_do, T(1), dv.row(0, kv), ld_dv);
      }
    }
  });
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
                              Tensor lse, Tensor o, Tensor delta, BlockMask mask, double scale, GradMode mode) {
  const char* op = "attention_block_backward";
  const Geometry g = check_qkv(op, q, k, v, mask);
  check_like(op, "d_o", d_o, "q", q);
  check_like(op, "dq", dq, "q", q);
  check_like(op, "dk", dk, "k", k);
  check_like(op, "dv", dv, "v", v);
  check_row_stat(op, "lse", lse, "q", q);
  LT_CHECK((o.ndim != 0) != (delta.ndim != 0),
           "{}: pass exactly one of o (the final O of the query rows) and delta = rowsum(dO ⊙ O), got o {} and "
           "delta {}; the other must be an empty Tensor{{}}",
           op, o.ndim != 0 ? o.describe() : "(none)", delta.ndim != 0 ? delta.describe() : "(none)");
  if (o.ndim != 0) {
    check_like(op, "o", o, "q", q);
  } else {
    check_row_stat(op, "delta", delta, "q", q);
  }
  LT_CHECK(std::isfinite(scale), "{}: scale is {}; it must be finite (usually 1/sqrt(head_dim))", op, scale);
  if (q.dtype == DType::f64) {
    backward_impl<double>(dq, dk, dv, q, k, v, d_o, lse, o, delta, g, mask, scale, mode);
  } else {
    backward_impl<float>(dq, dk, dv, q, k, v, d_o, lse, o, delta, g, mask, scale, mode);
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
