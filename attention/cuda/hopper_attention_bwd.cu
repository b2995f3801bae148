// Our Hopper flash-attention backward (hopper_attention.h: backward): one CTA per (K/V tile of 128
// keys, kv head), FlashAttention-3's structure with our own code. Per step both consumer warpgroups
// compute half of the dQ tile after a barrier, in lockstep. (A second kernel in which the warpgroups
// took turns computing a step's whole dQ tile, with TMA bulk or red.global dQ reductions and a share
// of the exp2 on the FMA pipe, measured 1.09-1.22x slower on the H200 at head dim 64 (16K, 64K) and
// 1.03-1.09x at 128 and 64K, 6% faster only at 128 and 16K where cuDNN is faster still
// (bench/results/attention-hopper-round2-h200-2026-12-03.json), was removed: see git history.)
//
// Why per kv head and not per query head: the CTA loops over every query head of its kv head's group,
// so dK and dV of its 128 keys are summed over the whole group (GQA/MQA) in f32 registers and stored
// or added once, with no atomics, no f32 scratch for dK/dV and a fixed order (deterministic dK/dV).
// Per query head would give Hq/Hkv times more CTAs (better balance at short lengths) but dK/dV summed
// across CTAs with f32 atomics plus a conversion pass. At the lengths this kernel is for (16K+ tokens,
// 32/4 heads: 128+ key tiles × 4 kv heads >= 512 CTAs on 132 SMs) the per-kv-head grid already fills
// the GPU; causal CTAs are launched longest first (key tile 0 meets every query tile).
//
// The step order, and what bounds the kernel: every step adds a 32 KB dQ tile into the f32
// accumulator (L2 reductions: a diagnostic build without them ran 1.28x faster at head dim 64 and
// 1.35x at 128, 64K tokens, on the H200). A CTA visits the query tiles from the LAST
// down to the first that meets its keys, so the CTAs running together are on the same few query tiles
// at once and their reductions (and Q/dO loads) hit the L2; visiting them from the diagonal up put
// the running CTAs on ~132 different tiles, a working set past the L2: on the H200 descending cut the
// DRAM traffic 2.5x (ncu, D 64 64K: 108 -> 43 GB) and the kernel's time by 12% / 13% at 8K (D 64 /
// 128), 6% / 15% at 16K and 1.5-4% / 0.4-2.4% at 64K in two calls
// (bench/results/attention-hopper-bwd-order-h200-2026-12-03.json). Under one kv head per launch
// section (hopper_attention.h, "The launch order") the diagonal-up order was tried again: 4-24% slower
// at both head dims and 16K-64K, 4.3x the DRAM reads at head dim 128 64K
// (bench/results/attention-hopper-launch-order-h100-2026-12-06.json).
// Which way each CTA walks (hopper_attention.h, BwdOrder; the default since 2026-12-08): walking down
// from the last query tile keeps CTAs that START TOGETHER on one tile, but under one kv head per section
// only the first wave does. The next kv head's CTAs start one by one as the previous kv head's end (key
// tile n + 1's CTA (128 / kBlockM)·group steps after key tile n's), so walking down they spread over
// every query tile of their kv head: the group's Q, dO and f32 dQ accumulator, 67 MB at head dim 128
// and 16K tokens, past the L2. A CTA that starts that many steps after its predecessor and walks UP
// from its first query tile (that many tiles further on) stands on the predecessor's tile at every
// step: the streamed CTAs move as one front. They also end together, so the CTAs after them start
// together and walk down. The host finds the streamed CTAs in the section model's start times
// (host::launch_starts, streamed_ctas) and passes a bit per CTA (BwdParams::ascending); the consumers
// read each step's tile and head from shared memory, where the producer writes them (a cursor of their
// own made ptxas spill more at D = 64). On an H100 at 16K (ncu, kernels alone): head dim 128 6.05 ->
// 1.23 GB of DRAM traffic (cuDNN's backward: 1.27), L2 hit rate 87 -> 97%, 9.58 -> 9.25 ms; head dim 64
// 3.85 -> 0.59 GB, 6.31 -> 6.26 ms. Delta + backward in processes against the previous build: head dim
// 128 7% faster at 16K and 1.8% at 64K; head dim 64 1% slower at 16K and level at 64K
// (bench/results/attention-hopper-bwd-step-order-h100-2026-12-08.json).
// CTAs of two key tiles each, j from the last query tile down and then K - 1 - j from its diagonal up
// (equal work for every CTA, and the CTAs that start together on two query tiles at a time), measured
// 1-5% slower at 8K-64K and both head dims on the H200 (the equal lengths lose the longest-first
// packing of the last wave; bench/results/attention-launch-sections-h200-2026-12-06.json), and were
// removed (git history: LONGTRAIN_HOPPER_BWD_PAIRS).
// (Pairing two key tiles' CTAs in a cluster to add their dQ tiles in distributed shared memory before
// one reduction measured 1.18-1.35x slower: see git history.)
// The reductions are TMA bulk reductions (cp.reduce.async.bulk .add.f32), one 16 KB per warpgroup
// and step from a staging buffer, instead of each thread's red.global.add.v4: 8-12% faster at head
// dim 64 and 4-7% at 128 (8K-64K, H200, bench/results/attention-hopper-bwd-bulk-h200-2026-12-03.json).
//
// The exp2: both consumer warpgroups compute Pᵀ in lockstep, so the MUFU (16 exp2 per cycle and SM)
// runs beside only dPᵀ's MMAs. At D = 128 Pᵀ is computed in four chunks of 16 queries, and each
// chunk's 16-query k-step of dV = Pᵀ·dO is issued before the next chunk's exp2: 3.2% faster at 64K,
// 4.7% at 16K, 1.9% slower at 8K (mean of four rounds in two calls). At D = 64 two chunks ran 0-4%
// slower and four made ptxas serialize the wgmmas (too few registers); a quarter (or an eighth) of
// the exp2 as a polynomial on the FMA pipe ran 33-40% (5-7%) slower; and issuing the next step's Sᵀ
// before this step's dQ staging serialized the wgmmas at both head dims
// (bench/results/attention-hopper-bwd-exp-chunks-h200-2026-12-03.json).
//
// Instructions per step: Nsight Compute (16K, both head dims) found the consumers issuing on 40% of
// cycles with the tensor pipe 46% busy, and a fifth of the instructions masking the exp2 (compares,
// predicate logic and a select per element, in every tile: the compiler had predicated the masked
// branch) and another fifth re-encoding wgmma descriptors in the uniform datapath. The mask is now a
// pass of its own, run only in the tiles that need it, every descriptor is one base plus constants
// (desc_at), and the step's query tile and head come from a counter instead of a division: at D = 64
// 3.4% faster at 8K, 16K and 64K, at D = 128 level. dSᵀ then went to shared memory by stmatrix, four
// 8×8 matrices of the accumulator's own fragments per instruction (8 a step at D = 64 instead of 32
// 4-byte stores): 3-4% faster again at D = 64, 4-9% at D = 128 (two rounds in one call each,
// bench/results/attention-hopper-bwd-instructions-h200-2026-12-04.json). (Issuing the previous step's
// dQ at the start of the next and staging it while Sᵀ runs measured 1.9-2.8% slower at D = 64 and
// 6-12% at D = 128, same file. At D = 128, issuing half or all of dK's k-steps after dQ, so that
// they run while dQ is staged, measured 8-16% slower: dK is what keeps the tensor pipe busy while dS
// is stored and the warpgroups meet at the barrier; reading the lse rows into registers before the Sᵀ
// wait, 0-4% slower; at D = 64 both spill or serialize the wgmmas. K_w's first column block in
// registers at D = 128 serialized them too (C7512). bench/results/step-policies-power-h200-2026-12-04.json.
// Again at D = 128 on 2026-12-05, in bench/results/attention-hopper-bwd-dq-path-2026-12-05.json:
// FlashAttention-3's order, dQ issued before dK and staged while dK runs, 14% slower; dQ by
// red.global from registers with the freed 32 KB as a third (Q, dO) stage 5-7% slower at both head
// dims, and tied with this kernel in FA3's order; the producer loading a step's lse/delta before its
// stage wait 1-4% slower; the next step's Sᵀ alone issued before dQ's staging, now without spills
// or serialized wgmmas, 10% slower. That file has the stall profile of this kernel at D = 128.)
//
// Why the two consumer warpgroups stay in lockstep (one barrier per step, each computing half of the
// step's dQ tile from all 128 keys of dS): kernels in which each warpgroup computed the whole tile over
// its own 64 keys, with no per-step barrier between them, measured slower on the H100 (ABCCBA processes,
// bench/results/attention-hopper-bwd-split-dq-h100-2026-12-07.json; the code was kept only at a local
// git tag that did not reach the shared repository). Each partial reduced on its own (twice the
// reductions at the L2): 14-19% slower at both head dims and lengths, so the reductions bound this
// kernel more than the barrier does.
// Warpgroup 0's partial added to warpgroup 1's in shared memory before one reduction (twice the
// staging traffic; at D = 128 dV and dK had to finish before the wider dQ, for registers): 6-9%
// slower at D = 128, level at D = 64 (-0.7% to +2.2%).
//
// The dQ writer: at D = 64 the reductions are issued by warp 1 of the producer warpgroup
// (FlashAttention-3's dQ writer) instead of each consumer warpgroup's thread 0 after a barrier of its
// 128 threads, so the consumers only arrive after their staging stores and go on to the next step.
// A/B'd against the kernel without it, three interleaved rounds in one call each (bench/results/
// attention-hopper-bwd-dq-writer-2026-12-06.json): at D = 64 1.9-2.8% faster at 16K and 1.3-1.7% at
// 64K (H100), 2.3% / 2.5% in one round on the H200. At D = 128 it is slower: 14-20% on the H200 with
// the producer's 24 registers (ptxas -v: the writer spills 52-68 bytes there, at both head dims), and
// still 5.8-6.4% (16K) and 3.7-6.9% (64K) slower on the H100 with a 32 producer / 232 consumer split
// that spills nothing; so D = 128 keeps the consumers' own reductions.
// Also tried on 2026-12-06 and not kept (bench/results/attention-hopper-bwd-ab-h200-2026-12-06.json,
// H200, two rounds each in one call at D = 128, one at D = 64): dSᵀ stored before the rest of dV and
// dK are issued, 9% slower at 16K and 0.8% at 64K (D = 128); L2 evict_last hints on the Q/dO loads and
// the dQ reductions with evict_first on K/V, 16% slower at 16K and level at 64K (D = 128), 0.4-1.3%
// slower at D = 64; the (Q, dO) stage released as soon as dV and dK are done (wait_group 1), before
// dQ, 2.4% faster at 64K but 15% slower at 16K (D = 128), 1.3-1.7% slower at D = 64.
//
// K_w in registers: at D = 64 each consumer thread loads its bf16 A fragments of K_w once (16
// registers) and Sᵀ = K_w·Qᵀ runs with A from registers, which takes 8 KB per warpgroup and step off
// the shared-memory reads of the MMAs (an SS m64n128k16 reads 6 KB per 64 tensor-core cycles, near
// the 128 bytes per cycle shared memory gives): 0.8% faster at 8K, 0.3% at 16K and 0.4% at 64K (two
// rounds in one call; ptxas spills 4 bytes in the causal kernel). V_w in registers as well (dPᵀ) made
// ptxas serialize the wgmmas and spill (C7512); D = 128 would need 32 registers per operand
// (bench/results/attention-hopper-bwd-k-registers-h200-2026-12-04.json).
//
// The peers at head dim 128, causal (read 2026-12-07; nothing of theirs is used here): FlashAttention-3
// (hopper/flash_bwd_launch_template.h) runs this kernel's structure: 64 queries × 128 keys, Sᵀ and dPᵀ
// swapped m64n64 SS, dV/dK RS from registers, dQ as two m64n64 halves staged and bulk-reduced, 24/240
// registers; it differs in a double-buffered dS (no barrier before its stmatrix), the query loop from
// the diagonal up and one CTA per query head. ThunderKittens (kernels/attention/mha_h100) lets one
// warpgroup compute the whole dQ tile as m64n128 while the other starts the next step, which is this
// file's removed turn-taking kernel (above). The three SS m64n64 products of a step read about as many
// shared-memory bytes per cycle as an SM gives (ncu: LSU 57%, tensor pipe 60% busy at 16K), the likely
// reason cuDNN's backward keeps a few percent ahead at this head dim.
//
// Per CTA: 384 threads = a producer warpgroup and two consumer warpgroups (setmaxnreg 24 / 240).
// - The producer's warp 1 is the dQ writer at D = 64 (below); warps 2-3 (and 1 at D = 128) leave.
// - The producer's warp 0 TMA-loads the K and V tiles once, then streams (Q, dO) tiles of kBlockM
//   query rows (128 for head_dim 64, 64 for head_dim 128) through a kStages ring, for every query head
//   of the group and every query tile that meets the keys (causal: those at or below the diagonal).
//   With each tile its 32 lanes copy the rows' lse (times log2 e) and delta into shared memory.
// - Consumer warpgroup w owns keys 64w..64w+63 of the tile. Per (query head, query tile) step it
//   computes, with the keys as the wgmma M dimension ("swapped" products, so P and dS come out
//   transposed, which is what dV and dK need as their register A operand):
//     Sᵀ  = K_w·Qᵀ        [64 × kBlockM]  SS (K and Q both K-major, as the forward's S = Q·Kᵀ);
//                                         at D = 64 RS, K_w from registers (below)
//     dPᵀ = V_w·dOᵀ       [64 × kBlockM]  SS
//     Pᵀ  = exp2(Sᵀ·scale·log2e − lse·log2e)  (0 where masked and for rows whose lse is −inf)
//     dSᵀ = Pᵀ ⊙ (dPᵀ − delta)
//     dV_w += Pᵀ·dO       [64 × D]  RS: Pᵀ as bf16 from registers, dO N-major (as V in the forward)
//     dK_w += dSᵀ·Q       [64 × D]  RS: dSᵀ from registers, Q N-major
//   and writes dSᵀ as bf16 into shared memory (M-major for the next product, by stmatrix), then after a
//   named barrier between the two consumer warpgroups (dQ needs all 128 keys of dS):
//     dQ_sub = dS·K       [64 × 64]  SS, A = dS M-major ("transposed"), B = K N-major
//   where warpgroup w's 64×64 sub-block is query rows 64w.. (head_dim 64) or head_dim columns 64w..
//   (head_dim 128) of the [kBlockM × D] dQ tile. The warpgroup stores it into its staging buffer
//   in shared memory (the accumulator's order, below), and its thread 0 issues one 16 KB bulk
//   reduction that adds the buffer into the f32 dQ accumulator in global memory.
// - dK (times scale) and dV leave the registers once, at the end: stored or added (f32 or bf16
//   destinations, their strides) by the thread that owns them.
// A small kernel then adds scale · (the f32 dQ accumulator) into (or over) the caller's dq: a 64 × 64
// sub-block per CTA, staged in shared memory and written a whole row at a time (dq_from_accum_tiled_
// kernel; 1.9x faster than one thread per accumulator float4 writing element pairs, which remains for
// dq views whose strides do not allow the row stores; hopper_attention.h, DqConvert).
//
// Shared memory (128-byte swizzle everywhere, hopper_attention.cu's header explains the layout and
// the descriptors): K and V tiles [128 keys][D] (kColBlocks column blocks of 64), a ring of kStages
// (Q, dO) tiles [kBlockM rows][D], two dS buffers, lse/delta rows per stage, mbarriers, and the two
// warpgroups' f32 dQ staging buffers (2×16 KB). Budgets:
//   D = 64,  kBlockM = 128: K 16 + V 16 + Q 2×16 + dO 2×16 + dS 2×16 + dQ 2×16 KB = 192 KB (+2 KB rows)
//   D = 128, kBlockM = 64:  K 32 + V 32 + Q 2×16 + dO 2×16 + dS 2×16 + dQ 2×16 KB = 192 KB (+1 KB rows)
// Registers per consumer thread (f32 accumulators): dV, dK D/2 each; Sᵀ, dPᵀ kBlockM/2 each; dQ 32:
//   D = 64: 32 + 32 + 64 + 64 (+ 32 dQ once Sᵀ, dPᵀ are packed to bf16) = 192 at the peak;
//   D = 128: 64 + 64 + 32 + 32 = 192. FlashAttention-3 runs the same tile shapes within 240.
// Why D = 128 keeps 64 query rows although 128 would ease the shared-memory bound (above): an SS
// m64nNk16 reads 2 KB of A and 32·N bytes of B while the tensor pipe takes N/2 cycles: 128 bytes per
// cycle at N = 64 (all an SM's shared memory gives, with nothing left for the TMA, dS and dQ traffic)
// and 96 at N = 128. With 128 query rows at D = 128 the accumulators take 64 + 64 + 64 + 64 = 256
// registers per thread, over the 240 a consumer gets, and the tiles K 32 + V 32 + Q 32 + dO 32 + dS 64
// + dQ 64 KB = 256 KB with a single (Q, dO) stage, over the 227 KB a CTA may use (224 with one dS
// buffer as well, and then no load overlaps the step).
//
// Synchronisation, every wait explicit:
// - kv_full (count 1): lane 0's arrive.expect_tx(K + V bytes); TMA completes it. Consumers wait once.
// - q_full[s], do_full[s] (count 32 each): lane 0 first raises the expected bytes (mbarrier.expect_tx,
//   no arrival) and issues the Q (dO) TMA; then each of the 32 lanes stores its lse (delta) values and
//   arrives, so a phase completes only when both the TMA bytes and every lane's stores are in.
// - empty[s] (count 256): every consumer thread arrives once per step after the wgmma that last reads
//   stage s's Q/dO (dK/dV) has completed and after its lse/delta reads; the producer waits on it
//   before refilling s (a fresh barrier's "previous phase" counts as complete: the first pass waits
//   on parity 1 and does not block).
// - named barrier 1 (256 consumer threads) per step: both warpgroups' dSᵀ stores (each thread fences
//   them to the async proxy first) are in before either issues the dQ wgmma that reads them. dS is
//   double-buffered (step i uses buffer i % 2): a warpgroup writes buffer b at step i + 2 only after
//   passing the barrier of step i + 1, which the other warpgroup reaches only after its step-i dQ
//   wgmma (the last reader of b) has completed.
// - named barrier 2 + w (warpgroup w's 128 threads) per step: all of its dQ staging stores (fenced to
//   the async proxy) are in before its thread 0 issues the bulk reduction that reads them. Before the
//   next step's named barrier 1, thread 0 waits until that reduction has read the buffer
//   (cp.async.bulk.wait_group.read), so no thread overwrites it early; at the end thread 0 waits for
//   the last reduction to complete before the CTA exits.
// - The dQ writer instead (D = 64, "The dQ writer" below): named barriers 4 + w (dQ full) and 6 + w
//   (dQ empty), each 128 threads of warpgroup w and the writer's 32. Per step w syncs on 6 + w (from
//   the second step on), stores and fences its staging buffer and arrives on 4 + w without waiting;
//   the writer syncs on 4 + w and its lane 0 issues the reduction; once both reductions of the step
//   have read their buffers (wait_group.read) the writer arrives on 6 + w for the next step (not
//   after the last step, so no arrival is left unconsumed), and at the end lane 0 waits for the last
//   reductions to complete. A warpgroup cannot arrive twice on 4 + w unseen: its next arrival needs
//   the writer's arrival on 6 + w, which comes after the writer's sync on 4 + w.
// Phases: step i uses stage s = i % kStages, parity (i / kStages) & 1 on the full barriers.
//
// Edges: keys >= Tk (TMA zero-fills them) and, causal, keys after the query are masked to P = 0 in
// the tiles that need it; query rows >= Tq get lse = +inf and delta = 0 in shared memory (P = 0,
// dS = 0), as do rows whose lse is −inf (a NaN delta of such a row is never read). Their dQ rows land
// in the accumulator's padding and are never copied out.
//
// The f32 dQ accumulator: [Hq][num_q_tiles][kBlockM·D] floats, each tile in the consumers' fragment
// order: sub-block w (4096 floats), then float4 j = 0..7, then thread t = 0..127, then 4 floats:
// (j, t, e) holds accumulator element i = 4j + e of thread t, i.e. (PTX wgmma D fragment) row
// 16·(t/32) + (t%32)/4 + 8·(e/2), column 8j + 2·(t%4) + e%2 of the 64×64 sub-block. A sub-block is
// then 16 contiguous KB (one bulk reduction; a warp's 16-byte staging stores cover 512 contiguous bytes,
// free of bank conflicts); the conversion kernels invert the map.
#include "attention/cuda/hopper_attention.h"
#include "attention/cuda/hopper_host.h"
#include "attention/cuda/hopper_ptx.cuh"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_host.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace longtrain::attn::hopper {
namespace {

using namespace ptx;

constexpr int kBlockN = 128;            // keys per CTA (its K/V tile)
constexpr int kWgKeys = 64;             // keys per consumer warpgroup: the wgmma M of Sᵀ, dPᵀ, dV, dK
constexpr int kThreads = 384;           // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kSwizzleElems = 64;       // bf16 elements in one 128-byte swizzled row
constexpr uint32_t kRowBytes = 128;     // one swizzled row
constexpr uint32_t kAtomBytes = 1024;   // 8 swizzled rows: the SBO of every descriptor here
constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 128·24 + 256·240 = 64512 <= 65536 registers
constexpr uint32_t kDsBarrier = 1;      // named barrier id (0 is __syncthreads)
constexpr uint32_t kDqStageBarrier = 2;  // + consumer warpgroup: its dQ staging stores are in
// With a dQ writer warp (BwdTiles::kDqWriter), + consumer warpgroup: its staging buffer is full (the
// warpgroup arrives, the writer syncs) and empty again (the writer arrives, the warpgroup syncs).
constexpr uint32_t kDqFullBarrier = 4, kDqEmptyBarrier = 6;
constexpr uint32_t kDqWriterBarrierThreads = 128 + 32;  // a consumer warpgroup and the writer warp
constexpr int kDqSub = 64;              // each consumer warpgroup's dQ sub-block is 64 × 64
constexpr int kOrderBits = 16384;       // CTAs whose step direction the launch carries (BwdParams::ascending)
constexpr int kDqSubFloats = kDqSub * kDqSub;
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kBlockN == 2 * kWgKeys, "two consumer warpgroups split the key tile");
static_assert(kConsumerThreads == 2 * 128, "two consumer warpgroups");
static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536, "register file");

