// `longtrain eval` under longtrain-run (Gloo on this machine): the validation loss and the loss by
// position of a sequence-parallel (and data- x sequence-parallel) evaluation equal one process's, for
// every attention schedule, on a model with yarn RoPE scaling evaluated at 2x its original context;
// training with RoPE scaling (yarn, llama3) under every schedule equals one rank; passkey retrieval scores in one forward pass per trial, so a sequence-
// parallel group finds a key a model knows wherever its tokens fall and misses it when the model is
// wrong, with the same grid as one process.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_export.h"
#include "parallel/net.h"
#include "passkey_model.h"
#include "train_fixture.h"
#include "trainer/passkey.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
namespace fs = std::filesystem;

// Runs `longtrain ARGS` in `nproc` processes (1: without the launcher) and returns its exit code;
// `output` gets stdout and stderr of every rank.
int run_longtrain(int nproc, const std::string& args, std::string& output) {
  const std::string cmd =
      nproc == 1 ? fmt::format("{} {} 2>&1", LONGTRAIN_BINARY, args)
                 : fmt::format("{} --nproc-per-node {} --master-addr 127.0.0.1 --master-port {} -- {} {} 2>&1",
                               LONGTRAIN_RUN_BINARY, nproc, parallel::net::pick_free_port(), LONGTRAIN_BINARY, args);
  return ::longtrain::test::run_command(cmd, output);
}

struct EvalOutput {
  double loss = NAN;
  int64_t tokens = 0;
  std::vector<double> buckets;
};

// What eval wrote to --json (full precision), checked against its printed output: exactly one
// "validation loss" line (only rank 0 prints) and `buckets` bucket losses, every number finite.
EvalOutput parse_eval(const std::string& out, const fs::path& json_path, size_t buckets) {
  EvalOutput e;
  const nlohmann::json j = nlohmann::json::parse(::longtrain::test::read_file(json_path));
  e.loss = j.at("loss").get<double>();
  e.tokens = j.at("tokens").get<int64_t>();
  for (const auto& b : j.at("buckets")) e.buckets.push_back(b.at("loss").get<double>());
  EXPECT_EQ(e.buckets.size(), buckets) << json_path;
  EXPECT_TRUE(std::isfinite(e.loss)) << json_path;
  for (double b : e.buckets) EXPECT_TRUE(std::isfinite(b)) << json_path;
  const std::regex loss_line("validation loss ([0-9.]+), perplexity");
  int lines = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), loss_line); it != std::sregex_iterator(); ++it, ++lines)
    EXPECT_NEAR(std::stod((*it)[1].str()), e.loss, 1e-4) << "printed and written losses differ";
  EXPECT_EQ(lines, 1) << "eval printed " << lines << " loss lines:\n" << out;
  return e;
}

// yarn over an original context of 32 (the fixture trains at 32 and the eval runs at 64).
const char* const kYarn[] = {"model.rope_scaling=yarn", "model.rope_factor=2",
                             "model.rope_original_max_position_embeddings=32"};

class DistributedEvalTest : public TrainTest {
 protected:
  // A checkpoint of the fixture's small model after 8 steps (made once for the suite).
  static fs::path checkpoint() {
    static fs::path dir = [] {
      const TrainSummary s = train(config("eval_model", {"checkpoint.every=0", "eval.batches=0", kYarn[0], kYarn[1],
                                                         kYarn[2]}));
      return s.run_dir / "checkpoints" / "step_8";
    }();
    return dir;
  }
};

