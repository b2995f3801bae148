#include "attention/sequence_attention.h"

#include "runtime/arena.h"

namespace longtrain::attn {

void LocalSequenceAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  attention_block_forward(o, lse, q, k, v, causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
}

void LocalSequenceAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o,
                                      Tensor lse, Tensor d_o) {
  ++counters.backward_calls;
  // delta = rowsum(dO ⊙ O) has the layout and dtype of lse.
  Arena scratch("attention scratch", lse.device);
  scratch.add("delta", {lse.size(0), lse.size(1)}, lse.dtype);
  scratch.allocate();
  Tensor delta = scratch.get("delta");
  attention_delta(delta, o, d_o);
  attention_block_backward(dq, dk, dv, q, k, v, d_o, lse, delta,
                           causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
}

}  // namespace longtrain::attn