template <int D> struct BwdTiles {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  // Query rows per step: 128 for D = 64; 64 for D = 128, where 128 would need 64 + 64 (dK, dV) +
  // 64 + 64 (Sᵀ, dPᵀ) = 256 accumulator registers per thread, over the 240 available.
  static constexpr int kBlockM = D == 64 ? 128 : 64;
  static constexpr int kStages = 2;  // (Q, dO) ring depth: one tile loading while one is consumed
  // Pᵀ's exp2 in this many chunks of the query columns, as measured (header: "The exp2").
  static constexpr int kExpChunks = D == 64 ? 1 : 4;
  // Sᵀ's A operand K_w from registers instead of shared memory, as measured (header: "K_w in
  // registers"): D / 4 registers per thread, which D = 128 has no room for.
  static constexpr bool kKInRegisters = D == 64;
  // The dQ bulk reductions issued by a writer warp (the producer warpgroup's warp 1; FlashAttention-3's
  // dQ writer) instead of each consumer warpgroup's thread 0 after a barrier of its 128 threads
  // (header: "The dQ writer"): 1.3-2.8% faster at D = 64, 4-20% slower at D = 128, as measured.
  static constexpr bool kDqWriter = D == 64;
  static_assert(kBlockM / 16 % kExpChunks == 0, "whole dV k-steps per exp2 chunk");
  static constexpr int kColBlocks = D / kSwizzleElems;
  static constexpr uint32_t kKVColBlockBytes = kBlockN * kRowBytes;
  static constexpr uint32_t kKVBytes = kColBlocks * kKVColBlockBytes;  // one K (or V) tile
  static constexpr uint32_t kQColBlockBytes = kBlockM * kRowBytes;
  static constexpr uint32_t kQBytes = kColBlocks * kQColBlockBytes;    // one Q (or dO) tile
  // dS [kBlockM queries × 128 keys] stored M-major: per 64 queries (one 128-byte row) a block of 128
  // key rows.
  static constexpr int kQueryBlocks = kBlockM / 64;
  static constexpr uint32_t kDsBlockBytes = kBlockN * kRowBytes;
  static constexpr uint32_t kDsBytes = kQueryBlocks * kDsBlockBytes;
  static constexpr int kDsBuffers = 2;
  static constexpr uint32_t kKOffset = 0;
  static constexpr uint32_t kVOffset = kKOffset + kKVBytes;
  static constexpr uint32_t kQOffset = kVOffset + kKVBytes;
  static constexpr uint32_t kDoOffset = kQOffset + kStages * kQBytes;
  static constexpr uint32_t kDsOffset = kDoOffset + kStages * kQBytes;
  static constexpr uint32_t kLseOffset = kDsOffset + kDsBuffers * kDsBytes;  // f32 [kStages][kBlockM]
  static constexpr uint32_t kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  // Per stage, the step's query tile and head as the producer walked them (int [kStages][2]): the
  // consumers read them there instead of walking a cursor of their own (registers they lack at D = 64).
  static constexpr uint32_t kStepOffset = kDeltaOffset + kStages * kBlockM * 4;
  static constexpr uint32_t kBarrierOffset = kStepOffset + kStages * 8;
  static constexpr int kBarriers = 1 + 3 * kStages;  // kv_full, q_full[s], do_full[s], empty[s]
  // Each consumer warpgroup's 64 × 64 f32 dQ sub-block, staged in the accumulator's order (16-byte
  // aligned, as bulk copies need).
  static constexpr uint32_t kDqStageOffset = (kBarrierOffset + 8 * kBarriers + 127) / 128 * 128;
  static constexpr uint32_t kDqStageBytes = kDqSubFloats * 4;
  // +1024: the dynamic shared memory base is only 16-byte aligned; the tiles are moved up to 1024.
  static constexpr uint32_t kSmemBytes = kDqStageOffset + 2 * kDqStageBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
  // Every tile starts on a swizzle atom (the descriptors' base offset is 0).
  static_assert(kKVBytes % kAtomBytes == 0 && kQBytes % kAtomBytes == 0 && kDsBytes % kAtomBytes == 0,
                "tiles are whole 1024-byte swizzle atoms");
  static_assert(kBarrierOffset % 8 == 0, "mbarriers are 8-byte aligned");

  // Accumulator floats per consumer thread (a 64 × N wgmma accumulator is N/2 per thread).
  static constexpr int kSFloats = kBlockM / 2;  // Sᵀ, dPᵀ: 64 keys × kBlockM queries
  static constexpr int kKVFloats = D / 2;       // dK, dV: 64 keys × D
  static constexpr int kDqFloats = kDqSubFloats / 128;
  static_assert(kDqFloats == 32, "a 64 × 64 dQ sub-block per warpgroup");
  static_assert(2 * kSFloats + 2 * kKVFloats <= 192, "accumulators live at the peak must leave room in 240 registers");
  // The two warpgroups' 64 × 64 sub-blocks tile the [kBlockM × D] dQ tile exactly.
  static_assert(kBlockM * D == 2 * kDqSubFloats, "dQ tile = two 64 × 64 sub-blocks");
  static constexpr int kDqTileFloats = kBlockM * D;
  // Per 16-key k-step of a 64-row operand: the loops below.
  static_assert(kBlockM % 16 == 0 && D % 16 == 0, "wgmma k-steps of 16");
  static_assert(kBlockM % 32 == 0, "the producer's 32 lanes copy kBlockM lse/delta rows");
};

