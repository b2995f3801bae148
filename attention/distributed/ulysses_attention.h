// Ulysses (head-parallel) attention and its 2D hybrid with the ring schedules (USP / LoongTrain).
//
// A Ulysses group of U ranks holds U token shards of T tokens each, all heads. An all-to-all turns
// them into U head shards: rank u of the group gets the query heads [u·Hq/U, (u+1)·Hq/U) and the K/V
// heads those read, for all U·T tokens of the group, placed in the order of the sequence (so causal
// masks are right). Attention runs on those heads (`inner`), and a second all-to-all sends each
// rank's O and LSE rows back to the rank that owns the tokens. Backward mirrors it: Q, K, V, O, LSE
// and dO go to the head shards, the inner backward runs there, and dQ, dK, dV come back.
//
// Pure Ulysses (attention.schedule ulysses): the group is the whole SP group, and `inner` is one
// rank's whole-sequence attention (LocalSequenceAttention, documents included).
// Hybrid (parallel.ulysses_size U < sp_size = U·R with a ring schedule): the SP rank p = g·U + u sits
// at position u of Ulysses group g (U consecutive ranks); the ring runs over the R ranks with the same
// u (one per group), each holding H/U heads of its group's tokens. The group's tokens form rank g's
// shard of the same layout over R ranks: contiguous chunks gU..gU+U-1 are chunk g of R; zigzag
// chunks {gU..gU+U-1} ∪ {2P-gU-U..2P-gU-1} are R-zigzag chunks g and 2R-1-g. So the inner schedule
// is the configured ring schedule over R ranks with the same layout, on U·T tokens per rank.
//
// Heads (GQA/MQA): Hq % U == 0; K/V heads are split when U divides Hkv; when U > Hkv (U % Hkv == 0)
// each K/V head goes only to the U/Hkv ranks whose query heads read it, and its dK/dV partials are
// summed back at the owner. Other counts are refused naming model.n_heads, model.n_kv_heads and the
// group size's key.
//
// Traffic per rank and layer, T tokens per rank, h = Hq/U query heads and g = max(Hkv/U, 1) K/V heads
// per member, head_dim D, b bytes per element (LSE: the accumulator dtype's), U-1 peers:
//   forward   (U-1)·T·(h + 2g)·D·b  (Q, K, V out)  +  (U-1)·T·h·(D·b + b_lse)  (O, LSE back)
//   backward  (U-1)·T·((3h + 2g)·D·b + h·b_lse)  (Q, K, V, O, dO, LSE out)  +  (U-1)·T·(h + 2g)·D·b_grad
// plus the inner ring schedule's own traffic (over R ranks, on U·T tokens and h, g heads).
//
// Kept forward (SequenceAttention::keep_forward: the model's policy keeps O and LSE, none or
// remat_aware): each layer's gathered head-layout Q, K, V, O, LSE stay in a slot of their own, so the
// backward sends only dO out and dQ, dK, dV back, and neither the forward all-to-alls nor the inner
// forward (the ring's) run again:
//   backward  (U-1)·T·h·D·b  (dO out)  +  (U-1)·T·(h + 2g)·D·b_grad
// for U·T·((2h + 2g)·D·b + h·b_lse) bytes a layer, the size of the layer's Q, K, V, O and LSE on this
// rank (under remat_aware that about doubles what a layer keeps; ulysses_kept_bytes, in the memory
// plan). Without it (policy full, offloaded checkpoints) the backward's all-to-all carries Q, K, V,
// O, dO and LSE, as above.
//
// Buffers (head-layout tensors, one send and one receive message per peer) persist across calls
// and are reallocated only when the shapes change. Packing and placing are strided copies
// (buffers.h copy_tensor: a CUDA kernel for CUDA tensors).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attention/distributed/buffers.h"
#include "attention/distributed/distributed_attention.h"

