// The training loop end to end on a small synthetic corpus: bit-exact resume, NaN/Inf handling both
// ways, eval of a checkpoint reproducing the loop's validation loss, and bad configs leaving no run
// directory behind (through the real `longtrain` binary).
#include <signal.h>
#include <unistd.h>

#include <cmath>
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
#include "train_fixture.h"
#include "trainer/checkpoint.h"

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
  // Model, optimizer shard, loader state and counters: the resumed run ends where the whole one did.
  test::expect_same_checkpoint(root_ / "runs/whole/checkpoints/step_8", fs::path(c.checkpoint.dir) / "step_8", 1);
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
  const model::MemoryPlan plan = plan_training_memory(config("planned"), 1);
  EXPECT_NE(out.find(plan.table()), std::string::npos) << "the printed plan is not plan_training_memory's:\n" << out;
  for (const char* row : {"parameters", "gradients", "adam m", "adam v", "activations, saved", "total"})
    EXPECT_NE(out.find(row), std::string::npos) << row << " missing in:\n" << out;
  EXPECT_NE(out.find("free on this host"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(root_ / "runs/planned")) << "--plan created the run directory";
  // A bad config is refused by --plan as by train.
  EXPECT_EQ(run_cli("train " + cfg.string() + " --plan --set model.n_kv_heads=3", out), 1) << out;
  EXPECT_NE(out.find("n_kv_heads"), std::string::npos) << out;
}

// eval and generate refuse what they cannot use, naming it: a checkpoint missing a file, a missing
// tokenizer, a tokenizer or data whose vocabulary is not the model's.
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

}  // namespace
}  // namespace longtrain::trainer