struct BwdParams {
  const float* lse;
  int64_t lse_ts, lse_hs;
  const float* delta;
  int64_t delta_ts, delta_hs;
  float* dq_accum;  // [Hq][num_q_tiles][kBlockM·D], fragment order (header comment); zeroed before
  void* dk;
  int64_t dk_ts, dk_hs;
  void* dv;
  int64_t dv_ts, dv_hs;
  bool dk_f32, dv_f32;
  bool accumulate;  // dk/dv += this block's gradients (else :=)
  int tq, tk;
  int group;        // q heads per kv head
  int kv_heads;
  int section;      // kv heads per launch-order section (the kernel's first lines)
  int num_q_tiles;  // ceil(Tq / kBlockM)
  float scale;      // natural-log scale (dK's factor)
  float scale_log2; // scale · log2(e) (for exp2)
  // Bit w: the CTA w-th in launch order visits its query tiles from the first that meets its keys up
  // (header, "The step order"); else from the last down. CTAs past kOrderBits go down.
  uint32_t ascending[kOrderBits / 32];
};

// A CTA's steps in order: query tile m (the last first, or from m_first up: header, "The step
// order") and query head (the kv head's group, fastest). The producer and the dQ writer each walk a
// copy of the kernel's cursor, so they agree; the consumers read each step's tile and head from shared
// memory, where the producer writes them (BwdTiles::kStepOffset). It counts instead of dividing by
// the group each step (a runtime divisor: ~20 instructions). Three registers: the group's heads come
// from kv_head (live in both callers for their K/V or dQ addresses) and p.group (a kernel parameter),
// not from registers of their own, for the producer warpgroup's 24.
struct StepCursor {
  int m, m_step, head;
  __device__ __forceinline__ StepCursor(const BwdParams& p, const int kv_head, const int m_first, const bool ascending)
      : m(ascending ? m_first : p.num_q_tiles - 1), m_step(ascending ? 1 : -1), head(kv_head * p.group) {}
  __device__ __forceinline__ void next(const BwdParams& p, const int kv_head) {
    if (++head == (kv_head + 1) * p.group) {
      head = kv_head * p.group;
      m += m_step;
    }
  }
};

