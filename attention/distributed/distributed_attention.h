// Sequence-parallel attention: one sequence of S tokens split over the P ranks of a sequence-parallel
// (SP) group, each rank holding S/P tokens in the chosen layout (parallel/layout.h), every rank
// getting the exact O and LSE of its tokens over the whole sequence, and the exact dQ, dK, dV.
// Four ring schedules, and Ulysses (below), compute the same function (docs/distributed-attention.md
// describes each):
//
//   ring       K/V rotate around the SP ring (P steps); the dK/dV accumulator of each K/V block
//              follows it on the same ring and comes home after P-1 hops. Causal blocks above the
//              diagonal are skipped, so with the contiguous layout rank r computes r + 1/2 blocks of
//              (S/P)² while rank P-1 computes P - 1/2. Works with either layout; over the zigzag
//              layout it computes exactly the zigzag schedule's blocks.
//   zigzag     the ring over the zigzag layout (2P chunks; rank r holds chunks r and 2P-1-r): every
//              rank computes the same area every step (half a block of (S/P)² when causal).
//   distflash  DistFlashAttn over the contiguous layout: ⌊P/2⌋+1 steps; at step t a rank r >= t
//              fetches K/V of rank r-t directly (point-to-point at distance t, prefetched during
//              step t-1), and a rank that ran out of causal work helps rank r-t+P: it receives that
//              rank's Q (backward: Q, dO, LSE and D), computes against its own K/V and sends the
//              partial (O, LSE) (backward: dQ) back to the owner, which merges it. Backward mirrors
//              it: owners send dK/dV partials back to the K/V's rank. Full attention (causal =
//              false) fetches all P-1 remote K/V blocks the same way (P steps).
//   burst      BurstAttention: forward rotates K/V like ring; backward rotates Q, dO, LSE and
//              D = rowsum(dO ⊙ O) instead, keeps dK/dV local, and sends the dQ accumulator of the
//              visiting Q block along behind it: per hop (3·D + 2)/(4·D) of ring's backward bytes
//              with MHA (0.78 at D = 16, 0.754 at D = 128). With GQA/MQA, Q has more heads than
//              K/V, so burst moves *more* than ring (Hq/Hkv times the Q-side tensors); use ring or
//              zigzag there. Topology-aware double ring when the SP group spans nodes: blocks
//              circulate on the intra-node ring, and each node's blocks move to the next node on
//              the inter-node ring (GPUs with the same local rank) once per intra-node cycle, that
//              transfer hidden behind the whole cycle; the dQ accumulators follow the same route,
//              summed over nodes on the inter-node ring. Same bytes as the single ring.
//              Layout: either. With zigzag it is balanced like zigzag; with contiguous it is correct
//              but causal work is as unbalanced as ring's (rank r does r + 1/2 blocks in forward,
//              P - r - 1/2 in backward), so configs should pair burst with zigzag.
//
//   ulysses    head parallelism (ulysses_attention.h): all-to-all to [S tokens, H/P heads], local
//              attention over the whole sequence, all-to-all back; with `ulysses` / `ulysses_ring` in
//              the spec, any of the four above runs across Ulysses groups (the 2D hybrid). Not a
//              DistributedAttention (it has no steps); the cost model (cost_model.h) gives its bytes.
//
// Common to all: the next step's inputs are posted (Communicator::start_p2p) before the current
// block computes and waited for after it, into spare buffers that persist across calls (allocated
// once per shape); partial O, LSE and the dQ/dK/dV accumulators that cross steps are in the
// accumulator dtype (f32 for bf16 tensors on CUDA; the tensor dtype, f32 or f64, on CPU); K/V travel
// with n_kv_heads, never expanded; blocks are computed by attention/local_attention.h with the mask
// that follows from global chunk indices (block_plan.h), so any layout is exact. A block's own
// partial O is written in o's dtype (what cuDNN writes, bf16 on CUDA) and merged at once into the
// f32 accumulator; it never crosses a step.
//
// Precision on CUDA: cuDNN rounds each block's O and dQ/dK/dV to bf16 before they reach the f32
// merge and accumulators (attention/cuda/local_attention.cu), so an element gets one bf16 rounding
// per block that contributed to it plus the final one, against one for single-GPU attention. At
// P = 2 (1024 tokens, GQA 8/2, head_dim 128; tests/gpu/distributed_attention_gpu_test.cpp) the
// worst error against the f64 reference was 7.9e-3 against single-GPU's 5.3e-3 (max|err|/max|ref|;
// on the same tokens up to 2.7x for dV), all within 4 bf16 ulps.
//
// On CUDA everything is queued on the compute stream and ordered against the NCCL transfers by
// events (parallel/nccl_communicator.h): forward and backward return before the device is done,
// and no call blocks the host (except burst's construction, which agrees on its topology).
//
// Documents (SequenceAttention::set_documents, document_mask.h): every schedule computes only the
// parts of its blocks that lie inside one document (a pair of blocks sharing none is skipped, the
// rest split per document with the mask each part needs), over the same transfers as without them;
// the traces count only the pairs computed. Every rank of the group must set the same documents.
//
// Every rank of the group calls forward/backward for every layer in the same order with the same
// local length T = S/P (what the loader hands out); T must split into the layout's chunks
// (zigzag: T even). The factory validates the schedule/layout pairing before any work.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "attention/distributed/block_plan.h"
#include "attention/sequence_attention.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace longtrain::attn {

