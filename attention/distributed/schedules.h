// The four schedules behind make_sequence_attention (distributed_attention.h describes them).
// ring and zigzag share one class (zigzag is the ring over the zigzag layout); burst reuses the ring
// rotation for its forward and rotates the Q side in backward; distflash has its own step loop.
#pragma once

#include <string>

#include "attention/distributed/block_plan.h"
#include "attention/distributed/buffers.h"
#include "attention/distributed/distributed_attention.h"
#include "attention/distributed/ring_rotation.h"

namespace longtrain::attn::dist {

// Scratch of a forward call: one block's partial (O in o's dtype, as the local attention writes
// it; LSE), and the O accumulator (the caller's o when it is in the accumulator dtype, as on CPU; a
// separate f32 buffer for bf16 o on CUDA).
struct ForwardScratch {
  Tensor o_blk, lse_blk;  // [T, Hq, D], [T, Hq]
  Tensor o_acc;           // [T, Hq, D]
};
// Sets o_acc := 0 and lse := -inf (an empty partial).
ForwardScratch prepare_forward(MessageSlots& slots, Tensor o, Tensor lse);
// o := o_acc when they differ.
void finish_forward(const ForwardScratch& s, Tensor o);

// Scratch of a backward call: what the block calls on this rank's own query rows read of the final O,
// D = rowsum(dO ⊙ O) where it is needed, and the gradient accumulators (the caller's dq/dk/dv when
// they are in the accumulator dtype; separate buffers otherwise), zeroed: backward overwrites.
struct BackwardScratch {
  // The caller's o when the block backward reads it directly (o in d_o's dtype: bf16 on CUDA, which
  // cuDNN reads in place with no delta pass); otherwise empty and the own rows use delta.
  Tensor o;               // [T, Hq, D]
  Tensor delta;           // [T, Hq]: computed when it travels (send_delta) or when o is not read
  Tensor dq, dk, dv;      // [T, Hq, D], [T, Hkv, D] x2

  // The (o, delta) pair for block calls on the own query rows: exactly one is non-empty.
  Tensor own_o() const { return o; }
  Tensor own_delta() const { return o.ndim != 0 ? Tensor{} : delta; }
};
// `send_delta`: the schedule sends this rank's Q side (Q, dO, LSE, D) to other ranks (burst, distflash
// with helpers), so D is computed even when the own blocks read O.
BackwardScratch prepare_backward(MessageSlots& slots, Tensor dq, Tensor dk, Tensor dv, Tensor o, Tensor lse,
                                 Tensor d_o, bool send_delta);
// dq/dk/dv := the separate accumulators, when there are any.
void finish_backward(const BackwardScratch& s, Tensor dq, Tensor dk, Tensor dv);

// Brackets one step's block calls for a ComputeObserver (null: nothing).
class ComputeScope {
 public:
  explicit ComputeScope(ComputeObserver* observer) : observer_(observer) {
    if (observer_) observer_->begin_compute();
  }
  ~ComputeScope() {
    if (observer_) observer_->end_compute();
  }
  ComputeScope(const ComputeScope&) = delete;
  ComputeScope& operator=(const ComputeScope&) = delete;