// Sᵀ or dPᵀ (+)= A[64 × 16] · B[16 × N]: A and B K-major in shared memory; N = kBlockM.
template <int N>
__device__ __forceinline__ void mma_ss_kmajor(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t accumulate) {
  if constexpr (N == 128) {
    wgmma_m64n128k16_ss(d, da, db, accumulate);
  } else {
    static_assert(N == 64, "N is 64 or 128");
    wgmma_m64n64k16_ss<0, 0>(d, da, db, accumulate);
  }
}

// dV or dK += A[64 × 16] · B[16 × N]: A as bf16 pairs from registers, B N-major in shared memory; N = D.
template <int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint64_t db) {
  if constexpr (N == 128) {
    wgmma_m64n128k16_rs(d, a0, a1, a2, a3, db);
  } else {
    static_assert(N == 64, "N is 64 or 128");
    wgmma_m64n64k16_rs(d, a0, a1, a2, a3, db);
  }
}

// Stores (or adds into) the pair (x, y) at dst, f32 or bf16.
__device__ __forceinline__ void put_pair(void* dst, bool f32, bool accumulate, float x, float y) {
  if (f32) {
    float2* p = static_cast<float2*>(dst);
    if (accumulate) {
      const float2 old = *p;
      x += old.x;
      y += old.y;
    }
    *p = make_float2(x, y);
  } else {
    __nv_bfloat162* p = static_cast<__nv_bfloat162*>(dst);
    if (accumulate) {
      const float2 old = __bfloat1622float2(*p);
      x += old.x;
      y += old.y;
    }
    *p = __floats2bfloat162_rn(x, y);
  }
}

// ---- the kernel ------------------------------------------------------------------------------------
//
// Accumulator fragments (PTX ISA, wgmma .m64nNk16 D fragment; hopper_attention.cu): thread `lane` of
// warp `warp` (within its warpgroup) holds element i of N/2 at row 16·warp + lane/4 + 8·((i/2) % 2)
// and column 8·(i/4) + 2·(lane % 4) + i % 2. Here the rows are keys and (for Sᵀ, dPᵀ) the columns
// queries. The pairs (2q, 2q+1), read four at a time for the k-th 16 columns, are the bf16 A fragment
// of the next MMA over those columns (a_r = pair 4k + r), which is how Pᵀ and dSᵀ feed dV and dK.

// The producer warp (its 32 lanes; the smem layout and barriers of Tl, a BwdTiles): lane 0 TMA-loads the K and V tiles once (kv_full), then for every step the (Q, dO) tiles
// into stage step % kStages after the consumers released it (empty), raising each full barrier's
// expected bytes first; every lane copies its rows' lse (times log2 e) and delta and arrives on both
// full barriers (count 32), so a phase completes when the TMA bytes and all 32 lanes' stores are in.
// Rows past Tq or with lse = -inf get lse = +inf (P = 0) and delta = 0 (dS = 0; a NaN delta of such a
// row is never read). It returns after the consumers' last releases, so no load is in flight when
// the warp leaves.
template <class Tl>
__device__ __forceinline__ void produce(const CUtensorMap* tm_q, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                        const CUtensorMap* tm_do, const BwdParams& p, const int lane,
                                        const uint32_t smem, float* const lse_rows, float* const delta_rows,
                                        int* const step_tiles,
                                        const int kv_head, const int n0, const int steps, StepCursor cursor) {
#if LT_HOPPER_DEVICE_CODE
  constexpr int M = Tl::kBlockM;
  constexpr int S = Tl::kStages;
  const uint32_t sK = smem + Tl::kKOffset, sV = smem + Tl::kVOffset;
  auto sQ = [&](int s) { return smem + Tl::kQOffset + s * Tl::kQBytes; };
  auto sDo = [&](int s) { return smem + Tl::kDoOffset + s * Tl::kQBytes; };
  const uint32_t bars = smem + Tl::kBarrierOffset;
  const uint32_t kv_full = bars;
  auto q_full = [&](int s) { return bars + 8u * (1 + s); };
  auto do_full = [&](int s) { return bars + 8u * (1 + S + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + 2 * S + s); };
  if (lane == 0) {
    prefetch_tensor_map(tm_q);
    prefetch_tensor_map(tm_k);
    prefetch_tensor_map(tm_v);
    prefetch_tensor_map(tm_do);
    mbar_arrive_expect_tx(kv_full, 2 * Tl::kKVBytes);
#pragma unroll
    for (int c = 0; c < Tl::kColBlocks; ++c) {
      tma_load_3d(sK + c * Tl::kKVColBlockBytes, tm_k, kv_full, c * kSwizzleElems, kv_head, n0);
      tma_load_3d(sV + c * Tl::kKVColBlockBytes, tm_v, kv_full, c * kSwizzleElems, kv_head, n0);
    }
  }
  for (int step = 0; step < steps; ++step, cursor.next(p, kv_head)) {
    const int s = step % S;
    const int m = cursor.m, head = cursor.head;
    const int m0 = m * M;
    // Load `step` into stage s waits for the release of load step - S from it: phase (step - S) / S of
    // empty[s], parity ((step / S) & 1) ^ 1; a fresh barrier's "previous phase" counts as complete, so
    // the first pass does not block. Every lane waits: each overwrites its own lse/delta slots.
    mbar_wait_no_trap(empty(s), ((step / S) & 1) ^ 1);
    if (lane == 0) {
      mbar_expect_tx(q_full(s), Tl::kQBytes);
#pragma unroll
      for (int c = 0; c < Tl::kColBlocks; ++c)
        tma_load_3d(sQ(s) + c * Tl::kQColBlockBytes, tm_q, q_full(s), c * kSwizzleElems, head, m0);
      mbar_expect_tx(do_full(s), Tl::kQBytes);
#pragma unroll
      for (int c = 0; c < Tl::kColBlocks; ++c)
        tma_load_3d(sDo(s) + c * Tl::kQColBlockBytes, tm_do, do_full(s), c * kSwizzleElems, head, m0);
    }
#pragma unroll
    for (int r = lane; r < M; r += 32) {
      const int64_t row = m0 + r;
      const float l = row < p.tq ? p.lse[row * p.lse_ts + head * p.lse_hs] : -INFINITY;
      const bool live = l != -INFINITY;  // past Tq, or a row that saw no key: P = 0, dS = 0
      lse_rows[s * M + r] = live ? l * kLog2e : INFINITY;
      delta_rows[s * M + r] = live ? p.delta[row * p.delta_ts + head * p.delta_hs] : 0.0f;
    }
    if (lane == 0) {
      step_tiles[2 * s] = m;
      step_tiles[2 * s + 1] = head;
    }
    // release: this lane's lse/delta (and lane 0's step) stores are visible to the waiters
    mbar_arrive(q_full(s));
    mbar_arrive(do_full(s));
  }
  // Stay until the consumers have released every stage (load step completed phase step / S of its
  // stage's empty barrier), so no load is in flight when warp 0 leaves.
  if (lane == 0)
    for (int step = max(0, steps - S); step < steps; ++step) mbar_wait_no_trap(empty(step % S), (step / S) & 1);
#endif  // LT_HOPPER_DEVICE_CODE
}

// The dQ writer warp (Tl::kDqWriter; its 32 lanes): per step, for each consumer warpgroup w, waits
// until w's staging buffer is full, lane 0 issues its bulk reduction into the accumulator; then, but
// after the last step, lane 0 waits until both reductions have read their buffers and the warp tells
// both warpgroups they may write them again. It returns once the last reductions have completed.
template <class Tl>
__device__ __forceinline__ void write_dq(const BwdParams& p, const int lane, const uint32_t smem, const int kv_head,
                                         const int steps, StepCursor cursor) {
#if LT_HOPPER_DEVICE_CODE
  for (int step = 0; step < steps; ++step, cursor.next(p, kv_head)) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      named_barrier_sync(kDqFullBarrier + w, kDqWriterBarrierThreads);
      if (lane == 0) {
        float* const acc = p.dq_accum +
                           (static_cast<int64_t>(cursor.head) * p.num_q_tiles + cursor.m) * Tl::kDqTileFloats +
                           w * kDqSubFloats;
        bulk_reduce_add_f32(acc, smem + Tl::kDqStageOffset + w * Tl::kDqStageBytes, Tl::kDqStageBytes);
        bulk_commit_group();
      }
    }
    // The consumers sync on the empty barriers before every step's staging stores but the first.
    if (step + 1 < steps) {
      if (lane == 0) bulk_wait_read_all();
      __syncwarp();
#pragma unroll
      for (int w = 0; w < 2; ++w) named_barrier_arrive(kDqEmptyBarrier + w, kDqWriterBarrierThreads);
    }
  }
  if (lane == 0) bulk_wait_all();
#endif  // LT_HOPPER_DEVICE_CODE
}

