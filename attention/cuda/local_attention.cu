// Local block attention on CUDA: cuDNN's fused SDPA (attention/cuda/cudnn_sdpa.cpp) for the block
// forward and backward, and our own fp32 kernels for D = rowsum(dO ⊙ O), the LSE merge, and the
// accumulation of each block's gradients into the caller's (usually f32) dq/dk/dv accumulators.
//
// The backward costs one cuDNN call and nothing else when the caller holds the final O and the
// destinations are bf16 views it fully overwrites (one rank: LocalSequenceAttention writing into the
// model's fused dQKV buffer): cuDNN reads O, forms delta itself, and writes dQ/dK/dV in place through
// their strides. The other cases are bridged with extra passes:
// - GradMode::accumulate (or f32 destinations): cuDNN writes the block's bf16 gradients to scratch
//   and an fp32 kernel adds (or converts) them into dq/dk/dv.
// - delta instead of O (query rows that came from another rank): cudnn_sdpa first tries a graph that
//   takes delta as an input; where no engine accepts it, cuDNN gets a stand-in O' = dO · delta / |dO|²
//   per row, whose rowsum(dO ⊙ O') is delta up to one bf16 rounding of O' (relative error ≤ 2^-9, the
//   same as rounding O itself to bf16).
// - an f32 O: rounded to bf16 in scratch, since cuDNN reads bf16.
//
// The block forward and backward can run our own Hopper kernels instead (attention/cuda/
// hopper_attention.cu, hopper_attention_bwd.cu), as the kernel policy says (kernel_choice.h: cudnn by
// default, hopper, or auto per call shape). Our backward needs none of the bridges above: it takes
// delta (formed from O by attention_delta first when O is given) and accumulates dQ/dK/dV in f32,
// writing or adding them once into bf16 or f32 destinations through their strides. The segmented
// (document-mask) calls stay on cuDNN.
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attention/backends.h"
#include "attention/cuda/cudnn_sdpa.h"
#include "attention/cuda/hopper_attention.h"
#include "attention/cuda/kernel_choice.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::attn::cuda {

using namespace longtrain::cuda_util;

