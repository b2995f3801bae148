// Our Hopper flash-attention forward (hopper_attention.h), in two kernels (FwdVariant):
// - baseline (fwd_baseline_kernel, the first kernel, described here): one CTA per (128 query rows,
//   query head), nothing overlapped inside a consumer warpgroup;
// - fwd_overlap_kernel, further down (overlap, the default): FlashAttention-3's schedule, with the
//   softmax of one tile overlapped with the GEMMs (its own P·V and the other warpgroups' GEMMs), one
//   CTA per work tile. (A persistent version, one CTA per SM taking work tiles from a counter in an
//   L2-aware order, measured 0.2-5% slower on the H200 and was removed: see git history.)
// Both share the producer/consumer structure, the shared-memory layout and the epilogue below.
//
// Warp specialization, FlashAttention-3's structure:
// - warpgroup 0 (the producer) shrinks to 24 registers; one of its threads issues TMA loads: the Q tile
//   once, then K and V tiles of 128 keys into a ring of kStages shared-memory stages, each guarded by
//   "full" mbarriers (TMA completes them with the bytes it wrote) and an "empty" mbarrier (the 256
//   consumer threads arrive when they are done reading the stage);
// - warpgroups 1 and 2 (the consumers) grow to 240 registers and own 64 query rows each: per K/V tile,
//   S = Q·Kᵀ with wgmma (both operands from shared memory), the online softmax in registers (exp2 with
//   scale·log2(e) folded in), P rounded to bf16 in registers and used directly as the register A
//   operand of O += P·V (V from shared memory, N-major: the transposed B operand).
// Causal blocks skip the K/V tiles wholly above the diagonal and mask only the tiles that cross it;
// keys >= Tk (TMA zero-fills the rows past the end) are masked in the last tile. The grid runs the
// longest (causal) query tiles first, in the launch order's sections (fwd_work_tile).
//
// Shared-memory layout. TMA writes every tile in 128-byte swizzled rows (CU_TENSOR_MAP_SWIZZLE_128B):
// a box is 64 bf16 of head_dim (128 bytes) by `rows` tokens, stored as rows × 128 bytes in 1024-byte
// atoms of 8 rows in which the 16-byte chunk c of row r lands at chunk c ^ (r % 8). A tile of D = 128
// is two such column blocks (d 0..63, then 64..127), one after the other. The wgmma descriptors
// describe exactly this layout (PTX ISA, "Shared Memory Matrix Layout", 128B swizzling):
// - Q and K are K-major operands (the reduction dim, head_dim, is contiguous): SBO = 1024 bytes (the
//   next 8 rows); LBO unused. The k-th 16-element slice of a column block starts 32·k bytes into it
//   (the hardware applies the swizzle to the address it computes, so the start may sit inside a
//   128-byte row as long as the atom is 1024-byte aligned, base offset 0).
// - V is the N-major B operand of P·V (rows are keys = the reduction dim, head_dim contiguous):
//   LBO = the distance between column blocks (the next 64 of head_dim), SBO = 1024 bytes (the next 8
//   keys); the 16 keys of the k-th step start 16·128·k bytes in.
#include "attention/cuda/hopper_attention.h"
#include "attention/cuda/hopper_host.h"
#include "attention/cuda/hopper_ptx.cuh"

#include <cuda.h>  // CUtensorMap and its enums only: the encode function comes from the driver at run time
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace longtrain::attn::hopper {
namespace {

using namespace ptx;

constexpr int kBlockM = 128;        // query rows per CTA
constexpr int kWarpgroupRows = 64;  // query rows per consumer warpgroup (the wgmma M)
constexpr int kBlockN = 128;        // keys per K/V tile
constexpr int kThreads = 384;       // producer warpgroup + 2 consumer warpgroups
constexpr int kSwizzleElems = 64;   // bf16 elements in one 128-byte swizzled row
constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128·24 + 256·240 <= 64K registers

template <int D> struct Tiles {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kStages = D == 64 ? 4 : 2;
  static constexpr int kColBlocks = D / kSwizzleElems;
  static constexpr uint32_t kQColBlockBytes = kBlockM * 128;
  static constexpr uint32_t kKVColBlockBytes = kBlockN * 128;
  static constexpr uint32_t kQBytes = kColBlocks * kQColBlockBytes;
  static constexpr uint32_t kKVBytes = kColBlocks * kKVColBlockBytes;  // one K (or V) tile
  static constexpr uint32_t kKOffset = kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kKVBytes;
  static constexpr int kBarriers = 1 + 3 * kStages;  // q_full, k_full[s], v_full[s], empty[s]
  // +1024: the dynamic shared memory base is only 16-byte aligned; the tiles are moved up to 1024.
  static constexpr uint32_t kSmemBytes = kBarrierOffset + 8 * kBarriers + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
};

struct Params {
  void* o;
  int64_t o_ts, o_hs;
  float* lse;
  int64_t lse_ts, lse_hs;
  int tq, tk;
  int group;        // q heads per kv head
  int kv_heads;
  int section;      // kv heads per launch-order section (fwd_work_tile)
  int num_q_tiles;
  float scale;      // natural-log scale (for the LSE)
  float scale_log2; // scale · log2(e) (for exp2)
};

// ---- the MMA issues both kernels share ------------------------------------------------------------

// S = Q·Kᵀ for this warpgroup's 64 rows and one K tile (stage address sK_stage), head_dim in steps of 16.
template <int D, uint32_t kQColBlockBytes, uint32_t kKVColBlockBytes>
__device__ __forceinline__ void issue_qk(float (&sc)[kBlockN / 2], const uint32_t sQ_wg, const uint32_t sK_stage) {
  // One encoding per operand, then constants (desc_at).
  const uint64_t da0 = smem_desc(sQ_wg, 16, 1024), db0 = smem_desc(sK_stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t in_block = (kk % 4) * 32;
    const uint64_t da = desc_at(da0, (kk / 4) * kQColBlockBytes + in_block);
    const uint64_t db = desc_at(db0, (kk / 4) * kKVColBlockBytes + in_block);
    wgmma_m64n128k16_ss(sc, da, db, kk > 0 ? 1u : 0u);
  }
}

// O += P·V for one V tile (stage address sV_stage), the tile's keys in steps of 16; P as bf16 pairs.
template <int D, uint32_t kKVColBlockBytes>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[kBlockN / 4],
                                         const uint32_t sV_stage) {
  const uint64_t db0 = smem_desc(sV_stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint64_t db = desc_at(db0, kk * 16 * 128, kKVColBlockBytes);
    if constexpr (D == 128) {
      wgmma_m64n128k16_rs(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], db);
    } else {
      wgmma_m64n64k16_rs(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], db);
    }
  }
}