template <int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_attention_bwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                                const BwdParams p) {
#if LT_HOPPER_DEVICE_CODE
  using Tl = BwdTiles<D>;
  constexpr int M = Tl::kBlockM;
  constexpr int S = Tl::kStages;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t smem = (raw + 1023u) & ~1023u;
  unsigned char* const smem_ptr = smem_raw + (smem - raw);  // the same address, generic
  const uint32_t sK = smem + Tl::kKOffset;  // (the MMAs address Q, dO, K and V through desc_at)
  auto sDs = [&](int b) { return smem + Tl::kDsOffset + b * Tl::kDsBytes; };
  float* const lse_rows = reinterpret_cast<float*>(smem_ptr + Tl::kLseOffset);      // [S][M], lse · log2 e
  float* const delta_rows = reinterpret_cast<float*>(smem_ptr + Tl::kDeltaOffset);  // [S][M]
  int* const step_tiles = reinterpret_cast<int*>(smem_ptr + Tl::kStepOffset);        // [S][2]: m, head
  const uint32_t bars = smem + Tl::kBarrierOffset;
  const uint32_t kv_full = bars;
  auto q_full = [&](int s) { return bars + 8u * (1 + s); };
  auto do_full = [&](int s) { return bars + 8u * (1 + S + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + 2 * S + s); };

  // This CTA's kv head and key tile (hopper_attention.h, "The launch order"): CTA w in launch order (x
  // fastest) takes, within its section of p.section kv heads, the key tiles from 0 up (causal: tile 0
  // meets the most query tiles) and the section's kv heads fastest. Grid (kv heads, key tiles).
  int kv_head, n_tile;
  launch_order_tile(p.section, p.kv_heads, 1, static_cast<int>(gridDim.y), kv_head, n_tile);
  const int n0 = n_tile * kBlockN;
  // Causal (Tq == Tk): query tiles wholly before key n0 see none of these keys. n0 < Tk = Tq, so at
  // least one tile remains; without a mask every query tile meets the keys.
  const int m_first = kCausal ? n0 / M : 0;
  const int steps = (p.num_q_tiles - m_first) * p.group;  // query tiles m_first to num_q_tiles - 1 (StepCursor)
  const int launch_index = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
  const bool ascending = launch_index < kOrderBits && ((p.ascending[launch_index / 32] >> (launch_index % 32)) & 1u);
  const StepCursor first_step(p, kv_head, m_first, ascending);

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int s = 0; s < S; ++s) {
      mbar_init(q_full(s), 32);
      mbar_init(do_full(s), 32);
      mbar_init(empty(s), kConsumerThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---- producer: warp 0, and warp 1 as the dQ writer (Tl::kDqWriter); the others leave at once (no
    // later CTA-wide barrier) ----
    setmaxnreg_dec<kProducerRegs>();
    if constexpr (Tl::kDqWriter) {
      if (threadIdx.x / 32 == 1) return write_dq<Tl>(p, threadIdx.x % 32, smem, kv_head, steps, first_step);
    }
    if (threadIdx.x >= 32) return;
    produce<Tl>(&tm_q, &tm_k, &tm_v, &tm_do, p, threadIdx.x, smem, lse_rows, delta_rows, step_tiles, kv_head, n0, steps,
                first_step);
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;  // keys n0 + 64·cw + [0, 64)
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  const int key_wg = n0 + kWgKeys * cw;
  const int key_row = kWgKeys * cw + 16 * warp + lane / 4;  // this thread's half-0 key row in the tile
  const int key_lo = n0 + key_row;                          // ... as a key index; half 1 is +8
  const int col_lane = 2 * (lane % 4);

  float dv[Tl::kKVFloats], dk[Tl::kKVFloats];
#pragma unroll
  for (int i = 0; i < Tl::kKVFloats; ++i) dv[i] = dk[i] = 0.0f;
  const bool keys_past_end = key_wg + kWgKeys > p.tk;  // this warpgroup has keys >= Tk (zero rows)

  mbar_wait_no_trap(kv_full, 0);
  // At D = 64, K_w is Sᵀ's A operand from registers (bf16 pairs, loaded once; header: "K_w in
  // registers"): pair r of k-step kk holds key rows key_row + 8·(r % 2), head_dim columns
  // 16·kk + 8·(r / 2) + col_lane + {0, 1}, read from the 128-byte swizzled K tile.
  constexpr bool kKRegs = Tl::kKInRegisters;
  uint32_t ka[kKRegs ? D / 16 : 1][4];
  if constexpr (kKRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = key_row + 8 * (r % 2);
        const int col = 16 * kk + 8 * (r / 2) + col_lane;
        const uint32_t byte = (col % 64) * 2;
        ka[kk][r] = ld_shared_u32(sK + (col / 64) * Tl::kKVColBlockBytes + row * kRowBytes +
                                  (((byte / 16) ^ (row % 8)) << 4) + byte % 16);
      }
    }
  }
  // Every operand's descriptor is this one's plus constants and the stage's or buffer's offset
  // (desc_at), not a new encoding of its address per wgmma.
  const uint64_t desc0 = smem_desc(smem, 16, kAtomBytes);
  const uint32_t wg_rows = kWgKeys * cw * kRowBytes;  // this warpgroup's 64 rows of K and V
  for (int step = 0; step < steps; ++step) {
    const int s = step % S;
    const uint32_t parity = (step / S) & 1;
    const uint32_t at_q = Tl::kQOffset + s * Tl::kQBytes, at_do = Tl::kDoOffset + s * Tl::kQBytes;  // stage s

    // Sᵀ = K_w·Qᵀ and dPᵀ = V_w·dOᵀ over head_dim in steps of 16 (the k-th slice of a column block
    // starts 32·k bytes in; hopper_attention.cu's header).
    float st[Tl::kSFloats], dpt[Tl::kSFloats];
    mbar_wait_no_trap(q_full(s), parity);
    // The step's query tile and head, from the producer (the load below follows the wait: both asm
    // volatile, kept in order).
    const int m = static_cast<int>(ld_shared_u32(smem + Tl::kStepOffset + 8 * s));
    const int head = static_cast<int>(ld_shared_u32(smem + Tl::kStepOffset + 8 * s + 4));
    const int m0 = m * M;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t in_block = (kk % 4) * 32;
      const uint64_t db = desc_at(desc0, at_q + (kk / 4) * Tl::kQColBlockBytes + in_block);
      if constexpr (kKRegs) {
        wgmma_m64n128k16_rs_kmajor(st, ka[kk][0], ka[kk][1], ka[kk][2], ka[kk][3], db, kk > 0 ? 1u : 0u);
      } else {
        const uint64_t da = desc_at(desc0, Tl::kKOffset + wg_rows + (kk / 4) * Tl::kKVColBlockBytes + in_block);
        mma_ss_kmajor<M>(st, da, db, kk > 0 ? 1u : 0u);
      }
    }
    wgmma_commit();
    mbar_wait_no_trap(do_full(s), parity);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t in_block = (kk % 4) * 32;
      const uint64_t da = desc_at(desc0, Tl::kVOffset + wg_rows + (kk / 4) * Tl::kKVColBlockBytes + in_block);
      const uint64_t db = desc_at(desc0, at_do + (kk / 4) * Tl::kQColBlockBytes + in_block);
      mma_ss_kmajor<M>(dpt, da, db, kk > 0 ? 1u : 0u);
    }
    wgmma_commit();
    wgmma_wait<1>();  // Sᵀ done (dPᵀ may still run)
    fence_operands(st);

    // Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e); lse·log2e is +inf for dead rows, so P = 0 there.
    // Masks: keys >= Tk and, causal, key > query, only in the tiles where some element needs it.
    const float* lse_s = lse_rows + s * M;
    const bool mask = keys_past_end || (kCausal && key_wg + kWgKeys - 1 > m0);
    // Pᵀ over the query columns [8·jj0, 8·jj1), then its bf16 A fragments (pair q = elements 2q, 2q+1).
    uint32_t pa[M / 4], dsa[M / 4];
    // The mask is a pass of its own over the exponentials, run only in the tiles that need it (`mask`
    // is the same for the whole warpgroup): folded into the exp2 loop, the compiler predicated its
    // compares and selects onto every element of every tile (a fifth of the kernel's instructions).
    auto p_columns = [&](const int jj0, const int jj1) {
#pragma unroll
      for (int jj = jj0; jj < jj1; ++jj) {
        const float2 l = *reinterpret_cast<const float2*>(lse_s + 8 * jj + col_lane);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * jj + e;
          st[i] = fast_exp2(fmaf(st[i], p.scale_log2, -((e % 2) ? l.y : l.x)));
        }
      }
      if (mask) {
#pragma unroll
        for (int jj = jj0; jj < jj1; ++jj) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key_lo + 8 * (e / 2);
            const int query = m0 + 8 * jj + col_lane + (e % 2);
            if (key >= p.tk || (kCausal && key > query)) st[4 * jj + e] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int q = 2 * jj0; q < 2 * jj1; ++q) pa[q] = pack_bf16(st[2 * q], st[2 * q + 1]);
    };
    // dV_w += Pᵀ·dO over the queries [16·kk0, 16·kk1): dO is the N-major B operand (rows = queries =
    // the reduction dim, head_dim contiguous), exactly as V in the forward's P·V: LBO = the next
    // column block (64 of head_dim), SBO = the next 8 rows, the k-th step 16 rows = 2048 bytes in.
    auto issue_dv = [&](const int kk0, const int kk1) {
#pragma unroll
      for (int kk = kk0; kk < kk1; ++kk) {
        const uint64_t db = desc_at(desc0, at_do + kk * 16 * kRowBytes, Tl::kQColBlockBytes);
        mma_rs<D>(dv, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], db);
      }
    };
    // Pᵀ in Tl::kExpChunks chunks of the queries, each but the last followed by the issue of its share
    // of dV, so the exp2 of one chunk runs beside the MMAs of the chunk before (header: "The exp2").
    constexpr int C = Tl::kExpChunks, kChunkJJ = M / 8 / C, kChunkKK = M / 16 / C;
    constexpr int kDvEarly = (C - 1) * kChunkKK;  // dV k-steps issued before dSᵀ
#pragma unroll
    for (int c = 0; c < C - 1; ++c) {
      p_columns(c * kChunkJJ, (c + 1) * kChunkJJ);
      wgmma_fence();
      issue_dv(c * kChunkKK, (c + 1) * kChunkKK);
      wgmma_commit();
    }
    p_columns((C - 1) * kChunkJJ, M / 8);
    wgmma_wait<C - 1>();  // dPᵀ done (the early dV groups may still run)
    fence_operands(dpt);

    // dSᵀ = Pᵀ ⊙ (dPᵀ − delta), in place of dPᵀ.
    const float* delta_s = delta_rows + s * M;
#pragma unroll
    for (int jj = 0; jj < M / 8; ++jj) {
      const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * jj + col_lane);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * jj + e;
        dpt[i] = st[i] * (dpt[i] - ((e % 2) ? dl.y : dl.x));
      }
    }

#pragma unroll
    for (int q = 0; q < M / 4; ++q) dsa[q] = pack_bf16(dpt[2 * q], dpt[2 * q + 1]);

    // The rest of dV, and dK_w += dSᵀ·Q over the tile's queries in steps of 16 (Q N-major, as dO).
    wgmma_fence();
    issue_dv(kDvEarly, M / 16);
