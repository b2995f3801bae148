// Backend entry points. ops.cpp checks the device and calls ops::cpu::<op> or ops::cuda::<op>; each
// backend defines its functions with exactly the signatures of ops.h (kernels/op_signatures.inc).
#pragma once

#include "kernels/ops.h"

namespace longtrain::ops::cpu {
#include "kernels/op_signatures.inc"
}  // namespace longtrain::ops::cpu

#ifdef LONGTRAIN_HAS_CUDA
namespace longtrain::ops::cuda {
#include "kernels/op_signatures.inc"
// Not an op: ops::embedding_backward_scratch_bytes on CUDA.
size_t embedding_backward_scratch_bytes(int64_t tokens, int64_t vocab);
}  // namespace longtrain::ops::cuda
#endif