// ---- the baseline kernel ---------------------------------------------------------------------------
//
// Accumulator fragments (PTX ISA, wgmma .m64nNk16 register fragment for D): thread `lane` of warp `w`
// (within its warpgroup) holds element i of N/2 at row 16·w + lane/4 + 8·((i/2) % 2) and column
// 8·(i/4) + 2·(lane % 4) + i % 2. So each thread owns two rows ("halves" h = 0, 1; h = (i/2) % 2), and
// the four lanes of a quad share a row. The same pairs, read 8 at a time, are exactly the bf16 A
// fragment of the next MMA over those columns: for the k-th 16 columns, registers
// (S[8k], S[8k+1]), (S[8k+2], S[8k+3]), (S[8k+4], S[8k+5]), (S[8k+6], S[8k+7]) are a0..a3.

// The epilogue of one consumer thread (both variants): normalise its two rows of O (fragment `o`,
// rows row_lo and row_lo + 8, columns 8·(i/4) + col_lane + i % 2), their LSE from the running max of the
// raw scores m_run and this thread's part of the denominator l_run (summed over the quad here), merge
// into the running partial (kMerge), store.
template <int D, bool kF32Out, bool kMerge>
__device__ __forceinline__ void store_rows(const float (&o)[D / 2], const float (&m_run)[2], const float (&l_run)[2],
                                           const int row_lo, const int col_lane, const int lane, const int head,
                                           const Params& p) {
#if LT_HOPPER_DEVICE_CODE
  float inv[2], lse_blk[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
    lse_blk[h] = l > 0.0f ? m_run[h] * p.scale + logf(l) : -INFINITY;
  }
  // Per row half: the weights of the old partial and of this block, the LSE to store, and whether to
  // write at all (a row of this block without keys leaves a merged accumulator as it is).
  float w_old[2] = {0.0f, 0.0f}, w_new[2] = {1.0f, 1.0f}, lse_out[2] = {lse_blk[0], lse_blk[1]};
  bool write[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_lo + 8 * h;
    write[h] = row < p.tq;
    if constexpr (kMerge) {
      const float l1 = write[h] ? p.lse[row * p.lse_ts + head * p.lse_hs] : -INFINITY;
      const float l2 = lse_blk[h];
      if (l2 == -INFINITY) {
        write[h] = false;
      } else if (l1 != -INFINITY) {  // as lse_merge_kernel (local_attention.cu)
        const float m = fmaxf(l1, l2);
        lse_out[h] = m + log1pf(expf(-fabsf(l1 - l2)));
        w_old[h] = expf(l1 - lse_out[h]);
        w_new[h] = expf(l2 - lse_out[h]);
      }
    }
  }
  if constexpr (kMerge) __syncwarp();  // every lane of the quad has read the old LSE before lane 0 writes it

  using Out = std::conditional_t<kF32Out, float, __nv_bfloat16>;
  Out* const out = static_cast<Out*>(p.o) + static_cast<int64_t>(head) * p.o_hs;
#pragma unroll
  for (int i = 0; i < D / 2; i += 2) {
    const int h = (i / 2) % 2;
    if (!write[h]) continue;
    const int64_t row = row_lo + 8 * h;
    Out* dst = out + row * p.o_ts + 8 * (i / 4) + col_lane;
    float v0 = o[i] * inv[h], v1 = o[i + 1] * inv[h];
    if constexpr (kMerge) {
      const float2 old = w_old[h] == 0.0f ? make_float2(0.0f, 0.0f) : *reinterpret_cast<const float2*>(dst);
      v0 = (w_old[h] == 0.0f ? 0.0f : w_old[h] * old.x) + w_new[h] * v0;
      v1 = (w_old[h] == 0.0f ? 0.0f : w_old[h] * old.y) + w_new[h] * v1;
    }
    if constexpr (kF32Out) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_lo + 8 * h;
      if (write[h]) p.lse[row * p.lse_ts + head * p.lse_hs] = lse_out[h];
    }
  }
#endif  // LT_HOPPER_DEVICE_CODE
}

// This CTA's work tile (hopper_attention.h, "The launch order"): its query head and its query tile
// counted from the last (tile_rev 0: the last, the longest causal one). Within its section of p.section
// kv heads, the query tiles longest first and the section's query heads fastest.
__device__ __forceinline__ void fwd_work_tile(const Params& p, int& head, int& tile_rev) {
  launch_order_tile(p.section, p.kv_heads, p.group, p.num_q_tiles, head, tile_rev);
}

