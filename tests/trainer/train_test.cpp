// The training loop end to end on a small synthetic corpus: bit-exact resume, NaN/Inf handling both
// ways, eval of a checkpoint reproducing the loop's validation loss, and bad configs leaving no run
// directory behind (through the real `longtrain` binary).
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/generate.h"
#include "model/hf_export.h"
#include "runtime/device.h"
#include "train_fixture.h"
#include "trainer/checkpoint.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
using test::read_file;
using test::LoggedStep;
using test::logged_steps;
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
  // Model, optimizer shard, loader state and counters: the resumed run ends where the whole one did.
  test::expect_same_checkpoint(root_ / "runs/whole/checkpoints/step_8", fs::path(c.checkpoint.dir) / "step_8", 1);
  // Model, optimizer shard and trainer state (loader position, counters) at step 8, bit for bit.
  const fs::path a = root_ / "runs/whole/checkpoints/step_8", b = fs::path(c.checkpoint.dir) / "step_8";
  for (const char* file : {"model.safetensors", "optimizer.rank0.safetensors"})
    EXPECT_TRUE(read_file(a / file) == read_file(b / file)) << file << " differs";
  const nlohmann::json sa = nlohmann::json::parse(read_file(a / "trainer_state.json")),
                       sb = nlohmann::json::parse(read_file(b / "trainer_state.json"));
  EXPECT_EQ(sa, sb);
  EXPECT_EQ(sb.at("loader").at("cursor").get<int64_t>(), 8 * 4);  // 8 steps of 2 x 2 windows
  EXPECT_FALSE(sb.contains("lr_restart"));  // nothing changed: the schedule is the original one
  const std::string log = read_file(root_ / "runs/resumed/train.log");
  EXPECT_NE(log.find("resumed from"), std::string::npos);
  // Only the run directory moved (and the checkpoint directory under it): the log says so, and
  // nothing else changed.
  size_t changes = 0;
  const std::string changed = "changed on resume: ";
  for (size_t at = log.find(changed); at != std::string::npos; at = log.find(changed, at + 1)) ++changes;
  EXPECT_EQ(changes, 2u) << log;
  EXPECT_NE(log.find("changed on resume: checkpoint.dir: "), std::string::npos) << log;
  EXPECT_NE(log.find("changed on resume: logging.run_dir: "), std::string::npos) << log;
  EXPECT_EQ(log.find("re-shaped"), std::string::npos) << log;
  EXPECT_EQ(log.find("new data"), std::string::npos) << log;
  // The loss went down over the run, and the run left its log, metrics and loss curve.
  EXPECT_LT(whole.losses.back(), whole.losses.front());
  EXPECT_TRUE(fs::exists(root_ / "runs/whole/metrics.jsonl"));
  EXPECT_NE(read_file(root_ / "runs/whole/loss.svg").find("<polyline"), std::string::npos);
  EXPECT_NE(read_file(root_ / "runs/whole/config.yaml").find("seq_len: 32"), std::string::npos);
}

// The schedule rule of the README, written out here independently of optimizer.cpp: the fixture's
// run (lr 3e-3 after 2 warmup steps, cosine to 3e-4 at step 8) resumed from step 4 with new
// values. L is the original schedule's lr of step 4.
double cosine_factor(double p) { return 0.5 * (1.0 + std::cos(M_PI * p)); }
double fixture_lr(int64_t s) {
  if (s <= 2) return 3e-3 * static_cast<double>(s) / 2.0;
  return 3e-4 + (3e-3 - 3e-4) * cosine_factor(static_cast<double>(s - 2) / 6.0);
}