#pragma unroll
    for (int kk = 0; kk < M / 16; ++kk) {
      const uint64_t db = desc_at(desc0, at_q + kk * 16 * kRowBytes, Tl::kQColBlockBytes);
      mma_rs<D>(dk, dsa[4 * kk], dsa[4 * kk + 1], dsa[4 * kk + 2], dsa[4 * kk + 3], db);
    }
    wgmma_commit();

    // dSᵀ into shared memory as the M-major A operand of dQ = dS·K: per 64 queries a block of 128
    // key rows of 128 bytes (64 queries), 128-byte swizzled (chunk c of row r at chunk c ^ (r % 8)).
    // Pair q of a lane holds key row key_row + 8·(q % 2), queries 8·(q/2) + col_lane + {0, 1}: for the
    // warp, pair q is the 8 × 8 matrix of keys 16·warp + 8·(q % 2) + [0, 8) (in the warpgroup's 64) and
    // queries 8·(q/2) + [0, 8), one 16-byte chunk of each of its 8 key rows. stmatrix stores four such
    // matrices (pairs 4j .. 4j + 3) in one instruction: lane t gives the row t % 8 of matrix t / 8, i.e.
    // key row stm_row (below) and query group g = 2j + t / 16. The swizzle puts a matrix's 8 rows in
    // distinct banks.
    const uint32_t ds_buf = sDs(step % Tl::kDsBuffers);
    {
      const int stm_row = kWgKeys * cw + 16 * warp + 8 * ((lane / 8) % 2) + lane % 8;  // % 8 == lane % 8
      const uint32_t row_addr = ds_buf + stm_row * kRowBytes;
#pragma unroll
      for (int j = 0; j < M / 16; ++j) {
        const int g = 2 * j + lane / 16;  // the matrix's query group of 8
        const uint32_t addr = row_addr + (g / 8) * Tl::kDsBlockBytes + (((g % 8) ^ (lane % 8)) << 4);
        stmatrix_x4(addr, dsa[4 * j], dsa[4 * j + 1], dsa[4 * j + 2], dsa[4 * j + 3]);
      }
    }
    fence_proxy_async_shared();
    // The dQ staging buffer's last reduction (issued at the end of the previous step) has read it
    // before anyone passes this barrier and writes it again.
    if (!Tl::kDqWriter && t == 0) bulk_wait_read_all();
    named_barrier_sync(kDsBarrier, kConsumerThreads);

    // dQ sub-block = dS·K over the 128 keys in steps of 16 (2048 bytes of dS rows and of K rows):
    // A = dS M-major (SBO = the next 8 keys; one 64-query block, so LBO is unused), B = K N-major
    // (as V in the forward). head_dim 64: warpgroup w takes query rows 64w.. (dS block w, all of K's
    // one column block); head_dim 128: all 64 query rows (dS block 0), K's column block w.
    float dq[Tl::kDqFloats];
    const uint32_t at_ds =
        Tl::kDsOffset + (step % Tl::kDsBuffers) * Tl::kDsBytes + (D == 64 ? cw * Tl::kDsBlockBytes : 0);
    const uint32_t at_k = Tl::kKOffset + (D == 64 ? 0 : cw * Tl::kKVColBlockBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint64_t da = desc_at(desc0, at_ds + kk * 16 * kRowBytes, Tl::kDsBlockBytes);
      const uint64_t db = desc_at(desc0, at_k + kk * 16 * kRowBytes, Tl::kKVColBlockBytes);
      wgmma_m64n64k16_ss<1, 1>(dq, da, db, kk > 0 ? 1u : 0u);
    }
    wgmma_commit();
    wgmma_wait<0>();  // dV, dK and dQ done: stage s's Q and dO, and dS buffer, are no longer read
    fence_operands(dv);
    fence_operands(dk);
    fence_operands(dq);
    mbar_arrive(empty(s));

    // dQ sub-block into the f32 accumulator (fragment order; header comment).
    // The sub-block into this warpgroup's staging buffer (the accumulator's own order, so one
    // contiguous 16 KB bulk reduction adds it), then thread 0 issues that once every store is in.
    // With a writer warp: the buffer is free once the writer says so (after the first step); the
    // stores go in and the warpgroup arrives without waiting for the reduction to be issued.
    const uint32_t stage = smem + Tl::kDqStageOffset + cw * Tl::kDqStageBytes;
    if constexpr (Tl::kDqWriter) {
      if (step > 0) named_barrier_sync(kDqEmptyBarrier + cw, kDqWriterBarrierThreads);
    }
#pragma unroll
    for (int j = 0; j < Tl::kDqFloats / 4; ++j)
      st_shared_v4(stage + 16u * t + 2048u * j, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
    fence_proxy_async_shared();
    if constexpr (Tl::kDqWriter) {
      named_barrier_arrive(kDqFullBarrier + cw, kDqWriterBarrierThreads);
    } else {
      named_barrier_sync(kDqStageBarrier + cw, 128);
      if (t == 0) {
        float* const acc = p.dq_accum + (static_cast<int64_t>(head) * p.num_q_tiles + m) * Tl::kDqTileFloats +
                           cw * kDqSubFloats;
        bulk_reduce_add_f32(acc, stage, Tl::kDqStageBytes);
        bulk_commit_group();
      }
    }
  }
  // The last reduction has completed (read its source, written the accumulator) before the CTA leaves
  // (with a writer warp, the writer waits for it).
  if (!Tl::kDqWriter && t == 0) bulk_wait_all();

  // ---- epilogue: dK = scale · Σ dSᵀ·Q, dV = Σ Pᵀ·dO for this warpgroup's keys ----
  char* const dk_base = static_cast<char*>(p.dk);
  char* const dv_base = static_cast<char*>(p.dv);
  const int dk_elem = p.dk_f32 ? 4 : 2, dv_elem = p.dv_f32 ? 4 : 2;
#pragma unroll
  for (int i = 0; i < Tl::kKVFloats; i += 2) {
    const int64_t key = key_lo + 8 * ((i / 2) % 2);
    if (key >= p.tk) continue;
    const int64_t col = 8 * (i / 4) + col_lane;
    put_pair(dk_base + (key * p.dk_ts + kv_head * p.dk_hs + col) * dk_elem, p.dk_f32, p.accumulate,
             dk[i] * p.scale, dk[i + 1] * p.scale);
    put_pair(dv_base + (key * p.dv_ts + kv_head * p.dv_hs + col) * dv_elem, p.dv_f32, p.accumulate, dv[i],
             dv[i + 1]);
  }
#endif  // LT_HOPPER_DEVICE_CODE
}

// dst[0] (+)= x (and dst[1] (+)= y with kPair), f32 or bf16.
template <class Out, bool kPair>
__device__ __forceinline__ void put_dq(Out* dst, float x, float y, bool accumulate) {
  if constexpr (std::is_same_v<Out, float>) {
    if constexpr (kPair) {
      float2* p2 = reinterpret_cast<float2*>(dst);
      if (accumulate) {
        const float2 old = *p2;
        x += old.x;
        y += old.y;
      }
      *p2 = make_float2(x, y);
    } else {
      *dst = accumulate ? *dst + x : x;
    }
  } else {
    if constexpr (kPair) {
      __nv_bfloat162* p2 = reinterpret_cast<__nv_bfloat162*>(dst);
      if (accumulate) {
        const float2 old = __bfloat1622float2(*p2);
        x += old.x;
        y += old.y;
      }
      *p2 = __floats2bfloat162_rn(x, y);
    } else {
      *dst = __float2bfloat16_rn(accumulate ? __bfloat162float(*dst) + x : x);
    }
  }
}

// dq[row, head, :] (+)= scale · accumulator, one thread per float4 of the accumulator (reads
// coalesced), inverting the fragment order: float4 (w, j, t) of tile (head, m) holds, for the 64 × 64
// sub-block w, rows r = 16·(t/32) + (t%32)/4 and r + 8, columns c = 8j + 2·(t%4) and c + 1.
template <int D, class Out>
__global__ void dq_from_accum_kernel(Out* dq, int64_t dq_ts, int64_t dq_hs, const float* __restrict__ acc, int tq,
                                     int num_q_tiles, int64_t total_float4, float scale, bool accumulate) {
  constexpr int M = BwdTiles<D>::kBlockM;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total_float4) return;
  constexpr int kTileFloat4 = M * D / 4;
  const int64_t tile = idx / kTileFloat4;
  const int rem = static_cast<int>(idx % kTileFloat4);
  const int w = rem / (kDqSubFloats / 4), j = (rem / 128) % 8, t = rem % 128;
  const int head = static_cast<int>(tile / num_q_tiles), m = static_cast<int>(tile % num_q_tiles);
  const float4 v = reinterpret_cast<const float4*>(acc)[idx];
  const int r = 16 * (t / 32) + (t % 32) / 4, c = 8 * j + 2 * (t % 4);
  // head_dim 64: sub-block w is query rows 64w..; head_dim 128: columns 64w..
  const int row0 = m * M + (D == 64 ? kDqSub * w : 0) + r;
  const int col = (D == 64 ? 0 : kDqSub * w) + c;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + 8 * h;
    if (row >= tq) continue;
    put_dq<Out, true>(dq + row * dq_ts + head * dq_hs + col, scale * (h ? v.z : v.x), scale * (h ? v.w : v.y),
                      accumulate);
  }
}

// The same conversion, one 64 × 64 sub-block per CTA staged in shared memory so that the writes go
// out as whole rows: dq_from_accum_kernel's threads write 2 elements of each of 2 rows, 4 bytes (bf16)
// per 16-byte stretch of a row, so every 32-byte sector of dq is written by four separate stores,
// and ncu measured it at 256 µs for 403 MB (head dim 128, 16K tokens, 32 heads; H100) where cuDNN's
// convert_dq moves 389 MB in 140 µs (bench/results/attention-bwd-kernels-ncu-h100-2026-12-07.json).
// Here a warp's 16 lanes write one row's 64 elements contiguously (8 bytes each in bf16, 16 in f32).
// Needs dq's base and strides aligned to those 8 / 16 bytes (launch_dq checks; else the kernel above).
// Shared-memory rows of 72 floats: the fragment stores (8 rows × 4 float2 per warp) then fill each
// bank twice, the minimum for 256 bytes, and the row reads are contiguous.
constexpr int kDqStageRow = kDqSub + 8;
constexpr int kDqTiledThreads = 256;