namespace {

// ---- kernels (one warp per (token, head) row of D elements) --------------------------------------
// Each lane handles 4 consecutive elements per step (8-byte bf16 / 16-byte f32 accesses) when every
// pointer and stride allows it (VEC), else single elements. These kernels are pure memory traffic.

constexpr int kWarpsPerBlock = 8;

struct RowView {  // [tokens, heads, dim] with element strides
  int64_t tokens, heads, dim, ts, hs;
};

__device__ __forceinline__ int64_t warp_row() {
  return (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
}

// Lane loops over a row: `step` elements per lane per iteration.
template <bool VEC> struct Lanes {
  static constexpr int step = VEC ? 4 : 1;
  __device__ static int64_t first() { return static_cast<int64_t>(threadIdx.x & 31) * step; }
  static constexpr int64_t stride = 32 * step;
};

template <bool VEC, class T> __device__ __forceinline__ void load_n(const T* p, float (&v)[4]) {
  if constexpr (VEC) {
    load4(p, v);
  } else {
    v[0] = to_float(p[0]);
  }
}
template <bool VEC, class T> __device__ __forceinline__ void store_n(T* p, const float (&v)[4]) {
  if constexpr (VEC) {
    store4(p, v);
  } else {
    p[0] = from_float<T>(v[0]);
  }
}

// delta[t, h] = Σ_d d_o[t, h, d] · o[t, h, d]
template <bool VEC, class O, class G>
__global__ void delta_kernel(float* delta, int64_t delta_ts, int64_t delta_hs, const O* o, RowView ov, const G* d_o,
                             RowView gv) {
  using L = Lanes<VEC>;
  const int64_t row = warp_row();
  if (row >= ov.tokens * ov.heads) return;
  const int64_t t = row / ov.heads, h = row - t * ov.heads;
  const O* orow = o + t * ov.ts + h * ov.hs;
  const G* grow = d_o + t * gv.ts + h * gv.hs;
  float acc = 0.0f;
  for (int64_t d = L::first(); d < ov.dim; d += L::stride) {
    float a[4], b[4];
    load_n<VEC>(orow + d, a);
    load_n<VEC>(grow + d, b);
#pragma unroll
    for (int i = 0; i < L::step; ++i) acc += a[i] * b[i];
  }
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) delta[t * delta_ts + h * delta_hs] = acc;
}

// o' [t, h, :] = d_o[t, h, :] · delta[t, h] / |d_o[t, h, :]|², computed on d_o / max|d_o| so the
// squares neither overflow nor underflow; a zero d_o row gives o' = 0 (then delta = 0 as well).
template <bool VEC>
__global__ void o_proxy_kernel(__nv_bfloat16* out, RowView outv, const __nv_bfloat16* d_o, RowView gv,
                               const float* delta, int64_t delta_ts, int64_t delta_hs) {
  using L = Lanes<VEC>;
  const int64_t row = warp_row();
  if (row >= gv.tokens * gv.heads) return;
  const int64_t t = row / gv.heads, h = row - t * gv.heads;
  const __nv_bfloat16* g = d_o + t * gv.ts + h * gv.hs;
  float amax = 0.0f;
  for (int64_t d = L::first(); d < gv.dim; d += L::stride) {
    float a[4];
    load_n<VEC>(g + d, a);
#pragma unroll
    for (int i = 0; i < L::step; ++i) amax = fmaxf(amax, fabsf(a[i]));
  }
  amax = warp_max(amax);
  const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
  float sq = 0.0f;
  for (int64_t d = L::first(); d < gv.dim; d += L::stride) {
    float a[4];
    load_n<VEC>(g + d, a);
#pragma unroll
    for (int i = 0; i < L::step; ++i) sq += (a[i] * inv) * (a[i] * inv);
  }
  sq = warp_sum(sq);
  const float c = amax > 0.0f ? delta[t * delta_ts + h * delta_hs] / (amax * sq) : 0.0f;
  __nv_bfloat16* o = out + t * outv.ts + h * outv.hs;
  for (int64_t d = L::first(); d < gv.dim; d += L::stride) {
    float a[4];
    load_n<VEC>(g + d, a);
#pragma unroll
    for (int i = 0; i < L::step; ++i) a[i] = a[i] * inv * c;
    store_n<VEC>(o + d, a);
  }
}

// dst [t, h, :] (+)= src [t, h, :]
template <bool VEC, class Dst, class Src>
__global__ void add_rows_kernel(Dst* dst, RowView dv, const Src* src, RowView sv, bool accumulate) {
  using L = Lanes<VEC>;
  const int64_t row = warp_row();
  if (row >= dv.tokens * dv.heads) return;
  const int64_t t = row / dv.heads, h = row - t * dv.heads;
  Dst* drow = dst + t * dv.ts + h * dv.hs;
  const Src* srow = src + t * sv.ts + h * sv.hs;
  for (int64_t d = L::first(); d < dv.dim; d += L::stride) {
    float a[4], b[4];
    load_n<VEC>(srow + d, b);
    if (accumulate) {
      load_n<VEC>(drow + d, a);
#pragma unroll
      for (int i = 0; i < L::step; ++i) b[i] += a[i];
    }
    store_n<VEC>(drow + d, b);
  }
}

// (o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_blk, lse_blk)); lse = -inf marks an empty side.
template <bool VEC, class A, class B>
__global__ void lse_merge_kernel(A* o_acc, RowView av, float* lse_acc, int64_t la_ts, int64_t la_hs, const B* o_blk,
                                 RowView bv, const float* lse_blk, int64_t lb_ts, int64_t lb_hs) {
  using L = Lanes<VEC>;
  const int64_t row = warp_row();
  if (row >= av.tokens * av.heads) return;
  const int64_t t = row / av.heads, h = row - t * av.heads;
  const float l1 = lse_acc[t * la_ts + h * la_hs], l2 = lse_blk[t * lb_ts + h * lb_hs];
  if (l2 == -INFINITY) return;  // nothing to merge in
  float w1, w2, l;
  if (l1 == -INFINITY) {        // empty accumulator: take the block (its old O is ignored, even if NaN)
    w1 = 0.0f;
    w2 = 1.0f;
    l = l2;
  } else {
    const float m = fmaxf(l1, l2);
    l = m + log1pf(expf(-fabsf(l1 - l2)));
    w1 = expf(l1 - l);
    w2 = expf(l2 - l);
  }
  A* a = o_acc + t * av.ts + h * av.hs;
  const B* b = o_blk + t * bv.ts + h * bv.hs;
  for (int64_t d = L::first(); d < av.dim; d += L::stride) {
    float x[4], y[4];
    load_n<VEC>(a + d, x);
    load_n<VEC>(b + d, y);
#pragma unroll
    for (int i = 0; i < L::step; ++i) x[i] = (w1 == 0.0f ? 0.0f : w1 * x[i]) + w2 * y[i];
    store_n<VEC>(a + d, x);
  }
  __syncwarp();
  if ((threadIdx.x & 31) == 0) lse_acc[t * la_ts + h * la_hs] = l;
}

// A block with no keys: o = 0, lse = -inf.
template <class O>
__global__ void empty_block_kernel(O* o, RowView ov, float* lse, int64_t l_ts, int64_t l_hs) {
  const int64_t row = warp_row();
  if (row >= ov.tokens * ov.heads) return;
  const int64_t t = row / ov.heads, h = row - t * ov.heads;
  O* orow = o + t * ov.ts + h * ov.hs;
  for (int64_t d = threadIdx.x & 31; d < ov.dim; d += 32) orow[d] = from_float<O>(0.0f);
  if ((threadIdx.x & 31) == 0) lse[t * l_ts + h * l_hs] = -INFINITY;
}

// dst [t, h, :] = 0 (GradMode::overwrite of a block without query-key pairs).
template <class T>
__global__ void zero_rows_kernel(T* dst, RowView dv) {
  const int64_t row = warp_row();
  if (row >= dv.tokens * dv.heads) return;
  const int64_t t = row / dv.heads, h = row - t * dv.heads;
  T* drow = dst + t * dv.ts + h * dv.hs;
  for (int64_t d = threadIdx.x & 31; d < dv.dim; d += 32) drow[d] = from_float<T>(0.0f);
}

// ---- host helpers ---------------------------------------------------------------------------------

RowView row_view(const Tensor& t) { return {t.shape[0], t.shape[1], t.shape[2], t.stride[0], t.stride[1]}; }
RowView contiguous_rows(int64_t tokens, int64_t heads, int64_t dim) {
  return {tokens, heads, dim, heads * dim, dim};
}

// 4-element accesses need D, both row strides and the base address aligned to 4 elements.
bool vectorizable(const void* p, RowView r, size_t elem) {
  return r.dim % 4 == 0 && r.ts % 4 == 0 && r.hs % 4 == 0 && reinterpret_cast<uintptr_t>(p) % (4 * elem) == 0;
}

// Calls f(std::true_type) or f(std::false_type).
template <class F> void with_vec(bool vec, F&& f) {
  if (vec)
    f(std::true_type{});
  else
    f(std::false_type{});
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

cudnn_sdpa::View sdpa_view(const Tensor& t) {
  return {t.data, t.shape[0], t.shape[1], t.shape[2], t.stride[0], t.stride[1]};
}
cudnn_sdpa::View sdpa_view(void* data, RowView r) { return {data, r.tokens, r.heads, r.dim, r.ts, r.hs}; }
cudnn_sdpa::StatsView stats_view(const Tensor& t) {
  return {static_cast<float*>(t.data), t.shape[0], t.shape[1], t.stride[0], t.stride[1]};
}

void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_tensor(q, 3, op, "q");
  check_tensor(k, 3, op, "k");
  check_tensor(v, 3, op, "v");
  check_dtype(q, DType::bf16, op, "q");
  check_dtype(k, DType::bf16, op, "k");
  check_dtype(v, DType::bf16, op, "v");
  check_same_shape(k, v, op);
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  LT_CHECK(k.size(2) == d, "{}: k {} must have q's head dim {}", op, k.describe(), d);
  LT_CHECK(hkv > 0 && hq % hkv == 0, "{}: q heads {} must be a multiple of k/v heads {} (GQA)", op, hq, hkv);
  LT_CHECK(d % 8 == 0 && d <= 256, "{}: head dim {} must be a multiple of 8 and at most 256 for cuDNN attention", op,
           d);
}

void check_rows(const char* op, const Tensor& t, const char* name, const Tensor& like) {
  check_tensor(t, 3, op, name);
  check_float(t, op, name);
  LT_CHECK(t.size(0) == like.size(0) && t.size(1) == like.size(1) && t.size(2) == like.size(2),
           "{}: {} {} must have the shape of {}", op, name, t.describe(), like.describe());
}

// Stats may be strided either way: token-major [T, Hq], or head-major (SequenceAttention::head_major_lse).
void check_stats(const char* op, const Tensor& s, const char* name, int64_t tokens, int64_t heads) {
  LT_CHECK(!s.empty() && s.device == Device::cuda && s.ndim == 2, "{}: {} must be a 2-d CUDA tensor, got {}", op, name,
           s.describe());
  check_dtype(s, DType::f32, op, name);
  LT_CHECK(s.size(0) == tokens && s.size(1) == heads, "{}: {} {} must be [{}, {}]", op, name, s.describe(), tokens,
           heads);
}

template <class F> void dispatch2(DType a, DType b, const char* op, F&& f) {
  dispatch_float(a, op, [&](auto ta) { dispatch_float(b, op, [&](auto tb) { f(ta, tb); }); });
}

// A bf16 view cuDNN can read or write in place: 16-byte aligned base and strides (what its TMA loads
// and stores need; head_dim % 8 == 0 keeps views into the fused QKV / dQKV buffers so).
bool cudnn_addressable(const Tensor& t) {
  return t.dtype == DType::bf16 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.stride[0] % 8 == 0 &&
         t.stride[1] % 8 == 0;
}

// dst (+)= src over [tokens, heads, dim] rows, converting to dst's dtype (accumulate = false: dst := src).
template <class Src>
void add_rows(const char* op, const char* name, const Tensor& dst, const Src* src, RowView srows, bool accumulate) {
  dispatch_float(dst.dtype, op, [&](auto tag) {
    using Dst = typename decltype(tag)::type;
    const bool vec = vectorizable(dst.data, row_view(dst), sizeof(Dst)) && vectorizable(src, srows, sizeof(Src));
    with_vec(vec, [&](auto v) {
      add_rows_kernel<decltype(v)::value, Dst, Src><<<row_blocks(srows.tokens * srows.heads), 32 * kWarpsPerBlock, 0,
                                                      cuda_stream()>>>(static_cast<Dst*>(dst.data), row_view(dst), src,
                                                                       srows, accumulate);
    });
  });
  LT_CUDA_LAUNCH_CHECK(name);
}

void zero_rows(const char* op, const Tensor& t) {
  const RowView r = row_view(t);
  if (r.tokens * r.heads == 0) return;
  dispatch_float(t.dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    zero_rows_kernel<T><<<row_blocks(r.tokens * r.heads), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
        static_cast<T*>(t.data), r);
  });
  LT_CUDA_LAUNCH_CHECK("zero_rows_kernel");
}

