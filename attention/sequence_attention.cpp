#include "attention/sequence_attention.h"

namespace longtrain::attn {

void LocalSequenceAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  attention_block_forward(o, lse, q, k, v, causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
}

void LocalSequenceAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o,
                                      Tensor lse, Tensor d_o) {
  ++counters.backward_calls;
  attention_block_backward(dq, dk, dv, q, k, v, d_o, lse, o, Tensor{},
                           causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_, GradMode::overwrite);
}

}  // namespace longtrain::attn
