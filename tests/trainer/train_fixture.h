// The fixture of the trainer tests: a small synthetic corpus, a tokenizer trained on it, prepared
// shards, and a small model config over them.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "trainer/trainer.h"

namespace longtrain::trainer::test {

namespace fs = std::filesystem;

// A missing file is an error (test_util.h), so "" is never compared with "".
using ::longtrain::test::read_file;

// The steps a run recorded in its metrics.jsonl (skipped and eval records left out).
struct LoggedStep {
  int64_t step = 0;
  double loss = 0.0, lr = 0.0;
};
inline std::vector<LoggedStep> logged_steps(const fs::path& run_dir) {
  std::vector<LoggedStep> out;
  std::istringstream in(read_file(run_dir / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss"))
      out.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>(), j.at("lr").get<double>()});
  }
  return out;
}

// A corpus with structure a small model can learn: sentences from a tiny grammar.
inline std::string synthetic_document(std::mt19937& rng) {
  static const char* subjects[] = {"the cat", "a dog", "my sister", "the old man", "every child", "our teacher"};
  static const char* verbs[] = {"sees", "likes", "follows", "paints", "remembers", "finds"};
  static const char* objects[] = {"the garden", "a red ball", "the river", "her letters", "the morning", "a song"};
  std::string doc;
  const int sentences = 3 + static_cast<int>(rng() % 5);
  for (int s = 0; s < sentences; ++s) {
    doc += fmt::format("{} {} {}. ", subjects[rng() % 6], verbs[rng() % 6], objects[rng() % 6]);
  }
  return doc;
}

// Expects checkpoint directory `got` to hold what `want` holds, byte for byte: the model, one
// optimizer shard per rank (`ranks` of them), trainer_state.json (step, counters, the loader's
// epoch, cursor and seed) and the rest. Only config.yaml may differ (it names the run directory).
inline void expect_same_checkpoint(const fs::path& want, const fs::path& got, int ranks) {
  ASSERT_TRUE(fs::is_directory(want)) << want;
  ASSERT_TRUE(fs::is_directory(got)) << got;
  std::vector<std::string> want_files, got_files;
  for (const auto& e : fs::directory_iterator(want)) want_files.push_back(e.path().filename().string());
  for (const auto& e : fs::directory_iterator(got)) got_files.push_back(e.path().filename().string());
  std::sort(want_files.begin(), want_files.end());
  std::sort(got_files.begin(), got_files.end());
  EXPECT_EQ(got_files, want_files);
  std::vector<std::string> required = {"model.safetensors", "trainer_state.json"};
  for (int r = 0; r < ranks; ++r) required.push_back(fmt::format("optimizer.rank{}.safetensors", r));
  for (const std::string& f : required)
    EXPECT_TRUE(std::find(want_files.begin(), want_files.end(), f) != want_files.end()) << want / f << " missing";
  for (const std::string& f : want_files) {
    if (f == "config.yaml" || f == "MANIFEST.json") continue;
    EXPECT_TRUE(read_file(want / f) == read_file(got / f)) << f << " differs between " << want << " and " << got;
  }
  // The manifests record the same files with the same sizes and checksums, config.yaml's aside.
  auto records = [](const fs::path& dir) {
    nlohmann::json files = nlohmann::json::parse(read_file(dir / "MANIFEST.json")).at("files");
    nlohmann::json kept = nlohmann::json::array();
    for (const auto& r : files)
      if (r.at("path") != "config.yaml") kept.push_back(r);
    return kept;
  };
  EXPECT_EQ(records(got), records(want));
  EXPECT_GE(records(want).size(), required.size());
}

class TrainTest : public ::testing::Test {
 protected:
  static inline fs::path root_;