TEST_F(DistributedEvalTest, SequenceParallelLossEqualsOneProcess) {
  const fs::path json_path = root_ / "eval.json";
  const std::string args = fmt::format("eval --checkpoint {} --batches 0 --buckets 4 --seq-len 64 --json {}",
                                       checkpoint().string(), json_path.string());
  std::string out;
  fs::remove(json_path);
  ASSERT_EQ(run_longtrain(1, args, out), 0) << out;
  const EvalOutput one = parse_eval(out, json_path, 4);
  EXPECT_GT(one.tokens, 0);
  std::printf("one process: loss %.9f over %lld tokens\n", one.loss, static_cast<long long>(one.tokens));
  struct Case {
    int nproc;
    std::string extra, shape;
  };
  const std::vector<Case> cases = {
      {2, "", "data parallel 1 x sequence parallel 2 (attention zigzag, layout zigzag)"},
      {2, "--schedule ring --layout contiguous", "sequence parallel 2 (attention ring, layout contiguous)"},
      {2, "--schedule burst", "sequence parallel 2 (attention burst"},
      {4, "--schedule distflash --layout contiguous", "data parallel 1 x sequence parallel 4 (attention distflash"},
      {4, "--sp-size 2", "data parallel 2 x sequence parallel 2"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} processes {}", c.nproc, c.extra));
    fs::remove(json_path);
    ASSERT_EQ(run_longtrain(c.nproc, args + " " + c.extra, out), 0) << out;
    EXPECT_NE(out.find(c.shape), std::string::npos) << out;
    const EvalOutput e = parse_eval(out, json_path, 4);
    EXPECT_EQ(e.tokens, one.tokens) << "another set of validation tokens";
    // f32 throughout; only the order of the attention's and the loss's sums differs.
    EXPECT_LT(::longtrain::test::scalar_relative_error(e.loss, one.loss), 1e-5) << e.loss << " vs " << one.loss;
    EXPECT_LT(::longtrain::test::relative_error(e.buckets, one.buckets), 1e-5);
    std::printf("%d processes %s: loss %.9f, relative difference %.2e\n", c.nproc, c.extra.c_str(), e.loss,
                ::longtrain::test::scalar_relative_error(e.loss, one.loss));
  }
}

// Forward and backward with RoPE scaling under every schedule: 8 training steps on 2 ranks log the
// losses one rank logs (the scaled cos/sin follow each token's global position whatever the layout).
TEST_F(DistributedEvalTest, TrainingWithRopeScalingUnderEveryScheduleEqualsOneRank) {
  const std::vector<std::vector<std::string>> scalings = {
      {kYarn[0], kYarn[1], kYarn[2]},
      {"model.rope_scaling=llama3", "model.rope_factor=4", "model.rope_original_max_position_embeddings=16",
       "model.rope_low_freq_factor=1", "model.rope_high_freq_factor=4"}};
  for (const std::vector<std::string>& scaling : scalings) {
    std::vector<std::string> common = {"train.steps=8", "eval.batches=0", "checkpoint.every=0", "train.batch_size=1",
                                       "optim.warmup_steps=2"};
    common.insert(common.end(), scaling.begin(), scaling.end());
    const std::string kind = scaling[0].substr(scaling[0].find('=') + 1);
    const TrainSummary single = train(config("rope_single_" + kind, common));
    struct Case {
      const char* schedule;
      const char* layout;
    };
    for (const Case& k : {Case{"ring", "contiguous"}, Case{"zigzag", "zigzag"}, Case{"distflash", "contiguous"},
                          Case{"burst", "zigzag"}}) {
      const std::string name = fmt::format("rope_{}_{}", kind, k.schedule);
      SCOPED_TRACE(name);
      std::string args = "train " + write_config(name).string();
      for (const std::string& s : common) args += " --set " + s;
      args += fmt::format(" --set parallel.sp_size=2 --set attention.schedule={} --set parallel.layout={}", k.schedule,
                          k.layout);
      std::string out;
      ASSERT_EQ(run_longtrain(2, args, out), 0) << out;
      const std::vector<test::LoggedStep> sp = test::logged_steps(root_ / "runs" / name);
      ASSERT_EQ(sp.size(), single.losses.size());
      double worst = 0;
      for (size_t i = 0; i < sp.size(); ++i)
        worst = std::max(worst, ::longtrain::test::scalar_relative_error(sp[i].loss, single.losses[i]));
      EXPECT_LT(worst, 1e-5);
      std::printf("%s: worst relative loss difference over %zu steps %.2e\n", name.c_str(), sp.size(), worst);
    }
  }
}

