// cuDNN fused attention through the backend API (cudnn_graph.h; no cudnn-frontend): the composite
// SDPA graphs of docs/cudnn-sdpa.md, which cuDNN matches to its Hopper flash-attention kernels.
// Plain views in, no Tensor checks here: attention/cuda/local_attention.cu validates and calls these.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace longtrain::attn::cudnn_sdpa {

// A bf16 [tokens, heads, dim] view with strides in elements (dim is unit-stride).
struct View {
  void* data = nullptr;
  int64_t tokens = 0, heads = 0, dim = 0;
  int64_t token_stride = 0, head_stride = 0;
};

// An f32 [tokens, heads] view (the LSE, "stats" to cuDNN).
struct StatsView {
  float* data = nullptr;
  int64_t tokens = 0, heads = 0;
  int64_t token_stride = 0, head_stride = 0;
};

// o = softmax(scale · q·kᵀ [+ causal mask]) · v and lse = natural-log LSE of the scaled scores.
// Causal is top-left aligned: query i sees keys j <= i.
void forward(View o, StatsView lse, View q, View k, View v, bool causal, float scale);

// dq, dk, dv (bf16, overwritten; strided views into a fused dQKV buffer are fine when base and
// strides are 16-byte aligned, which local_attention.cu checks before writing in place) of the block,
// given q, k, v, the final o and lse, and d_o: the frontend's graph, which forms delta =
// rowsum(dO ⊙ O) itself, as PyTorch's cuDNN attention does.
void backward(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse, bool causal,
              float scale);

// The same from delta = rowsum(dO ⊙ O_final) instead of O (query rows that came from another rank
// with their delta). A graph that takes delta as an input is tried once per shape; where no engine
// accepts it, make_o() is called for an O stand-in whose rowsum(d_o ⊙ o) is delta, and backward()
// runs on it. Measured on cuDNN 9.19 with an H200: no engine accepts the delta-input graph, so the
// stand-in is what runs there.
void backward_from_delta(View dq, View dk, View dv, View q, View k, View v, View d_o, StatsView lse, StatsView delta,
                         const std::function<View()>& make_o, bool causal, float scale);

// Segmented attention: `segments` independent attention problems in one call, each a run of query
// rows of q/o/lse against a run of key rows of k/v, with the same mask (causal: q_len == k_len,
// top-left within the segment). cuDNN's ragged ("THD") layout with a padding mask: per-segment
// lengths and ragged offsets, one fused kernel that computes only each segment's own tiles. Rows
// outside every segment are not touched. Query runs must be disjoint (and, for the backward, key
// runs too): attention/local_attention.cpp checks that.
struct Segment {
  int64_t q_start, q_len, k_start, k_len;
};

void forward_segments(View o, StatsView lse, View q, View k, View v, const std::vector<Segment>& segments,
                      bool causal, float scale);

// dq, dk, dv (bf16, overwritten in the segments' rows only) given the final o and lse.
void backward_segments(View dq, View dk, View dv, View q, View k, View v, View o, View d_o, StatsView lse,
                       const std::vector<Segment>& segments, bool causal, float scale);

}  // namespace longtrain::attn::cudnn_sdpa