hopper::OutView hopper_out(const Tensor& o) {
  return {o.data, o.dtype == DType::f32, o.shape[0], o.shape[1], o.shape[2], o.stride[0], o.stride[1]};
}

}  // namespace

void hopper_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor q, Tensor k, Tensor v, BlockMask mask,
                                double scale);

namespace {

// The block forward by cuDNN (non-empty block, checked arguments).
void cudnn_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, bool causal, double scale) {
  if (o.dtype == DType::bf16) {
    cudnn_sdpa::forward(sdpa_view(o), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), causal,
                        static_cast<float>(scale));
    return;
  }
  // f32 O: cuDNN writes bf16, widened into the caller's tensor.
  const int64_t tq = q.size(0), hq = q.size(1);
  const RowView tmp = contiguous_rows(tq, hq, q.size(2));
  void* o16 = scratch(Scratch::attn_fwd_out, static_cast<size_t>(tq * hq * q.size(2)) * sizeof(__nv_bfloat16));
  cudnn_sdpa::forward(sdpa_view(o16, tmp), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), causal,
                      static_cast<float>(scale));
  const bool vec = vectorizable(o.data, row_view(o), sizeof(float)) && vectorizable(o16, tmp, 2);
  with_vec(vec, [&](auto v) {
    add_rows_kernel<decltype(v)::value, float, __nv_bfloat16><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0,
                                                                cuda_stream()>>>(
        static_cast<float*>(o.data), row_view(o), static_cast<const __nv_bfloat16*>(o16), tmp, false);
  });
  LT_CUDA_LAUNCH_CHECK("add_rows_kernel");
}

