// Our own Hopper (sm_90a) flash-attention forward and backward: wgmma tensor-core MMAs fed by TMA
// loads through a multi-stage shared-memory ring, one producer warpgroup and two or three consumer
// warpgroups per CTA (FlashAttention-3's structure and schedule, our code; FwdVariant below).
// hopper_attention.cu (forward) and hopper_attention_bwd.cu (backward) are compiled for sm_90a only;
// on any other device supported() is false and callers keep cuDNN (attention/cuda/local_attention.cu
// picks these kernels as the kernel policy says: kernel_choice.h).
//
// Plain views in, as cudnn_sdpa.h: q, k, v bf16 [tokens, heads, dim] with element strides (dim is
// unit-stride; views into one fused QKV buffer are the common case), o bf16 or f32 of q's shape, lse
// f32 [Tq, Hq] strided. GQA/MQA without expanding K/V: query head h reads kv head h / (Hq / Hkv).
// LSE is natural-log and includes the scale, as cuDNN's: lse = log Σ_j exp(scale · q·k_j).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "attention/cuda/cudnn_sdpa.h"
#include "attention/local_attention.h"

namespace longtrain::attn::hopper {

using View = cudnn_sdpa::View;            // bf16 [tokens, heads, dim]
using StatsView = cudnn_sdpa::StatsView;  // f32 [tokens, heads]

// The output rows: bf16 or f32 [tokens, heads, dim], strides in elements.
struct OutView {
  void* data = nullptr;
  bool f32 = false;
  int64_t tokens = 0, heads = 0, dim = 0;
  int64_t token_stride = 0, head_stride = 0;
};

// Whether this GPU and shape can run the kernel at all: an sm_90 device (the code is sm_90a),
// head_dim 64 or 128, q_heads a positive multiple of kv_heads.
bool supported(int64_t head_dim, int64_t q_heads, int64_t kv_heads);

// Empty when forward() accepts these views; else why not (the first failed requirement, naming the
// argument), for a fallback decision or an error message. Besides supported(): TMA needs 16-byte
// aligned base addresses and token/head strides of q, k, v; o needs even strides and an 8-byte (f32)
// or 4-byte (bf16) aligned base (pairs of elements are stored together); merge needs an f32 o;
// causal needs Tq == Tk; every length must be positive.
std::string unsupported_reason(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v,
                               bool causal, bool merge);

// The forward kernel's schedule (both give the same results up to rounding; hopper_attention.cu):
// - overlap (the default): FlashAttention-3's schedule, one CTA per work tile: within a consumer warpgroup the
//   softmax of K/V tile n runs while the tensor cores compute P(n-1)·V(n-1), and the consumer
//   warpgroups take turns issuing their GEMMs (ping-pong) so one's softmax runs while another's GEMMs
//   do; head dim 64 uses 192-row tiles (three consumer warpgroups), head dim 128 uses 128-row tiles
//   (two). Every exp2 on the MUFU (an FMA-pipe polynomial for a share of them measured ~10% slower at
//   head dim 64);
// - baseline: the first kernel: per tile S = Q·Kᵀ, wait, softmax, O += P·V, wait; nothing overlaps
//   inside a warpgroup. Kept to measure against and to fall back to.
// (A persistent overlap kernel, one CTA per SM taking work tiles from a counter in sections of kv
// heads sized to the L2, measured 0.2-5% slower than overlap at head dims 64 and 128, 16K and 64K on
// the H200, bench/results/attention-hopper-round2-h200-2026-12-03.json, and was removed.)
enum class FwdVariant { overlap, baseline };

// LONGTRAIN_HOPPER_FWD_VARIANT (overlap or baseline), read once; overlap when unset. Throws on any
// other value.
FwdVariant default_fwd_variant();
const char* fwd_variant_name(FwdVariant variant);
FwdVariant parse_fwd_variant(const std::string& name, const char* source);

// The launch order of the CTAs. The GPU starts CTAs about in launch order, so the order decides which
// work runs at the same time and shares the L2: the kv heads are taken in sections of
// kv_heads_per_section (the last may be smaller), all of a section's CTAs before the next section's.
// Within a section the forward launches its query tiles longest first (causal), the section's query
// heads fastest, and the backward its key tiles longest first, the section's kv heads fastest. A
// section of every kv head is the order both kernels had until 2026-12-06 (every kv head's work at
// once). The default is one kv head per section where that leaves no tail (below): the running CTAs then read one kv head's K/V
// (forward) and the same few Q/dO tiles and dQ reductions (backward). On the H100 at head dim 128
// (32/8 heads) that cut the DRAM traffic at 64K tokens 8.6x in the forward and 3x in the backward
// (ncu), and with it the power that holds the GPU at its cap: the forward ran 10% faster at 64K
// (level at 16K and 32K), the backward 9-14% faster at 16K, 32K and 64K; at head dim 64 (32/4) the
// backward ran 2-3% faster, the forward level (sections of 1, 2, 4 and 8 kv heads, two calls;
// bench/results/attention-hopper-launch-order-h100-2026-12-06.json).
// The section size a call runs with when it passes 0 (as the model's calls do): the environment
// variable LONGTRAIN_HOPPER_FWD_SECTION / LONGTRAIN_HOPPER_BWD_SECTION when set (a positive integer,
// for benchmarks; anything else throws naming it), else the fewest kv heads per section whose launch
// leaves no tail (hopper_host.h, section_for_tail: a model of the block scheduler over the CTAs' work
// in launch order, within 7% of the ideal): one kv head from about 16K tokens up, two or more at 8K,
// where a kv head's CTAs are too few and one per section left the last section's longest CTAs running
// alone (in the model the backward 1.24x / 1.49x the ideal at head dims 128 / 64; on the H200 the
// model's two ran 1.16x / 1.41x faster, and the 1.1B step at 8K under `auto` 1.02-1.03x faster,
// bench/results/attention-launch-sections-h200-2026-12-06.json). At most kv_heads.
// Any size gives the same results up to rounding: the forward's bits do not depend on it; the
// backward's dK and dV (each CTA sums its own) depend on it only through the direction each CTA walks
// its query tiles, which the section model picks (BwdOrder below; none under descending or ascending);
// its dQ only in the order of the atomics.
int fwd_kv_heads_per_section(int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool causal,
                             FwdVariant variant = default_fwd_variant());
int bwd_kv_heads_per_section(int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool causal);

// o = softmax(scale · q·kᵀ [+ causal mask]) · v and lse, for this (Q block, K/V block) pair. Causal is
// top-left aligned (query i sees keys j <= i, Tq == Tk). scale must be positive.
// merge == false: o and lse are overwritten with the block's result.
// merge == true: o (f32) and lse hold a running partial, lse = -inf marking an empty row whose o is
// never read (it may be NaN); the block is merged into them in the kernel's epilogue
// (m = max(L1, L2); L = m + log(e^(L1-m) + e^(L2-m)); O = e^(L1-L)·O1 + e^(L2-L)·O2), so a ring step
// is one call with no separate merge pass.
// Bitwise deterministic: no atomics, a fixed reduction order. Throws (naming the argument) where
// unsupported_reason() is not empty.
// Runs default_fwd_variant(); the overload picks the schedule (tests and benchmarks run both) and
// the launch order (kv_heads_per_section; 0: the default).
void forward(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v, bool causal,
             float scale, bool merge);
void forward(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v, bool causal,
             float scale, bool merge, FwdVariant variant, int kv_heads_per_section = 0);

// ---- backward (hopper_attention_bwd.cu) ----------------------------------------------------------
//
// The block backward of local_attention.h's attention_block_backward: with P = exp(scale·q·kᵀ - lse)
// (the FINAL lse), dP = d_o·vᵀ, dS = P ⊙ (dP - delta):
//   dq (+)= scale · dS·k,   dk (+)= scale · dSᵀ·q,   dv (+)= Pᵀ·d_o.
// q, k, v, d_o bf16 [tokens, heads, dim] views (as forward() takes them); lse and delta f32 [Tq, Hq]
// strided (delta = rowsum(d_o ⊙ O_final), attention_delta). dq, dk, dv bf16 or f32 views of q's and
// k's shapes, each independently; accumulate = false overwrites every element, true adds this
// block's gradients. Everything accumulates in f32: a kv head's dK/dV over all its query heads (GQA,
// MQA) in registers, stored (or added) once; dQ in an f32 scratch accumulator (cuda_host.h's
// Scratch::attn_dq_accum, backward_dq_accum_bytes) added into dq by one pass at the end, so an f32
// destination gets f32 sums and a bf16 one a single rounding. A row whose lse is -inf (it saw no key)
// contributes nothing, whatever its delta. Not bitwise deterministic: dQ is summed over the K/V
// tiles with f32 atomics. Causal is top-left with Tq == Tk; head_dim 64 or 128.
// Empty when backward() accepts these views; else why not (the first failed requirement, naming the
// argument). Besides supported(): TMA alignment of q, k, v, d_o (16-byte base and strides); dq, dk,
// dv with even strides and pair-aligned bases (elements are written in pairs); causal needs Tq == Tk.
// (delta is not an argument: callers that start from O form it first, into a [Tq, Hq] buffer of
// their own; backward() checks its shape.)
std::string backward_unsupported_reason(const OutView& dq, const OutView& dk, const OutView& dv, const View& q,
                                        const View& k, const View& v, const View& d_o, const StatsView& lse,
                                        bool causal);

void backward(const OutView& dq, const OutView& dk, const OutView& dv, const View& q, const View& k, const View& v,
              const View& d_o, const StatsView& lse, const StatsView& delta, bool causal, float scale,
              bool accumulate, int kv_heads_per_section = 0);

// The direction in which each backward CTA walks its query tiles (hopper_attention_bwd.cu's header,
// "The step order"). descending: every CTA from the last query tile down, the only order until
// 2026-12-08. ascending: every CTA from the first tile that meets its keys up (tests). model (the
// default): the CTAs that the section model (hopper_host.h, launch_starts) starts together walk down,
// as the first wave does; those it starts one after another as earlier CTAs finish walk up, which puts
// them all on the same query tile at once (host::streamed_ctas). Causal calls only; without a mask
// every order is descending. LONGTRAIN_HOPPER_BWD_ORDER (model, descending or ascending, read once;
// other values throw) or set_bwd_order changes it for the process. dK and dV are summed in the order
// the CTA walks, so their bits depend on it (fixed for a shape and GPU model).
enum class BwdOrder { model, descending, ascending };
BwdOrder bwd_order();
void set_bwd_order(BwdOrder order);
BwdOrder parse_bwd_order(const std::string& name, const char* source);
const char* bwd_order_name(BwdOrder order);

// How backward() adds the f32 dQ accumulator into dq, after the main kernel: rows (a 64 × 64
// sub-block per CTA, staged in shared memory and written a whole row at a time; used where dq's base
// and strides are 8-byte aligned in bf16, 16 in f32) or pairs (one thread per float4 of the
// accumulator writing element pairs, any even strides; the only kernel until 2026-12-08). Both give
// the same bits. The default is rows; LONGTRAIN_HOPPER_DQ_CONVERT (rows or pairs, read once; other
// values throw) or set_dq_convert (tests, benchmarks) changes it for the process.
enum class DqConvert { rows, pairs };
DqConvert dq_convert();
void set_dq_convert(DqConvert convert);
DqConvert parse_dq_convert(const std::string& name, const char* source);
const char* dq_convert_name(DqConvert convert);

// The bytes of the f32 dQ accumulator backward() takes from scratch: Tq rounded up to the query tile
// (128 rows at head dim 64, 64 at 128), times Hq · head_dim floats
// (model/memory_plan.cpp counts the same).
size_t backward_dq_accum_bytes(int64_t tq, int64_t q_heads, int64_t head_dim);

// Tensor-level entry of the merge mode (defined in local_attention.cu beside attention_block_forward,
// with the same argument checks): (o_acc, lse_acc) <- merge((o_acc, lse_acc), block(q, k, v)).
// o_acc is f32 [Tq, Hq, D], lse_acc f32 [Tq, Hq]; a block without keys (Tk = 0) changes nothing.
// Not used by the schedules yet (they call attention_block_forward and lse_merge).
void attention_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor q, Tensor k, Tensor v, BlockMask mask,
                                   double scale);

}  // namespace longtrain::attn::hopper