// generate under longtrain-run: the KV cache sharded over 2 and 3 ranks (the prompt then spans
// several ranks' blocks) continues the prompt with the same text as one process, greedy and sampled,
// and only rank 0 prints it.
TEST_F(DistributedEvalTest, GenerateWithAShardedKvCacheEqualsOneProcess) {
  for (const char* sampling : {"--temperature 0", "--temperature 0.8 --top-p 0.9 --seed 5"}) {
    const std::string args = fmt::format(
        "generate --checkpoint {} --prompt \"the old man finds the river. my sister likes\" --max-new-tokens 24 {}",
        checkpoint().string(), sampling);
    std::string one;
    ASSERT_EQ(run_longtrain(1, args, one), 0) << one;
    const std::string text = one.substr(0, one.find('\n'));
    ASSERT_GT(text.size(), 20u) << one;
    for (int nproc : {2, 3}) {
      SCOPED_TRACE(fmt::format("{} on {} processes", sampling, nproc));
      std::string out;
      ASSERT_EQ(run_longtrain(nproc, args, out), 0) << out;
      EXPECT_NE(out.find("[rank 0]: " + text + "\n"), std::string::npos) << "one process: " << text << "\n" << out;
      for (int r = 1; r < nproc; ++r)
        EXPECT_EQ(out.find(fmt::format("[rank {}]: {}", r, text.substr(0, 10))), std::string::npos) << out;
    }
  }
}

// A plain Hugging Face directory (the checkpoint's config.json and weights, no MANIFEST, no data of its
// own) evaluates on --data with the checkpoint's loss, in one process and on 2 ranks.
TEST_F(DistributedEvalTest, AHuggingFaceDirectoryEvaluatesOnGivenData) {
  const fs::path hf = root_ / "eval_model_hf";
  fs::create_directories(hf);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(checkpoint() / f, hf / f, fs::copy_options::overwrite_existing);
  const fs::path json_path = root_ / "eval_hf.json";
  const std::string common = fmt::format("--batches 12 --buckets 4 --seq-len 64 --json {}", json_path.string());
  std::string out;
  fs::remove(json_path);
  ASSERT_EQ(run_longtrain(1, fmt::format("eval --checkpoint {} {}", checkpoint().string(), common), out), 0) << out;
  const EvalOutput ours = parse_eval(out, json_path, 4);
  for (int nproc : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} processes", nproc));
    fs::remove(json_path);
    ASSERT_EQ(run_longtrain(nproc, fmt::format("eval --checkpoint {} --data {} {}", hf.string(),
                                               (root_ / "shards").string(), common), out), 0) << out;
    const EvalOutput e = parse_eval(out, json_path, 4);
    EXPECT_EQ(e.tokens, ours.tokens);
    EXPECT_LT(::longtrain::test::scalar_relative_error(e.loss, ours.loss), 1e-5) << e.loss << " vs " << ours.loss;
  }
  EXPECT_NE(run_longtrain(1, fmt::format("eval --checkpoint {} {}", hf.string(), common), out), 0);
  EXPECT_NE(out.find("pass --data"), std::string::npos) << out;
}

TEST_F(DistributedEvalTest, SpSizeThatDoesNotFitIsAClearError) {
  std::string out;
  EXPECT_NE(run_longtrain(1, fmt::format("eval --checkpoint {} --sp-size 2", checkpoint().string()), out), 0);
  EXPECT_NE(out.find("--sp-size 2 needs that many processes"), std::string::npos) << out;
  EXPECT_NE(run_longtrain(3, fmt::format("eval --checkpoint {} --sp-size 2 --seq-len 64", checkpoint().string()), out), 0);
  EXPECT_NE(out.find("sp_size"), std::string::npos) << out;
}