// Whether our Hopper forward takes this (non-empty) call.
bool hopper_forward_ok(const Tensor& o, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       bool causal, bool merge) {
  return hopper::supported(q.size(2), q.size(1), k.size(1)) &&
         hopper::unsupported_reason(hopper_out(o), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), causal,
                                    merge)
             .empty();
}

CallShape forward_shape(const Tensor& o, const Tensor& q, const Tensor& k, bool causal, bool merge) {
  return {false, q.size(2), q.size(1), k.size(1), q.size(0), k.size(0), causal, o.dtype == DType::f32, merge};
}

}  // namespace

void attention_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, BlockMask mask, double scale) {
  const char* op = "attention_block_forward";
  check_qkv(op, q, k, v);
  check_rows(op, o, "o", q);
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1);
  check_stats(op, lse, "lse", tq, hq);
  const bool causal = mask == BlockMask::causal_diagonal;
  LT_CHECK(!causal || tq == tk, "{}: a causal_diagonal block needs as many queries as keys, got {} and {}", op, tq, tk);
  if (tq == 0) return;
  if (tk == 0) {
    dispatch_float(o.dtype, op, [&](auto tag) {
      using O = typename decltype(tag)::type;
      empty_block_kernel<O><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
          static_cast<O*>(o.data), row_view(o), static_cast<float*>(lse.data), lse.stride[0], lse.stride[1]);
    });
    LT_CUDA_LAUNCH_CHECK("empty_block_kernel");
    return;
  }
  run_chosen(
      forward_shape(o, q, k, causal, false), hopper_forward_ok(o, lse, q, k, v, causal, false),
      [&] { cudnn_block_forward(o, lse, q, k, v, causal, scale); },
      [&] {
        hopper::forward(hopper_out(o), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), causal,
                        static_cast<float>(scale), /*merge=*/false);
      });
}

void block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q, Tensor k, Tensor v,
                         BlockMask mask, double scale) {
  const char* op = "attention_block_forward_merge";
  check_qkv(op, q, k, v);
  check_rows(op, o_acc, "o_acc", q);
  check_rows(op, o_blk, "o_blk", q);
  check_stats(op, lse_acc, "lse_acc", q.size(0), q.size(1));
  check_stats(op, lse_blk, "lse_blk", q.size(0), q.size(1));
  const bool causal = mask == BlockMask::causal_diagonal;
  const bool nonempty = q.size(0) > 0 && k.size(0) > 0;
  const bool hopper_ok = nonempty && o_acc.dtype == DType::f32 && hopper_forward_ok(o_acc, lse_acc, q, k, v, causal, true);
  if (!hopper_ok) {  // the two steps (their own argument checks), each choosing its kernel
    cuda::attention_block_forward(o_blk, lse_blk, q, k, v, mask, scale);
    cuda::lse_merge(o_acc, lse_acc, o_blk, lse_blk);
    return;
  }
  run_chosen(
      forward_shape(o_acc, q, k, causal, true), true,
      [&] {
        cudnn_block_forward(o_blk, lse_blk, q, k, v, causal, scale);
        cuda::lse_merge(o_acc, lse_acc, o_blk, lse_blk);
      },
      [&] { hopper_block_forward_merge(o_acc, lse_acc, q, k, v, mask, scale); });
}