template <int D, bool kCausal, bool kF32Out, bool kMerge>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_baseline_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const Params p) {
#if LT_HOPPER_DEVICE_CODE
  using Tl = Tiles<D>;
  constexpr int S = Tl::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem, sK = smem + Tl::kKOffset, sV = smem + Tl::kVOffset;
  const uint32_t bars = smem + Tl::kBarrierOffset;
  const uint32_t q_full = bars;
  auto k_full = [&](int s) { return bars + 8u * (1 + s); };
  auto v_full = [&](int s) { return bars + 8u * (1 + S + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + 2 * S + s); };

  int head, tile_rev;
  fwd_work_tile(p, head, tile_rev);
  const int q_tile = p.num_q_tiles - 1 - tile_rev;
  const int m0 = q_tile * kBlockM;
  const int kv_head = head / p.group;
  const int q_end = min(m0 + kBlockM, p.tq);
  const int kv_tiles_all = (p.tk + kBlockN - 1) / kBlockN;
  // Causal (Tq == Tk): the last query row of this tile sees keys up to q_end - 1; later tiles are skipped.
  const int n_tiles = kCausal ? min(kv_tiles_all, (q_end - 1) / kBlockN + 1) : kv_tiles_all;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < S; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(empty(s), 2 * 128);  // every consumer thread arrives once per tile
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---- producer ----
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      mbar_arrive_expect_tx(q_full, Tl::kQBytes);
#pragma unroll
      for (int c = 0; c < Tl::kColBlocks; ++c)
        tma_load_3d(sQ + c * Tl::kQColBlockBytes, &tm_q, q_full, c * kSwizzleElems, head, m0);
      for (int n = 0; n < n_tiles; ++n) {
        const int s = n % S;
        // A fresh barrier counts as having completed the phase before phase 0, so the first pass
        // through the ring (parity 1) does not wait.
        mbar_wait(empty(s), ((n / S) & 1) ^ 1);
        mbar_arrive_expect_tx(k_full(s), Tl::kKVBytes);
#pragma unroll
        for (int c = 0; c < Tl::kColBlocks; ++c)
          tma_load_3d(sK + s * Tl::kKVBytes + c * Tl::kKVColBlockBytes, &tm_k, k_full(s), c * kSwizzleElems, kv_head,
                      n * kBlockN);
        mbar_arrive_expect_tx(v_full(s), Tl::kKVBytes);
#pragma unroll
        for (int c = 0; c < Tl::kColBlocks; ++c)
          tma_load_3d(sV + s * Tl::kKVBytes + c * Tl::kKVColBlockBytes, &tm_v, v_full(s), c * kSwizzleElems, kv_head,
                      n * kBlockN);
      }
      // Stay until the consumers have released every stage, so no load is in flight when this
      // thread leaves.
      for (int n = max(0, n_tiles - S); n < n_tiles; ++n) mbar_wait(empty(n % S), (n / S) & 1);
    }
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;  // consumer warpgroup: query rows m0 + 64·cw + [0, 64)
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  const int wg_row0 = m0 + kWarpgroupRows * cw;
  const int row_lo = wg_row0 + 16 * warp + lane / 4;  // this thread's half-0 row; half 1 is row_lo + 8
  const int col_lane = 2 * (lane % 4);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the raw (unscaled) scores, per row half
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running softmax denominator

  const uint32_t sQ_wg = sQ + cw * kWarpgroupRows * 128;  // this warpgroup's 64 rows of each column block
  mbar_wait(q_full, 0);

  for (int n = 0; n < n_tiles; ++n) {
    const int s = n % S;
    const uint32_t parity = (n / S) & 1;

    // S = Q·Kᵀ over head_dim in steps of 16.
    float sc[kBlockN / 2];
    mbar_wait(k_full(s), parity);
    wgmma_fence();
    issue_qk<D, Tl::kQColBlockBytes, Tl::kKVColBlockBytes>(sc, sQ_wg, sK + s * Tl::kKVBytes);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(sc);

    // Masks: keys past Tk (zero-filled by TMA) and, causal, keys after the query.
    const int key0 = n * kBlockN;
    const bool mask_tile = key0 + kBlockN > p.tk || (kCausal && key0 + kBlockN - 1 > wg_row0);
    if (mask_tile) {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) {
        const int key = key0 + 8 * (i / 4) + col_lane + (i % 2);
        const int row = row_lo + 8 * ((i / 2) % 2);
        if (key >= p.tk || (kCausal && key > row)) sc[i] = -INFINITY;
      }
    }

    // Online softmax: new row max (over the quad that shares the row), rescale factor of what came before.
    float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], sc[i]);
    float base[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      // A row with no visible key yet keeps max -inf; 0 stands in so that exp2(-inf - base) = 0, not NaN.
      base[h] = mx[h] == -INFINITY ? 0.0f : mx[h] * p.scale_log2;
      alpha[h] = fast_exp2(m_run[h] * p.scale_log2 - base[h]);
      m_run[h] = mx[h];
    }
    float rowsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) {
      const int h = (i / 2) % 2;
      sc[i] = fast_exp2(fmaf(sc[i], p.scale_log2, -base[h]));
      rowsum[h] += sc[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + rowsum[h];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) % 2];

    uint32_t pa[kBlockN / 4];
#pragma unroll
    for (int j = 0; j < kBlockN / 4; ++j) pa[j] = pack_bf16(sc[2 * j], sc[2 * j + 1]);

    // O += P·V over the tile's keys in steps of 16.
    mbar_wait(v_full(s), parity);
    wgmma_fence();
    issue_pv<D, Tl::kKVColBlockBytes>(o, pa, sV + s * Tl::kKVBytes);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o);
    mbar_arrive(empty(s));  // this thread has finished reading stage s (K and V)
  }

  // ---- epilogue: normalise, LSE, merge into the running partial, store ----
  store_rows<D, kF32Out, kMerge>(o, m_run, l_run, row_lo, col_lane, lane, head, p);
#endif  // LT_HOPPER_DEVICE_CODE
}

