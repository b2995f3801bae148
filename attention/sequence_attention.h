// SequenceAttention: the attention of one layer over this rank's token shard, as the model sees it.
// The model hands it Q, K, V of its local tokens (RoPE already applied with global positions) and
// gets back the final O and LSE of those tokens over the whole sequence. A single rank computes one
// block; the distributed schedules (ring, zigzag, distflash, burst) implement the same interface and
// communicate inside it. Counters let tests and the step log see how often attention really ran
// (remat_aware must run the forward once per step, full twice).
#pragma once

#include <cstdint>

#include "attention/local_attention.h"
#include "runtime/arena.h"

namespace longtrain::attn {

struct AttentionCounters {
  int64_t forward_calls = 0;   // SequenceAttention::forward calls (one per layer per forward)
  int64_t backward_calls = 0;
  int64_t bytes_sent = 0;      // by this rank, counted by the distributed schedules
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

  AttentionCounters counters;
};

// One rank holds the whole sequence: a single block, causal or full. Its backward hands the block
// backward the final O (cuDNN forms delta from it) and GradMode::overwrite, so on CUDA it is one
// cuDNN call writing straight into the dQKV views.
class LocalSequenceAttention final : public SequenceAttention {
 public:
  LocalSequenceAttention(bool causal, double scale) : causal_(causal), scale_(scale) {}
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override;

 private:
  bool causal_;
  double scale_;
};

}  // namespace longtrain::attn
