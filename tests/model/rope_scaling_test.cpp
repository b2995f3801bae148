// RoPE scaling: every rope_type's inverse frequencies and attention factor against values this test
// computes on its own in double (from transformers' definitions, written out here again), the real
// settings of Llama 3.1 and of a Qwen2.5-style yarn with the band edges worked out by hand, what
// `dynamic` means at a fixed training length, and config errors that name the key.
#include <cmath>
#include <numbers>

#include <gtest/gtest.h>

#include "model/llama.h"
#include "model/rope_scaling.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

using test::expect_error;

constexpr double kPi = std::numbers::pi;

std::vector<double> plain_inv_freq(double theta, int64_t D) {
  std::vector<double> out;
  for (int64_t i = 0; i < D; i += 2) out.push_back(std::exp(-std::log(theta) * static_cast<double>(i) / D));
  return out;
}

void expect_table(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " entry " << i;
    EXPECT_NEAR(got[i], want[i], 1e-13 * want[i]) << what << " entry " << i;
  }
}

RopeScaling llama31() {
  RopeScaling s;
  s.type = "llama3";
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position_embeddings = 8192;
  return s;
}

RopeScaling qwen_yarn() {
  RopeScaling s;
  s.type = "yarn";
  s.factor = 4;
  s.original_max_position_embeddings = 32768;
  return s;
}

TEST(RopeScaling, DefaultAndLinear) {
  const auto base = plain_inv_freq(10000.0, 64);
  RopeTable d = rope_table({}, 10000.0, 64, 4096);
  expect_table(d.inv_freq, base, "default");
  EXPECT_EQ(d.attention_factor, 1.0);

  RopeScaling lin;
  lin.type = "linear";
  lin.factor = 4;
  RopeTable l = rope_table(lin, 10000.0, 64, 4096);
  std::vector<double> want;
  for (double v : base) want.push_back(v / 4);
  expect_table(l.inv_freq, want, "linear");
  EXPECT_EQ(l.attention_factor, 1.0);
}

// Llama 3.1: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192. Wavelength
// 2π·500000^(2i/128) is below 8192/4 = 2048 for i <= 28 (kept), above 8192 for i >= 35 (divided by 8),
// and blended for i = 29..34: ln(2048/2π)/ln(500000)·64 = 28.2 and ln(8192/2π)/ln(500000)·64 = 34.99.
TEST(RopeScaling, Llama31PublishedSettings) {
  const auto base = plain_inv_freq(500000.0, 128);
  RopeTable t = rope_table(llama31(), 500000.0, 128, 131072);
  EXPECT_EQ(t.attention_factor, 1.0);
  std::vector<double> want;
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wavelen = 2 * kPi / base[i];
    if (wavelen < 8192.0 / 4) {
      want.push_back(base[i]);
    } else if (wavelen > 8192.0 / 1) {
      want.push_back(base[i] / 8);
    } else {
      const double s = (8192.0 / wavelen - 1) / (4 - 1);
      want.push_back((1 - s) * base[i] / 8 + s * base[i]);
    }
    const double tol = 1e-13 * base[i];
    const bool is_kept = std::abs(t.inv_freq[i] - base[i]) <= tol;
    const bool is_divided = std::abs(t.inv_freq[i] - base[i] / 8) <= tol;
    kept += is_kept;
    divided += is_divided;
    blended += !is_kept && !is_divided && t.inv_freq[i] < base[i] && t.inv_freq[i] > base[i] / 8;
  }
  expect_table(t.inv_freq, want, "llama3");
  EXPECT_EQ(kept, 29);
  EXPECT_EQ(blended, 6);
  EXPECT_EQ(divided, 29);
  // The blend is continuous at both edges: its weights run from (almost) 0 to (almost) 1.
  EXPECT_GT(t.inv_freq[29], base[29] / 8);
  EXPECT_LT(t.inv_freq[34], base[34]);
}