// hopper::attention_block_forward_merge (hopper_attention.h), with this file's argument checks.
void hopper_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor q, Tensor k, Tensor v, BlockMask mask,
                                double scale) {
  const char* op = "hopper::attention_block_forward_merge";
  check_qkv(op, q, k, v);
  check_rows(op, o_acc, "o_acc", q);
  check_dtype(o_acc, DType::f32, op, "o_acc");
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1);
  check_stats(op, lse_acc, "lse_acc", tq, hq);
  const bool causal = mask == BlockMask::causal_diagonal;
  LT_CHECK(!causal || tq == tk, "{}: a causal_diagonal block needs as many queries as keys, got {} and {}", op, tq, tk);
  if (tq == 0 || tk == 0) return;  // an empty block merges as nothing
  hopper::forward(hopper_out(o_acc), stats_view(lse_acc), sdpa_view(q), sdpa_view(k), sdpa_view(v), causal,
                  static_cast<float>(scale), /*merge=*/true);
}

void attention_delta(Tensor delta, Tensor o, Tensor d_o) {
  const char* op = "attention_delta";
  check_tensor(o, 3, op, "o");
  check_float(o, op, "o");
  check_rows(op, d_o, "d_o", o);
  check_stats(op, delta, "delta", o.size(0), o.size(1));
  const int64_t rows = o.size(0) * o.size(1);
  if (rows == 0) return;
  dispatch2(o.dtype, d_o.dtype, op, [&](auto ot, auto gt) {
    using O = typename decltype(ot)::type;
    using G = typename decltype(gt)::type;
    const bool vec = vectorizable(o.data, row_view(o), sizeof(O)) && vectorizable(d_o.data, row_view(d_o), sizeof(G));
    with_vec(vec, [&](auto v) {
      delta_kernel<decltype(v)::value, O, G><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
          static_cast<float*>(delta.data), delta.stride[0], delta.stride[1], static_cast<const O*>(o.data),
          row_view(o), static_cast<const G*>(d_o.data), row_view(d_o));
    });
  });
  LT_CUDA_LAUNCH_CHECK("delta_kernel");
}

namespace {

// The block backward by cuDNN (checked arguments, a non-empty block).
void cudnn_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o, Tensor lse,
                          Tensor o, Tensor delta, bool causal, double scale, GradMode mode) {
  const char* op = "attention_block_backward";
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const bool from_o = o.ndim != 0;
  const bool overwrite = mode == GradMode::overwrite;
  const RowView qrows = contiguous_rows(tq, hq, d), krows = contiguous_rows(tk, hkv, d);
  const size_t qbytes = static_cast<size_t>(tq * hq * d) * sizeof(__nv_bfloat16);
  const size_t kbytes = static_cast<size_t>(tk * hkv * d) * sizeof(__nv_bfloat16);
  // Where cuDNN writes: straight into dq/dk/dv when they are bf16 views this call overwrites, else
  // into bf16 scratch that is added (accumulate) or converted (overwrite of f32) afterwards.
  const bool in_place = overwrite && cudnn_addressable(dq) && cudnn_addressable(dk) && cudnn_addressable(dv);
  cudnn_sdpa::View dq_out, dk_out, dv_out;
  if (in_place) {
    dq_out = sdpa_view(dq);
    dk_out = sdpa_view(dk);
    dv_out = sdpa_view(dv);
  } else {
    dq_out = sdpa_view(scratch(Scratch::attn_dq, qbytes), qrows);
    dk_out = sdpa_view(scratch(Scratch::attn_dk, kbytes), krows);
    dv_out = sdpa_view(scratch(Scratch::attn_dv, kbytes), krows);
  }

  if (from_o) {
    cudnn_sdpa::View o_in;
    if (cudnn_addressable(o)) {
      o_in = sdpa_view(o);
    } else {  // f32 (or unaligned) O: cuDNN reads bf16 rows, rounded here into scratch
      void* o16 = scratch(Scratch::attn_o_proxy, qbytes);
      dispatch_float(o.dtype, op, [&](auto tag) {
        using O = typename decltype(tag)::type;
        const bool vec = vectorizable(o.data, row_view(o), sizeof(O)) && vectorizable(o16, qrows, 2);
        with_vec(vec, [&](auto v) {
          add_rows_kernel<decltype(v)::value, __nv_bfloat16, O><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0,
                                                                  cuda_stream()>>>(
              static_cast<__nv_bfloat16*>(o16), qrows, static_cast<const O*>(o.data), row_view(o), false);
        });
      });
      LT_CUDA_LAUNCH_CHECK("add_rows_kernel (o to bf16)");
      o_in = sdpa_view(o16, qrows);
    }
    cudnn_sdpa::backward(dq_out, dk_out, dv_out, sdpa_view(q), sdpa_view(k), sdpa_view(v), o_in, sdpa_view(d_o),
                         stats_view(lse), causal, static_cast<float>(scale));
  } else {
    // Only called when cuDNN cannot take delta directly: the O stand-in, in scratch.
    auto make_o = [&]() {
      void* o_proxy = scratch(Scratch::attn_o_proxy, qbytes);
      const bool vec = vectorizable(d_o.data, row_view(d_o), 2);
      with_vec(vec, [&](auto v) {
        o_proxy_kernel<decltype(v)::value><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
            static_cast<__nv_bfloat16*>(o_proxy), qrows, static_cast<const __nv_bfloat16*>(d_o.data), row_view(d_o),
            static_cast<const float*>(delta.data), delta.stride[0], delta.stride[1]);
      });
      LT_CUDA_LAUNCH_CHECK("o_proxy_kernel");
      return sdpa_view(o_proxy, qrows);
    };
    cudnn_sdpa::backward_from_delta(dq_out, dk_out, dv_out, sdpa_view(q), sdpa_view(k), sdpa_view(v), sdpa_view(d_o),
                                    stats_view(lse), stats_view(delta), make_o, causal, static_cast<float>(scale));
  }
  if (in_place) return;

  const bool accumulate = !overwrite;
  add_rows(op, "add_rows_kernel (dq)", dq, static_cast<const __nv_bfloat16*>(dq_out.data), qrows, accumulate);
  add_rows(op, "add_rows_kernel (dk)", dk, static_cast<const __nv_bfloat16*>(dk_out.data), krows, accumulate);
  add_rows(op, "add_rows_kernel (dv)", dv, static_cast<const __nv_bfloat16*>(dv_out.data), krows, accumulate);
}