TEST_F(TrainTest, ResumeWithAChangedScheduleFollowsTheRuleStepByStep) {
  const std::vector<std::string> base = {"eval.batches=0", "checkpoint.every=4", "checkpoint.keep_last=0"};
  TrainSummary first = train(config("sched_first", base));
  ASSERT_EQ(first.losses.size(), 8u);
  const std::vector<LoggedStep> original = logged_steps(root_ / "runs/sched_first");
  ASSERT_EQ(original.size(), 8u);
  for (const LoggedStep& s : original) EXPECT_NEAR(s.lr, fixture_lr(s.step), 1e-15) << "step " << s.step;
  const double L = fixture_lr(4);

  struct Case {
    const char* name;
    std::vector<std::string> sets;
    int64_t end;
    std::function<double(int64_t)> lr;  // the rule for steps 5..end
  };
  const Case cases[] = {
      // More steps: cosine from L at 4 to min_lr at 12.
      {"sched_more", {"train.steps=12", "checkpoint.every=2"}, 12,
       [&](int64_t s) { return 3e-4 + (L - 3e-4) * cosine_factor(static_cast<double>(s - 4) / 8.0); }},
      // New min_lr and schedule: linear from L at 4 to 1e-4 at 10.
      {"sched_linear", {"train.steps=10", "optim.min_lr=1e-4", "optim.schedule=linear"}, 10,
       [&](int64_t s) { return 1e-4 + (L - 1e-4) * (1.0 - static_cast<double>(s - 4) / 6.0); }},
      // Warmup that still has steps to go: linear from L at 4 to the new lr at 6, then cosine.
      {"sched_warmup", {"train.steps=10", "optim.warmup_steps=6", "optim.lr=4e-3"}, 10,
       [&](int64_t s) {
         if (s <= 6) return L + (4e-3 - L) * static_cast<double>(s - 4) / 2.0;
         return 3e-4 + (4e-3 - 3e-4) * cosine_factor(static_cast<double>(s - 6) / 4.0);
       }},
      // constant: linear from L at 4 to the new lr at 10.
      {"sched_constant", {"train.steps=10", "optim.schedule=constant", "optim.lr=1e-3"}, 10,
       [&](int64_t s) { return L + (1e-3 - L) * static_cast<double>(s - 4) / 6.0; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    std::vector<std::string> sets = base;
    sets.insert(sets.end(), k.sets.begin(), k.sets.end());
    TrainConfig c = config(k.name, sets);
    fs::create_directories(c.checkpoint.dir);
    fs::copy(root_ / "runs/sched_first/checkpoints/step_4", fs::path(c.checkpoint.dir) / "step_4",
             fs::copy_options::recursive);
    TrainSummary s = train(c, "auto");
    EXPECT_EQ(s.first_step, 5);
    EXPECT_EQ(s.last_step, k.end);
    const std::vector<LoggedStep> steps = logged_steps(root_ / "runs" / k.name);
    ASSERT_EQ(steps.size(), static_cast<size_t>(k.end - 4));
    double worst = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_EQ(steps[i].step, static_cast<int64_t>(5 + i));
      const double want = k.lr(steps[i].step);
      EXPECT_NEAR(steps[i].lr, want, 1e-12 * want) << "step " << steps[i].step;
      EXPECT_TRUE(std::isfinite(steps[i].loss)) << "step " << steps[i].step;
      worst = std::max(worst, std::abs(steps[i].lr - want) / want);
    }
    // No jump: the first resumed step's lr is as close to L as one step of the new schedule allows.
    EXPECT_LT(std::abs(steps[0].lr - L), std::abs(k.lr(6) - k.lr(5)) + 1e-12);
    ::testing::Test::RecordProperty(std::string(k.name) + "_worst_relative_lr_error", fmt::format("{:.1e}", worst));
    // The log names each change and the re-shaped schedule.
    const std::string log = read_file(root_ / "runs" / k.name / "train.log");
    EXPECT_NE(log.find("lr schedule re-shaped at optimizer step 4"), std::string::npos) << log;
    for (const std::string& set : k.sets) {
      const std::string key = set.substr(0, set.find('='));
      EXPECT_NE(log.find("changed on resume: " + key + ": "), std::string::npos) << key << "\n" << log;
    }
  }

  // More steps trains on to the new end, writes checkpoints at the new steps, and lowers the loss.
  const fs::path more = root_ / "runs/sched_more";
  EXPECT_NE(read_file(more / "train.log").find("changed on resume: train.steps: 8 -> 12"), std::string::npos);
  EXPECT_NE(read_file(more / "train.log").find("changed on resume: checkpoint.every: 4 -> 2"), std::string::npos);
  for (int step : {6, 8, 10, 12})
    EXPECT_EQ(verify_checkpoint(more / fmt::format("checkpoints/step_{}", step)), "") << "step " << step;
  const std::vector<LoggedStep> more_steps = logged_steps(more);
  EXPECT_LT(more_steps.back().loss, original.front().loss);
  // The re-shaped schedule is part of the checkpoint: resuming step 8 again, unchanged, follows it
  // and gives the same steps 9..12 bit for bit.
  TrainConfig again = config("sched_again", {"eval.batches=0", "checkpoint.every=2", "checkpoint.keep_last=0",
                                             "train.steps=12"});
  fs::create_directories(again.checkpoint.dir);
  fs::copy(more / "checkpoints/step_8", fs::path(again.checkpoint.dir) / "step_8", fs::copy_options::recursive);
  train(again, "auto");
  const std::vector<LoggedStep> again_steps = logged_steps(root_ / "runs/sched_again");
  ASSERT_EQ(again_steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(again_steps[i].lr, more_steps[4 + i].lr) << "step " << again_steps[i].step;
    EXPECT_EQ(again_steps[i].loss, more_steps[4 + i].loss) << "step " << again_steps[i].step;
  }
  EXPECT_TRUE(read_file(more / "checkpoints/step_12/model.safetensors") ==
              read_file(root_ / "runs/sched_again/checkpoints/step_12/model.safetensors"));
  EXPECT_EQ(read_file(root_ / "runs/sched_again/train.log").find("re-shaped"), std::string::npos);

  // Fewer steps than the checkpoint has taken is an error naming both.
  try {
    train(config("sched_fewer", {"eval.batches=0", "train.steps=3", "optim.warmup_steps=1"}),
          (root_ / "runs/sched_first/checkpoints/step_4").string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.steps (3) is below its step 4"), std::string::npos) << e.what();
  }
}

// SIGTERM (or SIGINT) mid-run: the step in flight finishes, a checkpoint of it is written and train
// returns early; resuming from it ends exactly where the uninterrupted run ends.
TEST_F(TrainTest, SigtermFinishesTheStepCheckpointsAndResumesBitExactly) {
  const std::vector<std::string> sets = {"checkpoint.every=0", "eval.batches=0"};
  TrainSummary whole = train(config("sig_whole", sets));
  ASSERT_EQ(whole.stopped_by_signal, 0);
  for (int sig : {SIGTERM, SIGINT}) {
    const std::string name = std::string("sig_") + (sig == SIGTERM ? "term" : "int");
    TrainHooks hooks;
    bool raised = false;  // once: the hook runs per micro-batch, and a second signal ends the process
    hooks.after_backward = [sig, &raised](int64_t step, model::LlamaModel&) {
      if (step == 3 && !raised) raised = (::raise(sig) == 0);
    };
    TrainSummary stopped = train(config(name, sets), "", hooks);
    EXPECT_EQ(stopped.stopped_by_signal, sig);
    EXPECT_EQ(stopped.last_step, 3);
    EXPECT_EQ(stopped.losses.size(), 3u);
    ASSERT_TRUE(stopped.last_checkpoint);
    EXPECT_EQ(stopped.last_checkpoint->filename(), "step_3");
    TrainSummary resumed = train(config(name, sets), "auto");
    EXPECT_EQ(resumed.stopped_by_signal, 0);
    EXPECT_EQ(resumed.first_step, 4);
    test::expect_same_checkpoint(root_ / "runs/sig_whole/checkpoints/step_8",
                                 root_ / "runs" / name / "checkpoints/step_8", 1);
  }
  // The handlers are gone with the run: the default action is back (a signal now would end the test).
  struct sigaction now {};
  ::sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

// New data on resume: the loader starts the new shards from their beginning with the run's seed,
// so the first resumed step trains on the new data's first windows (not on the old position).
TEST_F(TrainTest, ResumeOnNewDataStartsItFromItsBeginning) {
  const fs::path other = prepare_other_corpus("other_shards", 11);
  const std::vector<std::string> base = {"eval.batches=0", "checkpoint.every=0", "train.steps=4"};
  train(config("newdata", base));
  const fs::path step4 = root_ / "runs/newdata/checkpoints/step_4";
  const nlohmann::json saved = nlohmann::json::parse(read_file(step4 / "trainer_state.json"));
  ASSERT_EQ(saved.at("loader").at("cursor").get<int64_t>(), 16);

  // The loss of step 5 as it must be: the step-4 model on the first 4 windows of a fresh loader over
  // the new data with seed 3, and (to show the test tells them apart) at the old position 16..19.
  LoadedModel m = load_model_from_checkpoint(step4);
  data::LoaderOptions o;
  o.shard_dir = other.string();
  o.seq_len = 32;
  o.seed = 3;
  o.prefetch = 0;
  o.vocab_size = 320;
  data::Loader fresh(o);
  auto step_loss = [&](int64_t first_window) {
    double sum = 0, count = 0;
    for (int64_t w = first_window; w < first_window + 4; ++w) {
      data::Batch b = fresh.make_batch(0, w);
      const int64_t n = static_cast<int64_t>(b.tokens.size());
      model::LossSum l = m.model->forward({Tensor(b.tokens.data(), DType::i32, {n}),
                                           Tensor(b.labels.data(), DType::i32, {n}),
                                           Tensor(b.positions.data(), DType::i32, {n})});
      sum += l.sum;
      count += static_cast<double>(l.count);
    }
    return sum / count;
  };
  const double from_start = step_loss(0), from_old_position = step_loss(16);

  std::vector<std::string> sets = {"eval.batches=0", "checkpoint.every=0", "train.steps=6",
                                   "data.train=" + other.string()};
  TrainConfig c = config("newdata", sets);
  TrainSummary s = train(c, "auto");
  ASSERT_EQ(s.first_step, 5);
  ASSERT_EQ(s.losses.size(), 2u);
  EXPECT_NEAR(s.losses[0], from_start, 1e-5 * from_start);
  EXPECT_GT(std::abs(s.losses[0] - from_old_position), 1e-3) << "the old position gives the same loss";
  EXPECT_TRUE(std::isfinite(s.losses[1]));
  ::testing::Test::RecordProperty("step5_loss", fmt::format("{:.6f}", s.losses[0]));
  ::testing::Test::RecordProperty("fresh_stream_loss", fmt::format("{:.6f}", from_start));
  ::testing::Test::RecordProperty("old_position_loss", fmt::format("{:.6f}", from_old_position));
  // Two steps into the new data: its loader stands at window 8 of epoch 0.
  const nlohmann::json state =
      nlohmann::json::parse(read_file(root_ / "runs/newdata/checkpoints/step_6/trainer_state.json"));
  EXPECT_EQ(state.at("loader").at("cursor").get<int64_t>(), 8);
  EXPECT_EQ(state.at("loader").at("epoch").get<int64_t>(), 0);
  const std::string log = read_file(root_ / "runs/newdata/train.log");
  EXPECT_NE(log.find("changed on resume: data.train: "), std::string::npos) << log;
  const std::string said = "new data: data.train changed from " + (root_ / "shards").string() + " to " +
                           other.string() +
                           "; the loader starts it from its beginning (epoch 0, window 0 of its order) with the "
                           "run's seed 3";
  EXPECT_NE(log.find(said), std::string::npos) << log;
}
// data.train as a mixture of two shard sets: the interrupted run resumed from step 4 equals the
// uninterrupted one bit for bit (losses, model, optimizer, loader state with both sources'
// positions), and metrics.jsonl counts the tokens taken from each source, adding up to the tokens
// trained on.
TEST_F(TrainTest, MixtureResumeIsBitExactAndMetricsCountTokensPerSource) {
  const fs::path other = prepare_other_corpus("mix_other", 13);
  const std::string a = (root_ / "shards").string(), b = other.string();
  const std::vector<std::string> mix = {
      fmt::format("data.train=[{{path: {}, weight: 0.6}}, {{path: {}, weight: 0.4}}]", a, b), "data.val=" + a};
  TrainSummary whole = train(config("mix_whole", mix));
  ASSERT_EQ(whole.losses.size(), 8u);
  TrainConfig c = config("mix_resumed", mix);
  fs::create_directories(c.checkpoint.dir);
  fs::copy(root_ / "runs/mix_whole/checkpoints/step_4", fs::path(c.checkpoint.dir) / "step_4",
           fs::copy_options::recursive);
  TrainSummary resumed = train(c, "auto");
  ASSERT_EQ(resumed.first_step, 5);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[4 + i]) << "step " << 5 + i;
  test::expect_same_checkpoint(root_ / "runs/mix_whole/checkpoints/step_8", fs::path(c.checkpoint.dir) / "step_8", 1);
  const nlohmann::json state =
      nlohmann::json::parse(read_file(root_ / "runs/mix_whole/checkpoints/step_8/trainer_state.json")).at("loader");
  ASSERT_EQ(state.at("version"), 2) << state.dump();
  ASSERT_EQ(state.at("sources").size(), 2u);
  EXPECT_EQ(state.at("draws").get<int64_t>(), 8 * 4);  // 8 steps of 2 x 2 windows
  // Each step's record: tokens by source, summing to 4 windows x 32 tokens per step so far; both
  // sources drawn; the resumed run's records equal the whole run's.
  auto per_source = [&](const std::string& run) {
    std::vector<nlohmann::json> out;
    std::istringstream in(read_file(root_ / "runs" / run / "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) out.push_back(j.at("tokens_by_source"));
    }
    return out;
  };
  const std::vector<nlohmann::json> w = per_source("mix_whole"), r = per_source("mix_resumed");
  ASSERT_EQ(w.size(), 8u);
  ASSERT_EQ(r.size(), 4u);
  for (size_t i = 0; i < 8; ++i) {
    ASSERT_EQ(w[i].size(), 2u) << w[i].dump();
    EXPECT_EQ(w[i].at(a).get<int64_t>() + w[i].at(b).get<int64_t>(), static_cast<int64_t>(i + 1) * 4 * 32)
        << w[i].dump();
  }
  EXPECT_GT(w[7].at(a).get<int64_t>(), 0);
  EXPECT_GT(w[7].at(b).get<int64_t>(), 0);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(r[i], w[4 + i]) << "step " << 5 + i;
  const std::string log = read_file(root_ / "runs/mix_whole/train.log");
  EXPECT_NE(log.find("mixture source 1: " + b + " (weight 0.4)"), std::string::npos) << log;
  EXPECT_NE(log.find("tokens by source: " + a + " "), std::string::npos) << log;
  // A mixture has no validation split of its own: eval without data.val is refused by name.
  EXPECT_THROW(
      {
        try {
          train(config("mix_noval", {mix[0]}));
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("data.val is empty: set data.val"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
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

// data.document_mask: the step log reports the attention work this rank did (the pairs inside the
// step's documents, forward and backward, every layer: what the loader's windows imply), with its
// idle fraction; the run's final validation loss is what `evaluate` gives with the document mask on a
// loader of the checkpoint, and differs from the unmasked one (eval follows the key). Without the key
// the record has no such fields.
TEST_F(TrainTest, DocumentMaskLogsPairsPerRankAndEvalFollowsIt) {
  TrainSummary s = train(config("docmask", {"train.steps=2", "checkpoint.every=0", "optim.warmup_steps=1",
                                            "data.document_mask=true", "data.prefetch=0"}));
  ASSERT_TRUE(s.final_eval && s.last_checkpoint);
  LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint);
  EXPECT_TRUE(m.config.data.document_mask);
  const TrainConfig& c = m.config;
  // The step's windows, from a loader like the run's.
  data::LoaderOptions lo;
  lo.shard_dir = c.data.train;
  lo.seq_len = c.data.seq_len;
  lo.seed = static_cast<uint64_t>(c.train.seed);
  lo.prefetch = 0;
  lo.document_mask = true;
  data::Loader windows(lo);
  const int64_t S = c.data.seq_len, micro = c.train.batch_size * c.train.grad_accum;
  std::vector<int64_t> want;
  int64_t boundaries = 0;
  for (int step = 0; step < 2; ++step) {
    int64_t pairs = 0;
    for (int64_t i = 0; i < micro; ++i) {
      const data::Batch b = windows.next();
      const attn::Documents docs = attn::documents_from_starts(b.doc_starts, S);
      boundaries += docs.count() - 1;
      pairs += 2 * c.model.n_layers * attn::document_pairs(docs, S, true);  // forward + backward
    }
    want.push_back(pairs);
  }
  EXPECT_GT(boundaries, 0) << "the windows hold no document boundary: the test shows nothing";
  std::istringstream in(read_file(s.run_dir / "metrics.jsonl"));
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ASSERT_TRUE(j.contains("attention_pairs_per_rank")) << line;
    const auto pairs = j.at("attention_pairs_per_rank").get<std::vector<double>>();
    const auto idle = j.at("attention_idle_fraction_per_rank").get<std::vector<double>>();
    ASSERT_EQ(pairs.size(), 1u);
    ASSERT_EQ(idle.size(), 1u);
    EXPECT_EQ(static_cast<int64_t>(pairs[0]), want[static_cast<size_t>(steps)]) << line;
    EXPECT_GE(idle[0], 0.0);
    EXPECT_LE(idle[0], 1.0);
    EXPECT_EQ(j.at("attention_imbalance").get<double>(), 1.0);
    ++steps;
  }
  EXPECT_EQ(steps, 2);
  EXPECT_NE(read_file(s.run_dir / "train.log").find("document-masked attention: query-key pairs computed per rank"),
            std::string::npos);

  data::LoaderOptions o;
  o.shard_dir = c.data.train;
  o.split = "val";
  o.seq_len = S;
  o.prefetch = 0;
  o.document_mask = true;
  data::Loader val(o);
  const EvalResult masked = evaluate(*m.model, val, c.eval.batches, c.eval.position_buckets);
  EXPECT_EQ(masked.loss, s.final_eval->loss);
  EXPECT_EQ(masked.tokens, s.final_eval->tokens);
  o.document_mask = false;
  data::Loader plain_val(o);
  const EvalResult plain = evaluate(*m.model, plain_val, c.eval.batches, c.eval.position_buckets);
  EXPECT_GT(plain.tokens, masked.tokens) << "the boundary labels are not ignored without the mask";
  EXPECT_NE(plain.loss, masked.loss);

  train(config("no_docmask", {"train.steps=1", "checkpoint.every=0", "optim.warmup_steps=1", "eval.batches=0"}));
  EXPECT_EQ(read_file(root_ / "runs" / "no_docmask" / "metrics.jsonl").find("attention_pairs_per_rank"),
            std::string::npos);
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

// model.checkpoint: auto (the default) with a fake device budget between what none and remat_aware
// need: the run trains under remat_aware, and train.log and metrics.jsonl say so and why; with room
// for none it takes none; with room for neither it stops before creating the run directory, naming
// the keys. Tiling and offload set in the config reach the model (the log's token chunks).
TEST_F(TrainTest, AutoCheckpointChoosesByTheMemoryPlan) {
  const TrainConfig probe = config("auto_probe", {"train.steps=2", "eval.batches=0", "checkpoint.every=0",
                                                  "optim.warmup_steps=1", "model.mlp_chunk_tokens=5"});
  const model::DeviceMemory lots{size_t{8} << 30, size_t{8} << 30};
  TrainConfig fixed = probe;
  fixed.model.checkpoint = model::CheckpointPolicy::none;
  const size_t none_bytes = plan_training_memory(fixed, 1, lots, lots).plan.total();
  fixed.model.checkpoint = model::CheckpointPolicy::remat_aware;
  const size_t remat_bytes = plan_training_memory(fixed, 1, lots, lots).plan.total();
  ASSERT_LT(remat_bytes, none_bytes);
  const size_t headroom = size_t{1} << 30;  // memory_headroom of a budget below 50 GiB
  auto budget = [&](size_t bytes) { return model::DeviceMemory{headroom + bytes, headroom + bytes}; };

  TrainHooks hooks;
  hooks.device_memory = budget((none_bytes + remat_bytes) / 2);
  TrainConfig c = probe;
  c.logging.run_dir = (root_ / "runs" / "auto_remat").string();
  c.checkpoint.dir = (root_ / "runs" / "auto_remat" / "checkpoints").string();
  train(c, "", hooks);
  const std::string log = read_file(root_ / "runs" / "auto_remat" / "train.log");
  EXPECT_NE(log.find("memory: auto: remat_aware without offload (none without offload needs"), std::string::npos) << log;
  EXPECT_NE(log.find("token chunks: MLP 5, loss"), std::string::npos) << log;
  EXPECT_NE(log.find("checkpoint policy remat_aware"), std::string::npos) << log;
  std::ifstream in(root_ / "runs" / "auto_remat" / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("checkpoint").get<std::string>(), "remat_aware");
    EXPECT_EQ(j.at("offload").get<std::string>(), "none");
    EXPECT_EQ(j.at("attention_forwards_per_layer").get<double>(), 1.0);
  }
  EXPECT_EQ(lines, 2);

  hooks.device_memory = budget(none_bytes + 4096);
  c.logging.run_dir = (root_ / "runs" / "auto_none").string();
  c.checkpoint.dir = (root_ / "runs" / "auto_none" / "checkpoints").string();
  train(c, "", hooks);
  EXPECT_NE(read_file(root_ / "runs" / "auto_none" / "train.log").find("memory: auto: none without offload (the fastest; it fits)"),
            std::string::npos);

  hooks.device_memory = budget(remat_bytes / 4);
  c.logging.run_dir = (root_ / "runs" / "auto_nothing").string();
  c.checkpoint.dir = (root_ / "runs" / "auto_nothing" / "checkpoints").string();
  try {
    train(c, "", hooks);
    ADD_FAILURE() << "a run that fits nowhere started";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* part : {"not enough host memory", "model.checkpoint auto", "model.offload auto", "auto: nothing fits"})
      EXPECT_NE(m.find(part), std::string::npos) << "missing \"" << part << "\" in: " << m;
  }
  EXPECT_FALSE(fs::exists(root_ / "runs" / "auto_nothing"));
}

// model.offload: checkpoints through the whole trainer on CPU: the same losses bit for bit as keeping
// the checkpoints, and the step log's plan (which counts the host copies on a CPU run) still bounds
// the allocated peak.
TEST_F(TrainTest, OffloadedCheckpointsTrainTheSameLosses) {
  std::vector<double> losses[2];
  for (int o = 0; o < 2; ++o) {
    const std::string name = o ? "offload_on" : "offload_off";
    TrainSummary s = train(config(name, {"train.steps=3", "eval.batches=0", "checkpoint.every=0", "optim.warmup_steps=1",
                                         "model.checkpoint=remat_aware", o ? "model.offload=checkpoints" : "model.offload=none"}));
    losses[o] = s.losses;
    std::ifstream in(root_ / "runs" / name / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j.at("offload").get<std::string>(), o ? "checkpoints" : "none");
      EXPECT_LE(j.at("allocated_peak_gib").get<double>(), j.at("plan_gib").get<double>()) << name;
      EXPECT_GE(j.at("allocated_peak_gib").get<double>(), 0.9 * j.at("plan_gib").get<double>()) << name;
    }
  }
  ASSERT_EQ(losses[0].size(), 3u);
  for (double l : losses[0]) ASSERT_TRUE(std::isfinite(l));
  EXPECT_EQ(losses[0], losses[1]);
}

// train.cuda_graphs where graphs cannot run (the CPU): set (true), the log says why; by default (auto)
// it says nothing; training is unchanged either way.
// (On a GPU, tests/gpu/model_gpu_test.cpp's GpuModelCudaGraphs checks graphed steps against eager ones.)
TEST_F(TrainTest, CudaGraphsOffTheGpuAreReportedUnusedAndChangeNothing) {
  std::vector<double> losses[3];
  const char* settings[3] = {"train.cuda_graphs=false", "train.cuda_graphs=true", nullptr};  // nullptr: default
  for (int g = 0; g < 3; ++g) {
    const std::string name = fmt::format("graphs_{}", g);
    std::vector<std::string> sets = {"train.steps=3", "eval.batches=0", "checkpoint.every=0"};
    if (settings[g] != nullptr) sets.push_back(settings[g]);
    TrainSummary s = train(config(name, sets));
    losses[g] = s.losses;
    EXPECT_EQ(s.graph_captures, 0);
    EXPECT_EQ(s.graph_replays, 0);
    const std::string log = read_file(root_ / "runs" / name / "train.log");
    EXPECT_EQ(log.find("train.cuda_graphs is set but not used: the model is not on CUDA") != std::string::npos, g == 1)
        << log;
    if (g != 1) {
      EXPECT_EQ(log.find("CUDA graph"), std::string::npos) << log;
    }
  }
  ASSERT_EQ(losses[0].size(), 3u);
  for (double l : losses[0]) ASSERT_TRUE(std::isfinite(l));
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
}

// train.cuda_graphs on a GPU as a user runs it (skipped without one): four micro-batches a step (two
// graphs: the first overwrites the discarded gradients, the others add), evals (which free buffers, so
// the graphs are dropped and captured again) and checkpoints. The losses are eager training's: the
// first step's to the bit (same parameters, deterministic forward), the rest within the run-to-run
// rounding of cuDNN's backward (dQ added with atomics).
TEST_F(TrainTest, CudaGraphsOnTheGpuTrainTheEagerLosses) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device available";
  // s[2]: the default (auto), which must use graphs on one GPU as true does.
  TrainSummary s[3];
  for (int g = 0; g < 3; ++g) {
    const std::string name = g == 2 ? "gpu_graphs_auto" : g ? "gpu_graphs_on" : "gpu_graphs_off";
    std::vector<std::string> sets = {"train.device=cuda", "model.head_dim=64", "eval.every=3",
                                     "attention.kernel=cudnn", "train.gemm_algorithm=heuristic"};
    if (g < 2) sets.push_back(g ? "train.cuda_graphs=true" : "train.cuda_graphs=false");
    TrainConfig c = load_config(write_config(name).string(), sets);
    resolve_device(c, true);
    s[g] = train(c);
  }
  EXPECT_EQ(s[2].graph_off_reason, "");
  EXPECT_EQ(s[2].graph_captures, s[1].graph_captures);
  EXPECT_EQ(s[2].graph_replays, s[1].graph_replays);
  ASSERT_EQ(s[2].losses.size(), 8u);
  for (size_t i = 0; i < s[0].losses.size(); ++i)
    EXPECT_NEAR(s[2].losses[i], s[0].losses[i], 5e-3 * std::abs(s[0].losses[i])) << "auto, step " << i + 1;
  std::printf("  CUDA graphs: %lld captured, %lld micro-batches replayed%s%s\n", (long long)s[1].graph_captures,
              (long long)s[1].graph_replays, s[1].graph_off_reason.empty() ? "" : "; off: ",
              s[1].graph_off_reason.c_str());
  EXPECT_EQ(s[1].graph_off_reason, "");
  EXPECT_GE(s[1].graph_captures, 2);
  EXPECT_GT(s[1].graph_replays, s[1].graph_captures);
  EXPECT_EQ(s[0].graph_captures, 0);
  ASSERT_EQ(s[0].losses.size(), 8u);
  ASSERT_EQ(s[1].losses.size(), 8u);
  EXPECT_EQ(s[1].losses[0], s[0].losses[0]);
  for (size_t i = 0; i < s[0].losses.size(); ++i) {
    ASSERT_TRUE(std::isfinite(s[1].losses[i])) << "step " << i + 1;
    std::printf("  step %zu loss: graphs %.7f, eager %.7f\n", i + 1, s[1].losses[i], s[0].losses[i]);
    EXPECT_NEAR(s[1].losses[i], s[0].losses[i], 5e-3 * std::abs(s[0].losses[i])) << "step " << i + 1;
  }
  ASSERT_TRUE(s[0].final_eval && s[1].final_eval);
  EXPECT_NEAR(s[1].final_eval->loss, s[0].final_eval->loss, 5e-3 * std::abs(s[0].final_eval->loss));
  const std::string log = read_file(root_ / "runs/gpu_graphs_on/train.log");
  EXPECT_NE(log.find("CUDA graphs: each micro-batch's forward and backward replayed as one graph"), std::string::npos)
      << log;
}

// Through the real CLI: each class of config error exits non-zero with its message, and no run
// directory appears.
int run_cli(const std::string& args, std::string& output, const std::string& env = "") {
  const std::string cmd = fmt::format("{} {} {} 2>&1", env, LONGTRAIN_BINARY, args);
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  output.clear();
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// No user-facing error carries the C++ source location that raised it ("…/data/shards.cpp:232: ");
// LONGTRAIN_DEBUG=1 adds it on a line of its own.
void expect_no_source_location(const std::string& output) {
  static const std::regex location(R"([A-Za-z0-9_]+\.(cpp|cu|h):[0-9]+)");
  EXPECT_FALSE(std::regex_search(output, location)) << "a source location in: " << output;
}

TEST_F(TrainTest, ErrorsNameNoSourceLocationUnlessDebugging) {
  const fs::path cfg = write_config("no_location");
  std::string out;
  EXPECT_EQ(run_cli("train " + cfg.string() + " --set data.train=/nowhere/shards", out), 1) << out;
  EXPECT_NE(out.find("/nowhere/shards"), std::string::npos) << out;
  expect_no_source_location(out);
  EXPECT_EQ(run_cli("train " + cfg.string() + " --set data.train=/nowhere/shards", out, "LONGTRAIN_DEBUG=1"), 1);
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(longtrain: debug: raised at \S+\.(cpp|h):[0-9]+)"))) << out;
}

// `train --plan` prints the memory plan and exits without training or creating the run directory.
TEST_F(TrainTest, PlanPrintsTheMemoryPlanAndTrainsNothing) {
  const fs::path cfg = write_config("planned");
  std::string out;
  ASSERT_EQ(run_cli("train " + cfg.string() + " --plan", out), 0) << out;
  const model::DeviceMemory host = model::device_memory(Device::cpu);
  const model::MemoryPlan plan = plan_training_memory(config("planned"), 1, host, host).plan;
  EXPECT_NE(out.find(plan.table()), std::string::npos) << "the printed plan is not plan_training_memory's:\n" << out;
  EXPECT_NE(out.find("memory: auto: none without offload (the fastest; it fits)"), std::string::npos) << out;
  // --device-memory: auto for a budget between what none and remat_aware need (1 GiB headroom below 50 GiB).
  TrainConfig fixed = config("planned");
  fixed.model.checkpoint = model::CheckpointPolicy::none;
  const double none_gib = static_cast<double>(plan_training_memory(fixed, 1, host, host).plan.total()) / 1073741824.0;
  fixed.model.checkpoint = model::CheckpointPolicy::remat_aware;
  const double remat_gib = static_cast<double>(plan_training_memory(fixed, 1, host, host).plan.total()) / 1073741824.0;
  ASSERT_EQ(run_cli(fmt::format("train {} --plan --device-memory {:.9f}", cfg.string(), 1 + (none_gib + remat_gib) / 2),
                    out), 0) << out;
  EXPECT_NE(out.find("memory: auto: remat_aware without offload (none without offload needs"), std::string::npos) << out;
  EXPECT_NE(out.find("(as given by --device-memory)"), std::string::npos) << out;
  for (const char* row : {"parameters", "gradients", "adam m", "adam v", "activations, saved", "total"})
    EXPECT_NE(out.find(row), std::string::npos) << row << " missing in:\n" << out;
  EXPECT_NE(out.find("free on this host"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(root_ / "runs/planned")) << "--plan created the run directory";
  EXPECT_EQ(out.find("attention per layer"), std::string::npos) << "one rank has no attention traffic:\n" << out;
  // With sequence parallelism the cost model's block: the configured schedule's exact bytes per rank
  // (Ulysses over 2 ranks: 16 tokens, 4/2 heads of 8, f32, its forward kept under the auto policy; see
  // distributed_train_test) and the fastest.
  ASSERT_EQ(run_cli("train " + cfg.string() +
                        " --plan --set parallel.sp_size=2 --set attention.schedule=ulysses --plan-inter-gbs 12",
                    out),
            0)
      << out;
  EXPECT_NE(out.find("12 GB/s 10 us across"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(fmt::format(R"(configured +ulysses +sent +{:.3f} MiB per rank)",
                                                            (3200.0 + 3072.0) / 1048576.0))))
      << out;
  EXPECT_NE(out.find("  fastest "), std::string::npos) << out;
  // A bad config is refused by --plan as by train.
  EXPECT_EQ(run_cli("train " + cfg.string() + " --plan --set model.n_kv_heads=3", out), 1) << out;
  EXPECT_NE(out.find("n_kv_heads"), std::string::npos) << out;
}

// eval and generate refuse what they cannot use, naming it: a checkpoint missing a file, a missing
// tokenizer, a tokenizer or data whose vocabulary is not the model's.
// `longtrain eval` follows the checkpoint's data.document_mask, and --document-mask overrides it: the
// printed validation loss is the run's final one with the mask and another one without it.
TEST_F(TrainTest, EvalCliFollowsTheRunsDocumentMask) {
  TrainSummary s = train(config("cli_docmask", {"train.steps=2", "checkpoint.every=0", "eval.batches=3",
                                                "optim.warmup_steps=1", "data.document_mask=true"}));
  ASSERT_TRUE(s.last_checkpoint && s.final_eval);
  const std::string masked_line = fmt::format("validation loss {:.4f}", s.final_eval->loss);
  std::string out;
  ASSERT_EQ(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --batches 3", out), 0) << out;
  EXPECT_NE(out.find("document mask on"), std::string::npos) << out;
  EXPECT_NE(out.find(masked_line), std::string::npos) << out;
  ASSERT_EQ(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --batches 3 --document-mask false", out), 0)
      << out;
  EXPECT_EQ(out.find("document mask on"), std::string::npos) << out;
  EXPECT_EQ(out.find(masked_line), std::string::npos) << out;
  EXPECT_NE(out.find("validation loss "), std::string::npos) << out;
  EXPECT_NE(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --document-mask maybe", out), 0) << out;
}

TEST_F(TrainTest, EvalAndGenerateErrorsNameTheProblem) {
  TrainSummary s = train(config("cli_errors", {"train.steps=2", "checkpoint.every=0", "eval.batches=1"}));
  ASSERT_TRUE(s.last_checkpoint);
  const fs::path good = *s.last_checkpoint;
  std::string out;
  ASSERT_EQ(run_cli("eval --checkpoint " + good.string(), out), 0) << out;
  ASSERT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt 'the cat' --max-new-tokens 3", out), 0)
      << out;

  // An incomplete checkpoint: its model file is gone.
  const fs::path incomplete = root_ / "cli_errors_incomplete";
  fs::copy(good, incomplete, fs::copy_options::recursive);
  fs::remove(incomplete / "model.safetensors");
  for (const char* cmd : {"eval", "generate"}) {
    const std::string extra = std::string(cmd) == "generate" ? " --prompt hi --max-new-tokens 3" : "";
    EXPECT_EQ(run_cli(std::string(cmd) + " --checkpoint " + incomplete.string() + extra, out), 1) << cmd << out;
    EXPECT_NE(out.find(incomplete.string()), std::string::npos) << cmd << ": " << out;
    EXPECT_NE(out.find("model.safetensors"), std::string::npos) << cmd << ": " << out;
    expect_no_source_location(out);
  }

  // No tokenizer: the run's data.tokenizer was moved away, so the checkpoint holds none either.
  TrainSummary moved = train(config("cli_errors_moved_tokenizer", {"train.steps=2", "checkpoint.every=0",
                                                                   "eval.batches=0",
                                                                   "data.tokenizer=" + (root_ / "gone.model").string()}));
  ASSERT_TRUE(moved.last_checkpoint);
  ASSERT_FALSE(fs::exists(*moved.last_checkpoint / "tokenizer.model"));
  EXPECT_EQ(run_cli("generate --checkpoint " + moved.last_checkpoint->string() + " --prompt hi --max-new-tokens 3",
                    out), 1) << out;
  EXPECT_NE(out.find("gone.model"), std::string::npos) << out;
  EXPECT_NE(out.find("--tokenizer"), std::string::npos) << out;
  // An explicit --tokenizer that is not there is refused, not replaced by the checkpoint's.
  EXPECT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt hi --max-new-tokens 3 --tokenizer " +
                        (root_ / "nowhere.model").string(), out), 1) << out;
  EXPECT_NE(out.find("nowhere.model"), std::string::npos) << out;

  // A vocabulary that is not the model's: another tokenizer, and data prepared with it.
  const fs::path other = root_ / "cli_errors_other";
  fs::create_directories(other);
  data::TokenizerTrainOptions to;
  to.inputs = {(root_ / "corpus.jsonl").string()};
  to.model_prefix = (other / "tok").string();
  to.vocab_size = 300;
  to.threads = 1;
  data::train_tokenizer(to);
  data::PrepareOptions po;
  po.tokenizer = (other / "tok.model").string();
  po.inputs = {(root_ / "corpus.jsonl").string()};
  po.output = (other / "shards").string();
  po.val_fraction = 0.1;
  po.threads = 1;
  po.progress = false;
  data::prepare_corpus(po);
  EXPECT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt hi --max-new-tokens 3 --tokenizer " +
                        (other / "tok.model").string(), out), 1) << out;
  EXPECT_NE(out.find("300"), std::string::npos) << out;
  EXPECT_NE(out.find("320"), std::string::npos) << out;
  EXPECT_EQ(run_cli("eval --checkpoint " + good.string() + " --data " + (other / "shards").string(), out), 1) << out;
  EXPECT_NE(out.find("300"), std::string::npos) << out;
  EXPECT_NE(out.find("320"), std::string::npos) << out;
  expect_no_source_location(out);
}

// A write that fails while a checkpoint is saved (here a real one: RLIMIT_FSIZE makes the kernel refuse
// any file over 64 KiB with EFBIG, as a full disk refuses with ENOSPC) is a clear error; the previous
// checkpoint stays intact, `--resume auto` picks it, and the run then ends as if nothing happened.
TEST_F(TrainTest, AFailedCheckpointWriteLeavesThePreviousOneToResumeFrom) {
  const fs::path cfg = write_config("write_fails");
  const std::string args = "train " + cfg.string() + " --set checkpoint.every=4 --set eval.batches=0";
  const fs::path ckpts = root_ / "runs/write_fails/checkpoints";
  std::string out;
  ASSERT_EQ(run_cli(args, out), 0) << out;
  const fs::path reference = root_ / "write_fails_step_8";
  fs::copy(ckpts / "step_8", reference, fs::copy_options::recursive);
  fs::remove_all(ckpts / "step_8");

  // Resume from step 4 where no file may grow past 64 KiB: the model file of step 8 cannot be written.
  // SIGXFSZ is ignored so that the write fails with EFBIG instead of killing the process.
  EXPECT_EQ(run_cli(args + " --resume auto", out, "trap '' XFSZ; ulimit -f 64;"), 1) << out;
  EXPECT_NE(out.find("checkpoint of step 8 could not be written"), std::string::npos) << out;
  EXPECT_NE(out.find("File too large"), std::string::npos) << out;
  EXPECT_NE(out.find("--resume auto"), std::string::npos) << out;
  expect_no_source_location(out);
  const size_t error_at = out.find("longtrain: error:");
  if (error_at != std::string::npos) std::cout << "  " << out.substr(error_at, out.find('\n', error_at) - error_at) << "\n";
  EXPECT_FALSE(fs::exists(ckpts / "step_8")) << "a half-written step_8 was published";
  EXPECT_EQ(verify_checkpoint(ckpts / "step_4"), "") << "the previous checkpoint was damaged";
  const std::optional<CheckpointRef> pick = resolve_resume(ckpts, "auto");
  ASSERT_TRUE(pick);
  EXPECT_EQ(pick->path.filename(), "step_4");

  ASSERT_EQ(run_cli(args + " --resume auto", out), 0) << out;
  test::expect_same_checkpoint(reference, ckpts / "step_8", 1);
}

// generate prints the prompt and its continuation decoded as one sequence: what SentencePiece gives
// for the prompt's tokens followed by the sampled ones (greedy here, so the test can sample the same).
TEST_F(TrainTest, GeneratePrintsPromptAndContinuationAsOneText) {
  TrainSummary s = train(config("generated", {"train.steps=6", "checkpoint.every=0", "eval.batches=0"}));
  ASSERT_TRUE(s.last_checkpoint);
  const std::string prompt = "the old man";
  std::string out;
  ASSERT_EQ(run_cli("generate --checkpoint " + s.last_checkpoint->string() + " --prompt '" + prompt +
                        "' --temperature 0 --max-new-tokens 8", out), 0) << out;
  LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint, 1);
  data::Tokenizer tok((*s.last_checkpoint / "tokenizer.model").string());
  std::vector<int32_t> ids;
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const std::vector<int32_t> prompt_ids = tok.encode(prompt);
  ids.insert(ids.end(), prompt_ids.begin(), prompt_ids.end());
  model::SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<int32_t> continuation = model::generate(*m.model, ids, 8, greedy, tok.eos_id());
  ASSERT_FALSE(continuation.empty());
  std::vector<int32_t> all = prompt_ids;
  all.insert(all.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(out, tok.decode(all) + "\n");
  EXPECT_EQ(out.rfind(prompt, 0), 0u) << out;
  // A continuation whose first piece starts a word keeps the space in front of it.
  if (tok.piece(continuation[0]).rfind("\xe2\x96\x81", 0) == 0) {
    EXPECT_EQ(out[prompt.size()], ' ') << out;
  }
}

// A Hugging Face directory whose tokenizer is a tokenizer.json (GPT-2-style byte-level BPE from the
// parity fixture): generate picks it by default and prints the prompt and the greedy continuation
// as the tokenizer decodes them; a run with data.tokenizer = a tokenizer.json keeps it in each
// checkpoint under that name.
TEST_F(TrainTest, GenerateAndCheckpointsUseATokenizerJson) {
  const fs::path json_path = fs::path(LONGTRAIN_HF_TOKENIZER_FIXTURE) / "gpt2_style/tokenizer.json";
  const fs::path dir = root_ / "hf_bpe";
  fs::create_directories(dir);
  model::LlamaConfig cfg;
  cfg.vocab_size = 1024;  // the tokenizer's 1000 ids, padded as published models pad theirs
  cfg.dim = 32;
  cfg.n_layers = 1;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 8;
  cfg.ffn_dim = 64;
  cfg.max_seq_len = 64;
  {
    model::LlamaModel random(cfg, model::Precision::cpu(DType::f32), model::CheckpointPolicy::none, 64);
    random.initialize(5, 0.5);
    model::HfLlamaConfig hf;
    hf.model = cfg;
    model::export_hf_directory(dir.string(), hf, random.params(), DType::f32);
  }
  fs::copy_file(json_path, dir / "tokenizer.json");
  const std::string prompt = "It is a truth universally acknowledged";
  std::string out;
  ASSERT_EQ(run_cli("generate --checkpoint " + dir.string() + " --prompt '" + prompt +
                        "' --temperature 0 --max-new-tokens 6", out), 0) << out;
  LoadedModel m = load_model_from_checkpoint(dir, 1);
  EXPECT_EQ(m.config.data.tokenizer, (dir / "tokenizer.json").string());
  data::Tokenizer tok((dir / "tokenizer.json").string());
  ASSERT_TRUE(tok.is_hf());
  const std::vector<int32_t> prompt_ids = tok.encode(prompt);
  model::SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<int32_t> continuation = model::generate(*m.model, prompt_ids, 6, greedy, tok.eos_id());
  std::vector<int32_t> all = prompt_ids;
  all.insert(all.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(out, tok.decode(all) + "\n");
  EXPECT_EQ(out.rfind(" " + prompt, 0), 0u) << out;  // GPT-2's add_prefix_space
  // A tokenizer smaller than the model is fine for a tokenizer.json, a larger one is not.
  fs::create_directories(root_ / "hf_small");
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(dir / f, root_ / "hf_small" / f);
  fs::copy_file(fs::path(LONGTRAIN_HF_TOKENIZER_FIXTURE) / "llama3_style/tokenizer.json",
                root_ / "hf_small/tokenizer.json");
  EXPECT_EQ(run_cli("generate --checkpoint " + (root_ / "hf_small").string() + " --prompt hi", out), 1) << out;
  EXPECT_NE(out.find("has 1501 pieces but the model's vocabulary is 1024"), std::string::npos) << out;

  TrainSummary s = train(config("json_tok", {"train.steps=2", "checkpoint.every=0", "eval.batches=0",
                                             "data.tokenizer=" + json_path.string()}));
  ASSERT_TRUE(s.last_checkpoint);
  EXPECT_TRUE(read_file(*s.last_checkpoint / "tokenizer.json") == read_file(json_path));
  EXPECT_FALSE(fs::exists(*s.last_checkpoint / "tokenizer.model"));
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
    expect_no_source_location(out);
  }
}

// Through the real CLI: a resume that changes keys a checkpoint cannot take exits 1 naming every
// one with its old and new value (all refused keys but train.device, which needs a GPU here, and
// parallel.sp_size, which needs several processes: the launcher test has it), and changes nothing
// on disk: the run directory's config and checkpoints stay as they were.
TEST_F(TrainTest, ResumeThroughTheCliRefusesEveryChangedKeyThatTheCheckpointCannotTake) {
  const std::vector<std::string> base = {"train.steps=2", "checkpoint.every=0", "eval.batches=0"};
  train(config("refused", base));
  fs::copy_file(root_ / "tok.model", root_ / "tok2.model", fs::copy_options::overwrite_existing);
  const fs::path run = root_ / "runs/refused";
  const std::string config_before = read_file(run / "config.yaml");
  const auto quoted = [](const fs::path& p) { return nlohmann::json(p.string()).dump(); };
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"model.vocab_size=384", "model.vocab_size: 320 -> 384"},
      {"model.dim=48", "model.dim: 32 -> 48"},
      {"model.n_layers=3", "model.n_layers: 2 -> 3"},
      {"model.n_heads=6", "model.n_heads: 4 -> 6"},
      {"model.n_kv_heads=3", "model.n_kv_heads: 2 -> 3"},
      {"model.head_dim=12", "model.head_dim: 8 -> 12"},
      {"model.ffn_dim=96", "model.ffn_dim: 64 -> 96"},
      {"model.rope_theta=500000", "model.rope_theta: 10000.0 -> 500000.0"},
      {"model.norm_eps=0.001", "model.norm_eps: 1e-05 -> 0.001"},
      {"model.tie_embeddings=true", "model.tie_embeddings: false -> true"},
      {"model.max_seq_len=128", "model.max_seq_len: 64 -> 128"},
      {"model.init_std=0.01", "model.init_std: 0.02 -> 0.01"},
      {"data.tokenizer=" + (root_ / "tok2.model").string(),
       "data.tokenizer: " + quoted(root_ / "tok.model") + " -> " + quoted(root_ / "tok2.model")},
      {"data.seq_len=48", "data.seq_len: 32 -> 48"},
      {"train.dtype=f64", "train.dtype: f32 -> f64"},
      {"train.seed=4", "train.seed: 3 -> 4"},
      {"optim.weight_decay=0.05", "optim.weight_decay: 0.1 -> 0.05"},
      {"optim.beta1=0.8", "optim.beta1: 0.9 -> 0.8"},
      {"optim.beta2=0.99", "optim.beta2: 0.95 -> 0.99"},
      {"optim.eps=1e-6", "optim.eps: 1e-08 -> 1e-06"},
      {"optim.grad_clip=0.5", "optim.grad_clip: 1.0 -> 0.5"},
      {"optim.no_decay=[norm]", "optim.no_decay: [\"norm\", \"embed_tokens\"] -> [\"norm\"]"},
      {"attention.causal=false", "attention.causal: true -> false"},
  };
  std::string args = "train " + write_config("refused").string() + " --resume auto";
  for (const std::string& set : base) args += " --set " + set;
  // Allowed and elastic ones alongside (the batch re-split, the same global batch) are not named.
  for (const char* set : {"train.steps=4", "logging.log_every=1", "train.batch_size=4", "train.grad_accum=1"})
    args += std::string(" --set ") + set;
  for (const auto& [set, named] : refused) args += " --set '" + set + "'";
  std::string out;
  EXPECT_EQ(run_cli(args, out), 1) << out;
  EXPECT_NE(out.find("longtrain: error: cannot resume from " + (run / "checkpoints/step_2").string() +
                     ": these keys are part of what the checkpoint means"),
            std::string::npos)
      << out;
  for (const auto& [set, named] : refused)
    EXPECT_NE(out.find("\n  " + named + "\n"), std::string::npos) << named << "\n" << out;
  for (const char* key : {"train.steps", "logging.log_every", "train.batch_size", "train.grad_accum"})
    EXPECT_EQ(out.find(key), std::string::npos) << key << " is allowed on resume\n" << out;
  EXPECT_EQ(out.find(".cpp"), std::string::npos) << "a source location in a user-facing error\n" << out;
  EXPECT_EQ(read_file(run / "config.yaml"), config_before);
  EXPECT_EQ(list_complete_checkpoints(run / "checkpoints").size(), 1u);

  // One refused key alone is named alone; the same resume without it goes on.
  std::string one = "train " + write_config("refused").string() + " --resume auto";
  for (const std::string& set : base) one += " --set " + set;
  one += " --set train.steps=4";
  EXPECT_EQ(run_cli(one + " --set train.seed=9", out), 1) << out;
  EXPECT_NE(out.find("\n  train.seed: 3 -> 9\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("model."), std::string::npos) << out;
  EXPECT_EQ(run_cli(one, out), 0) << out;
  EXPECT_NE(out.find("changed on resume: train.steps: 2 -> 4"), std::string::npos) << out;
  EXPECT_EQ(verify_checkpoint(run / "checkpoints/step_4"), "");
}

// Elastic keys on one rank: the batch may be split otherwise (train.batch_size × train.grad_accum
// the same: the same windows in the same order, summed in the same order), and the run continues bit
// for bit; another global batch is refused, naming both and the grad_accum that keeps it.
TEST_F(TrainTest, ResumeMayResplitTheBatchButMustKeepTheGlobalBatch) {
  const std::vector<std::string> base = {"train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0",
                                         "eval.batches=0", "train.batch_size=2", "train.grad_accum=2"};
  const TrainSummary whole = train(config("resplit_whole", base));
  ASSERT_EQ(whole.losses.size(), 4u);
  const fs::path step2 = root_ / "runs/resplit_whole/checkpoints/step_2";

  std::vector<std::string> resplit = base;
  resplit.insert(resplit.end(), {"train.batch_size=4", "train.grad_accum=1"});
  const TrainSummary resumed = train(config("resplit", resplit), step2.string());
  ASSERT_EQ(resumed.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.losses[i], whole.losses[2 + i]) << "step " << 3 + i;
  const std::string log = read_file(root_ / "runs/resplit/train.log");
  EXPECT_NE(log.find("changed on resume: train.batch_size: 2 -> 4"), std::string::npos) << log;
  EXPECT_NE(log.find("changed on resume: train.grad_accum: 2 -> 1"), std::string::npos) << log;

  std::vector<std::string> smaller = base;
  smaller.push_back("train.grad_accum=1");
  try {
    train(config("resplit_smaller", smaller), step2.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot resume from " + step2.string() + ": it was trained with 4 sequences per step "
                        "(train.batch_size 2 × train.grad_accum 2 × 1 data-parallel ranks"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("this run takes 2"), std::string::npos) << what;
    EXPECT_NE(what.find("set train.grad_accum to 2"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(root_ / "runs/resplit_smaller"));
}

}  // namespace
}  // namespace longtrain::trainer
