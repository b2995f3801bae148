// Hugging Face parity on the GPU: every fixture of tests/fixtures/hf_parity (the plain shapes and each
// RoPE scaling type over 4x its original context) loaded as eval and generate load a Hugging Face
// directory on the GPU (trainer::load_model_from_checkpoint, bf16 mixed precision), against
// transformers' float32 logits (the `logits` golden, CPU) and held to transformers' own bfloat16
// error: the golden's `logits_bf16` is transformers' bf16 forward on a GPU (make_goldens.py), so
// "within bf16's rounding" means "no further from the f32 logits than transformers in bf16 is", with
// a factor of 2 for the different (but equally valid) places the two round to bf16.
//
// Checked for the full logits (forward_logits, the training forward's layers), the per-token losses of
// the fused head (f32 statistics) and the KV-cache decoding of generate. Every line prints as
//   HF_PARITY_GPU <fixture> <path> <ours norm-wise> <ours max-normalised> <transformers bf16 norm-wise>
// <transformers bf16 max-normalised>
// which the GPU run collects into bench/results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../model/hf_parity_fixtures.h"
#include "gpu_test_util.h"
#include "model/generate.h"
#include "model/hf_export.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "trainer/trainer.h"

#ifndef LONGTRAIN_HF_PARITY_DIR
#error "LONGTRAIN_HF_PARITY_DIR (the tests/fixtures/hf_parity folder) must be defined by the build"
#endif

namespace longtrain::test {
namespace {

namespace fs = std::filesystem;

// Our bf16 error may be this many times transformers' own bf16 error (norm-wise and max-normalised).
constexpr double kBf16Factor = 2.0;

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const model::HfParityFixture& f : model::hf_parity_fixtures()) names.push_back(f.name);
  return names;
}

std::vector<double> golden_tensor(const model::SafetensorsFile& f, const std::string& name, int64_t rows,
                                  int64_t cols, DType dtype) {
  const int64_t n = rows * std::max<int64_t>(cols, 1);
  std::vector<unsigned char> bytes(static_cast<size_t>(n) * dtype_size(dtype));
  const Tensor t = cols ? Tensor(bytes.data(), dtype, {rows, cols}) : Tensor(bytes.data(), dtype, {rows});
  f.read(name, t);
  return download(t);
}

// Cross-entropy of token t+1 from logits row t, in double (transformers' bf16 losses, from its logits).
std::vector<double> next_token_losses(const std::vector<double>& logits, const std::vector<int32_t>& tokens,
                                      int64_t vocab) {
  std::vector<double> out;
  for (size_t t = 0; t + 1 < tokens.size(); ++t) {
    const double* row = logits.data() + t * vocab;
    double mx = -INFINITY, sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, row[v]);
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
    out.push_back(mx + std::log(sum) - row[tokens[t + 1]]);
  }
  return out;
}

// `ours` and transformers' bf16 result against transformers' f32 golden: ours within kBf16Factor of
// transformers' own bf16 error, both norms.
void expect_within_bf16(const std::string& fixture, const std::string& what, const std::vector<double>& ours,
                        const std::vector<double>& theirs_bf16, const std::vector<double>& golden) {
  const double on = norm_relative_error(ours, golden), om = relative_error(ours, golden);
  const double tn = norm_relative_error(theirs_bf16, golden), tm = relative_error(theirs_bf16, golden);
  std::printf("HF_PARITY_GPU %s %s %.6e %.6e %.6e %.6e\n", fixture.c_str(), what.c_str(), on, om, tn, tm);
  ASSERT_TRUE(std::isfinite(tn) && std::isfinite(tm)) << "transformers' bf16 golden is not finite";
  EXPECT_LE(on, kBf16Factor * tn) << fixture << " " << what << ": norm-wise, against transformers' bf16 " << tn;
  EXPECT_LE(om, kBf16Factor * tm) << fixture << " " << what << ": max-normalised, against transformers' bf16 " << tm;
}

class HfParityGpuTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfParityGpuTest, Bf16WithinTransformersOwnBf16Error) {
  LT_REQUIRE_GPU();
  const fs::path dir = fs::path(LONGTRAIN_HF_PARITY_DIR) / GetParam();
  const std::vector<int32_t> tokens =
      nlohmann::json::parse(read_file((dir / "tokens.json").string())).at("tokens").get<std::vector<int32_t>>();
  const auto T = static_cast<int64_t>(tokens.size());
  ASSERT_GE(T, 4);

  const model::SafetensorsFile golden((dir / "golden.safetensors").string());
  ASSERT_TRUE(golden.metadata().count("cuda_bf16_vs_cpu_f32"))
      << dir / "golden.safetensors" << " has no transformers bf16 logits: it was made without a GPU; "
      << "run make_goldens.py on a GPU machine (README.md beside it)";
  trainer::LoadedModel loaded = trainer::load_model_from_checkpoint(dir, T, Device::cuda);
  model::LlamaModel& m = *loaded.model;
  const int64_t V = m.config().vocab_size;
  const std::vector<double> logits = golden_tensor(golden, "logits", T, V, DType::f32);
  const std::vector<double> logits_bf16 = golden_tensor(golden, "logits_bf16", T, V, DType::f32);
  const std::vector<double> losses = golden_tensor(golden, "losses", T - 1, 0, DType::f32);

  std::vector<int32_t> labels(tokens.begin() + 1, tokens.end()), positions(static_cast<size_t>(T));
  labels.push_back(model::LlamaModel::kIgnoreIndex);
  for (int64_t t = 0; t < T; ++t) positions[t] = static_cast<int32_t>(t);
  DeviceTensor d_tokens(DType::i32, {T}), d_labels(DType::i32, {T}), d_positions(DType::i32, {T});
  upload_ints(d_tokens, tokens);
  upload_ints(d_labels, labels);
  upload_ints(d_positions, positions);
  const model::TokenShard shard{d_tokens, d_labels, d_positions};

  HostTensor<bf16> out({T, V});
  m.forward_logits(shard, out);
  expect_within_bf16(GetParam(), "logits", download(out), logits_bf16, logits);

  DeviceTensor d_losses(DType::f32, {T});
  const model::LossSum sum = m.forward(shard, d_losses);
  EXPECT_EQ(sum.count, T - 1);
  std::vector<double> per_token = download(d_losses);
  EXPECT_EQ(per_token.back(), 0.0) << "the ignored last label has a loss";
  per_token.pop_back();
  expect_within_bf16(GetParam(), "losses", per_token, next_token_losses(logits_bf16, tokens, V), losses);

  // generate's path: half the tokens as the prompt, then one at a time through the KV cache.
  model::KvCache cache(m.config(), m.precision(), T);
  const int64_t prompt = T / 2;
  std::vector<double> decoded, rows, rows_bf16;
  auto take = [&](const std::vector<float>& row, int64_t position) {
    ASSERT_EQ(static_cast<int64_t>(row.size()), V);
    decoded.insert(decoded.end(), row.begin(), row.end());
    rows.insert(rows.end(), logits.begin() + position * V, logits.begin() + (position + 1) * V);
    rows_bf16.insert(rows_bf16.end(), logits_bf16.begin() + position * V, logits_bf16.begin() + (position + 1) * V);
  };
  take(model::decode_tokens(m, cache, std::vector<int32_t>(tokens.begin(), tokens.begin() + prompt)), prompt - 1);
  for (int64_t t = prompt; t < T; ++t) take(model::decode_tokens(m, cache, {tokens[t]}), t);
  expect_within_bf16(GetParam(), "generate", decoded, rows_bf16, rows);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParityGpuTest, ::testing::ValuesIn(fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace longtrain::test
