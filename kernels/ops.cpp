// The public ops: pick the backend by the tensors' device (argument checks live in the backends,
// next to the code that relies on them).
#include "kernels/backends.h"
#include "runtime/dispatch.h"

namespace longtrain::ops {

void embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  LT_DISPATCH(common_device("embedding_forward", {&out, &tokens, &table}), embedding_forward, out, tokens, table);
}
void embedding_backward(Tensor d_table, Tensor tokens, Tensor d_out) {
  LT_DISPATCH(common_device("embedding_backward", {&d_table, &tokens, &d_out}), embedding_backward, d_table,
              tokens, d_out);
}
void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  LT_DISPATCH(common_device("rmsnorm_forward", {&y, &rstd, &x, &w}), rmsnorm_forward, y, rstd, x, w, eps);
}
void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd) {
  LT_DISPATCH(common_device("rmsnorm_backward", {&dx, &dw, &dy, &x, &w, &rstd}), rmsnorm_backward, dx, dw, dy, x,
              w, rstd);
}
void rope_forward(Tensor x, Tensor positions, const RopeParams& p) {
  LT_DISPATCH(common_device("rope_forward", {&x, &positions}), rope_forward, x, positions, p);
}
void rope_backward(Tensor dx, Tensor positions, const RopeParams& p) {
  LT_DISPATCH(common_device("rope_backward", {&dx, &positions}), rope_backward, dx, positions, p);
}
void swiglu_forward(Tensor out, Tensor gate_up) {
  LT_DISPATCH(common_device("swiglu_forward", {&out, &gate_up}), swiglu_forward, out, gate_up);
}
void swiglu_backward(Tensor d_gate_up, Tensor d_out, Tensor gate_up) {
  LT_DISPATCH(common_device("swiglu_backward", {&d_gate_up, &d_out, &gate_up}), swiglu_backward, d_gate_up,
              d_out, gate_up);
}
void linear_forward(Tensor y, Tensor x, Tensor w) {
  LT_DISPATCH(common_device("linear_forward", {&y, &x, &w}), linear_forward, y, x, w);
}
void linear_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w) {
  LT_DISPATCH(common_device("linear_backward", {&dx, &dw, &dy, &x, &w}), linear_backward, dx, dw, dy, x, w);
}
void add_inplace(Tensor y, Tensor x) {
  LT_DISPATCH(common_device("add_inplace", {&y, &x}), add_inplace, y, x);
}
void lm_head_cross_entropy(Tensor losses, Tensor dx, Tensor dw, Tensor x, Tensor w, Tensor labels,
                           const CrossEntropyParams& p) {
  LT_DISPATCH(common_device("lm_head_cross_entropy", {&losses, &dx, &dw, &x, &w, &labels}), lm_head_cross_entropy,
              losses, dx, dw, x, w, labels, p);
}

void convert(Tensor dst, Tensor src) {
  LT_DISPATCH(common_device("convert", {&dst, &src}), convert, dst, src);
}
void adamw_update(Tensor param, Tensor master, Tensor m, Tensor v, Tensor grad, const AdamWParams& p) {
  LT_DISPATCH(common_device("adamw_update", {&param, &master, &m, &v, &grad}), adamw_update, param, master, m, v,
              grad, p);
}
double sum_squares(Tensor x) { LT_DISPATCH(common_device("sum_squares", {&x}), sum_squares, x); }

}  // namespace longtrain::ops