// yarn with factor 4, original 32768, theta 1e6, head_dim 128 (Qwen2.5's long-context setting):
// low = floor(128·ln(32768/(2π·32))/(2 ln 1e6)) = floor(23.60) = 23, high = ceil(128·ln(32768/2π)/(2 ln 1e6))
// = ceil(39.65) = 40; dims up to 23 keep their frequency, from 40 on are divided by 4, linear between;
// attention factor 0.1·ln 4 + 1 = 1.1386294361.
TEST(RopeScaling, YarnQwenSetting) {
  const auto base = plain_inv_freq(1e6, 128);
  RopeTable t = rope_table(qwen_yarn(), 1e6, 128, 131072);
  EXPECT_NEAR(t.attention_factor, 1.1386294361119891, 1e-15);
  std::vector<double> want;
  for (size_t i = 0; i < base.size(); ++i) {
    const double ramp = std::min(1.0, std::max(0.0, (static_cast<double>(i) - 23.0) / (40.0 - 23.0)));
    want.push_back(base[i] * (1 - ramp) + base[i] / 4 * ramp);
  }
  expect_table(t.inv_freq, want, "yarn");
  for (int i = 0; i <= 23; ++i) EXPECT_NEAR(t.inv_freq[i], base[i], 1e-13 * base[i]) << "dim " << i << " should extrapolate";
  for (int i = 24; i < 40; ++i) {
    EXPECT_LT(t.inv_freq[i], base[i] * (1 - 1e-6)) << "dim " << i << " should be on the ramp";
    EXPECT_GT(t.inv_freq[i], base[i] / 4 * (1 + 1e-6)) << "dim " << i << " should be on the ramp";
  }
  for (int i = 40; i < 64; ++i) EXPECT_NEAR(t.inv_freq[i], base[i] / 4, 1e-13 * base[i]) << "dim " << i;
}

TEST(RopeScaling, YarnFields) {
  const auto base = plain_inv_freq(10000.0, 64);
  // truncate false: the band edges stay fractional.
  RopeScaling s;
  s.type = "yarn";
  s.factor = 8;
  s.original_max_position_embeddings = 4096;
  s.beta_fast = 16;
  s.beta_slow = 2;
  s.truncate = false;
  const double low = 64 * std::log(4096 / (16 * 2 * kPi)) / (2 * std::log(10000.0));
  const double high = 64 * std::log(4096 / (2 * 2 * kPi)) / (2 * std::log(10000.0));
  ASSERT_NE(low, std::floor(low));
  RopeTable t = rope_table(s, 10000.0, 64, 1);
  std::vector<double> want;
  for (size_t i = 0; i < base.size(); ++i) {
    const double ramp = std::min(1.0, std::max(0.0, (static_cast<double>(i) - low) / (high - low)));
    want.push_back(base[i] * (1 - ramp) + base[i] / 8 * ramp);
  }
  expect_table(t.inv_freq, want, "yarn, truncate false");
  EXPECT_NEAR(t.attention_factor, 0.1 * std::log(8.0) + 1, 1e-15);

  // mscale and mscale_all_dim (DeepSeek's form): m(f, mscale) / m(f, mscale_all_dim).
  s.mscale = 0.707;
  s.mscale_all_dim = 1.0;
  EXPECT_NEAR(rope_table(s, 10000.0, 64, 1).attention_factor,
              (0.1 * 0.707 * std::log(8.0) + 1) / (0.1 * 1.0 * std::log(8.0) + 1), 1e-15);
  s.mscale_all_dim = 0;  // only one of them: the plain 0.1·ln f + 1
  EXPECT_NEAR(rope_table(s, 10000.0, 64, 1).attention_factor, 0.1 * std::log(8.0) + 1, 1e-15);
  s.attention_factor = 0.5;  // given: used as is
  EXPECT_EQ(rope_table(s, 10000.0, 64, 1).attention_factor, 0.5);
}

// dynamic at a fixed length L: identity for L <= L0; for L > L0, plain RoPE with
// theta' = theta·(f·L/L0 - (f-1))^(D/(D-2)).
TEST(RopeScaling, DynamicAtAFixedLength) {
  RopeScaling s;
  s.type = "dynamic";
  s.factor = 4;
  s.original_max_position_embeddings = 2048;
  for (int64_t L : {1, 1024, 2048})
    expect_table(rope_table(s, 10000.0, 64, L).inv_freq, plain_inv_freq(10000.0, 64), "dynamic at L <= L0");
  const double theta = 10000.0 * std::pow(4.0 * 8192 / 2048 - 3, 64.0 / 62);
  RopeTable t = rope_table(s, 10000.0, 64, 8192);
  expect_table(t.inv_freq, plain_inv_freq(theta, 64), "dynamic at L = 4 L0");
  EXPECT_EQ(t.attention_factor, 1.0);
  EXPECT_LT(t.inv_freq[31], plain_inv_freq(10000.0, 64)[31] / 4);  // a stronger stretch than linear's at this L
}