namespace longtrain::attn {

// The heads rank `rank` of a Ulysses group of `group_size` gets.
struct UlyssesHeads {
  int64_t q_begin = 0, q_count = 0;
  int64_t kv_begin = 0, kv_count = 0;
};
// Throws naming model.n_heads / model.n_kv_heads / `group_key` when the counts cannot be split.
UlyssesHeads ulysses_heads(int64_t n_heads, int64_t n_kv_heads, int group_size, int rank,
                           const std::string& group_key = "parallel.ulysses_size");
// Same checks, no result (config validation).
void check_ulysses_heads(int64_t n_heads, int64_t n_kv_heads, int group_size,
                         const std::string& group_key = "parallel.ulysses_size");

// Where the T tokens of rank u of Ulysses group g go in the group's gathered U·T tokens: runs of its
// local rows [local_start, +length) at gathered rows [gathered_start, +length). The gathered order is
// rank g's local order in `layout` over R = sp_size / U ranks (the whole sequence in order when R = 1).
struct UlyssesRun {
  int64_t local_start, gathered_start, length;
};
std::vector<UlyssesRun> ulysses_runs(SeqLayout layout, int64_t local_len, int group_size, int ring_size,
                                     int group_index, int member);

// The single-rank pieces of the all-to-all (tested on CUDA against the CPU):
// dst [T, h, D] := src[:, head_begin : head_begin + h, :] (src a strided view, e.g. of fused QKV).
void ulysses_pack_heads(Tensor dst, Tensor src, int64_t head_begin);
// gathered rows of `runs` := from_peer rows (forward: a received head shard into the sequence).
void ulysses_place_rows(Tensor gathered, Tensor from_peer, const std::vector<UlyssesRun>& runs);
// to_peer rows := gathered rows of `runs` (the reverse: a peer's tokens out of the sequence).
void ulysses_pack_rows(Tensor to_peer, Tensor gathered, const std::vector<UlyssesRun>& runs);
// dst[:, head_begin : head_begin + h, :] := (or +=, accumulate) src [T, h, D].
void ulysses_place_heads(Tensor dst, Tensor src, int64_t head_begin, bool accumulate);

class UlyssesAttention final : public SequenceAttention {
 public:
  // `group`: the Ulysses group (not owned); `inner`: the attention over the gathered tokens (owned);
  // `ring_size`/`ring_rank`: R and this group's index g (1, 0 for pure Ulysses). `group_key` names the
  // setting of the group size in errors.
  UlyssesAttention(parallel::Communicator& group, std::unique_ptr<SequenceAttention> inner, SeqLayout layout,
                   int ring_size, int ring_rank, std::string group_key);

  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;
  void keep_forward(int64_t n_layers) override;
  bool keeps_forward() const override { return !kept_.empty(); }

  int group_size() const { return group_.size(); }
  int ring_size() const { return ring_size_; }
  SequenceAttention& inner() { return *inner_; }
  std::string describe() const;
  // Bytes this rank's all-to-alls sent in the last forward / backward (the inner schedule's are in
  // its own counters; counters.bytes_sent has both).
  int64_t last_forward_a2a_bytes() const { return forward_a2a_bytes_; }
  int64_t last_backward_a2a_bytes() const { return backward_a2a_bytes_; }

 private:
  // Heads and runs of every member for this call's shapes.
  void plan(const Tensor& q, const Tensor& k);
  // Runs the inner call with this object's documents, adding its counters to ours.
  template <class F>
  void run_inner(F&& f);
  int64_t exchange(const std::vector<dist::Message>& send, const std::vector<dist::Message>& recv);
  // keep_forward's slot of the current layer (set_layer); `op` names the call in errors.
  dist::MessageSlots& kept_slot(const char* op);

  parallel::Communicator& group_;
  std::unique_ptr<SequenceAttention> inner_;
  SeqLayout layout_;
  int ring_size_, ring_rank_;
  std::string group_key_;
  std::vector<UlyssesHeads> heads_;
  std::vector<std::vector<UlyssesRun>> runs_;
  bool replicated_kv_ = false;
  int64_t forward_a2a_bytes_ = 0, backward_a2a_bytes_ = 0;
  // keep_forward: per layer, the gathered Q, K, V, O, LSE of its last forward (and whether there was one
  // since keep_forward, for the shapes `kept_spec_` records).
  std::vector<std::unique_ptr<dist::MessageSlots>> kept_;
  std::vector<bool> kept_filled_;
  // Forward: packed Q/K/V per peer out and in, the gathered head-layout tensors, O/LSE per peer out
  // and in. Backward: the same with Q, K, V, O, dO, LSE in and dQ, dK, dV back.
  // One slot per member (the own one is copied locally).
  dist::MessageSlots fwd_out_{"ulysses qkv out"}, fwd_in_{"ulysses qkv in"}, fwd_ret_out_{"ulysses o out"},
      fwd_ret_in_{"ulysses o in"};
  dist::MessageSlots bwd_out_{"ulysses backward out"}, bwd_in_{"ulysses backward in"},
      bwd_ret_out_{"ulysses grads out"}, bwd_ret_in_{"ulysses grads in"};
  dist::MessageSlots fwd_gathered_{"ulysses forward gathered"}, bwd_gathered_{"ulysses backward gathered"};
};

// The bytes one layer's kept head-layout Q, K, V, O, LSE take on a member of a Ulysses group of
// `group_size` (T tokens per rank; `elem` Q/K/V/O's dtype, `stat` LSE's): the memory plan's count of
// what keep_forward keeps, laid out as UlyssesAttention allocates it.
size_t ulysses_kept_bytes(int group_size, int64_t tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                          DType elem, DType stat, Device device);

}  // namespace longtrain::attn
