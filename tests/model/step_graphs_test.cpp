// The cache of forward_backward's CUDA graphs (model/step_graphs.h): which call replays which graph,
// when graphs are dropped and when they turn off. The graphs here are empty (no capture without a GPU);
// tests/gpu/model_gpu_test.cpp (GpuModelCudaGraphs) captures and replays real ones.
#include <gtest/gtest.h>

#include <string>

#include "model/llama.h"
#include "model/step_graphs.h"

namespace longtrain::model {
namespace {

StepGraphKey key(int64_t tokens = 61, std::vector<bool> discarded = {true, true, false}) {
  static int ids, labels, positions, loss;
  StepGraphKey k;
  k.tokens = tokens;
  k.ids = &ids;
  k.labels = &labels;
  k.positions = &positions;
  k.ids_stride = k.labels_stride = k.positions_stride = 1;
  k.loss_sum = &loss;
  k.discarded = std::move(discarded);
  return k;
}

StepGraphEffects effects(int64_t forwards) {
  StepGraphEffects e;
  e.discarded_after = {false, false, false};
  e.attention_forward_calls = forwards;
  return e;
}

TEST(StepGraphs, AKeyIsCapturedAfterAnEagerCallWithoutTrialsAndFoundByEveryField) {
  StepGraphs g;
  EXPECT_FALSE(g.ready_to_capture(key()));  // the first call runs eagerly
  g.record_eager_call(key(), /*clean=*/false);  // it ran a kernel trial call
  EXPECT_FALSE(g.ready_to_capture(key()));
  g.record_eager_call(key(), /*clean=*/true);
  EXPECT_TRUE(g.ready_to_capture(key()));
  EXPECT_FALSE(g.ready_to_capture(key(59)));
  EXPECT_EQ(g.find(key(), /*frees=*/5), nullptr);
  g.add(key(), CudaGraph{}, effects(2), /*frees=*/5);
  const StepGraphs::Entry* e = g.find(key(), 5);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->effects.attention_forward_calls, 2);
  // Any field the captured kernels took from the host makes another call.
  EXPECT_EQ(g.find(key(59), 5), nullptr);
  EXPECT_EQ(g.find(key(61, {false, false, false}), 5), nullptr);
  StepGraphKey other_buffer = key();
  other_buffer.loss_sum = &other_buffer;
  EXPECT_EQ(g.find(other_buffer, 5), nullptr);
  StepGraphKey other_policy = key();
  other_policy.attention_kernel_policy = 1;
  EXPECT_EQ(g.find(other_policy, 5), nullptr);
  EXPECT_EQ(g.stats().captures, 1);
  EXPECT_EQ(g.stats().dropped, 0);
}

TEST(StepGraphs, AFreedBufferDropsEveryGraph) {
  StepGraphs g;
  g.add(key(), CudaGraph{}, effects(1), /*frees=*/3);
  g.add(key(59), CudaGraph{}, effects(1), /*frees=*/3);
  ASSERT_NE(g.find(key(), 3), nullptr);
  EXPECT_EQ(g.find(key(), 4), nullptr);  // a buffer was freed since the capture
  EXPECT_EQ(g.stats().dropped, 2);
  EXPECT_EQ(g.find(key(59), 4), nullptr);
  // Captured again, it is found at the new count.
  g.add(key(), CudaGraph{}, effects(1), /*frees=*/4);
  EXPECT_NE(g.find(key(), 4), nullptr);
  g.drop_all();  // what set_rope_length does
  EXPECT_EQ(g.find(key(), 4), nullptr);
  EXPECT_EQ(g.stats().dropped, 3);
  // A dropped key that ran clean before is captured again at its next call, without an eager one.
  g.record_eager_call(key(), true);
  g.add(key(), CudaGraph{}, effects(1), 4);
  g.drop_all();
  EXPECT_TRUE(g.ready_to_capture(key()));
  EXPECT_FALSE(g.off());
}

TEST(StepGraphs, TheOldestGraphGoesWhenTheCacheIsFull) {
  StepGraphs g;
  for (size_t i = 0; i <= StepGraphs::kMaxGraphs; ++i) {
    g.add(key(50 + static_cast<int64_t>(i)), CudaGraph{}, effects(1), 0);
    g.count_replay();  // paid for: no turning off
  }
  EXPECT_EQ(g.find(key(50), 0), nullptr);
  for (size_t i = 1; i <= StepGraphs::kMaxGraphs; ++i) EXPECT_NE(g.find(key(50 + static_cast<int64_t>(i)), 0), nullptr);
  EXPECT_EQ(g.stats().dropped, 1);
  EXPECT_FALSE(g.off());
}

// Calls that change every step (here the token count) make every step's calls new: graphs turn off
// instead of capturing every step.
TEST(StepGraphs, CallsThatKeepChangingTurnGraphsOff) {
  StepGraphs g;
  for (int64_t i = 0; i < StepGraphs::kMaxUnpaidCaptures; ++i) {
    EXPECT_FALSE(g.off()) << i;
    g.add(key(100 + i), CudaGraph{}, effects(1), 0);
    g.count_replay();  // one replay per capture: each step's last micro-batches; not worth a capture a step
  }
  EXPECT_TRUE(g.off());
  EXPECT_NE(g.stats().off_reason.find("kept changing"), std::string::npos) << g.stats().off_reason;
  EXPECT_NE(g.stats().off_reason.find("token count"), std::string::npos) << g.stats().off_reason;
}

TEST(StepGraphs, AModelOffCudaRefusesGraphsWithTheReason) {
  LlamaConfig c;
  c.vocab_size = 11;
  c.dim = 8;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.ffn_dim = 16;
  c.max_seq_len = 16;
  LlamaModel m(c, Precision::cpu(DType::f32), CheckpointPolicy::remat_aware, 8);
  EXPECT_EQ(m.set_cuda_graphs(true), "the model is not on CUDA");
  EXPECT_EQ(m.set_cuda_graphs(false), "");
  EXPECT_EQ(m.graph_stats().captures, 0);
}

}  // namespace
}  // namespace longtrain::model