// ---- the overlap kernel (FwdVariant::overlap) ----------------------------------------------------------
//
// FlashAttention-3's schedule (its hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp, our code). The baseline
// leaves the tensor cores idle while a warpgroup runs its softmax; here they have other work then:
//
// 1. Inside a consumer warpgroup (intra-warpgroup overlap). The K/V tiles are visited in reverse
//    (last tile first) and iteration i (tile n = n_tiles - 1 - i) issues two GEMM groups back to back,
//        S(i) = Q·K(i)ᵀ          (wgmma SS, fresh accumulators)
//        O += P(i-1)·V(i-1)      (wgmma RS, P of the previous tile still in registers)
//    then waits for S(i) only (wgmma.wait_group 1) and runs the softmax of S(i) while P(i-1)·V(i-1)
//    is still on the tensor cores; wait_group 0 then O *= alpha(i), P(i) = bf16(S(i)). The last
//    tile's P·V runs after the loop. Live registers: O, P(i-1) (read by the in-flight MMA until
//    wait_group 0) and S(i): at D = 128, 64 + 32 + 64 of the 240; at D = 64, 32 + 32 + 64 of 160.
//    (Issuing S(i+1) before the softmax of S(i) instead would need two S buffers, 128 registers, more
//    than fit beside O at D = 128; this order needs one S and one P. FlashAttention-4's lazy rescale,
//    keeping a stale max as the exp2 base until some row's max grows by more than 8 log2 units and
//    skipping O *= alpha until then, measured level: 0.996-1.004x the time at D = 128 and
//    1.001-1.026x at 64, 16K and 64K, two rounds of 20 repetitions on the H200
//    (bench/results/attention-hopper-fwd-lazy-rescale-2026-12-05.json); see git history.)
// 2. Between consumer warpgroups (ping-pong / round robin). Each warpgroup issues its two GEMM groups
//    only in its turn: named barrier kTurnBarrier + cw, completed by the previous warpgroup's
//    bar.arrive after its own issue (128 + 128 threads). So the tensor cores run one warpgroup's
//    GEMMs after another's, and each warpgroup's softmax runs while the others' GEMMs do, instead of
//    all GEMMs contending at once and all softmaxes idling the tensor cores together.
//
// Tile per head dim (FlashAttention-3's hopper/tile_size.h reasoning, for causal bf16):
// - D = 128: 128 x 128, two consumer warpgroups at 240 registers. The GEMMs (2 · 2·64·128·128 FLOPs per
//   warpgroup and tile, ~1024 tensor-core cycles at ~4096 dense bf16 FLOPs per cycle and SM) outweigh
//   the softmax (64·128 exp2 at 16 per cycle and SM, ~512 cycles of MUFU), so two warpgroups
//   alternating keep the tensor cores fed; 240 registers hold O (64) + P (32) + S (64) without spills.
// - D = 64: 192 x 128, three consumer warpgroups at 160 registers (128·24 + 384·160 <= 64K). The GEMMs
//   are half as long (~512 cycles) while the softmax is as long as at D = 128, so the exp2 unit is as
//   busy as the tensor cores: a third warpgroup gives the scheduler more softmax to overlap, the
//   192-row tile reads each K/V tile from L2 once per 192 query rows instead of 128 (1.5x fewer bytes
//   per FLOP, as the tiles go by faster), and 160 registers still hold O (32) + P (32) + S (64).
//   FA3 uses the turns (its scheduler barrier) with three warpgroups too.
//
// Work tiles. A work tile is (query tile of kBlockM rows, query head), one per CTA: grid (Hq,
// num_q_tiles), launched in sections of kv heads (fwd_work_tile; hopper_attention.h, "The launch
// order"): within a section the longest (causal) query tiles first, the section's heads fastest.
//
// Pipeline. Q is loaded once (q_full: the TMA bytes). K and V have separate rings of kStages stages,
// each stage with a "full" mbarrier and an "empty" one (one arrival per consumer warp once its wgmma
// reads are done: K(i) after wait_group 1 of iteration i, V(i-1) after wait_group 0 of iteration i).
// The producer issues loads in the order the consumers need them: K(0), Q, then K(i), V(i-1) for
// i >= 1, then V(n-1). Deadlock-free for kStages >= 2: each wait of the producer is for a release that
// needs only loads issued before it (load K(i) waits for the release of K(i - kStages), given in its
// iteration, which needs K(i - kStages), V(i - kStages - 1) and Q, all issued before K(i - 1); load V(i)
// waits for the release of V(i - kStages), given one iteration later or at the last P·V, which needs
// at most K(i - kStages + 1), issued before V(i - kStages); the turns order warpgroups within one
// iteration, which needs the same loads).
//
// Turns (named barriers, 128 arrivals by the previous warpgroup + 128 by the syncing one per phase):
// every warpgroup takes a turn in iterations 1 .. n_tiles - 1 of every work tile (the same count for
// all, as they share the work tile), and hands over after each turn to the next warpgroup (cw + 1,
// the last to 0). The last warpgroup hands warpgroup 0 its first turn at the start, and warpgroup 0
// takes one more bar.sync at the end that absorbs the last warpgroup's final hand-over: barrier 0
// gets 1 + T arrivals and T + 1 syncs (T: the turns of each warpgroup), every other barrier T and T.
// A warpgroup's hand-over k + 1 comes after its turn k + 1, which waited for its predecessor's turn
// k + 1 and so on back to warpgroup 0's sync k + 1: a barrier never holds two unconsumed hand-overs.
//
// Masking: with the reverse order, the tiles that need a mask (the causal diagonal tiles of this
// warpgroup's rows, the zero-filled tail past Tk) are the first n_masked iterations, so the steady
// state runs a mask-free loop (and skips the -inf checks, which only masked rows can need).
template <int D> struct OverlapTiles {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kConsumerWGs = D == 64 ? 3 : 2;
  static constexpr int kBlockM = kWarpgroupRows * kConsumerWGs;  // query rows per CTA
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kConsumerWarps = 4 * kConsumerWGs;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = D == 64 ? 160 : 240;
  // The registers at launch (__launch_bounds__(kThreads, 1): 65536 / kThreads, a multiple of 8) are
  // the CTA's pool: the producer's setmaxnreg.dec gives its share back and the consumers'
  // setmaxnreg.inc takes from it; asking for more than the pool holds would wait forever (at D = 128,
  // 168 · 384 = 64512 registers: 24 + 2·240 per lane exactly, so the producer cannot grow to 32).
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static_assert(128 * kProducerRegs + 128 * kConsumerWGs * kConsumerRegs <= kLaunchRegs * kThreads,
                "the CTA's register pool");
  static_assert(kProducerRegs <= kLaunchRegs && kConsumerRegs >= kLaunchRegs && kConsumerRegs % 8 == 0 &&
                    kProducerRegs % 8 == 0 && kConsumerRegs <= 256 && kProducerRegs >= 24,
                "setmaxnreg bounds");
  // Stages per K/V ring: as many as fit (one CTA per SM either way); >= 2 for the deadlock argument.
  static constexpr int kStages = D == 64 ? 4 : 3;
  static_assert(kStages >= 2, "the producer order needs two stages per ring");
  static constexpr int kColBlocks = D / kSwizzleElems;
  static constexpr uint32_t kQColBlockBytes = kBlockM * 128;
  static constexpr uint32_t kKVColBlockBytes = kBlockN * 128;
  static constexpr uint32_t kQBytes = kColBlocks * kQColBlockBytes;
  static constexpr uint32_t kKVBytes = kColBlocks * kKVColBlockBytes;  // one K (or V) tile
  // The Q tile, each warpgroup's Q rows and every K/V tile start on a 1024-byte swizzle atom (descriptor
  // base offset 0).
  static_assert((kWarpgroupRows * 128) % 1024 == 0 && kQColBlockBytes % 1024 == 0 && kQBytes % 1024 == 0 &&
                    kKVBytes % 1024 == 0,
                "swizzle atoms");
  static constexpr uint32_t kKOffset = kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr uint32_t kBarrierOffset = kVOffset + kStages * kKVBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;  // q_full, k_full[s], v_full[s], k_empty[s], v_empty[s]
  static constexpr uint32_t kSmemBytes = kBarrierOffset + 8 * kBarriers + 1024;  // +1024: alignment
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
};

