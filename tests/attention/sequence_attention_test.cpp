// LocalSequenceAttention (attention/sequence_attention.h), the single-rank SequenceAttention the model
// calls: the same O, LSE and gradients as calling the block ops directly on the whole sequence (delta,
// accumulating into a zeroed buffer), on q/k/v and dq/dk/dv views into fused QKV / dQKV buffers, with
// backward overwriting a dQKV buffer full of garbage; and counters that count its calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention/sequence_attention.h"
#include "test_util.h"

namespace longtrain::attn {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 29, kHeads = 6, kKvHeads = 2, kHeadDim = 6;

// The fused QKV GEMM output [T, (Hq + 2·Hkv)·D] and its q, k, v views (strided, never copied).
template <class T>
struct Fused {
  HostTensor<T> buffer{kTokens, kHeads + 2 * kKvHeads, kHeadDim};
  Tensor q, k, v;
  Fused() {
    const Tensor all = buffer;
    q = all.narrow(1, 0, kHeads);
    k = all.narrow(1, kHeads, kKvHeads);
    v = all.narrow(1, kHeads + kKvHeads, kKvHeads);
  }
  Fused(const Fused&) = delete;
  Fused& operator=(const Fused&) = delete;
};

template <class T>
void check_against_direct_calls(bool causal) {
  SCOPED_TRACE(::testing::Message() << (std::is_same_v<T, double> ? "f64" : "f32")
                                    << (causal ? " causal" : " full"));
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  const BlockMask mask = causal ? BlockMask::causal_diagonal : BlockMask::none;
  Fused<T> qkv, dqkv_seq, dqkv_direct;
  test::fill_uniform(qkv.buffer, 5, -1.5, 1.5);
  // backward overwrites: the model need not zero its dQKV buffer, so this one starts with garbage.
  test::fill_uniform(dqkv_seq.buffer, 9, -3.0, 3.0);
  HostTensor<T> o_seq({kTokens, kHeads, kHeadDim}), lse_seq({kTokens, kHeads});
  HostTensor<T> o_direct({kTokens, kHeads, kHeadDim}), lse_direct({kTokens, kHeads}), delta({kTokens, kHeads});
  HostTensor<T> d_o({kTokens, kHeads, kHeadDim});
  test::fill_uniform(d_o, 6);

  LocalSequenceAttention attention(causal, scale);
  attention.forward(o_seq, lse_seq, qkv.q, qkv.k, qkv.v);
  EXPECT_EQ(attention.counters.forward_calls, 1);
  EXPECT_EQ(attention.counters.backward_calls, 0);
  attention.backward(dqkv_seq.q, dqkv_seq.k, dqkv_seq.v, qkv.q, qkv.k, qkv.v, o_seq, lse_seq, d_o);
  EXPECT_EQ(attention.counters.forward_calls, 1);
  EXPECT_EQ(attention.counters.backward_calls, 1);
  EXPECT_EQ(attention.counters.bytes_sent, 0);  // one rank sends nothing

  attention_block_forward(o_direct, lse_direct, qkv.q, qkv.k, qkv.v, mask, scale);
  attention_delta(delta, o_direct, d_o);
  attention_block_backward(dqkv_direct.q, dqkv_direct.k, dqkv_direct.v, qkv.q, qkv.k, qkv.v, d_o, lse_direct,
                           Tensor{}, delta, mask, scale, GradMode::accumulate);

  // The same computation in the same order: identical bits.
  EXPECT_EQ(o_seq.values, o_direct.values);
  EXPECT_EQ(lse_seq.values, lse_direct.values);
  EXPECT_EQ(dqkv_seq.buffer.values, dqkv_direct.buffer.values);
  // And not trivially: the output and every gradient part carry values.
  double max_dk = 0.0;
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kKvHeads * kHeadDim; ++c)
      max_dk = std::max(max_dk, std::abs(static_cast<double>(
                                    dqkv_seq.buffer[(t * (kHeads + 2 * kKvHeads) + kHeads) * kHeadDim + c])));
  EXPECT_GT(max_dk, 1e-3);

  // Causal really is causal: the first token's output is its own value row.
  if (causal) {
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t d = 0; d < kHeadDim; ++d)
        EXPECT_NEAR(static_cast<double>(o_seq[h * kHeadDim + d]),
                    static_cast<double>(qkv.v.template ptr<T>()[(h / (kHeads / kKvHeads)) * kHeadDim + d]), 1e-6);
  }

  attention.forward(o_seq, lse_seq, qkv.q, qkv.k, qkv.v);
  attention.forward(o_seq, lse_seq, qkv.q, qkv.k, qkv.v);
  EXPECT_EQ(attention.counters.forward_calls, 3);
  EXPECT_EQ(attention.counters.backward_calls, 1);
}

TEST(LocalSequenceAttention, MatchesDirectBlockCallsAndCountsThem) {
  for (bool causal : {true, false}) {
    check_against_direct_calls<double>(causal);
    check_against_direct_calls<float>(causal);
  }
}

// model.attention_head_groups: the backward in calls over groups of kv heads (and their query heads)
// writes the same bits as one call (heads are independent) and counts the same pairs; a count that
// does not divide the kv heads is refused naming the key. (The head-major LSE of the CUDA path is in
// tests/gpu/attention_gpu_test.cpp.)
template <class T>
void check_head_groups(bool causal) {
  SCOPED_TRACE(::testing::Message() << (std::is_same_v<T, double> ? "f64" : "f32") << (causal ? " causal" : " full"));
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  Fused<T> qkv, dqkv_one, dqkv_groups;
  test::fill_uniform(qkv.buffer, 15, -1.5, 1.5);
  test::fill_uniform(dqkv_one.buffer, 16, -3.0, 3.0);
  test::fill_uniform(dqkv_groups.buffer, 17, -3.0, 3.0);
  HostTensor<T> o({kTokens, kHeads, kHeadDim}), lse({kTokens, kHeads}), d_o({kTokens, kHeads, kHeadDim});
  test::fill_uniform(d_o, 18);
  LocalSequenceAttention one(causal, scale), groups(causal, scale);
  groups.set_backward_head_groups(kKvHeads);
  one.forward(o, lse, qkv.q, qkv.k, qkv.v);
  one.counters.pairs = 0;
  one.backward(dqkv_one.q, dqkv_one.k, dqkv_one.v, qkv.q, qkv.k, qkv.v, o, lse, d_o);
  groups.backward(dqkv_groups.q, dqkv_groups.k, dqkv_groups.v, qkv.q, qkv.k, qkv.v, o, lse, d_o);
  EXPECT_EQ(dqkv_groups.buffer.values, dqkv_one.buffer.values);
  EXPECT_EQ(groups.counters.pairs, one.counters.pairs);

  LocalSequenceAttention three(causal, scale);
  three.set_backward_head_groups(3);
  test::expect_error(
      [&] { three.backward(dqkv_groups.q, dqkv_groups.k, dqkv_groups.v, qkv.q, qkv.k, qkv.v, o, lse, d_o); },
      {"model.attention_head_groups", "3 head groups"});
}

TEST(LocalSequenceAttention, BackwardInKvHeadGroupsEqualsOneCall) {
  static_assert(kKvHeads > 1, "two or more kv heads to split");
  for (bool causal : {true, false}) {
    check_head_groups<double>(causal);
    check_head_groups<float>(causal);
  }
}

}  // namespace
}  // namespace longtrain::attn