enum class Schedule : uint8_t { ring, zigzag, distflash, burst, ulysses };

std::string_view schedule_name(Schedule s);
// "ring", "zigzag", "distflash", "burst" or "ulysses" (ulysses_attention.h); anything else is an error naming the accepted values.
Schedule parse_schedule(std::string_view name);

struct SequenceAttentionSpec {
  Schedule schedule = Schedule::zigzag;
  bool causal = true;
  double scale = 0.0;  // softmax scale (usually 1/sqrt(head_dim)); must be > 0
  SeqLayout layout = SeqLayout::zigzag;
  // The SP group (not owned; must outlive the attention). Null or size 1: one rank holds the whole
  // sequence and the factory returns LocalSequenceAttention.
  parallel::Communicator* sp = nullptr;
  // burst only (ignored by the others): this rank's intra-node and inter-node rings of the SP group
  // (parallel/process_group.h). When both are given, the inter-node ring has more than one member
  // and they tile the SP group as nodes × ranks per node, burst runs the double ring; otherwise (a
  // group inside one node, or a ragged shape) it runs the single ring over `sp`.
  parallel::Communicator* intra_node = nullptr;
  parallel::Communicator* inter_node = nullptr;
  // How the chunk pairs two ranks share become local block calls (block_plan.h).
  ChunkCalls chunk_calls = ChunkCalls::merged;
  // The 2D hybrid (ulysses_attention.h; not owned): with a ring schedule and `ulysses` of more than one
  // rank, Ulysses runs inside `ulysses` (U consecutive SP ranks) and the schedule runs over
  // `ulysses_ring` (the R = P / U ranks at this rank's position in their groups; null or size 1: no
  // ring, Ulysses alone). burst then runs over `ulysses_ring`: its double ring when the two rings of
  // `ulysses_ring` across nodes are given (parallel/process_group.h ulysses_ring_intra_node,
  // ulysses_ring_inter_node), else its single ring. Ignored by schedule ulysses, which is Ulysses over
  // the whole of `sp`.
  parallel::Communicator* ulysses = nullptr;
  parallel::Communicator* ulysses_ring = nullptr;
  parallel::Communicator* ulysses_ring_intra_node = nullptr;
  parallel::Communicator* ulysses_ring_inter_node = nullptr;
};

// Throws longtrain::Error naming the setting and the fix: zigzag needs the zigzag layout, distflash
// the contiguous one; scale > 0; communicators on one device and consistent with each other.
void check_sequence_attention_spec(const SequenceAttentionSpec& spec);

// The attention the model calls for this spec (validated first).
std::unique_ptr<SequenceAttention> make_sequence_attention(const SequenceAttentionSpec& spec);