// Whether our Hopper backward takes this (non-empty, checked) call.
bool hopper_backward_ok(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& d_o, const Tensor& lse, bool causal) {
  return hopper::supported(q.size(2), q.size(1), k.size(1)) &&
         hopper::backward_unsupported_reason(hopper_out(dq), hopper_out(dk), hopper_out(dv), sdpa_view(q),
                                             sdpa_view(k), sdpa_view(v), sdpa_view(d_o), stats_view(lse), causal)
             .empty();
}

// The block backward by our Hopper kernel: delta from O first (attention_delta into scratch) when the
// caller gave O; dq/dk/dv accumulated in f32 and written (or added) once, whatever their dtype.
void hopper_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o, Tensor lse,
                           Tensor o, Tensor delta, bool causal, double scale, GradMode mode) {
  hopper::StatsView delta_view;
  if (o.ndim != 0) {
    const int64_t tq = q.size(0), hq = q.size(1);
    // The rows' delta = rowsum(dO ⊙ O) in the scratch cuDNN uses for the same sum (softmax_sum).
    Tensor rows_delta(scratch(Scratch::attn_softmax_sum, static_cast<size_t>(tq * hq) * sizeof(float)), DType::f32,
                      {tq, hq}, Device::cuda);
    attention_delta(rows_delta, o, d_o);
    delta_view = stats_view(rows_delta);
  } else {
    delta_view = stats_view(delta);
  }
  hopper::backward(hopper_out(dq), hopper_out(dk), hopper_out(dv), sdpa_view(q), sdpa_view(k), sdpa_view(v),
                   sdpa_view(d_o), stats_view(lse), delta_view, causal, static_cast<float>(scale),
                   mode == GradMode::accumulate);
}

}  // namespace

namespace {

// The arguments of a backward call (block or segments): q, k, v and their gradients' shapes, a bf16
// d_o of q's shape, lse [Tq, Hq], and exactly one of o (the final O) and delta.
void check_backward_args(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& d_o, const Tensor& lse, const Tensor& o,
                         const Tensor& delta) {
  check_qkv(op, q, k, v);
  check_rows(op, dq, "dq", q);
  check_rows(op, dk, "dk", k);
  check_rows(op, dv, "dv", v);
  check_tensor(d_o, 3, op, "d_o");
  check_dtype(d_o, DType::bf16, op, "d_o");
  check_same_shape(d_o, q, op);
  check_stats(op, lse, "lse", q.size(0), q.size(1));
  const bool from_o = o.ndim != 0;
  LT_CHECK(from_o != (delta.ndim != 0),
           "{}: pass exactly one of o (the final O of the query rows) and delta = rowsum(dO ⊙ O), got o {} and "
           "delta {}; the other must be an empty Tensor{{}}",
           op, from_o ? o.describe() : "(none)", delta.ndim != 0 ? delta.describe() : "(none)");
  if (from_o) {
    check_rows(op, o, "o", q);
  } else {
    check_stats(op, delta, "delta", q.size(0), q.size(1));
  }
}

}  // namespace

