// Hugging Face parity: longtrain's f32 CPU forward against transformers' LlamaForCausalLM on the same
// checkpoints. Each fixture in tests/fixtures/hf_parity/ is a small longtrain model written by our own
// exporter (GQA with an untied head, tied embeddings with MHA, MQA with non-default rope_theta and
// norm_eps, and each rope_scaling type over 4x its original context); golden.safetensors beside it holds transformers' logits and per-token losses for the
// committed token sequence (make_goldens.py; README.md there says how they were made).
//
// The model is loaded with longtrain's Hugging Face reader, run by the training forward (the fused,
// chunked LM head and cross-entropy give the losses; forward_logits gives the full logits) and by
// generation's KV-cache path, and each result must match the golden to a relative error below 1e-5,
// norm-wise (||a - b|| / ||b||) and max-normalised (max |a - b| / max |b|). Non-finite values and
// missing files fail the test. The committed fixtures must also be what write_hf_parity_fixture writes
// today, so that the recipe in README.md reproduces them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hf_parity_fixtures.h"
#include "model/generate.h"
#include "model/hf_export.h"
#include "model/llama.h"
#include "model/safetensors.h"
#include "test_util.h"

#ifndef LONGTRAIN_HF_PARITY_DIR
#error "LONGTRAIN_HF_PARITY_DIR (the tests/fixtures/hf_parity folder) must be defined by the build"
#endif

namespace longtrain::model {
namespace {

namespace fs = std::filesystem;

constexpr double kTolerance = 1e-5;  // f32 against f32, relative, both norms

// Every fixture of hf_parity_fixtures() is tested; a folder of one missing on disk fails.
std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const HfParityFixture& f : hf_parity_fixtures()) names.push_back(f.name);
  return names;
}

struct Errors {
  double norm_wise = 0.0;  // ||a - b|| / ||b||
  double max_wise = 0.0;   // max |a - b| / max |b|
  bool finite = true;      // every value of a and b is finite
};

// The error of `a` against the reference `b`. Sizes must match; NaN or Inf anywhere makes the errors
// infinite (and finite false), so no comparison below can pass on them.
Errors compare(const std::vector<double>& a, const std::vector<double>& b) {
  Errors e;
  EXPECT_EQ(a.size(), b.size());
  if (a.size() != b.size() || b.empty()) {
    e.norm_wise = e.max_wise = INFINITY;
    return e;
  }
  double diff2 = 0.0, ref2 = 0.0, diff_max = 0.0, ref_max = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) e.finite = false;
    const double d = a[i] - b[i];
    diff2 += d * d;
    ref2 += b[i] * b[i];
    diff_max = std::max(diff_max, std::abs(d));
    ref_max = std::max(ref_max, std::abs(b[i]));
  }
  if (!e.finite || ref2 == 0.0) {
    e.norm_wise = e.max_wise = INFINITY;
    return e;
  }
  e.norm_wise = std::sqrt(diff2 / ref2);
  e.max_wise = diff_max / ref_max;
  return e;
}

void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& golden) {
  const Errors e = compare(got, golden);
  std::printf("  %-34s norm-wise %.3e  max-normalised %.3e\n", what.c_str(), e.norm_wise, e.max_wise);
  EXPECT_TRUE(e.finite) << what << ": NaN or Inf";
  EXPECT_LT(e.norm_wise, kTolerance) << what;
  EXPECT_LT(e.max_wise, kTolerance) << what;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A golden tensor ([n] or [rows, cols]) as doubles; one that is absent or of another shape or dtype is
// an error naming the file and the tensor.
std::vector<double> golden_tensor(const SafetensorsFile& f, const std::string& name, std::vector<int64_t> shape,
                                  DType dtype) {
  EXPECT_TRUE(shape.size() == 1 || shape.size() == 2);
  const int64_t n = shape.size() == 1 ? shape[0] : shape[0] * shape[1];
  std::vector<unsigned char> bytes(static_cast<size_t>(n) * dtype_size(dtype));
  const Tensor t = shape.size() == 1 ? Tensor(bytes.data(), dtype, {shape[0]})
                                     : Tensor(bytes.data(), dtype, {shape[0], shape[1]});
  f.read(name, t);
  return test::download(t);
}

class HfParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfParityTest, ForwardMatchesTransformers) {
  const fs::path dir = fs::path(LONGTRAIN_HF_PARITY_DIR) / GetParam();
  for (const char* file : {"config.json", "model.safetensors", "tokens.json", "golden.safetensors"})
    ASSERT_TRUE(fs::is_regular_file(dir / file))
        << (dir / file) << " is missing: the fixtures and goldens are committed; see README.md beside them";

  const HfLlamaConfig hf = read_hf_config((dir / "config.json").string());
  const LlamaConfig& c = hf.model;
  const std::vector<int32_t> tokens =
      nlohmann::json::parse(read_text(dir / "tokens.json")).at("tokens").get<std::vector<int32_t>>();
  const auto T = static_cast<int64_t>(tokens.size());
  ASSERT_GE(T, 2);