// Named barrier ids of the consumer turns: kTurnBarrier + cw is consumer warpgroup cw's (id 0 is
// __syncthreads'); 2·128 threads take part in each phase (the previous warpgroup arrives, cw syncs).
constexpr uint32_t kTurnBarrier = 1;
constexpr uint32_t kTurnThreads = 2 * 128;

// The online softmax of one S tile in place (S becomes the unnormalised P = exp2(S·scale_log2 - base)):
// the new row maxima (over the quad sharing a row), alpha = the factor for what came before, the
// denominators. kCheckInf: a row may have seen only masked (-inf) scores so far; its max stays -inf
// and 0 stands in as the base so that exp2(-inf - base) = 0, not NaN. Two accumulators per row half
// halve the dependent chains of fmax and add. Every exp2 is the MUFU's ex2: moving 3 of 16 to an FMA
// polynomial (FlashAttention-4's trick) measured ~10% slower at D = 64 on the H200 (464 against 516
// TFLOP/s at 16K), so it was removed.
template <bool kCheckInf>
__device__ __forceinline__ void online_softmax(float (&sc)[kBlockN / 2], float (&m_run)[2], float (&l_run)[2],
                                               float (&alpha)[2], const float scale_log2) {
  float mx[2][2] = {{m_run[0], m_run[0]}, {m_run[1], m_run[1]}};
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) mx[(i / 2) % 2][i % 2] = fmaxf(mx[(i / 2) % 2][i % 2], sc[i]);
  float base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m = fmaxf(mx[h][0], mx[h][1]);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    base[h] = (kCheckInf && m == -INFINITY) ? 0.0f : m * scale_log2;
    alpha[h] = fast_exp2(m_run[h] * scale_log2 - base[h]);  // m_run = -inf (nothing seen yet): 0
    m_run[h] = m;
  }
  float sum[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    const int h = (i / 2) % 2;
    const float x = fmaf(sc[i], scale_log2, -base[h]);
    sc[i] = fast_exp2(x);
    sum[h][i % 2] += sc[i];
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + (sum[h][0] + sum[h][1]);
}