template <int D, class Out>
__global__ void __launch_bounds__(kDqTiledThreads)
    dq_from_accum_tiled_kernel(Out* dq, int64_t dq_ts, int64_t dq_hs, const float* __restrict__ acc, int tq,
                               int num_q_tiles, float scale, bool accumulate) {
  constexpr int M = BwdTiles<D>::kBlockM;
  __shared__ float tile[kDqSub][kDqStageRow];
  const int64_t sub = blockIdx.x;  // (head, m, w): sub-block w of tile (head, m)
  const int w = static_cast<int>(sub % 2);
  const int64_t tile_index = sub / 2;
  const int head = static_cast<int>(tile_index / num_q_tiles), m = static_cast<int>(tile_index % num_q_tiles);
  const float4* src = reinterpret_cast<const float4*>(acc + sub * kDqSubFloats);
#pragma unroll
  for (int k = 0; k < kDqSubFloats / 4 / kDqTiledThreads; ++k) {
    const int i = k * kDqTiledThreads + static_cast<int>(threadIdx.x);  // float4 (j, t) = j·128 + t
    const int j = i / 128, t = i % 128;
    const float4 v = src[i];
    const int r = 16 * (t / 32) + (t % 32) / 4, c = 8 * j + 2 * (t % 4);
    *reinterpret_cast<float2*>(&tile[r][c]) = make_float2(v.x, v.y);
    *reinterpret_cast<float2*>(&tile[r + 8][c]) = make_float2(v.z, v.w);
  }
  __syncthreads();
  // head_dim 64: sub-block w is query rows 64w..; head_dim 128: columns 64w..
  const int row_base = m * M + (D == 64 ? kDqSub * w : 0);
  const int col_base = D == 64 ? 0 : kDqSub * w;
#pragma unroll
  for (int k = 0; k < kDqSubFloats / 4 / kDqTiledThreads; ++k) {
    const int i = k * kDqTiledThreads + static_cast<int>(threadIdx.x);  // row i / 16, float4 i % 16 of it
    const int r = i / 16, c = 4 * (i % 16);
    const int64_t row = row_base + r;
    if (row >= tq) continue;
    const float4 v = *reinterpret_cast<const float4*>(&tile[r][c]);
    float x[4] = {scale * v.x, scale * v.y, scale * v.z, scale * v.w};
    Out* dst = dq + row * dq_ts + head * dq_hs + col_base + c;
    if constexpr (std::is_same_v<Out, float>) {
      float4* d4 = reinterpret_cast<float4*>(dst);
      if (accumulate) {
        const float4 old = *d4;
        x[0] += old.x;
        x[1] += old.y;
        x[2] += old.z;
        x[3] += old.w;
      }
      *d4 = make_float4(x[0], x[1], x[2], x[3]);
    } else {
      uint2* d2 = reinterpret_cast<uint2*>(dst);
      if (accumulate) {
        const uint2 old = *d2;
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old.y));
        x[0] += a.x;
        x[1] += a.y;
        x[2] += b.x;
        x[3] += b.y;
      }
      const __nv_bfloat162 lo = __floats2bfloat162_rn(x[0], x[1]), hi = __floats2bfloat162_rn(x[2], x[3]);
      uint2 out;
      out.x = *reinterpret_cast<const uint32_t*>(&lo);
      out.y = *reinterpret_cast<const uint32_t*>(&hi);
      *d2 = out;
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------------

int block_m(int64_t head_dim) { return head_dim == 64 ? BwdTiles<64>::kBlockM : BwdTiles<128>::kBlockM; }

template <int D, bool kCausal>
void launch_bwd(const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const CUtensorMap& mdo,
                const BwdParams& p, int kv_heads, int kv_tiles) {
  auto* kernel = hopper_attention_bwd_kernel<D, kCausal>;
  static_assert(4 * sizeof(CUtensorMap) + sizeof(BwdParams) <= 4096,
                "the kernel's parameters (BwdParams::ascending included) fit the classic 4 KB limit");
  constexpr uint32_t smem_bytes = BwdTiles<D>::kSmemBytes;
  static const bool configured = [kernel] {
    LT_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(kv_heads), static_cast<unsigned>(kv_tiles));
  kernel<<<grid, kThreads, smem_bytes, cuda_stream()>>>(mq, mk, mv, mdo, p);
  LT_CUDA_LAUNCH_CHECK("hopper_attention_bwd_kernel");
}


// dq (+)= scale · the accumulator: by whole rows (dq_from_accum_tiled_kernel) where dq's base and
// strides allow its 8-byte (bf16) / 16-byte (f32) stores, else in element pairs.
template <int D>
void launch_dq(const OutView& dq, const float* acc, int tq, int hq, int num_q_tiles, float scale, bool accumulate) {
  static_assert(BwdTiles<D>::kDqTileFloats == 2 * kDqSubFloats, "dQ tile = two 64 × 64 sub-blocks");
  const size_t store_bytes = dq.f32 ? 16 : 8, elem_bytes = dq.f32 ? 4 : 2;
  const bool rows_aligned = reinterpret_cast<uintptr_t>(dq.data) % store_bytes == 0 &&
                            (dq.token_stride * elem_bytes) % store_bytes == 0 &&
                            (dq.head_stride * elem_bytes) % store_bytes == 0;
  if (rows_aligned && dq_convert() == DqConvert::rows) {
    const unsigned blocks = static_cast<unsigned>(static_cast<int64_t>(hq) * num_q_tiles * 2);
    auto go = [&](auto* kernel, auto* out) {
      kernel<<<blocks, kDqTiledThreads, 0, cuda_stream()>>>(out, dq.token_stride, dq.head_stride, acc, tq,
                                                             num_q_tiles, scale, accumulate);
    };
    if (dq.f32) {
      go(dq_from_accum_tiled_kernel<D, float>, static_cast<float*>(dq.data));
    } else {
      go(dq_from_accum_tiled_kernel<D, __nv_bfloat16>, static_cast<__nv_bfloat16*>(dq.data));
    }
    LT_CUDA_LAUNCH_CHECK("dq_from_accum_tiled_kernel");
    return;
  }
  const int64_t total = static_cast<int64_t>(hq) * num_q_tiles * BwdTiles<D>::kDqTileFloats / 4;
  constexpr int kBlock = 256;
  const unsigned blocks = static_cast<unsigned>((total + kBlock - 1) / kBlock);
  auto go = [&](auto* kernel, auto* out) {
    kernel<<<blocks, kBlock, 0, cuda_stream()>>>(out, dq.token_stride, dq.head_stride, acc, tq, num_q_tiles, total,
                                                 scale, accumulate);
  };
  if (dq.f32) {
    go(dq_from_accum_kernel<D, float>, static_cast<float*>(dq.data));
  } else {
    go(dq_from_accum_kernel<D, __nv_bfloat16>, static_cast<__nv_bfloat16*>(dq.data));
  }
  LT_CUDA_LAUNCH_CHECK("dq_from_accum_kernel");
}

// An output written in element pairs: aligned to a pair, even strides.
std::string check_grad(const OutView& g, const char* name, int64_t tokens, int64_t heads, int64_t dim) {
  if (g.tokens != tokens || g.heads != heads || g.dim != dim)
    return fmt::format("{} [{}, {}, {}] must be [{}, {}, {}]", name, g.tokens, g.heads, g.dim, tokens, heads, dim);
  const size_t pair_bytes = g.f32 ? 8 : 4;
  if (g.data == nullptr || reinterpret_cast<uintptr_t>(g.data) % pair_bytes != 0 || g.token_stride % 2 != 0 ||
      g.head_stride % 2 != 0)
    return fmt::format("{} needs a {}-byte aligned base and even strides (it is written in element pairs), got {} "
                       "with strides {}, {}",
                       name, pair_bytes, g.data, g.token_stride, g.head_stride);
  return {};
}

std::string check_stats(const StatsView& s, const char* name, int64_t tokens, int64_t heads) {
  if (s.data == nullptr || s.tokens != tokens || s.heads != heads)
    return fmt::format("{} must be [{}, {}], got [{}, {}]{}", name, tokens, heads, s.tokens, s.heads,
                       s.data == nullptr ? " without data" : "");
  return {};
}

}  // namespace

DqConvert parse_dq_convert(const std::string& name, const char* source) {
  if (name == "rows") return DqConvert::rows;
  if (name == "pairs") return DqConvert::pairs;
  throw Error(fmt::format("{}: the hopper backward's dQ conversion must be rows or pairs, got '{}'", source, name));
}

const char* dq_convert_name(DqConvert convert) { return convert == DqConvert::rows ? "rows" : "pairs"; }

namespace {
// A process-wide switch (one per enum and parser): the environment variable's value when first read,
// else `fallback`; a setter changes it for the process.
template <class E, E (*Parse)(const std::string&, const char*)>
std::atomic<E>& setting_from_env(const char* env, E fallback) {
  static std::atomic<E> setting{[&] {
    const char* value = std::getenv(env);
    return value && *value ? Parse(value, env) : fallback;
  }()};
  return setting;
}

std::atomic<DqConvert>& dq_convert_setting() {
  return setting_from_env<DqConvert, parse_dq_convert>("LONGTRAIN_HOPPER_DQ_CONVERT", DqConvert::rows);
}
}  // namespace

DqConvert dq_convert() { return dq_convert_setting().load(); }
void set_dq_convert(DqConvert convert) { dq_convert_setting().store(convert); }

size_t backward_dq_accum_bytes(int64_t tq, int64_t q_heads, int64_t head_dim) {
  const int64_t m = block_m(head_dim);
  return static_cast<size_t>((tq + m - 1) / m * m * q_heads * head_dim) * sizeof(float);
}

