// Generation with a KV cache equals the full forward pass: the logits of incremental decoding give
// the same per-token losses as LlamaModel::forward over the whole sequence.
#include <cmath>

#include <gtest/gtest.h>

#include "model/generate.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

LlamaConfig small_config() {
  LlamaConfig c;
  c.vocab_size = 40;
  c.dim = 24;
  c.n_layers = 2;
  c.n_heads = 6;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.ffn_dim = 20;
  c.max_seq_len = 64;
  return c;
}

double loss_of(const std::vector<float>& logits, int32_t label) {
  double mx = logits[0];
  for (float v : logits) mx = std::max<double>(mx, v);
  double s = 0.0;
  for (float v : logits) s += std::exp(v - mx);
  return mx + std::log(s) - logits[static_cast<size_t>(label)];
}

TEST(Generate, CachedDecodingMatchesTheFullForward) {
  const LlamaConfig c = small_config();
  const int64_t T = 23, prompt_len = 9;
  LlamaModel model(c, Precision::cpu(DType::f64), CheckpointPolicy::none, T);
  model.initialize(21, 0.2);
  test::HostTensor<int32_t> tokens({T}), labels({T}), positions({T});
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<int32_t>((t * 13 + 1) % c.vocab_size);
    positions[t] = static_cast<int32_t>(t);
  }
  for (int64_t t = 0; t + 1 < T; ++t) labels[t] = tokens[t + 1];
  labels[T - 1] = LlamaModel::kIgnoreIndex;
  test::HostTensor<double> losses({T});
  model.forward({tokens, labels, positions}, losses);

  // The prompt in one call, then one token per call: each returned logits row predicts the next token.
  KvCache cache(c, model.precision(), T);
  std::vector<int32_t> prompt(tokens.values.begin(), tokens.values.begin() + prompt_len);
  std::vector<float> logits = decode_tokens(model, cache, prompt);
  EXPECT_NEAR(loss_of(logits, labels[prompt_len - 1]), losses[prompt_len - 1], 1e-5);
  for (int64_t t = prompt_len; t + 1 < T; ++t) {
    logits = decode_tokens(model, cache, {tokens[t]});
    EXPECT_NEAR(loss_of(logits, labels[t]), losses[t], 1e-5) << "position " << t;  // logits are float
  }
  EXPECT_EQ(cache.length(), T - 1);
}

TEST(Generate, GreedySamplingIsArgmaxAndTopPKeepsTheNucleus) {
  std::vector<float> logits = {0.1f, 3.0f, -1.0f, 2.9f};
  uint64_t state = 1;
  EXPECT_EQ(sample_token(logits, {0.0, 1.0, 0}, state), 1);
  // top_p small enough keeps only the most likely token.
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(logits, {1.0, 0.01, 0}, state), 1);
  // With top_p = 1 every token appears, in proportion to its probability.
  std::vector<int> counts(4, 0);
  for (int i = 0; i < 20000; ++i) counts[static_cast<size_t>(sample_token(logits, {1.0, 1.0, 0}, state))]++;
  double z = std::exp(0.1) + std::exp(3.0) + std::exp(-1.0) + std::exp(2.9);
  EXPECT_NEAR(counts[1] / 20000.0, std::exp(3.0) / z, 0.02);
  EXPECT_NEAR(counts[2] / 20000.0, std::exp(-1.0) / z, 0.01);
}

TEST(Generate, SameSeedSameTextAndLimitsAreChecked) {
  const LlamaConfig c = small_config();
  LlamaModel model(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 8);
  model.initialize(2);
  SamplingParams sp{0.9, 0.9, 42};
  auto a = generate(model, {1, 2, 3}, 10, sp), b = generate(model, {1, 2, 3}, 10, sp);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 10u);
  EXPECT_THROW(generate(model, {1, 2, 3}, 100, sp), Error);  // beyond max_seq_len
  EXPECT_THROW(generate(model, {}, 3, sp), Error);
}

}  // namespace
}  // namespace longtrain::model