 private:
  ComputeObserver* observer_;
};

// The messages the schedules send: a K/V-shaped pair (K/V in k's dtype, or the dK/dV accumulators in
// the accumulator dtype), and a backward's Q side, Q, dO, LSE and D = rowsum(dO ⊙ O) (so O itself
// never travels).
MessageSpec kv_spec(const Tensor& k, DType dtype);
MessageSpec backward_q_side_spec(const Tensor& q, const Tensor& d_o, DType acc);

// Shapes of a backward call beyond DistributedAttention::check_call's: dq/d_o/o like q, dk/dv like k.
void check_backward_tensors(const char* schedule, Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor o,
                            Tensor d_o);

// One block call of a forward: attn(q rows, k/v rows) into the (o_blk, lse_blk) rows, merged into the
// (o_acc, lse_acc) rows. q, o_*, lse_* are indexed by the call's query range, k/v by its key range.
void forward_call(const BlockCall& call, Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q,
                  Tensor k, Tensor v, double scale);
// One block call of a backward, accumulating into the dq rows and the dk/dv rows. Exactly one of o
// (the final O of the query side) and delta is non-empty (attention_block_backward).
void backward_call(const BlockCall& call, Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                   Tensor lse, Tensor o, Tensor delta, double scale);

// All the calls of one block pair, returning the query-key pairs they cover: one block call each, or,
// when a document mask refined them (`segmented`), grouped into segmented calls (segment_calls), one
// attention_segments_* call per group over the rows the group spans.
int64_t forward_calls(const std::vector<BlockCall>& calls, bool segmented, Tensor o_acc, Tensor lse_acc, Tensor o_blk,
                      Tensor lse_blk, Tensor q, Tensor k, Tensor v, double scale);
int64_t backward_calls(const std::vector<BlockCall>& calls, bool segmented, Tensor dq, Tensor dk, Tensor dv, Tensor q,
                       Tensor k, Tensor v, Tensor d_o, Tensor lse, Tensor o, Tensor delta, double scale);

// ring and zigzag: K/V rotate on the SP ring; backward sends the dK/dV accumulator behind them.
class RingAttention final : public DistributedAttention {
 public:
  RingAttention(Schedule schedule, const SequenceAttentionSpec& spec);
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;
  std::string describe() const override;

 private:
  RingRotation forward_rotation_{"ring forward"}, backward_rotation_{"ring backward"};
  MessageSlots fwd_scratch_{"ring forward scratch"}, bwd_scratch_{"ring backward scratch"};
};

// burst: forward like ring (over the double ring when given); backward rotates Q, dO, LSE, D with the
// dQ accumulator behind them, dK/dV local.
class BurstAttention final : public DistributedAttention {
 public:
  explicit BurstAttention(const SequenceAttentionSpec& spec);
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;
  std::string describe() const override;
  bool uses_double_ring() const { return topology_.is_double(); }

 private:
  RingTopology topology_;
  RingRotation forward_rotation_{"burst forward"}, backward_rotation_{"burst backward"};
  MessageSlots fwd_scratch_{"burst forward scratch"}, bwd_scratch_{"burst backward scratch"};
};

// What rank `rank` of P does at step `step` of DistFlashAttn's schedule: its own diagonal block, an
// owner step (its Q against the K/V of rank `peer`), a helper step (the Q side of rank `peer` against
// its own K/V), or nothing.
struct DistFlashTask {
  enum Kind : uint8_t { idle, own, owner, helper } kind = idle;
  int peer = -1;
};
DistFlashTask distflash_task(int sp_size, bool causal, int rank, int step);
int distflash_steps(int sp_size, bool causal);  // ⌊P/2⌋ + 1 causal, P full attention

// distflash: DistFlashAttn's helper schedule over the contiguous layout.
class DistFlashAttention final : public DistributedAttention {
 public:
  explicit DistFlashAttention(const SequenceAttentionSpec& spec);
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;
  std::string describe() const override;


 private:
  // Forward: this rank's K/V and Q as sent, the K/V or Q received for the next step (two, alternating),
  // the helper's partial (O, LSE) sent back (two, alternating) and the one received.
  MessageSlots fwd_own_kv_{"distflash own kv"}, fwd_own_q_{"distflash own q"}, fwd_kv_in_{"distflash kv in"},
      fwd_q_in_{"distflash q in"}, fwd_res_out_{"distflash partial out"}, fwd_res_in_{"distflash partial in"},
      fwd_scratch_{"distflash forward scratch"};
  // Backward: the same with the Q side being (Q, dO, LSE, D) and the results dK/dV (owner steps) and
  // dQ (helper steps).
  MessageSlots bwd_own_kv_{"distflash backward own kv"}, bwd_own_q_{"distflash backward own q"},
      bwd_kv_in_{"distflash backward kv in"}, bwd_q_in_{"distflash backward q in"},
      bwd_dkv_out_{"distflash dkv out"}, bwd_dq_out_{"distflash dq out"}, bwd_dkv_in_{"distflash dkv in"},
      bwd_dq_in_{"distflash dq in"}, bwd_scratch_{"distflash backward scratch"};
};

}  // namespace longtrain::attn::dist
