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
#include <nlohmann/json.hpp>

#include "train_fixture.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
using test::read_file;
namespace fs = std::filesystem;

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

// The step log shows how often attention ran: once per layer under remat_aware, twice under full;
// and the most memory longtrain had allocated, which the memory plan checked before the start must
// match (within 10%, never below what was allocated).
TEST_F(TrainTest, StepLogCountsAttentionForwardsAndPeakMemoryMatchesThePlan) {
  for (auto [policy, expected] : {std::pair{"remat_aware", 1.0}, std::pair{"full", 2.0}, std::pair{"none", 1.0}}) {
    const std::string name = std::string("attn_count_") + policy;
    train(config(name, {"train.steps=2", "eval.batches=0", "checkpoint.every=0", "optim.warmup_steps=1",
                        std::string("model.checkpoint=") + policy}));
    std::ifstream in(root_ / "runs" / name / "metrics.jsonl");
    int lines = 0;
    for (std::string line; std::getline(in, line); ++lines) {
      EXPECT_NE(line.find(fmt::format("\"attention_forwards_per_layer\":{:.1f},", expected)), std::string::npos)
          << policy << ": " << line;
      const nlohmann::json j = nlohmann::json::parse(line);
      const double peak = j.at("allocated_peak_gib").get<double>(), plan = j.at("plan_gib").get<double>();
      EXPECT_GT(peak, 0.0) << policy;
      EXPECT_LE(peak, plan) << policy << ": more was allocated than planned";
      EXPECT_GE(peak, 0.9 * plan) << policy << ": the plan is more than 10% above what was allocated";
    }
    EXPECT_EQ(lines, 2);
  }
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
