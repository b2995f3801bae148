#include "attention/sequence_attention.h"

#include <chrono>

namespace longtrain::attn {

namespace {

// Adds the host seconds of a scope to a counter.
class WallClock {
 public:
  explicit WallClock(double& seconds) : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
  ~WallClock() { seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double& seconds_;
  std::chrono::steady_clock::time_point start_;
};

// The calls of one rank's whole-sequence block: one, or one per document.
std::vector<BlockCall> local_calls(const Documents& docs, int64_t T, bool causal) {
  check_documents(docs, T, "single-rank attention");
  const std::vector<BlockCall> whole = {{0, T, 0, T, causal ? BlockMask::causal_diagonal : BlockMask::none}};
  return document_block_calls(whole, docs, SeqLayout::contiguous, 1, T, 0, 0, causal);
}

}  // namespace

void LocalSequenceAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  const WallClock wall(counters.wall_seconds), busy(counters.compute_seconds);
  if (documents_.empty()) {
    attention_block_forward(o, lse, q, k, v, causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_);
    counters.pairs += BlockCall{0, q.size(0), 0, k.size(0), causal_ ? BlockMask::causal_diagonal : BlockMask::none}
                          .pairs();
    return;
  }
  // Documents partition the tokens: one segmented call, each document a segment writing its own rows.
  for (const SegmentCall& c : segment_calls(local_calls(documents_, q.size(0), causal_))) {
    attention_segments_forward(o, lse, q, k, v, c.segments, c.mask, scale_);
    counters.pairs += c.pairs;
  }
}

void LocalSequenceAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o,
                                      Tensor lse, Tensor d_o) {
  ++counters.backward_calls;
  const WallClock wall(counters.wall_seconds), busy(counters.compute_seconds);
  if (documents_.empty()) {
    // head_groups_ calls of whole kv-head groups (a query head reads only its own kv head).
    const int64_t hkv = k.size(1), hq = q.size(1);
    LT_CHECK(hkv % head_groups_ == 0,
             "attention backward: {} head groups (model.attention_head_groups) do not divide the {} kv heads",
             head_groups_, hkv);
    const int64_t gkv = hkv / head_groups_, gq = hq / head_groups_;
    for (int64_t g = 0; g < head_groups_; ++g) {
      auto qh = [&](const Tensor& t) { return t.narrow(1, g * gq, gq); };
      auto kh = [&](const Tensor& t) { return t.narrow(1, g * gkv, gkv); };
      attention_block_backward(qh(dq), kh(dk), kh(dv), qh(q), kh(k), kh(v), qh(d_o), qh(lse), qh(o), Tensor{},
                               causal_ ? BlockMask::causal_diagonal : BlockMask::none, scale_, GradMode::overwrite);
    }
    counters.pairs += BlockCall{0, q.size(0), 0, k.size(0), causal_ ? BlockMask::causal_diagonal : BlockMask::none}
                          .pairs();
    return;
  }
  // A document's query rows and key rows are the same tokens, and the documents partition them: one
  // segmented call overwrites every element of dq, dk and dv.
  for (const SegmentCall& c : segment_calls(local_calls(documents_, q.size(0), causal_))) {
    attention_segments_backward(dq, dk, dv, q, k, v, d_o, lse, o, Tensor{}, c.segments, c.mask, scale_,
                                GradMode::overwrite);
    counters.pairs += c.pairs;
  }
}

void LocalSequenceAttention::set_backward_head_groups(int64_t groups) {
  LT_CHECK(groups >= 1, "attention backward head groups must be at least 1, got {}", groups);
  head_groups_ = groups;
}

}  // namespace longtrain::attn