LlamaConfig small_config() {
  LlamaConfig c;
  c.vocab_size = 40;
  c.dim = 16;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 8;
  c.ffn_dim = 24;
  c.max_seq_len = 64;
  return c;
}

double model_loss(const LlamaConfig& c, int64_t rope_length, int64_t T) {
  LlamaModel model(c, Precision::cpu(DType::f64), CheckpointPolicy::none, T);
  model.initialize(5, 0.5);
  model.set_rope_length(rope_length);
  test::HostTensor<int32_t> tokens({T}), labels({T}), positions({T});
  for (int64_t t = 0; t < T; ++t) {
    tokens[t] = static_cast<int32_t>((t * 7 + 1) % c.vocab_size);
    labels[t] = static_cast<int32_t>((t * 5 + 2) % c.vocab_size);
    positions[t] = static_cast<int32_t>(t);
  }
  return model.forward({tokens, labels, positions}).sum;
}

// The model follows the run's length: a dynamic model trained at L <= L0 is the plain model, and at
// L > L0 it is the plain model with the rescaled theta.
TEST(RopeScaling, DynamicModelAtTrainingLength) {
  LlamaConfig plain = small_config();
  LlamaConfig dyn = plain;
  dyn.rope_scaling.type = "dynamic";
  dyn.rope_scaling.factor = 2;
  dyn.rope_scaling.original_max_position_embeddings = 16;
  const int64_t T = 32;
  EXPECT_EQ(model_loss(dyn, 16, T), model_loss(plain, 16, T));
  EXPECT_EQ(model_loss(dyn, 8, T), model_loss(plain, 8, T));
  LlamaConfig rescaled = plain;
  rescaled.rope_theta = 10000.0 * std::pow(2.0 * 32 / 16 - 1, 8.0 / 6);
  const double at_32 = model_loss(dyn, 32, T);
  EXPECT_NEAR(at_32, model_loss(rescaled, 32, T), 1e-12 * std::abs(at_32));
  EXPECT_GT(std::abs(at_32 - model_loss(plain, 32, T)), 1e-6) << "dynamic at L = 2 L0 should change the model";
}

TEST(RopeScaling, ConfigErrorsNameTheKey) {
  RopeScaling s;
  s.type = "ntk";
  expect_error([&] { validate_rope_scaling(s); },
                     {"model.rope_scaling 'ntk'", "default, linear, dynamic, yarn, llama3"});
  s = {};
  s.type = "linear";
  expect_error([&] { validate_rope_scaling(s); }, {"rope_scaling linear needs model.rope_factor"});
  s.factor = 0.5;
  expect_error([&] { validate_rope_scaling(s); }, {"model.rope_factor must be >= 1", "0.5"});
  s = qwen_yarn();
  s.original_max_position_embeddings = 0;
  expect_error([&] { validate_rope_scaling(s); },
                     {"rope_scaling yarn needs model.rope_original_max_position_embeddings"});
  s = llama31();
  s.high_freq_factor = 0;
  expect_error([&] { validate_rope_scaling(s); }, {"llama3 needs model.rope_high_freq_factor"});
  s = llama31();
  s.high_freq_factor = 1;
  expect_error([&] { validate_rope_scaling(s); }, {"model.rope_high_freq_factor (1) must be above"});
  s = llama31();
  s.beta_fast = 32;
  expect_error([&] { validate_rope_scaling(s); },
                     {"model.rope_beta_fast is set but model.rope_scaling llama3 does not use it"});
  s = {};
  s.factor = 2;
  expect_error([&] { validate_rope_scaling(s); }, {"model.rope_factor is set", "default does not use it"});
  // LlamaConfig::validate checks it too.
  LlamaConfig c = small_config();
  c.rope_scaling.type = "yarn";
  expect_error([&] { c.validate(); }, {"rope_scaling yarn needs model.rope_factor"});
}

}  // namespace
}  // namespace longtrain::model