std::string backward_unsupported_reason(const OutView& dq, const OutView& dk, const OutView& dv, const View& q,
                                        const View& k, const View& v, const View& d_o, const StatsView& lse,
                                        bool causal) {
  if (!host::sm90_device()) return "the hopper attention kernel needs an sm_90 (H100/H200) GPU";
  if (q.dim != 64 && q.dim != 128) return fmt::format("head_dim must be 64 or 128, got {}", q.dim);
  if (k.dim != q.dim || v.dim != q.dim || d_o.dim != q.dim)
    return fmt::format("q, k, v and d_o must share head_dim, got {}, {}, {}, {}", q.dim, k.dim, v.dim, d_o.dim);
  if (k.heads <= 0 || q.heads % k.heads != 0 || v.heads != k.heads)
    return fmt::format("q heads {} must be a multiple of k/v heads {} / {}", q.heads, k.heads, v.heads);
  if (q.tokens <= 0 || k.tokens <= 0)
    return fmt::format("needs at least one query and one key, got Tq = {}, Tk = {}", q.tokens, k.tokens);
  if (v.tokens != k.tokens) return fmt::format("k and v must have as many tokens, got {} and {}", k.tokens, v.tokens);
  if (d_o.tokens != q.tokens || d_o.heads != q.heads)
    return fmt::format("d_o [{}, {}] must have q's tokens and heads [{}, {}]", d_o.tokens, d_o.heads, q.tokens,
                       q.heads);
  if (causal && q.tokens != k.tokens)
    return fmt::format("a causal block needs Tq == Tk, got {} and {}", q.tokens, k.tokens);
  // Grid: kv heads × key tiles (y <= 65535); int32 row indices in the kernels.
  if (k.tokens > int64_t{65535} * kBlockN || q.tokens > (int64_t{1} << 30) || k.heads > 65535)
    return fmt::format("Tq {} / Tk {} / kv heads {} too large for one call", q.tokens, k.tokens, k.heads);
  for (const auto& [view, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}, std::pair{&d_o, "d_o"}}) {
    std::string why = host::check_tma_input(*view, name);
    if (!why.empty()) return why;
  }
  for (const auto& [g, name, t, h] : {std::tuple{&dq, "dq", q.tokens, q.heads}, std::tuple{&dk, "dk", k.tokens, k.heads},
                                      std::tuple{&dv, "dv", k.tokens, k.heads}}) {
    std::string why = check_grad(*g, name, t, h, q.dim);
    if (!why.empty()) return why;
  }
  return check_stats(lse, "lse", q.tokens, q.heads);
}

BwdOrder parse_bwd_order(const std::string& name, const char* source) {
  if (name == "model") return BwdOrder::model;
  if (name == "descending") return BwdOrder::descending;
  if (name == "ascending") return BwdOrder::ascending;
  throw Error(
      fmt::format("{}: the hopper backward's step order must be model, descending or ascending, got '{}'", source, name));
}

const char* bwd_order_name(BwdOrder order) {
  switch (order) {
    case BwdOrder::model: return "model";
    case BwdOrder::descending: return "descending";
    case BwdOrder::ascending: return "ascending";
  }
  return "?";
}

namespace {
std::atomic<BwdOrder>& bwd_order_setting() {
  return setting_from_env<BwdOrder, parse_bwd_order>("LONGTRAIN_HOPPER_BWD_ORDER", BwdOrder::model);
}

// The CTAs' work in launch order (the kernel's first lines): key tiles from 0, each CTA's work its
// steps (the query tiles that meet its keys times the group's query heads) plus one for loading K/V
// and storing dK/dV.
std::vector<int64_t> bwd_tile_work(int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   bool causal) {
  const int64_t m = block_m(head_dim), q_tiles = (tq + m - 1) / m, kv_tiles = (tk + kBlockN - 1) / kBlockN;
  const int64_t group = q_heads / kv_heads;
  std::vector<int64_t> work(static_cast<size_t>(kv_tiles));
  for (int64_t n = 0; n < kv_tiles; ++n)
    work[static_cast<size_t>(n)] = 1 + (q_tiles - (causal ? n * kBlockN / m : 0)) * group;
  return work;
}

// BwdParams::ascending for a launch: under BwdOrder::model the CTAs host::streamed_ctas picks from the
// section model's start times (computed once per shape and section on this device); every CTA or none
// under the other orders. Without a causal mask every CTA meets every query tile and they all start
// together, so the order stays descending.
void set_step_directions(BwdParams& p, int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                         bool causal) {
  std::fill(std::begin(p.ascending), std::end(p.ascending), 0u);
  const BwdOrder order = bwd_order();
  if (!causal || order == BwdOrder::descending) return;
  if (order == BwdOrder::ascending) {
    std::fill(std::begin(p.ascending), std::end(p.ascending), ~0u);
    return;
  }
  const int slots = host::sm_count();
  static host::Memo<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int>, std::vector<uint32_t>> cache;
  const std::vector<uint32_t> bits = cache.get({tq, tk, q_heads, kv_heads, head_dim, p.section, slots}, [&] {
    const std::vector<int64_t> work = bwd_tile_work(tq, tk, q_heads, kv_heads, head_dim, causal);
    const std::vector<int64_t> starts = host::launch_starts(work, 1, kv_heads, p.section, slots);
    // Neighbouring key tiles' CTAs in a stream start one key tile's query tiles (times the group's
    // heads) apart: starts within half of that count as one (host::streamed_ctas).
    const int64_t stream_gap = kBlockN / block_m(head_dim) * (q_heads / kv_heads);
    const std::vector<bool> streamed = host::streamed_ctas(starts, stream_gap / 2);
    std::vector<uint32_t> words(kOrderBits / 32, 0u);
    for (size_t w = 0; w < streamed.size() && w < static_cast<size_t>(kOrderBits); ++w)
      if (streamed[w]) words[w / 32] |= 1u << (w % 32);
    return words;
  });
  std::copy(bits.begin(), bits.end(), std::begin(p.ascending));
}
}  // namespace

BwdOrder bwd_order() { return bwd_order_setting().load(); }
void set_bwd_order(BwdOrder order) { bwd_order_setting().store(order); }

int bwd_kv_heads_per_section(int64_t tq, int64_t tk, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool causal) {
  if (const int asked = host::section_from_env("LONGTRAIN_HOPPER_BWD_SECTION", kv_heads); asked > 0) return asked;
  LT_CHECK(tq > 0 && tk > 0 && kv_heads > 0 && q_heads % kv_heads == 0,
           "hopper attention backward: Tq {}, Tk {}, q heads {}, kv heads {} give no launch order", tq, tk, q_heads,
           kv_heads);
  return host::cached_section_for_tail("bwd", bwd_tile_work(tq, tk, q_heads, kv_heads, head_dim, causal), 1, kv_heads);
}

void backward(const OutView& dq, const OutView& dk, const OutView& dv, const View& q, const View& k, const View& v,
              const View& d_o, const StatsView& lse, const StatsView& delta, bool causal, float scale,
              bool accumulate, int kv_heads_per_section) {
  std::string why = backward_unsupported_reason(dq, dk, dv, q, k, v, d_o, lse, causal);
  if (why.empty()) why = check_stats(delta, "delta", q.tokens, q.heads);
  LT_CHECK(why.empty(), "hopper attention backward: {}", why);
  LT_CHECK(scale > 0.0f && std::isfinite(scale), "hopper attention backward: scale must be positive and finite, got {}",
           scale);
  const int M = block_m(q.dim);
  const CUtensorMap mq = host::tile_map(q, M, "q"), mdo = host::tile_map(d_o, M, "d_o");
  const CUtensorMap mk = host::tile_map(k, kBlockN, "k"), mv = host::tile_map(v, kBlockN, "v");

  BwdParams p{};
  p.lse = lse.data;
  p.lse_ts = lse.token_stride;
  p.lse_hs = lse.head_stride;
  p.delta = delta.data;
  p.delta_ts = delta.token_stride;
  p.delta_hs = delta.head_stride;
  p.dk = dk.data;
  p.dk_ts = dk.token_stride;
  p.dk_hs = dk.head_stride;
  p.dk_f32 = dk.f32;
  p.dv = dv.data;
  p.dv_ts = dv.token_stride;
  p.dv_hs = dv.head_stride;
  p.dv_f32 = dv.f32;
  p.accumulate = accumulate;
  p.tq = static_cast<int>(q.tokens);
  p.tk = static_cast<int>(k.tokens);
  p.group = static_cast<int>(q.heads / k.heads);
  p.kv_heads = static_cast<int>(k.heads);
  p.section = kv_heads_per_section > 0
                  ? std::min(kv_heads_per_section, p.kv_heads)
                  : bwd_kv_heads_per_section(q.tokens, k.tokens, q.heads, k.heads, q.dim, causal);
  p.num_q_tiles = static_cast<int>((q.tokens + M - 1) / M);
  set_step_directions(p, q.tokens, k.tokens, q.heads, k.heads, q.dim, causal);
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;

  // The f32 dQ accumulator, zeroed on the stream before the kernel adds into it.
  const size_t acc_bytes = backward_dq_accum_bytes(q.tokens, q.heads, q.dim);
  p.dq_accum = static_cast<float*>(cuda_util::scratch(cuda_util::Scratch::attn_dq_accum, acc_bytes));
  LT_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0, acc_bytes, cuda_stream()));

  const int hkv = static_cast<int>(k.heads), kv_tiles = static_cast<int>((k.tokens + kBlockN - 1) / kBlockN);
  const int hq = static_cast<int>(q.heads);
  if (q.dim == 64) {
    if (causal) {
      launch_bwd<64, true>(mq, mk, mv, mdo, p, hkv, kv_tiles);
    } else {
      launch_bwd<64, false>(mq, mk, mv, mdo, p, hkv, kv_tiles);
    }
    launch_dq<64>(dq, p.dq_accum, p.tq, hq, p.num_q_tiles, scale, accumulate);
  } else {
    if (causal) {
      launch_bwd<128, true>(mq, mk, mv, mdo, p, hkv, kv_tiles);
    } else {
      launch_bwd<128, false>(mq, mk, mv, mdo, p, hkv, kv_tiles);
    }
    launch_dq<128>(dq, p.dq_accum, p.tq, hq, p.num_q_tiles, scale, accumulate);
  }
}

}  // namespace longtrain::attn::hopper