// A model that knows the key of the only trial (passkey_model.h), exported as a Hugging Face
// directory, is scored 1/1 by one process and by sequence-parallel groups of 2 and 3 (the trial is
// padded to what the layout splits); mapped wrong, 0/1 everywhere.
TEST_F(DistributedEvalTest, PasskeyInOneForwardUnderSequenceParallelism) {
  const data::Tokenizer tok((root_ / "tok.model").string());
  PasskeyOptions o;
  o.lengths = {300};
  o.depths = {0.5};
  o.trials = 1;
  std::vector<int32_t> prompt;
  std::vector<int32_t> answer;
  std::map<int32_t, int32_t> f;
  for (o.seed = 0;; ++o.seed) {
    ASSERT_LT(o.seed, 50u) << "no key with a consistent mapping";
    prompt.clear();
    passkey_eval(tok, o, [&](const std::vector<int32_t>& tokens) {
      if (prompt.empty()) prompt = tokens;
      return std::vector<float>(static_cast<size_t>(tok.vocab_size()), 0.0f);
    });
    const std::string text = tok.decode(std::vector<int32_t>(prompt.begin() + (tok.bos_id() >= 0), prompt.end()));
    std::smatch m;
    ASSERT_TRUE(std::regex_search(text, m, std::regex("The pass key is ([0-9]+)\\.")));
    const std::vector<int32_t> head = tok.encode(text), full = tok.encode(text + " " + m[1].str());
    answer.assign(full.begin() + static_cast<std::ptrdiff_t>(head.size()), full.end());
    if (answer.size() >= 2 && test::key_mapping(prompt, answer, f)) break;
  }
  auto export_model = [&](const std::map<int32_t, int32_t>& mapping, const std::string& name) {
    model::LlamaModel m(test::key_mapping_config(tok.vocab_size(), 512), model::Precision::cpu(DType::f32),
                        model::CheckpointPolicy::none, 1);
    test::set_key_mapping_weights(m, mapping);
    model::HfLlamaConfig hf;
    hf.model = m.config();
    const fs::path dir = root_ / name;
    model::export_hf_directory(dir.string(), hf, m.params(), DType::f32);
    return dir;
  };
  std::map<int32_t, int32_t> wrong = f;
  wrong[answer[0]] = (wrong[answer[0]] + 1) % static_cast<int32_t>(tok.vocab_size());
  const fs::path knows = export_model(f, "knows_key"), misses = export_model(wrong, "misses_key");
  for (const auto& [dir, expect] : {std::pair{knows, "1/1"}, std::pair{misses, "0/1"}}) {
    for (int nproc : {1, 2, 3}) {
      for (const char* layout : {"zigzag", "contiguous"}) {
        if (nproc == 1 && std::string(layout) == "contiguous") continue;
        SCOPED_TRACE(fmt::format("{} on {} processes, layout {}", dir.filename().string(), nproc, layout));
        std::string out;
        const std::string args =
            fmt::format("eval --checkpoint {} --passkey --lengths 300 --depths 0.5 --trials 1 --seed {} --tokenizer {} "
                        "--out {}{}",
                        dir.string(), o.seed, (root_ / "tok.model").string(),
                        (root_ / fmt::format("pk_{}_{}_{}", dir.filename().string(), nproc, layout)).string(),
                        nproc == 1 ? "" : std::string(layout) == "zigzag" ? " --layout zigzag" : " --layout contiguous --schedule ring");
        ASSERT_EQ(run_longtrain(nproc, args, out), 0) << out;
        std::smatch m;
        ASSERT_TRUE(std::regex_search(out, m, std::regex("\\s300\\s+([0-9]+/[0-9]+)"))) << out;
        EXPECT_EQ(m[1].str(), expect) << out;
      }
    }
  }
}

}  // namespace
}  // namespace longtrain::trainer
