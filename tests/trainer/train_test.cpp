// The training loop end to end on a small synthetic corpus: bit-exact resume, NaN/Inf handling both
// ways, eval of a checkpoint reproducing the loop's validation loss, and bad configs leaving no run
// directory behind (through the real `longtrain` binary).
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "trainer/trainer.h"

namespace longtrain::trainer {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A corpus with structure a small model can learn: sentences from a tiny grammar.
std::string synthetic_document(std::mt19937& rng) {
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

class TrainTest : public ::testing::Test {
 protected:
  static fs::path root_;

  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / fmt::format("longtrain-train-test-{}", getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::mt19937 rng(5);
    {
      std::ofstream out(root_ / "corpus.jsonl");
      for (int d = 0; d < 300; ++d) out << "{\"text\": \"" << synthetic_document(rng) << "\"}\n";
    }
    data::TokenizerTrainOptions to;
    to.inputs = {(root_ / "corpus.jsonl").string()};
    to.model_prefix = (root_ / "tok").string();
    to.vocab_size = 320;
    to.threads = 1;
    data::train_tokenizer(to);
    data::PrepareOptions po;
    po.tokenizer = (root_ / "tok.model").string();
    po.inputs = {(root_ / "corpus.jsonl").string()};
    po.output = (root_ / "shards").string();
    po.val_fraction = 0.1;
    po.threads = 1;
    po.progress = false;
    data::prepare_corpus(po);
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

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
fs::path TrainTest::root_;

TEST_F(TrainTest, ResumeIsBitExact) {
  TrainSummary whole = train(config("whole"));
  ASSERT_EQ(whole.losses.size(), 8u);
  const fs::path step4 = root_ / "runs/whole/checkpoints/step_4";
  ASSERT_TRUE(fs::exists(step4 / "model.safetensors"));

  // An interrupted run: the same config in another run directory, holding only step 4.
  TrainConfig c = config("resumed");
  fs::create_directories(c.checkpoint.dir);
  fs::copy(step4, fs::path(c.checkpoint.dir) / "step_4", fs::copy_options::recursive);
  TrainSummary resumed = train(c, "auto");
  ASSERT_EQ(resumed.first_step, 5);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[4 + i]) << "step " << 5 + i;
  EXPECT_EQ(read_file(root_ / "runs/whole/checkpoints/step_8/model.safetensors"),
            read_file(fs::path(c.checkpoint.dir) / "step_8/model.safetensors"));
  EXPECT_EQ(read_file(root_ / "runs/whole/checkpoints/step_8/optimizer.safetensors"),
            read_file(fs::path(c.checkpoint.dir) / "step_8/optimizer.safetensors"));
  // The loss went down over the run, and the run left its log, metrics and loss curve.
  EXPECT_LT(whole.losses.back(), whole.losses.front());
  EXPECT_TRUE(fs::exists(root_ / "runs/whole/metrics.jsonl"));
  EXPECT_NE(read_file(root_ / "runs/whole/loss.svg").find("<polyline"), std::string::npos);
  EXPECT_NE(read_file(root_ / "runs/whole/config.yaml").find("seq_len: 32"), std::string::npos);
}

TEST_F(TrainTest, ResumeWithAChangedConfigIsRefusedNamingTheKey) {
  train(config("changed", {"train.steps=4", "checkpoint.every=2", "eval.batches=0"}));
  TrainConfig c = config("changed", {"train.steps=4", "checkpoint.every=2", "eval.batches=0", "optim.lr=0.01"});
  try {
    train(c, "auto");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.lr"), std::string::npos) << e.what();
  }
}

TEST_F(TrainTest, NonFiniteGradientsAreSkippedWithoutAnUpdate) {
  TrainConfig c = config("nan_skip", {"train.on_nonfinite=skip", "eval.batches=0"});
  std::vector<float> before_step3;
  bool unchanged_at_step4 = false;
  TrainHooks hooks;
  hooks.after_backward = [&](int64_t step, model::LlamaModel& m) {
    Tensor p = m.params().flat();
    if (step == 3 && before_step3.empty()) {
      before_step3.assign(p.ptr<float>(), p.ptr<float>() + p.numel());
      m.grads().flat().ptr<float>()[5] = NAN;
    }
    if (step == 4 && !unchanged_at_step4)
      unchanged_at_step4 = std::equal(before_step3.begin(), before_step3.end(), p.ptr<float>());
  };
  TrainSummary s = train(c, "", hooks);
  EXPECT_EQ(s.skipped_steps, 1);
  EXPECT_TRUE(std::isnan(s.losses[2]));
  EXPECT_TRUE(unchanged_at_step4) << "the step with a NaN gradient changed the parameters";
  EXPECT_TRUE(std::isfinite(s.losses.back()));
}

TEST_F(TrainTest, NonFiniteLossStopsTheRunNamingTheStep) {
  TrainConfig c = config("nan_stop", {"train.on_nonfinite=stop", "eval.batches=0"});
  TrainHooks hooks;
  hooks.after_backward = [](int64_t step, model::LlamaModel& m) {
    if (step == 3) m.grads().flat().ptr<float>()[0] = INFINITY;
  };
  try {
    train(c, "", hooks);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 3"), std::string::npos) << e.what();
  }
  // Too many skips in a row stop the run as well.
  TrainConfig k = config("nan_many", {"train.on_nonfinite=skip", "train.max_nonfinite_skips=1", "eval.batches=0"});
  hooks.after_backward = [](int64_t step, model::LlamaModel& m) {
    if (step >= 3) m.grads().flat().ptr<float>()[0] = NAN;
  };
  EXPECT_THROW(train(k, "", hooks), Error);
}

TEST_F(TrainTest, EvalOfACheckpointReproducesTheLoopsValidationLoss) {
  TrainSummary s = train(config("evaluated", {"train.steps=3", "checkpoint.every=0"}));
  ASSERT_TRUE(s.final_eval && s.last_checkpoint);
  LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint);
  EXPECT_EQ(m.step, 3);
  data::LoaderOptions o;
  o.shard_dir = m.config.data.train;
  o.split = "val";
  o.seq_len = m.config.data.seq_len;
  o.prefetch = 0;
  data::Loader val(o);
  EvalResult e = evaluate(*m.model, val, m.config.eval.batches, m.config.eval.position_buckets);
  EXPECT_EQ(e.loss, s.final_eval->loss);
  EXPECT_EQ(e.tokens, s.final_eval->tokens);
  EXPECT_EQ(e.bucket_loss.size(), static_cast<size_t>(m.config.eval.position_buckets));
}

// Through the real CLI: each class of config error exits non-zero with its message, and no run
// directory appears.
int run_cli(const std::string& args, std::string& output) {
  const std::string cmd = fmt::format("{} {} 2>&1", LONGTRAIN_BINARY, args);
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  output.clear();
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(TrainTest, BadConfigsExitNonZeroAndCreateNoRunDirectory) {
  struct Case {
    const char* name;
    std::string extra;
    const char* expect;
  };
  const Case cases[] = {
      {"unknown_key", "optim2:\n  lr: 1\n", "optim2"},
      {"wrong_type", "", "train.steps"},
      {"out_of_range", "", "optim.beta2"},
      {"inconsistent", "", "n_kv_heads"},
      {"missing_data", "", "nowhere"},
  };
  const std::vector<std::string> sets[] = {
      {}, {"train.steps=many"}, {"optim.beta2=1.5"}, {"model.n_kv_heads=3"}, {"data.train=/nowhere/shards"}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    fs::path cfg = write_config(cases[i].name, cases[i].extra);
    std::string args = "train " + cfg.string();
    for (const std::string& s : sets[i]) args += " --set " + s;
    std::string out;
    EXPECT_EQ(run_cli(args, out), 1) << cases[i].name << ": " << out;
    EXPECT_NE(out.find(cases[i].expect), std::string::npos) << cases[i].name << ": " << out;
    EXPECT_FALSE(fs::exists(root_ / "runs" / cases[i].name)) << cases[i].name << " created its run directory";
  }
}

}  // namespace
}  // namespace longtrain::trainer
