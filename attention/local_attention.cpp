#include "attention/backends.h"
#include "runtime/dispatch.h"

namespace longtrain::attn {

void attention_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, BlockMask mask, double scale) {
  LT_DISPATCH(common_device("attention_block_forward", {&o, &lse, &q, &k, &v}), attention_block_forward, o, lse, q,
              k, v, mask, scale);
}
void attention_delta(Tensor delta, Tensor o, Tensor d_o) {
  LT_DISPATCH(common_device("attention_delta", {&delta, &o, &d_o}), attention_delta, delta, o, d_o);
}
void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                              Tensor lse, Tensor o, Tensor delta, BlockMask mask, double scale, GradMode mode) {
  LT_DISPATCH(common_device("attention_block_backward", {&dq, &dk, &dv, &q, &k, &v, &d_o, &lse, &o, &delta}),
              attention_block_backward, dq, dk, dv, q, k, v, d_o, lse, o, delta, mask, scale, mode);
}
void lse_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk) {
  LT_DISPATCH(common_device("lse_merge", {&o_acc, &lse_acc, &o_blk, &lse_blk}), lse_merge, o_acc, lse_acc, o_blk,
              lse_blk);
}

}  // namespace longtrain::attn