// What one forward or backward call did, step by step, on this rank: the query-key pairs its block
// calls covered (a causal diagonal block of n rows counts n(n+1)/2) and the bytes it sent. Tests
// check balance and traffic with it; benchmarks turn it into idle fractions.
struct ScheduleStep {
  int64_t pairs = 0;
  int64_t bytes_sent = 0;
};
struct ScheduleTrace {
  // One entry per compute step, plus a trailing one for the transfers after the last step (the
  // accumulators' last hops in a ring backward, distflash's last partial results).
  std::vector<ScheduleStep> steps;
  int64_t pairs() const;
  int64_t bytes_sent() const;
};

// Sees the compute of every schedule step: begin_compute() before its block calls (attention
// kernels, LSE merges, gradient accumulation) are queued and end_compute() after, on the host; not
// around packing, zeroing or waiting for transfers. Benchmarks record CUDA events there to measure
// each rank's busy time (bench/cp_bench.cpp). Neither may throw.
class ComputeObserver {
 public:
  virtual ~ComputeObserver() = default;
  virtual void begin_compute() noexcept = 0;
  virtual void end_compute() noexcept = 0;
};

// The base of the four schedules (schedules.h): the group, the layout and the traces.
class DistributedAttention : public SequenceAttention {
 public:
  Schedule schedule() const { return schedule_; }
  bool causal() const { return causal_; }
  SeqLayout layout() const { return layout_; }
  int sp_size() const { return sp_.size(); }
  int sp_rank() const { return sp_.rank(); }
  // "ring over 'sp0' (4 ranks)", "double ring: 2 nodes x 2 ranks", ... for logs.
  virtual std::string describe() const = 0;

  const ScheduleTrace& last_forward() const { return forward_trace_; }
  const ScheduleTrace& last_backward() const { return backward_trace_; }

  // Not owned; null (the default) observes nothing.
  void set_compute_observer(ComputeObserver* observer) { timing_.next = observer; }

 protected:
  DistributedAttention(Schedule schedule, const SequenceAttentionSpec& spec);

  // Checks the shapes of a forward/backward call (q [T, Hq, D], k/v [T, Hkv, D], T splitting into
  // the layout's chunks, the output dtypes) and returns T. `op` names the call in errors.
  int64_t check_call(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                     const Tensor& lse) const;
  // The block calls of `q_rank`'s queries against `kv_rank`'s keys, T tokens each; with documents
  // (set_documents), only the parts of them inside shared documents (document_block_calls): a pair
  // of ranks whose blocks share no document gets no call.
  std::vector<BlockCall> block_calls(int q_rank, int kv_rank, int64_t T) const {
    return document_block_calls(plan_block_calls(layout_, sp_.size(), T, q_rank, kv_rank, causal_, chunk_calls_),
                                documents_, layout_, sp_.size(), T, q_rank, kv_rank, causal_);
  }
  // Checks the documents against the call (the whole sequence is T · P tokens; CPU only for now).
  void check_call_documents(const Tensor& q, int64_t T) const;
  // Adds a finished forward or backward call to the counters: its bytes and pairs, and (wall) the host
  // seconds since `start`.
  void count_call(const ScheduleTrace& trace, std::chrono::steady_clock::time_point start);

  Schedule schedule_;
  bool causal_;
  double scale_;
  SeqLayout layout_;
  ChunkCalls chunk_calls_;
  parallel::Communicator& sp_;
  ScheduleTrace forward_trace_, backward_trace_;

  // Times every compute step on the host into counters.compute_seconds, then passes it on to the
  // observer set_compute_observer gave (benchmarks: CUDA events).
  struct ComputeTiming final : ComputeObserver {
    AttentionCounters* counters = nullptr;
    ComputeObserver* next = nullptr;
    std::chrono::steady_clock::time_point start;
    void begin_compute() noexcept override {
      start = std::chrono::steady_clock::now();
      if (next) next->begin_compute();
    }
    void end_compute() noexcept override {
      if (next) next->end_compute();
      counters->compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  };
  ComputeTiming timing_;
  ComputeObserver* observer_ = &timing_;  // what the schedules bracket their compute steps with
};

}  // namespace longtrain::attn