template <int D, bool kCausal, bool kF32Out, bool kMerge>
__global__ void __launch_bounds__(OverlapTiles<D>::kThreads, 1)
    fwd_overlap_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const Params p) {
#if LT_HOPPER_DEVICE_CODE
  using Tl = OverlapTiles<D>;
  constexpr int S = Tl::kStages;
  constexpr int kWGs = Tl::kConsumerWGs;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sQ = smem, sK = smem + Tl::kKOffset, sV = smem + Tl::kVOffset;
  const uint32_t bars = smem + Tl::kBarrierOffset;
  const uint32_t q_full = bars;
  auto k_full = [&](int s) { return bars + 8u * (1 + s); };
  auto v_full = [&](int s) { return bars + 8u * (1 + S + s); };
  auto k_empty = [&](int s) { return bars + 8u * (1 + 2 * S + s); };
  auto v_empty = [&](int s) { return bars + 8u * (1 + 3 * S + s); };

  // This CTA's work tile ("Work tiles"): its first query row m0, its query head, and its K/V tiles
  // n_tiles (iteration i works on K/V tile n_tiles - 1 - i). Causal (Tq == Tk): the last query row
  // sees keys up to q_end - 1; later tiles are skipped.
  int head, tile_rev;
  fwd_work_tile(p, head, tile_rev);
  const int m0 = (p.num_q_tiles - 1 - tile_rev) * Tl::kBlockM;
  const int kv_tiles_all = (p.tk + kBlockN - 1) / kBlockN;
  const int q_end = min(m0 + Tl::kBlockM, p.tq);
  const int n_tiles = kCausal ? min(kv_tiles_all, (q_end - 1) / kBlockN + 1) : kv_tiles_all;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);  // the producer's arrive_expect_tx; TMA completes the bytes
    for (int s = 0; s < S; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), Tl::kConsumerWarps);  // one arrival per consumer warp and key tile
      mbar_init(v_empty(s), Tl::kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Waits: for key tile i in a ring of S stages, the "full" wait is for phase i / S of stage i % S
  // (parity (i / S) & 1), and the producer's wait before load i is for the release of load i - S,
  // phase i / S - 1 of the stage's "empty" barrier (parity ((i / S) & 1) ^ 1; a fresh barrier counts
  // as having completed the phase before phase 0, so the first pass does not wait). Neither barrier
  // can run two phases ahead of such a wait: the next phase of a "full" needs the release that follows
  // this wait, that of an "empty" needs the load that follows it.
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---- producer: one thread issues every load, in the order the consumers use them ----
    setmaxnreg_dec<Tl::kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      const int kv_head = head / p.group;
      auto load = [&](const CUtensorMap* map, uint32_t ring, uint32_t full, uint32_t empty_bar, int i) {
        mbar_wait(empty_bar, ((i / S) & 1) ^ 1);
        mbar_arrive_expect_tx(full, Tl::kKVBytes);
#pragma unroll
        for (int c = 0; c < Tl::kColBlocks; ++c)
          tma_load_3d(ring + (i % S) * Tl::kKVBytes + c * Tl::kKVColBlockBytes, map, full, c * kSwizzleElems, kv_head,
                      (n_tiles - 1 - i) * kBlockN);
      };
      auto load_k = [&](int i) { load(&tm_k, sK, k_full(i % S), k_empty(i % S), i); };
      auto load_v = [&](int i) { load(&tm_v, sV, v_full(i % S), v_empty(i % S), i); };
      load_k(0);
      mbar_arrive_expect_tx(q_full, Tl::kQBytes);
#pragma unroll
      for (int c = 0; c < Tl::kColBlocks; ++c)
        tma_load_3d(sQ + c * Tl::kQColBlockBytes, &tm_q, q_full, c * kSwizzleElems, head, m0);
      for (int i = 1; i < n_tiles; ++i) {
        load_k(i);
        load_v(i - 1);
      }
      load_v(n_tiles - 1);
      // Stay until the consumers have released the last loads (the last phase of each of those
      // stages), so no load is in flight when this thread leaves.
      for (int x = max(0, n_tiles - S); x < n_tiles; ++x) {
        mbar_wait(k_empty(x % S), (x / S) & 1);
        mbar_wait(v_empty(x % S), (x / S) & 1);
      }
    }
  } else {
    // ---- consumers ----
    // Their waits are mbar_wait_no_trap: a trap after setmaxnreg.inc makes ptxas allocate this branch
    // within the entry count (168 / 128 registers) instead of kConsumerRegs, and spill (hopper_ptx.cuh).
    setmaxnreg_inc<Tl::kConsumerRegs>();
    const int cw = warpgroup - 1;  // consumer warpgroup: query rows m0 + 64·cw + [0, 64)
    const int t = threadIdx.x % 128;
    const int warp = t / 32, lane = t % 32;
    const int col_lane = 2 * (lane % 4);
    const bool warp_leader = lane == 0;  // arrives on the empty barriers for its warp

    // Turns (see "Turns" above): this warpgroup's barrier and the next one's (round robin cw -> cw + 1
    // -> ... -> 0). The last warpgroup hands warpgroup 0 its first turn here.
    const uint32_t my_turn = kTurnBarrier + cw, next_turn = kTurnBarrier + (cw + 1) % kWGs;
    named_barrier_arrive_if(kTurnBarrier, kTurnThreads, cw == kWGs - 1);

    mbar_wait_no_trap(q_full, 0);
    const int wg_row0 = m0 + kWarpgroupRows * cw;
    const int row_lo = wg_row0 + 16 * warp + lane / 4;  // this thread's half-0 row; half 1 is row_lo + 8
    auto key0 = [&](int i) { return (n_tiles - 1 - i) * kBlockN; };
    // Keys >= key_end[h] are masked for the row of half h: past Tk (zero-filled by TMA) and, causal,
    // after the query. Rows >= Tq (zero-filled Q) compute harmless finite values and are never stored.
    int key_end[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) key_end[h] = kCausal ? min(p.tk, row_lo + 8 * h + 1) : p.tk;
    // The first n_masked iterations need the mask: causal, the tiles from the one holding this
    // warpgroup's first row on (tiles before it hold only keys < wg_row0, visible to all its rows);
    // else the tail tile if Tk is not a multiple of the tile.
    int n_masked = kCausal ? n_tiles - wg_row0 / kBlockN : 0;
    if (p.tk % kBlockN != 0 && n_tiles == kv_tiles_all) n_masked = max(n_masked, 1);
    n_masked = min(max(n_masked, 0), n_tiles);

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY};  // running max of the raw (unscaled) scores, per row half
    float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running softmax denominator
    uint32_t pa[kBlockN / 4];                 // P of the previous tile, bf16 pairs: the A operand of P·V

    const uint32_t sQ_wg = sQ + cw * kWarpgroupRows * 128;  // this warpgroup's 64 rows of each column block
    auto k_stage = [&](int i) { return sK + (i % S) * Tl::kKVBytes; };
    auto v_stage = [&](int i) { return sV + (i % S) * Tl::kKVBytes; };
    auto parity = [&](int i) { return static_cast<uint32_t>((i / S) & 1); };
    auto mask = [&](float (&sc)[kBlockN / 2], int i) {
      int lim[2];  // element j is masked where its offset 8·(j/4) + j % 2 from key0 + col_lane reaches lim
#pragma unroll
      for (int h = 0; h < 2; ++h) lim[h] = key_end[h] - key0(i) - col_lane;
#pragma unroll
      for (int j = 0; j < kBlockN / 2; ++j)
        if (8 * (j / 4) + (j % 2) >= lim[(j / 2) % 2]) sc[j] = -INFINITY;
    };
    auto to_p = [&](const float (&sc)[kBlockN / 2]) {
#pragma unroll
      for (int j = 0; j < kBlockN / 4; ++j) pa[j] = pack_bf16(sc[2 * j], sc[2 * j + 1]);
    };

    // Iteration 0: S(0) alone (no P yet), outside the turns.
    {
      float sc[kBlockN / 2];
      mbar_wait_no_trap(k_full(0), parity(0));
      wgmma_fence();
      issue_qk<D, Tl::kQColBlockBytes, Tl::kKVColBlockBytes>(sc, sQ_wg, k_stage(0));
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(sc);
      mbar_arrive_if(k_empty(0), warp_leader);
      if (n_masked > 0) mask(sc, 0);
      float alpha[2];  // unused: O is still zero
      online_softmax<true>(sc, m_run, l_run, alpha, p.scale_log2);
      to_p(sc);
    }

    // Iteration i >= 1, in this warpgroup's turn: S(i) and P(i-1)·V(i-1), then the softmax of S(i)
    // while P(i-1)·V(i-1) runs. Branch-free from the first wgmma to the last wait (predicated arrives).
    auto step = [&](const int i, auto masked_tag) {
      constexpr bool kMasked = decltype(masked_tag)::value;
      mbar_wait_no_trap(k_full(i % S), parity(i));
      mbar_wait_no_trap(v_full((i - 1) % S), parity(i - 1));
      named_barrier_sync(my_turn, kTurnThreads);  // the previous warpgroup has issued its GEMMs
      float sc[kBlockN / 2];
      wgmma_fence();  // P(i-1) and the rescaled O were written by ordinary instructions
      issue_qk<D, Tl::kQColBlockBytes, Tl::kKVColBlockBytes>(sc, sQ_wg, k_stage(i));
      wgmma_commit();
      issue_pv<D, Tl::kKVColBlockBytes>(o, pa, v_stage(i - 1));
      wgmma_commit();
      named_barrier_arrive_if(next_turn, kTurnThreads, true);
      wgmma_wait<1>();  // S(i) is complete (groups complete in order); P(i-1)·V(i-1) may still run
      fence_operands(sc);
      mbar_arrive_if(k_empty(i % S), warp_leader);
      if constexpr (kMasked) mask(sc, i);
      float alpha[2];
      online_softmax<kMasked>(sc, m_run, l_run, alpha, p.scale_log2);
      wgmma_wait<0>();  // P(i-1)·V(i-1) is complete: O may be rescaled, P's registers rewritten
      fence_operands(o);
      fence_operands(sc);  // keeps the bf16 packing of P(i) after the wait (P(i-1) is read until then)
      mbar_arrive_if(v_empty((i - 1) % S), warp_leader);
#pragma unroll
      for (int jj = 0; jj < D / 2; ++jj) o[jj] *= alpha[(jj / 2) % 2];
      to_p(sc);
    };
    int i = 1;
