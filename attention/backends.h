// Backend entry points of local_attention.h. local_attention.cpp checks the device and calls
// attn::cpu::<op> or attn::cuda::<op>, each defined with exactly these signatures.
#pragma once

#include "attention/local_attention.h"

namespace longtrain::attn::cpu {
#include "attention/attention_signatures.inc"
}  // namespace longtrain::attn::cpu

#ifdef LONGTRAIN_HAS_CUDA
namespace longtrain::attn::cuda {
#include "attention/attention_signatures.inc"
// The fused segmented calls (cuDNN's ragged layout) behind attention_segments_*: every segment's rows
// written, nothing else; local_attention.cpp checks the segments and handles the rows outside them.
void segments_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, const std::vector<Segment>& segments,
                      BlockMask mask, double scale);
void segments_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o, Tensor lse,
                       Tensor o, Tensor delta, const std::vector<Segment>& segments, BlockMask mask, double scale,
                       GradMode mode);
// attention_block_forward_merge (argument checks of its own where it falls back on the two steps).
void block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q, Tensor k, Tensor v,
                         BlockMask mask, double scale);
}  // namespace longtrain::attn::cuda
#endif
