#include "attention/sequence_attention.h"


namespace longtrain::attn {

void LocalSequenceAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  attention_block_forward(o, lse, q, k, v, causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
}

void LocalSequenceAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o,
                                      Tensor lse, Tensor d_o) {
  ++counters.backward_calls;
  // delta = rowsum(dO ⊙ O) has the layout and dtype of lse. Its buffer lives across calls (one
  // allocation per model, not one per layer and step) and is replaced only when it is too small.
  const int64_t rows = lse.size(0), heads = lse.size(1);
  if (!delta_.allocated() || delta_.device() != lse.device || delta_.table()[0].dtype != lse.dtype ||
      delta_.table()[0].numel < rows * heads) {
    delta_ = Arena("attention delta", lse.device);
    delta_.add("delta", {rows * heads}, lse.dtype);
    delta_.allocate();
  }
  Tensor delta = delta_.get("delta").narrow(0, rows * heads).reshape({rows, heads});
  attention_delta(delta, o, d_o);
  attention_block_backward(dq, dk, dv, q, k, v, d_o, lse, delta,
                           causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
}

}  // namespace longtrain::attn