void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o, Tensor lse,
                              Tensor o, Tensor delta, BlockMask mask, double scale, GradMode mode) {
  const char* op = "attention_block_backward";
  check_backward_args(op, dq, dk, dv, q, k, v, d_o, lse, o, delta);
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const bool causal = mask == BlockMask::causal_diagonal;
  LT_CHECK(!causal || tq == tk, "{}: a causal_diagonal block needs as many queries as keys, got {} and {}", op, tq, tk);
  const bool overwrite = mode == GradMode::overwrite;
  if (tq == 0 || tk == 0) {  // no query-key pairs: every gradient contribution is zero
    if (overwrite) {
      zero_rows(op, dq);
      zero_rows(op, dk);
      zero_rows(op, dv);
    }
    return;
  }

  run_chosen(
      CallShape{true, d, hq, hkv, tq, tk, causal,
                dq.dtype == DType::f32 && dk.dtype == DType::f32 && dv.dtype == DType::f32, !overwrite},
      hopper_backward_ok(dq, dk, dv, q, k, v, d_o, lse, causal),
      [&] { cudnn_block_backward(dq, dk, dv, q, k, v, d_o, lse, o, delta, causal, scale, mode); },
      [&] { hopper_block_backward(dq, dk, dv, q, k, v, d_o, lse, o, delta, causal, scale, mode); });
}

void lse_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk) {
  const char* op = "lse_merge";
  check_tensor(o_acc, 3, op, "o_acc");
  check_float(o_acc, op, "o_acc");
  check_rows(op, o_blk, "o_blk", o_acc);
  const int64_t tq = o_acc.size(0), h = o_acc.size(1);
  check_stats(op, lse_acc, "lse_acc", tq, h);
  check_stats(op, lse_blk, "lse_blk", tq, h);
  if (tq * h == 0) return;
  dispatch2(o_acc.dtype, o_blk.dtype, op, [&](auto at, auto bt) {
    using A = typename decltype(at)::type;
    using B = typename decltype(bt)::type;
    const bool vec =
        vectorizable(o_acc.data, row_view(o_acc), sizeof(A)) && vectorizable(o_blk.data, row_view(o_blk), sizeof(B));
    with_vec(vec, [&](auto v) {
      lse_merge_kernel<decltype(v)::value, A, B><<<row_blocks(tq * h), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
          static_cast<A*>(o_acc.data), row_view(o_acc), static_cast<float*>(lse_acc.data), lse_acc.stride[0],
          lse_acc.stride[1], static_cast<const B*>(o_blk.data), row_view(o_blk),
          static_cast<const float*>(lse_blk.data), lse_blk.stride[0], lse_blk.stride[1]);
    });
  });
  LT_CUDA_LAUNCH_CHECK("lse_merge_kernel");
}

// ---- segmented calls ------------------------------------------------------------------------------

namespace {

std::vector<cudnn_sdpa::Segment> sdpa_segments(const std::vector<Segment>& segments) {
  std::vector<cudnn_sdpa::Segment> out;
  out.reserve(segments.size());
  for (const Segment& s : segments) out.push_back({s.q_start, s.q_len, s.k_start, s.k_len});
  return out;
}

}  // namespace

void segments_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, const std::vector<Segment>& segments,
                      BlockMask mask, double scale) {
  const char* op = "attention_segments_forward";
  check_qkv(op, q, k, v);
  check_rows(op, o, "o", q);
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2);
  check_stats(op, lse, "lse", tq, hq);
  const bool causal = mask == BlockMask::causal_diagonal;
  const auto segs = sdpa_segments(segments);
  if (o.dtype == DType::bf16) {
    cudnn_sdpa::forward_segments(sdpa_view(o), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), segs, causal,
                                 static_cast<float>(scale));
    return;
  }
  // f32 O: cuDNN writes bf16 rows into scratch, widened into the caller's rows segment by segment
  // (the rows between segments hold the caller's empty partials and stay as they are).
  const RowView tmp = contiguous_rows(tq, hq, d);
  void* o16 = scratch(Scratch::attn_fwd_out, static_cast<size_t>(tq * hq * d) * sizeof(__nv_bfloat16));
  cudnn_sdpa::forward_segments(sdpa_view(o16, tmp), stats_view(lse), sdpa_view(q), sdpa_view(k), sdpa_view(v), segs,
                               causal, static_cast<float>(scale));
  for (const Segment& s : segments) {
    const auto* src = static_cast<const __nv_bfloat16*>(o16) + s.q_start * tmp.ts;
    add_rows(op, "add_rows_kernel (segment o)", o.narrow(0, s.q_start, s.q_len), src,
             contiguous_rows(s.q_len, hq, d), false);
  }
}