#pragma unroll 1
    for (; i < n_masked; ++i) step(i, std::true_type{});
#pragma unroll 1
    for (; i < n_tiles; ++i) step(i, std::false_type{});

    // The last tile's P·V, outside the turns.
    {
      const int last = n_tiles - 1;
      mbar_wait_no_trap(v_full(last % S), parity(last));
      wgmma_fence();
      issue_pv<D, Tl::kKVColBlockBytes>(o, pa, v_stage(last));
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(o);
      mbar_arrive_if(v_empty(last % S), warp_leader);
    }

    store_rows<D, kF32Out, kMerge>(o, m_run, l_run, row_lo, col_lane, lane, head, p);
    // Warpgroup 0 absorbs the last warpgroup's final hand-over (see "Turns"), so every turn barrier
    // ends with no arrivals pending.
    if (cw == 0) named_barrier_sync(kTurnBarrier, kTurnThreads);
  }
#endif  // LT_HOPPER_DEVICE_CODE
}

// ---- host side ---------------------------------------------------------------------------------------

// Query rows per CTA of each variant (the Q tensor map's box and the grid's tiles).
int block_rows(FwdVariant variant, int64_t head_dim) {
  if (variant == FwdVariant::baseline) return kBlockM;
  return head_dim == 64 ? OverlapTiles<64>::kBlockM : OverlapTiles<128>::kBlockM;
}

template <int D, bool kCausal, bool kF32Out, bool kMerge>
void launch_overlap(const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const Params& p,
                    int q_heads) {
  using Tl = OverlapTiles<D>;
  auto* kernel = fwd_overlap_kernel<D, kCausal, kF32Out, kMerge>;
  static const bool configured = [kernel] {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(Tl::kSmemBytes)));
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(q_heads), static_cast<unsigned>(p.num_q_tiles));
  kernel<<<grid, Tl::kThreads, Tl::kSmemBytes, cuda_stream()>>>(mq, mk, mv, p);
  LT_CUDA_LAUNCH_CHECK("hopper fwd_overlap_kernel");
}

template <int D, bool kCausal, bool kF32Out, bool kMerge>
void launch(FwdVariant variant, const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const Params& p,
            int q_heads) {
  if (variant == FwdVariant::baseline) {
    static const bool configured = [] {
      LT_CUDA_CHECK(cudaFuncSetAttribute(fwd_baseline_kernel<D, kCausal, kF32Out, kMerge>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Tiles<D>::kSmemBytes)));
      return true;
    }();
    (void)configured;
    const dim3 grid(static_cast<unsigned>(q_heads), static_cast<unsigned>(p.num_q_tiles));
    fwd_baseline_kernel<D, kCausal, kF32Out, kMerge>
        <<<grid, kThreads, Tiles<D>::kSmemBytes, cuda_stream()>>>(mq, mk, mv, p);
    LT_CUDA_LAUNCH_CHECK("hopper fwd_baseline_kernel");
  } else {
    launch_overlap<D, kCausal, kF32Out, kMerge>(mq, mk, mv, p, q_heads);
  }
}

}  // namespace

bool supported(int64_t head_dim, int64_t q_heads, int64_t kv_heads) {
  return (head_dim == 64 || head_dim == 128) && kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0 &&
         host::sm90_device();
}

