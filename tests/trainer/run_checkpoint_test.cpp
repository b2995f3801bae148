// A run's checkpoints end to end (trainer/run_checkpoint.cpp) on the fixture's small corpus: resume
// equals the uninterrupted run bit for bit (plain, after SIGTERM/SIGINT, over a data mixture), a
// resume that changes the schedule or the data follows the documented rule, a failed checkpoint write
// leaves the previous one to resume from, and through the real `longtrain` binary a resume refuses
// every key the checkpoint cannot take and keeps the global batch when the world changes.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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
using test::expect_no_source_location;
using test::run_cli;
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
