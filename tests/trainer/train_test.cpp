// The training loop end to end on a small synthetic corpus (trainer/trainer.cpp): NaN/Inf handling
// both ways, the step log (attention forwards, peak memory against the plan, document-masked pairs per
// rank), the memory plan's choice of checkpointing and offload, CUDA graphs, `train --plan`, and bad
// configs leaving no run directory behind (through the real `longtrain` binary). Resume: run_checkpoint_test.cpp;
// eval and generate: eval_test.cpp.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/device.h"
#include "train_fixture.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
using test::read_file;
using test::logged_steps;
using test::expect_no_source_location;
using test::run_cli;
namespace fs = std::filesystem;

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