std::string unsupported_reason(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v,
                               bool causal, bool merge) {
  if (!host::sm90_device()) return "the hopper attention kernel needs an sm_90 (H100/H200) GPU";
  if (q.dim != 64 && q.dim != 128) return fmt::format("head_dim must be 64 or 128, got {}", q.dim);
  if (k.dim != q.dim || v.dim != q.dim || o.dim != q.dim)
    return fmt::format("q, k, v and o must share head_dim, got {}, {}, {}, {}", q.dim, k.dim, v.dim, o.dim);
  if (k.heads <= 0 || q.heads % k.heads != 0 || v.heads != k.heads)
    return fmt::format("q heads {} must be a multiple of k/v heads {} / {}", q.heads, k.heads, v.heads);
  if (q.tokens <= 0 || k.tokens <= 0)
    return fmt::format("needs at least one query and one key, got Tq = {}, Tk = {}", q.tokens, k.tokens);
  if (v.tokens != k.tokens) return fmt::format("k and v must have as many tokens, got {} and {}", k.tokens, v.tokens);
  if (causal && q.tokens != k.tokens)
    return fmt::format("a causal block needs Tq == Tk, got {} and {}", q.tokens, k.tokens);
  if (q.tokens > int64_t{65535} * kBlockM || k.tokens > (int64_t{1} << 30))
    return fmt::format("Tq {} / Tk {} too long for one call", q.tokens, k.tokens);
  for (const auto& [view, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    std::string why = host::check_tma_input(*view, name);
    if (!why.empty()) return why;
  }
  if (o.tokens != q.tokens || o.heads != q.heads)
    return fmt::format("o [{}, {}, {}] must have q's shape [{}, {}, {}]", o.tokens, o.heads, o.dim, q.tokens, q.heads,
                       q.dim);
  const size_t pair_bytes = o.f32 ? 8 : 4;
  if (o.data == nullptr || reinterpret_cast<uintptr_t>(o.data) % pair_bytes != 0 || o.token_stride % 2 != 0 ||
      o.head_stride % 2 != 0)
    return fmt::format("o needs a {}-byte aligned base and even strides (it is written in element pairs), got {} "
                       "with strides {}, {}",
                       pair_bytes, o.data, o.token_stride, o.head_stride);
  if (merge && !o.f32) return "merge needs an f32 o (the running partial)";
  if (lse.data == nullptr || lse.tokens != q.tokens || lse.heads != q.heads)
    return fmt::format("lse must be [{}, {}], got [{}, {}]", q.tokens, q.heads, lse.tokens, lse.heads);
  return {};
}

FwdVariant parse_fwd_variant(const std::string& name, const char* source) {
  if (name == "overlap") return FwdVariant::overlap;
  if (name == "baseline") return FwdVariant::baseline;
  throw Error(fmt::format("{}: the hopper forward variant must be overlap or baseline, got '{}'", source, name));
}

const char* fwd_variant_name(FwdVariant variant) {
  switch (variant) {
    case FwdVariant::overlap: return "overlap";
    case FwdVariant::baseline: return "baseline";
  }
  return "?";
}

FwdVariant default_fwd_variant() {
  static const FwdVariant variant = [] {
    const char* env = std::getenv("LONGTRAIN_HOPPER_FWD_VARIANT");
    return env && *env ? parse_fwd_variant(env, "LONGTRAIN_HOPPER_FWD_VARIANT") : FwdVariant::overlap;
  }();
  return variant;
}

int fwd_kv_heads_per_section(int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool causal,
                             FwdVariant variant) {
  if (const int asked = host::section_from_env("LONGTRAIN_HOPPER_FWD_SECTION", kv_heads); asked > 0) return asked;
  LT_CHECK(tq > 0 && tk > 0 && kv_heads > 0 && q_heads % kv_heads == 0,
           "hopper attention forward: Tq {}, Tk {}, q heads {}, kv heads {} give no launch order", tq, tk, q_heads,
           kv_heads);
  // The CTAs in launch order (fwd_work_tile): query tiles from the last, each CTA's work its K/V tiles
  // plus one for its prologue and epilogue.
  const int64_t rows = block_rows(variant, head_dim), q_tiles = (tq + rows - 1) / rows;
  const int64_t kv_tiles = (tk + kBlockN - 1) / kBlockN;
  std::vector<int64_t> work(static_cast<size_t>(q_tiles));
  for (int64_t t = 0; t < q_tiles; ++t) {
    const int64_t q_end = std::min((q_tiles - t) * rows, tq);
    work[static_cast<size_t>(t)] = 1 + (causal ? std::min(kv_tiles, (q_end - 1) / kBlockN + 1) : kv_tiles);
  }
  return host::cached_section_for_tail(variant == FwdVariant::overlap ? "fwd_overlap" : "fwd_baseline", work,
                                       q_heads / kv_heads, kv_heads);
}

void forward(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v, bool causal,
             float scale, bool merge) {
  forward(o, lse, q, k, v, causal, scale, merge, default_fwd_variant());
}

void forward(const OutView& o, const StatsView& lse, const View& q, const View& k, const View& v, bool causal,
             float scale, bool merge, FwdVariant variant, int kv_heads_per_section) {
  const std::string why = unsupported_reason(o, lse, q, k, v, causal, merge);
  LT_CHECK(why.empty(), "hopper attention forward: {}", why);
  LT_CHECK(scale > 0.0f && std::isfinite(scale), "hopper attention forward: scale must be positive and finite, got {}",
           scale);
  const int rows = block_rows(variant, q.dim);
  const CUtensorMap mq = host::tile_map(q, rows, "q"), mk = host::tile_map(k, kBlockN, "k"), mv = host::tile_map(v, kBlockN, "v");
  Params p{};
  p.o = o.data;
  p.o_ts = o.token_stride;
  p.o_hs = o.head_stride;
  p.lse = lse.data;
  p.lse_ts = lse.token_stride;
  p.lse_hs = lse.head_stride;
  p.tq = static_cast<int>(q.tokens);
  p.tk = static_cast<int>(k.tokens);
  p.group = static_cast<int>(q.heads / k.heads);
  p.kv_heads = static_cast<int>(k.heads);
  p.section = kv_heads_per_section > 0
                  ? std::min(kv_heads_per_section, p.kv_heads)
                  : fwd_kv_heads_per_section(q.tokens, k.tokens, q.heads, k.heads, q.dim, causal, variant);
  p.num_q_tiles = static_cast<int>((q.tokens + rows - 1) / rows);
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  const int hq = static_cast<int>(q.heads);
  auto go = [&](auto d, auto causal_tag, auto f32_tag, auto merge_tag) {
    launch<decltype(d)::value, decltype(causal_tag)::value, decltype(f32_tag)::value, decltype(merge_tag)::value>(
        variant, mq, mk, mv, p, hq);
  };
  using T = std::true_type;
  using F = std::false_type;
  auto by_out = [&](auto d, auto c) {
    if (merge) {
      go(d, c, T{}, T{});
    } else if (o.f32) {
      go(d, c, T{}, F{});
    } else {
      go(d, c, F{}, F{});
    }
  };
  auto by_mask = [&](auto d) {
    if (causal) {
      by_out(d, T{});
    } else {
      by_out(d, F{});
    }
  };
  if (q.dim == 64) {
    by_mask(std::integral_constant<int, 64>{});
  } else {
    by_mask(std::integral_constant<int, 128>{});
  }
}

}  // namespace longtrain::attn::hopper