void segments_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o, Tensor lse,
                       Tensor o, Tensor delta, const std::vector<Segment>& segments, BlockMask mask, double scale,
                       GradMode mode) {
  const char* op = "attention_segments_backward";
  check_backward_args(op, dq, dk, dv, q, k, v, d_o, lse, o, delta);
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const bool from_o = o.ndim != 0;
  const bool causal = mask == BlockMask::causal_diagonal;
  const RowView qrows = contiguous_rows(tq, hq, d), krows = contiguous_rows(tk, hkv, d);
  const size_t qbytes = static_cast<size_t>(tq * hq * d) * sizeof(__nv_bfloat16);
  const size_t kbytes = static_cast<size_t>(tk * hkv * d) * sizeof(__nv_bfloat16);

  // cuDNN reads a bf16 O: the caller's, a rounded copy of an f32 one, or the stand-in built from delta.
  cudnn_sdpa::View o_in;
  if (from_o && cudnn_addressable(o)) {
    o_in = sdpa_view(o);
  } else {
    check_rows(op, from_o ? o : d_o, from_o ? "o" : "d_o", q);
    void* o16 = scratch(Scratch::attn_o_proxy, qbytes);
    if (from_o) {
      dispatch_float(o.dtype, op, [&](auto tag) {
        using O = typename decltype(tag)::type;
        const bool vec = vectorizable(o.data, row_view(o), sizeof(O)) && vectorizable(o16, qrows, 2);
        with_vec(vec, [&](auto vv) {
          add_rows_kernel<decltype(vv)::value, __nv_bfloat16, O><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0,
                                                                   cuda_stream()>>>(
              static_cast<__nv_bfloat16*>(o16), qrows, static_cast<const O*>(o.data), row_view(o), false);
        });
      });
      LT_CUDA_LAUNCH_CHECK("add_rows_kernel (o to bf16)");
    } else {
      check_stats(op, delta, "delta", tq, hq);
      const bool vec = vectorizable(d_o.data, row_view(d_o), 2);
      with_vec(vec, [&](auto vv) {
        o_proxy_kernel<decltype(vv)::value><<<row_blocks(tq * hq), 32 * kWarpsPerBlock, 0, cuda_stream()>>>(
            static_cast<__nv_bfloat16*>(o16), qrows, static_cast<const __nv_bfloat16*>(d_o.data), row_view(d_o),
            static_cast<const float*>(delta.data), delta.stride[0], delta.stride[1]);
      });
      LT_CUDA_LAUNCH_CHECK("o_proxy_kernel");
    }
    o_in = sdpa_view(o16, qrows);
  }

  // Straight into bf16 views this call overwrites (local_attention.cpp has zeroed the rows outside
  // the segments); else into scratch, added or converted segment by segment. dQ must have Q's token
  // stride: measured on cuDNN 9.19 (H200), a segmented backward whose dQ rows are spaced unlike Q's
  // gives wrong dQ (dK and dV are right), so the dQ scratch is laid out with Q's row stride.
  const bool in_place = mode == GradMode::overwrite && cudnn_addressable(dq) && cudnn_addressable(dk) &&
                        cudnn_addressable(dv) && dq.stride[0] == q.stride[0];
  const RowView dq_rows{tq, hq, d, q.stride[0], d};
  cudnn_sdpa::View dq_out, dk_out, dv_out;
  if (in_place) {
    dq_out = sdpa_view(dq);
    dk_out = sdpa_view(dk);
    dv_out = sdpa_view(dv);
  } else {
    dq_out = sdpa_view(scratch(Scratch::attn_dq, static_cast<size_t>(tq * q.stride[0]) * sizeof(__nv_bfloat16)),
                       dq_rows);
    dk_out = sdpa_view(scratch(Scratch::attn_dk, kbytes), krows);
    dv_out = sdpa_view(scratch(Scratch::attn_dv, kbytes), krows);
  }
  cudnn_sdpa::backward_segments(dq_out, dk_out, dv_out, sdpa_view(q), sdpa_view(k), sdpa_view(v), o_in,
                                sdpa_view(d_o), stats_view(lse), sdpa_segments(segments), causal,
                                static_cast<float>(scale));
  if (in_place) return;
  const bool accumulate = mode == GradMode::accumulate;
  for (const Segment& s : segments) {
    add_rows(op, "add_rows_kernel (segment dq)", dq.narrow(0, s.q_start, s.q_len),
             static_cast<const __nv_bfloat16*>(dq_out.data) + s.q_start * dq_rows.ts,
             RowView{s.q_len, hq, d, dq_rows.ts, d}, accumulate);
    add_rows(op, "add_rows_kernel (segment dk)", dk.narrow(0, s.k_start, s.k_len),
             static_cast<const __nv_bfloat16*>(dk_out.data) + s.k_start * krows.ts, contiguous_rows(s.k_len, hkv, d),
             accumulate);
    add_rows(op, "add_rows_kernel (segment dv)", dv.narrow(0, s.k_start, s.k_len),
             static_cast<const __nv_bfloat16*>(dv_out.data) + s.k_start * krows.ts, contiguous_rows(s.k_len, hkv, d),
             accumulate);
  }
}

}  // namespace longtrain::attn::cuda

namespace longtrain::attn::hopper {

void attention_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor q, Tensor k, Tensor v, BlockMask mask,
                                   double scale) {
  cuda::hopper_block_forward_merge(o_acc, lse_acc, q, k, v, mask, scale);
}

}  // namespace longtrain::attn::hopper