  const SafetensorsFile golden((dir / "golden.safetensors").string());
  for (const char* key : {"transformers_version", "transformers_commit", "torch_version", "date"})
    ASSERT_TRUE(golden.metadata().count(key)) << "golden.safetensors has no metadata '" << key << "'";
  std::printf("%s: transformers %s (%s), torch %s, made %s; %lld tokens, vocab %lld\n", GetParam().c_str(),
              golden.metadata().at("transformers_version").c_str(), golden.metadata().at("transformers_commit").c_str(),
              golden.metadata().at("torch_version").c_str(), golden.metadata().at("date").c_str(),
              static_cast<long long>(T), static_cast<long long>(c.vocab_size));
  const std::vector<double> golden_tokens = golden_tensor(golden, "tokens", {T}, DType::i32);
  for (int64_t t = 0; t < T; ++t)
    ASSERT_EQ(golden_tokens[t], tokens[t]) << "golden.safetensors was made from other tokens than tokens.json";
  const std::vector<double> golden_logits = golden_tensor(golden, "logits", {T, c.vocab_size}, DType::f32);
  const std::vector<double> golden_losses = golden_tensor(golden, "losses", {T - 1}, DType::f32);

  LlamaModel model(c, Precision::cpu(DType::f32), CheckpointPolicy::none, T);
  model.set_rope_length(T);  // rope_scaling dynamic: the table for this length, as transformers' forward
  const SafetensorsLoadReport report = load_hf_weights(dir.string(), model.params());
  EXPECT_TRUE(report.ignored.empty()) << "our own export carries tensors the model lacks";

  // The shard: the sequence at positions 0..T-1, each label the next token (the last one ignored).
  test::HostTensor<int32_t> tok({T}), labels({T}), positions({T});
  for (int64_t t = 0; t < T; ++t) {
    tok[t] = tokens[t];
    labels[t] = t + 1 < T ? tokens[t + 1] : LlamaModel::kIgnoreIndex;
    positions[t] = static_cast<int32_t>(t);
  }
  const TokenShard shard{tok, labels, positions};

  test::HostTensor<float> logits({T, c.vocab_size});
  model.forward_logits(shard, logits);
  expect_close("logits (forward_logits)", test::download(logits), golden_logits);

  test::HostTensor<float> losses({T});
  const LossSum sum = model.forward(shard, losses);
  std::vector<double> per_token = test::download(losses);
  EXPECT_EQ(per_token.back(), 0.0) << "the ignored last label has a loss";
  per_token.pop_back();
  expect_close("per-token losses (fused head)", per_token, golden_losses);
  EXPECT_EQ(sum.count, T - 1);
  double golden_sum = 0.0;
  for (double l : golden_losses) golden_sum += l;
  expect_close("loss sum", {sum.sum}, {golden_sum});

  // Generation: the first half as a prompt, then one token at a time through the KV cache; the logits
  // after each step are the golden row of that position.
  KvCache cache(c, model.precision(), T);
  const int64_t prompt = T / 2;
  std::vector<double> decoded, golden_rows;
  auto take = [&](const std::vector<float>& row, int64_t position) {
    ASSERT_EQ(static_cast<int64_t>(row.size()), c.vocab_size);
    decoded.insert(decoded.end(), row.begin(), row.end());
    golden_rows.insert(golden_rows.end(), golden_logits.begin() + position * c.vocab_size,
                       golden_logits.begin() + (position + 1) * c.vocab_size);
  };
  take(decode_tokens(model, cache, std::vector<int32_t>(tokens.begin(), tokens.begin() + prompt)), prompt - 1);
  for (int64_t t = prompt; t < T; ++t) take(decode_tokens(model, cache, {tokens[t]}), t);
  expect_close("logits (generate, KV cache)", decoded, golden_rows);
}

// The committed checkpoint and tokens are byte for byte what the fixture code writes now: when this
// fails, the exporter or the initialisation changed, and the fixtures and their goldens must be made
// again (README.md beside them) before the next change to them.
TEST_P(HfParityTest, FixtureIsWhatTheFixtureCodeWrites) {
  const fs::path committed = fs::path(LONGTRAIN_HF_PARITY_DIR) / GetParam();
  const fs::path fresh = fs::temp_directory_path() / ("longtrain_hf_parity_" + std::to_string(::getpid())) / GetParam();
  fs::remove_all(fresh);
  for (const HfParityFixture& f : hf_parity_fixtures())
    if (f.name == GetParam()) write_hf_parity_fixture(fresh, f);
  for (const char* file : {"model.safetensors", "tokens.json"}) {
    ASSERT_TRUE(fs::is_regular_file(committed / file)) << (committed / file) << " is missing";
    ASSERT_TRUE(fs::is_regular_file(fresh / file)) << (fresh / file) << " was not written";
    EXPECT_TRUE(read_text(committed / file) == read_text(fresh / file))
        << (committed / file) << " differs from what make_hf_parity_fixtures writes now";
  }
  fs::remove_all(fresh.parent_path());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParityTest, ::testing::ValuesIn(fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// The comparison itself must be able to fail: NaN, Inf and a wrong value are caught.
TEST(HfParityCompare, FailsOnNonFiniteAndWrongValues) {
  const std::vector<double> ref = {1.0, -2.0, 3.0};
  EXPECT_LT(compare({1.0, -2.0, 3.0}, ref).max_wise, 1e-15);
  EXPECT_FALSE(compare({NAN, -2.0, 3.0}, ref).finite);
  EXPECT_FALSE(compare({1.0, INFINITY, 3.0}, ref).finite);
  EXPECT_FALSE(compare(ref, {1.0, -2.0, NAN}).finite);
  EXPECT_EQ(compare({NAN, NAN, NAN}, ref).norm_wise, INFINITY);
  EXPECT_GT(compare({1.0, -2.0, 3.001}, ref).max_wise, kTolerance);
  EXPECT_GT(compare({1.0, -2.0, 3.001}, ref).norm_wise, kTolerance);
}

}  // namespace
}  // namespace longtrain::model
