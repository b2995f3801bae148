// SequenceAttention: the attention of one layer over this rank's token shard, as the model sees it.
// The model hands it Q, K, V of its local tokens (RoPE already applied with global positions) and
// gets back the final O and LSE of those tokens over the whole sequence. A single rank computes one
// block; the distributed schedules (ring, zigzag, distflash, burst) implement the same interface and
// communicate inside it. Counters let tests and the step log see how often attention really ran
// (remat_aware must run the forward once per step, full twice).
#pragma once

#include <cstdint>
#include <utility>

#include "attention/document_mask.h"
#include "attention/local_attention.h"
#include "runtime/arena.h"

namespace longtrain::attn {

struct AttentionCounters {
  int64_t forward_calls = 0;   // SequenceAttention::forward calls (one per layer per forward)
  int64_t backward_calls = 0;
  int64_t bytes_sent = 0;      // by this rank, counted by the distributed schedules
  // The attention work this rank did, forward and backward together: query-key pairs its block calls
  // covered (with a document mask: only the pairs really computed), host seconds inside forward and
  // backward, and the part of them spent in block calls (the rest is packing and waiting for
  // transfers). On the CPU the calls are synchronous, so 1 - compute / wall is the rank's measured
  // idle fraction; on CUDA the calls are only queued and the seconds are not the device's.
  int64_t pairs = 0;
  double wall_seconds = 0.0;
  double compute_seconds = 0.0;
};

class SequenceAttention {
 public:
  virtual ~SequenceAttention() = default;

  // q [T, Hq, D], k/v [T, Hkv, D]: this rank's tokens. Writes o [T, Hq, D] and lse [T, Hq].
  virtual void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) = 0;
  // From the forward's o and lse and the output gradient d_o: writes dq, dk, dv (overwrites every
  // element; the caller need not zero them). They are views into one fused dQKV buffer, which one
  // rank's attention (LocalSequenceAttention) fills in place on CUDA, with no scratch copy.
  virtual void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                        Tensor d_o) = 0;

  // The documents of the window the next forward/backward calls belong to (document_mask.h), in
  // global token coordinates of the whole sequence; empty (the default) = no document mask. The model
  // sets them once per shard, before its first layer; every rank of a group sets the same ones.
  void set_documents(Documents documents) { documents_ = std::move(documents); }
  const Documents& documents() const { return documents_; }

  // Whether the caller should store the LSE head-major (a [T, Hq] view with strides (1, rows), over
  // [Hq, rows] storage) on CUDA. cuDNN reads and writes its stats that way faster: on an H200 at 64K
  // tokens, 32 query / 4 KV heads, head dim 64, fwd+bwd took 140.4 ms with head-major stats against
  // 148.5 ms token-major (torch, which keeps them head-major: 140.0 ms). One rank's attention hands
  // the LSE straight to cuDNN; the distributed schedules merge partial results in token-major
  // buffers, so they keep the default.
  virtual bool head_major_lse() const { return false; }

  // The number of calls the backward of a dense (document-free) sequence is split into by kv heads
  // (model.attention_head_groups; a divisor of Hkv, checked at the call). One rank's attention runs
  // each call over Hkv / groups kv heads and their query heads, so the backward's workspace shrinks
  // by that factor; the distributed schedules keep one call (their blocks are shorter already).
  virtual void set_backward_head_groups(int64_t groups) { (void)groups; }
  virtual int64_t backward_head_groups() const { return 1; }

  // Per-layer state. A model whose checkpoint policy keeps every layer's O and LSE and does not run the
  // attention forward again in backward (none, remat_aware; not with offloaded checkpoints) calls
  // keep_forward(n_layers) once, then set_layer(l) before each forward and backward call of layer l.
  // An attention that can reuse what its forward made keeps it per layer (Ulysses: the head-layout
  // Q, K, V, O, LSE, so its backward sends only dO out and dQ, dK, dV back) and says so with
  // keeps_forward(): its backward then reads d_o alone, and q, k, v, o, lse only give the shapes (the
  // model need not recompute Q, K, V for it). The default keeps nothing and reads them all.
  // A forward-only pass (evaluation, generation) sets kNoLayer: nothing is kept for it, so its lengths
  // need not be the training step's and the kept state of the step is not disturbed.
  static constexpr int64_t kNoLayer = -1;
  virtual void keep_forward(int64_t n_layers) { (void)n_layers; }
  virtual bool keeps_forward() const { return false; }
  void set_layer(int64_t layer) { layer_ = layer; }

  // Whether a call without documents queues its work on cuda_stream() alone, with nothing waited for
  // or read back on the host and no other stream: then a CUDA graph can hold it (LlamaModel::
  // set_cuda_graphs). Not the distributed schedules, whose transfers run on communication streams.
  virtual bool graph_capturable() const { return false; }

  AttentionCounters counters;

 protected:
  Documents documents_;
  int64_t layer_ = 0;
};

// One rank holds the whole sequence: a single block, causal or full (with documents: one segmented
// call, a segment per document, written in place). Its backward hands the block
// backward the final O (cuDNN forms delta from it) and GradMode::overwrite, so on CUDA it is one
// cuDNN call writing straight into the dQKV views.
class LocalSequenceAttention final : public SequenceAttention {
 public:
  LocalSequenceAttention(bool causal, double scale) : causal_(causal), scale_(scale) {}
  bool head_major_lse() const override { return true; }
  bool graph_capturable() const override { return true; }
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;
  void set_backward_head_groups(int64_t groups) override;
  int64_t backward_head_groups() const override { return head_groups_; }

 private:
  bool causal_;
  double scale_;
  int64_t head_groups_ = 1;
};

}  // namespace longtrain::attn