  // A SentencePiece tokenizer of `vocab_size` trained on the suite's corpus (dir/tok.model), and the
  // corpus prepared with it (dir/shards, a tenth for validation).
  static void tokenizer_and_shards(const fs::path& dir, int vocab_size) {
    data::TokenizerTrainOptions to;
    to.inputs = {(root_ / "corpus.jsonl").string()};
    to.model_prefix = (dir / "tok").string();
    to.vocab_size = vocab_size;
    to.threads = 1;
    data::train_tokenizer(to);
    data::PrepareOptions po;
    po.tokenizer = (dir / "tok.model").string();
    po.inputs = {(root_ / "corpus.jsonl").string()};
    po.output = (dir / "shards").string();
    po.val_fraction = 0.1;
    po.threads = 1;
    po.progress = false;
    data::prepare_corpus(po);
  }

  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / fmt::format("longtrain-train-test-{}", getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::mt19937 rng(5);
    {
      std::ofstream out(root_ / "corpus.jsonl");
      for (int d = 0; d < 300; ++d) out << "{\"text\": \"" << synthetic_document(rng) << "\"}\n";
    }
    tokenizer_and_shards(root_, 320);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  // Shards of another corpus from the same grammar (another seed), with the suite's tokenizer: new
  // data for a resumed run. Returns the shard directory.
  static fs::path prepare_other_corpus(const std::string& name, unsigned seed) {
    std::mt19937 rng(seed);
    const fs::path corpus = root_ / (name + ".jsonl");
    {
      std::ofstream out(corpus);
      for (int d = 0; d < 300; ++d) out << "{\"text\": \"" << synthetic_document(rng) << "\"}\n";
    }
    data::PrepareOptions po;
    po.tokenizer = (root_ / "tok.model").string();
    po.inputs = {corpus.string()};
    po.output = (root_ / name).string();
    po.val_fraction = 0.1;
    po.threads = 1;
    po.progress = false;
    data::prepare_corpus(po);
    return root_ / name;
  }

  // A small model on the synthetic corpus; `extra` is appended YAML (later keys win via --set).
  static fs::path write_config(const std::string& name, const std::string& extra = "") {
    fs::path p = root_ / (name + ".yaml");
    std::ofstream out(p);
    out << fmt::format(R"(model:
  vocab_size: 320
  dim: 32
  n_layers: 2
  n_heads: 4
  n_kv_heads: 2
  ffn_dim: 64
  max_seq_len: 64
data:
  train: {0}/shards
  tokenizer: {0}/tok.model
  seq_len: 32
train:
  device: cpu
  steps: 8
  batch_size: 2
  grad_accum: 2
  seed: 3
optim:
  lr: 0.003
  warmup_steps: 2
  min_lr: 0.0003
checkpoint:
  every: 4
eval:
  batches: 3
  every: 0
logging:
  run_dir: {0}/runs/{1}
  log_every: 100
  plot: true
{2})",
                       root_.string(), name, extra);
    return p;
  }

  static TrainConfig config(const std::string& name, const std::vector<std::string>& sets = {},
                            const std::string& extra = "") {
    TrainConfig c = load_config(write_config(name, extra).string(), sets);
    resolve_device(c, false);
    return c;
  }
};


// No user-facing error carries the C++ source location that raised it ("…/data/shards.cpp:232: ");
// LONGTRAIN_DEBUG=1 adds it on a line of its own.
inline void expect_no_source_location(const std::string& output) {
  static const std::regex location(R"([A-Za-z0-9_]+\.(cpp|cu|h):[0-9]+)");
  EXPECT_FALSE(std::regex_search(output, location)) << "a source location in: " << output;
}

#ifdef LONGTRAIN_BINARY
// The real `longtrain ARGS`, with `env` ("NAME=value ...") before it: its exit code, and stdout and
// stderr in `output`. For the tests whose target defines LONGTRAIN_BINARY (tests/trainer/CMakeLists.txt).
inline int run_cli(const std::string& args, std::string& output, const std::string& env = "") {
  return ::longtrain::test::run_command(fmt::format("{} {} {} 2>&1", env, LONGTRAIN_BINARY, args), output);
}
#endif

}  // namespace longtrain::trainer::test
