// Training with several processes through the real launcher (Gloo on this machine): data parallel
// with batch b per rank equals one rank with batch 2b, also over 3 ranks with accumulation (the
// gradient reduction runs bucket by bucket during backward).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <chrono>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "parallel/multiproc_util.h"
#include "parallel/net.h"
#include "parallel/store.h"
#include "train_fixture.h"
#include "trainer/checkpoint.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
namespace fs = std::filesystem;

// Losses of the steps recorded in a run's metrics.jsonl.
std::vector<double> logged_losses(const fs::path& run_dir) {
  std::ifstream in(run_dir / "metrics.jsonl");
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// The largest |got - want| / |want| over the steps; infinity where a value is NaN or infinite, so a
// comparison against a bound fails there.
double worst_relative_difference(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double d = std::abs(got[i] - want[i]) / std::abs(want[i]);
    if (!std::isfinite(d)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, d);
  }
  return worst;
}

// Every sequence-parallel schedule with a layout it runs in, for the tests that run each over 2 ranks.
struct TwoRankSchedule {
  const char* schedule;
  const char* layout;
};
constexpr TwoRankSchedule kTwoRankSchedules[] = {
    {"ring", "contiguous"}, {"zigzag", "zigzag"}, {"distflash", "contiguous"}, {"burst", "zigzag"}};

// `sets` with the sequence split over 2 ranks under schedule `s`.
std::vector<std::string> over_two_ranks(std::vector<std::string> sets, const TwoRankSchedule& s) {
  sets.insert(sets.end(), {"parallel.sp_size=2", fmt::format("attention.schedule={}", s.schedule),
                           fmt::format("parallel.layout={}", s.layout)});
  return sets;
}

int launch(int nproc, const std::string& args) {
  const std::string cmd = fmt::format("{} --nproc-per-node {} --master-addr 127.0.0.1 --master-port {} -- {} {} 2>&1",
                                      LONGTRAIN_RUN_BINARY, nproc, parallel::net::pick_free_port(), LONGTRAIN_BINARY, args);
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The same with the launcher's output (every rank's lines, stdout and stderr) in `output`.
int launch_capture(int nproc, const std::string& args, std::string& output) {
  const std::string cmd =
      fmt::format("{} --nproc-per-node {} --master-addr 127.0.0.1 --master-port {} -- {} {} 2>&1", LONGTRAIN_RUN_BINARY,
                  nproc, parallel::net::pick_free_port(), LONGTRAIN_BINARY, args);
  return ::longtrain::test::run_command(cmd, output);
}

class DistributedTrainTest : public TrainTest {
 protected:
  // `longtrain train` arguments for run `name` with `sets` as --set overrides.
  static std::string train_args(const std::string& name, const std::vector<std::string>& sets) {
    std::string args = "train " + write_config(name).string();
    for (const std::string& s : sets) args += " --set " + s;
    return args;
  }
  // The same as an argv for longtrain-run over `nproc` ranks (for a launcher the test signals).
  static std::vector<std::string> launcher_argv(int nproc, const std::string& name,
                                                const std::vector<std::string>& sets) {
    std::vector<std::string> argv = {LONGTRAIN_RUN_BINARY, "--nproc-per-node", std::to_string(nproc),
                                     "--master-addr", "127.0.0.1", "--master-port",
                                     std::to_string(parallel::net::pick_free_port()), "--", LONGTRAIN_BINARY, "train",
                                     write_config(name).string()};
    for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
    return argv;
  }
  // Waits until run `run` logged `steps` losses (or the launcher ended, or 60 s passed).
  static void wait_for_steps(const fs::path& run, size_t steps, pid_t launcher) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (logged_losses(run).size() < steps && std::chrono::steady_clock::now() < deadline) {
      if (::longtrain::test::wait_for_exit(launcher, std::chrono::milliseconds(10))) break;
    }
  }
};

TEST_F(DistributedTrainTest, DataParallelEqualsOneRankWithTheWholeBatch) {
  const std::vector<std::string> common = {"train.steps=10", "eval.batches=0", "checkpoint.every=0",
                                           "train.grad_accum=1"};
  std::vector<std::string> one = common, two = common;
  one.push_back("train.batch_size=4");
  TrainSummary single = train(config("dp_single", one));

  two.push_back("train.batch_size=2");
  ASSERT_EQ(launch(2, train_args("dp_two", two)), 0);
  std::vector<double> parallel = logged_losses(root_ / "runs/dp_two");
  ASSERT_EQ(parallel.size(), single.losses.size());
  const double worst = worst_relative_difference(parallel, single.losses);
  EXPECT_LT(worst, 1e-5);
  ::testing::Test::RecordProperty("worst_relative_loss_difference", fmt::format("{:.2e}", worst));
  // The replicas wrote one run directory (rank 0's) and one checkpoint.
  EXPECT_TRUE(fs::exists(root_ / "runs/dp_two/checkpoints/step_10/model.safetensors"));
}

// 3 ranks (so the ZeRO-1 shard boundaries fall inside layers, and the layer-by-layer gradient
// buckets straddle them) with 2 accumulated micro-batches of 1 sequence each (only the last one's
// backward reduces) equal one rank with the 6 sequences in one batch.
TEST_F(DistributedTrainTest, DataParallelOverThreeRanksWithAccumulationEqualsOneRank) {
  const std::vector<std::string> common = {"train.steps=6", "eval.batches=0", "checkpoint.every=0"};
  std::vector<std::string> one = common, three = common;
  one.insert(one.end(), {"train.batch_size=6", "train.grad_accum=1"});
  TrainSummary single = train(config("dp3_single", one));

  three.insert(three.end(), {"train.batch_size=1", "train.grad_accum=2"});
  ASSERT_EQ(launch(3, train_args("dp3_accum", three)), 0);
  std::vector<double> parallel = logged_losses(root_ / "runs/dp3_accum");
  ASSERT_EQ(parallel.size(), single.losses.size());
  const double worst = worst_relative_difference(parallel, single.losses);
  EXPECT_LT(worst, 1e-5);
  ::testing::Test::RecordProperty("worst_relative_loss_difference", fmt::format("{:.2e}", worst));
}

// Sequence parallelism through the trainer: 20 steps with the sequence split over 2 ranks give the
// losses of 1 rank holding it whole, for every schedule.
TEST_F(DistributedTrainTest, SequenceParallelTrainingEqualsOneRank) {
  const std::vector<std::string> common = {"train.steps=20", "eval.batches=0", "checkpoint.every=0",
                                           "train.batch_size=1", "optim.warmup_steps=2"};
  TrainSummary single = train(config("sp_single", common));
  for (const TwoRankSchedule& k : kTwoRankSchedules) {
    const std::string name = fmt::format("sp_{}", k.schedule);
    ASSERT_EQ(launch(2, train_args(name, over_two_ranks(common, k))), 0) << name;
    std::vector<double> sp = logged_losses(root_ / "runs" / name);
    ASSERT_EQ(sp.size(), single.losses.size()) << name;
    const double worst = worst_relative_difference(sp, single.losses);
    EXPECT_LT(worst, 1e-5) << name;
    ::testing::Test::RecordProperty(name, fmt::format("{:.2e}", worst));
  }
}

// Ulysses and the 2D hybrid train what one rank trains: schedule ulysses over 2 ranks (both layouts,
// and with document masks against one rank with them), and Ulysses inside pairs with zigzag or
// distflash across 2 pairs (4 ranks), burst across them (also with document masks), ulysses and a hybrid
// under remat_aware, and ulysses under the full policy. Under the default policy (it keeps O and LSE) attention runs once per layer and
// Ulysses keeps its forward, so the step log's traffic is the all-to-alls' exact bytes with only dO in
// the backward's; under full the forward runs twice and the backward carries Q, K, V, O, dO and LSE
// (ulysses_attention.h: 16 tokens per rank, 4 query and 2 KV heads of 8, f32: forward
// 16·((2+2)·8 + 2·8 + 2)·4 = 3200 B; backward kept 16·(2·8 + (2+2)·8)·4 = 3072 B, otherwise
// 16·((6+2)·8 + 2 + (2+2)·8)·4 = 6272 B per layer).
TEST_F(DistributedTrainTest, UlyssesAndTheHybridTrainLikeOneRank) {
  const std::vector<std::string> common = {"train.steps=6", "eval.batches=0", "checkpoint.every=0",
                                           "train.batch_size=1", "optim.warmup_steps=2"};
  TrainSummary single = train(config("u_single", common));
  std::vector<std::string> masked_common = common;
  masked_common.push_back("data.document_mask=true");
  TrainSummary single_masked = train(config("u_single_masked", masked_common));
  ASSERT_EQ(single_masked.losses.size(), single.losses.size());
  ASSERT_NE(single_masked.losses.back(), single.losses.back()) << "the document mask must change what is trained";
  struct Case {
    const char* name;
    int ranks;
    std::vector<std::string> sets;
    bool masked;
    bool full = false;  // model.checkpoint full
  };
  const std::vector<Case> cases = {
      {"u_zigzag", 2, {"attention.schedule=ulysses", "parallel.layout=zigzag"}, false},
      {"u_full", 2, {"attention.schedule=ulysses", "parallel.layout=zigzag", "model.checkpoint=full"}, false, true},
      // remat_aware: the model recomputes only the input norm for Ulysses, which kept Q, K, V itself.
      {"u_remat", 2, {"attention.schedule=ulysses", "parallel.layout=zigzag", "model.checkpoint=remat_aware"}, false},
      {"u2x2_remat", 4,
       {"parallel.ulysses_size=2", "attention.schedule=zigzag", "parallel.layout=zigzag", "model.checkpoint=remat_aware"},
       false},
      {"u_contiguous", 2, {"attention.schedule=ulysses", "parallel.layout=contiguous"}, false},
      {"u_masked", 2, {"attention.schedule=ulysses", "parallel.layout=zigzag"}, true},
      {"u2x2_zigzag", 4, {"parallel.ulysses_size=2", "attention.schedule=zigzag", "parallel.layout=zigzag"}, false},
      {"u2x2_distflash", 4, {"parallel.ulysses_size=2", "attention.schedule=distflash", "parallel.layout=contiguous"},
       false},
      {"u2x2_masked", 4, {"parallel.ulysses_size=2", "attention.schedule=burst", "parallel.layout=zigzag"}, true}};
  for (const Case& k : cases) {
    std::vector<std::string> sets = k.masked ? masked_common : common;
    sets.push_back(fmt::format("parallel.sp_size={}", k.ranks));
    sets.insert(sets.end(), k.sets.begin(), k.sets.end());
    ASSERT_EQ(launch(k.ranks, train_args(k.name, sets)), 0) << k.name;
    const std::vector<double>& want = k.masked ? single_masked.losses : single.losses;
    std::ifstream in(root_ / "runs" / k.name / "metrics.jsonl");
    size_t step = 0;
    double worst = 0;
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ASSERT_LT(step, want.size()) << k.name;
      worst = std::max(worst, std::abs(j.at("loss").get<double>() - want[step]) / std::abs(want[step]));
      EXPECT_EQ(j.at("attention_forwards_per_layer").get<double>(), k.full ? 2.0 : 1.0) << k.name;
      if (k.ranks == 2) {
        EXPECT_DOUBLE_EQ(j.at("attention_sent_mib_per_layer").get<double>(),
                         (k.full ? 2 * 3200.0 + 6272.0 : 3200.0 + 3072.0) / 1048576.0)
            << k.name;
      }
      // The memory plan counts the all-to-all buffers (and the ring's over the gathered tokens).
      const double peak = j.at("allocated_peak_gib").get<double>(), plan = j.at("plan_gib").get<double>();
      EXPECT_LE(peak, plan) << k.name;
      EXPECT_GE(peak, 0.9 * plan) << k.name;
      if (step == 0)
        std::cout << "  " << k.name << ": peak " << peak * 1073741824.0 << " B, plan "
                << plan * 1073741824.0 << " B\n";
      ++step;
    }
    EXPECT_EQ(step, want.size()) << k.name;
    EXPECT_LT(worst, 1e-5) << k.name;
    ::testing::Test::RecordProperty(k.name, fmt::format("{:.2e}", worst));
    std::cout << "  " << k.name << ": worst relative loss difference " << fmt::format("{:.2e}", worst) << "\n";
  }
}

// data.document_mask under sequence parallelism: every schedule trains what one rank trains with the
// mask (same losses), and the step log's pairs per rank add up to the one rank's pairs (each pair
// inside a document computed once over the group, none across documents), with an idle fraction
// per rank and the imbalance (max / mean) they imply.
TEST_F(DistributedTrainTest, DocumentMaskUnderSequenceParallelismEqualsOneRankAndLogsWorkPerRank) {
  const std::vector<std::string> common = {"train.steps=4", "eval.batches=0", "checkpoint.every=0",
                                           "train.batch_size=1", "optim.warmup_steps=1", "data.document_mask=true"};
  TrainSummary single = train(config("dm_single", common));
  // Per step: the one rank's pairs.
  std::vector<double> single_pairs;
  {
    std::ifstream in(root_ / "runs" / "dm_single" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) single_pairs.push_back(j.at("attention_pairs_per_rank").at(0).get<double>());
    }
  }
  ASSERT_EQ(single_pairs.size(), 4u);
  for (const TwoRankSchedule& s : kTwoRankSchedules) {
    const std::string name = fmt::format("dm_{}", s.schedule);
    ASSERT_EQ(launch(2, train_args(name, over_two_ranks(common, s))), 0) << name;
    std::ifstream in(root_ / "runs" / name / "metrics.jsonl");
    size_t step = 0;
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ASSERT_LT(step, single.losses.size()) << name;
      EXPECT_LT(std::abs(j.at("loss").get<double>() - single.losses[step]) / single.losses[step], 1e-5)
          << name << " step " << step + 1;
      const auto pairs = j.at("attention_pairs_per_rank").get<std::vector<double>>();
      const auto idle = j.at("attention_idle_fraction_per_rank").get<std::vector<double>>();
      ASSERT_EQ(pairs.size(), 2u) << name;
      ASSERT_EQ(idle.size(), 2u) << name;
      EXPECT_EQ(pairs[0] + pairs[1], single_pairs[step]) << name << " step " << step + 1;
      for (double f : idle) {
        EXPECT_GE(f, 0.0) << name;
        EXPECT_LE(f, 1.0) << name;
      }
      EXPECT_DOUBLE_EQ(j.at("attention_imbalance").get<double>(), 2 * std::max(pairs[0], pairs[1]) / (pairs[0] + pairs[1]))
          << name;
      ++step;
    }
    EXPECT_EQ(step, single.losses.size()) << name;
  }
}

// Under sequence parallelism the step log shows what recomputation costs: remat_aware runs attention
// (and its ring transfers) once per layer, full twice, so full sends one forward's bytes more; the
// allocated peak (schedule buffers included) matches the memory plan.
TEST_F(DistributedTrainTest, SequenceParallelStepLogShowsAttentionTrafficAndPeakMemory) {
  std::map<std::string, double> sent;
  std::map<std::string, std::vector<double>> losses;
  // "offload": remat_aware with model.offload: checkpoints, which must train the same losses bit for bit.
  for (const char* run : {"remat_aware", "full", "offload"}) {
    const std::string name = std::string("sp_log_") + run;
    const bool offload = std::string(run) == "offload";
    const char* policy = offload ? "remat_aware" : run;
    std::string args = "train " + write_config(name).string();
    for (const std::string& s : {std::string("train.steps=2"), std::string("eval.batches=0"),
                                 std::string("checkpoint.every=0"), std::string("train.batch_size=1"),
                                 std::string("optim.warmup_steps=1"), std::string("parallel.sp_size=2"),
                                 std::string("attention.schedule=zigzag"), std::string("parallel.layout=zigzag"),
                                 "model.checkpoint=" + std::string(policy),
                                 std::string("model.offload=") + (offload ? "checkpoints" : "none")})
      args += " --set " + s;
    ASSERT_EQ(launch(2, args), 0) << policy;
    losses[run] = logged_losses(root_ / "runs" / name);
    std::ifstream in(root_ / "runs" / name / "metrics.jsonl");
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ++steps;
      EXPECT_EQ(j.at("attention_forwards_per_layer").get<double>(), std::string(policy) == "full" ? 2.0 : 1.0)
          << policy;
      sent[run] = j.at("attention_sent_mib_per_layer").get<double>();
      const double peak = j.at("allocated_peak_gib").get<double>(), plan = j.at("plan_gib").get<double>();
      EXPECT_LE(peak, plan) << policy;
      EXPECT_GE(peak, 0.9 * plan) << policy;
    }
    EXPECT_EQ(steps, 2) << policy;
  }
  ASSERT_EQ(losses["remat_aware"].size(), 2u);
  EXPECT_EQ(losses["offload"], losses["remat_aware"]) << "offloaded checkpoints changed the losses";
  EXPECT_EQ(sent["offload"], sent["remat_aware"]);
  // What full sends on top of remat_aware is exactly one more forward: zigzag over 2 ranks sends this
  // rank's K and V once (16 tokens x 2 KV heads x head dim 8, f32), per layer.
  const double forward_mib = 2.0 * 16 * 2 * 8 * 4 / 1048576.0;
  EXPECT_GT(sent["remat_aware"], forward_mib);
  EXPECT_DOUBLE_EQ(sent["full"] - sent["remat_aware"], forward_mib) << "full re-runs the forward's transfers";
}

// ZeRO-1: each rank checkpoints its optimizer shard; resuming on the same world size continues the
// uninterrupted run bit for bit, and one process takes it over only with the same global batch.
TEST_F(DistributedTrainTest, ShardedOptimizerResumesBitExactly) {
  auto args_for = [&](const std::string& name) {
    std::string args = "train " + write_config(name).string();
    for (const char* s : {"train.steps=8", "checkpoint.every=4", "eval.batches=0", "train.batch_size=2"})
      args += std::string(" --set ") + s;
    return args;
  };
  ASSERT_EQ(launch(2, args_for("zero_whole")), 0);
  const fs::path step4 = root_ / "runs/zero_whole/checkpoints/step_4";
  ASSERT_TRUE(fs::exists(step4 / "optimizer.rank0.safetensors"));
  ASSERT_TRUE(fs::exists(step4 / "optimizer.rank1.safetensors"));

  fs::create_directories(root_ / "runs/zero_resumed/checkpoints");
  fs::copy(step4, root_ / "runs/zero_resumed/checkpoints/step_4", fs::copy_options::recursive);
  ASSERT_EQ(launch(2, args_for("zero_resumed") + " --resume auto"), 0);
  std::vector<double> whole = logged_losses(root_ / "runs/zero_whole"),
                      resumed = logged_losses(root_ / "runs/zero_resumed");
  ASSERT_EQ(whole.size(), 8u);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[4 + i]) << "step " << 5 + i;
  test::expect_same_checkpoint(root_ / "runs/zero_whole/checkpoints/step_8",
                               root_ / "runs/zero_resumed/checkpoints/step_8", 2);

  // One process takes over the state of two only with the same global batch (2 × 2 × 2 ranks): with
  // train.batch_size 2 it is refused, naming the grad_accum that keeps it.
  TrainConfig one = config("zero_alone", {"train.steps=8", "checkpoint.every=4", "eval.batches=0",
                                          "train.batch_size=2"});
  try {
    train(one, (root_ / "runs/zero_whole/checkpoints/step_4").string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("it was trained with 8 sequences per step (train.batch_size 2 × "
                                         "train.grad_accum 2 × 2 data-parallel ranks, 2 ranks (data parallel 2 × "
                                         "sequence parallel 1)) and this run takes 4"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("set train.grad_accum to 4"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(root_ / "runs/zero_alone"));
}

// Data and sequence parallelism together (4 ranks: 2 replicas of a 2-rank zigzag group): resuming
// from step 2 writes the same step 4 as the uninterrupted run, every file of it, every shard.
TEST_F(DistributedTrainTest, DataAndSequenceParallelResumeIsBitExact) {
  auto args_for = [&](const std::string& name) {
    std::string args = "train " + write_config(name).string();
    for (const char* s : {"train.steps=4", "checkpoint.every=2", "eval.batches=0", "train.batch_size=1",
                          "train.grad_accum=1", "parallel.sp_size=2", "parallel.layout=zigzag",
                          "attention.schedule=zigzag"})
      args += std::string(" --set ") + s;
    return args;
  };
  ASSERT_EQ(launch(4, args_for("dpsp_whole")), 0);
  const fs::path step2 = root_ / "runs/dpsp_whole/checkpoints/step_2";
  fs::create_directories(root_ / "runs/dpsp_resumed/checkpoints");
  fs::copy(step2, root_ / "runs/dpsp_resumed/checkpoints/step_2", fs::copy_options::recursive);
  ASSERT_EQ(launch(4, args_for("dpsp_resumed") + " --resume auto"), 0);
  const std::vector<double> whole = logged_losses(root_ / "runs/dpsp_whole"),
                            resumed = logged_losses(root_ / "runs/dpsp_resumed");
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(resumed.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed[i], whole[2 + i]) << "step " << 3 + i;
  test::expect_same_checkpoint(root_ / "runs/dpsp_whole/checkpoints/step_4",
                               root_ / "runs/dpsp_resumed/checkpoints/step_4", 4);
}

// Preemption through the launcher, data and sequence parallel (4 ranks: 2 replicas of a 2-rank
// group): SIGTERM to longtrain-run reaches every rank; they finish the same step, write its checkpoint
// and exit with kExitPreempted, which the launcher returns; --resume auto then ends exactly where an
// uninterrupted run ends.
TEST_F(DistributedTrainTest, SigtermThroughTheLauncherCheckpointsAndResumesBitExactly) {
  const std::vector<std::string> sets = {"train.steps=120", "checkpoint.every=0", "eval.batches=0",
                                         "train.batch_size=1", "train.grad_accum=1", "parallel.sp_size=2",
                                         "parallel.layout=zigzag", "attention.schedule=zigzag",
                                         "logging.log_every=1000"};
  const fs::path run = root_ / "runs/preempted";
  const pid_t launcher = ::longtrain::test::spawn(launcher_argv(4, "preempted", sets), {},
                                                  (root_ / "preempted.out").string(),
                                                  (root_ / "preempted.err").string());
  wait_for_steps(run, 3, launcher);  // a few steps, then preempt
  ASSERT_GE(logged_losses(run).size(), 3u) << test::read_file(root_ / "preempted.err");
  ASSERT_EQ(::kill(launcher, SIGTERM), 0);
  const std::optional<int> status = ::longtrain::test::wait_for_exit(launcher, std::chrono::seconds(60));
  if (!status) ::longtrain::test::kill_and_reap(launcher);
  ASSERT_TRUE(status) << "the launcher did not stop within 60 s of SIGTERM";
  const std::string err = test::read_file(root_ / "preempted.err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), parallel::kExitPreempted) << err;
  const size_t stopped_at = logged_losses(run).size();
  ASSERT_LT(stopped_at, 120u) << "the run ended before the signal arrived";
  const fs::path ckpt = run / "checkpoints" / fmt::format("step_{}", stopped_at);
  EXPECT_TRUE(fs::exists(ckpt / "MANIFEST.json")) << ckpt << "\n" << err;
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(fs::exists(ckpt / fmt::format("optimizer.rank{}.safetensors", r))) << r;

  ASSERT_EQ(launch(4, train_args("preempted", sets) + " --resume auto"), 0);
  ASSERT_EQ(launch(4, train_args("unpreempted", sets)), 0);
  const std::vector<double> whole = logged_losses(root_ / "runs/unpreempted"), parts = logged_losses(run);
  ASSERT_EQ(parts.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(parts[i], whole[i]) << "step " << i + 1;
  test::expect_same_checkpoint(root_ / "runs/unpreempted/checkpoints/step_120", run / "checkpoints/step_120", 4);
}

// A rank killed with SIGKILL in the middle of training (data and sequence parallel, 4 ranks): every
// rank stops within 10 s, the launcher exits with the killed rank's status (128 + 9), and
// `--resume auto` from the newest complete checkpoint ends exactly where an uninterrupted run ends.
TEST_F(DistributedTrainTest, ARankKilledMidRunStopsTheJobAndResumeIsBitExact) {
  const std::vector<std::string> sets = {"train.steps=120", "checkpoint.every=10", "eval.batches=0",
                                         "train.batch_size=1", "train.grad_accum=1", "parallel.sp_size=2",
                                         "parallel.layout=zigzag", "attention.schedule=zigzag",
                                         "logging.log_every=1000"};
  const fs::path run = root_ / "runs/killed";
  const pid_t launcher = ::longtrain::test::spawn(launcher_argv(4, "killed", sets), {},
                                                  (root_ / "killed.out").string(), (root_ / "killed.err").string());
  wait_for_steps(run, 15, launcher);  // past the checkpoint of step 10
  ASSERT_GE(logged_losses(run).size(), 15u) << test::read_file(root_ / "killed.err");
  // The ranks are the launcher's children; kill the third.
  std::vector<pid_t> ranks;
  {
    std::ifstream children("/proc/" + std::to_string(launcher) + "/task/" + std::to_string(launcher) + "/children");
    for (pid_t p; children >> p;) ranks.push_back(p);
  }
  ASSERT_EQ(ranks.size(), 4u);
  ASSERT_EQ(::kill(ranks[2], SIGKILL), 0);
  const auto killed_at = std::chrono::steady_clock::now();
  const std::optional<int> status = ::longtrain::test::wait_for_exit(launcher, std::chrono::seconds(10));
  if (!status) ::longtrain::test::kill_and_reap(launcher);
  ASSERT_TRUE(status) << "the job did not stop within 10 s of a rank's SIGKILL";
  const double stop_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  std::cout << "  the job stopped " << stop_s << " s after the SIGKILL\n";
  const std::string err = test::read_file(root_ / "killed.err");
  ASSERT_TRUE(WIFEXITED(*status)) << err;
  EXPECT_EQ(WEXITSTATUS(*status), 128 + SIGKILL) << err;
  for (pid_t p : ranks) EXPECT_FALSE(::longtrain::test::pid_alive(p)) << "rank pid " << p << " survived";
  ASSERT_LT(logged_losses(run).size(), 120u) << "the run ended before the kill";

  ASSERT_EQ(launch(4, train_args("killed", sets) + " --resume auto"), 0);
  ASSERT_EQ(launch(4, train_args("not_killed", sets)), 0);
  test::expect_same_checkpoint(root_ / "runs/not_killed/checkpoints/step_120", run / "checkpoints/step_120", 4);
}

TEST_F(DistributedTrainTest, SequenceParallelSizeWithoutEnoughProcessesIsAClearError) {
  try {
    train(config("sp_alone", {"parallel.sp_size=2", "parallel.layout=zigzag"}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("longtrain-run --nproc-per-node 2"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(root_ / "runs/sp_alone"));
}

// The run: sequence parallel over 2 ranks through longtrain-run, resumed in its own run
// directory with more steps (accepted, logged, the lr following the rule, checkpoints at the new
// steps), then with a new parallel layout and model shape (refused, naming each key).
TEST_F(DistributedTrainTest, SequenceParallelRunResumesWithMoreStepsAndRefusesANewLayout) {
  std::string args = "train " + write_config("sp_resume").string();
  for (const char* s : {"train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0", "eval.batches=0",
                        "train.batch_size=1", "parallel.sp_size=2"})
    args += std::string(" --set ") + s;
  std::string out;
  ASSERT_EQ(launch_capture(2, args, out), 0) << out;
  const fs::path run = root_ / "runs/sp_resume";
  const std::vector<test::LoggedStep> first = test::logged_steps(run);
  ASSERT_EQ(first.size(), 4u);

  ASSERT_EQ(launch_capture(2, args + " --resume auto --set train.steps=8", out), 0) << out;
  const std::vector<test::LoggedStep> all = test::logged_steps(run);  // metrics.jsonl of both launches
  ASSERT_EQ(all.size(), 8u);
  // Step 4 ended the cosine at min_lr (3e-4): the rule goes on from there to min_lr at step 8.
  const double L = first.back().lr;
  EXPECT_NEAR(L, 3e-4, 1e-15);
  for (size_t i = 4; i < 8; ++i) {
    EXPECT_EQ(all[i].step, static_cast<int64_t>(i + 1));
    const double want = 3e-4 + (L - 3e-4) * 0.5 * (1.0 + std::cos(M_PI * static_cast<double>(i + 1 - 4) / 4.0));
    EXPECT_NEAR(all[i].lr, want, 1e-12 * want) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(all[i].loss)) << "step " << i + 1;
  }
  const std::string log = test::read_file(run / "train.log");
  EXPECT_NE(log.find("changed on resume: train.steps: 4 -> 8"), std::string::npos) << log;
  for (int step : {6, 8}) {
    const fs::path dir = run / fmt::format("checkpoints/step_{}", step);
    EXPECT_EQ(verify_checkpoint(dir), "") << "step " << step;
    EXPECT_TRUE(fs::exists(dir / "optimizer.rank1.safetensors")) << "step " << step;
  }

  // Another model shape with another parallel layout: refused through the launcher, the refused key
  // named by the ranks with its old and new value (the elastic and allowed ones not); the run
  // directory keeps its checkpoints.
  std::string refused = args + " --resume auto --set train.steps=10 --set parallel.sp_size=1 --set "
                               "parallel.layout=contiguous --set attention.schedule=ring --set model.n_layers=3";
  EXPECT_NE(launch_capture(2, refused, out), 0) << out;
  EXPECT_NE(out.find("  model.n_layers: 2 -> 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("cannot resume from " + (run / "checkpoints/step_8").string()), std::string::npos) << out;
  for (const char* key : {"train.steps: 8 -> 10", "parallel.sp_size: 2 -> 1", "parallel.layout: zigzag"})
    EXPECT_EQ(out.find(key), std::string::npos) << key << ": an allowed or elastic change named as refused\n" << out;
  EXPECT_EQ(list_complete_checkpoints(run / "checkpoints").size(), 4u);
  EXPECT_EQ(test::logged_steps(run).size(), 8u);
}

// Elastic resume through the launcher: a checkpoint written by one world continues on another with
// the same global batch. The ZeRO-1 shards are re-sharded (bit for bit: optimizer_state_test) and the
// loader continues at the same window, so the first resumed step sees the uninterrupted run's weights
// and data. Its loss is bit-identical where the sum runs in the same order (2 data-parallel ranks of
// one sequence each against 1 rank accumulating the same 2 sequences: l0 + l1 either way); later
// steps, and sequence-parallel changes (another split of the attention and of the loss's partial
// sums), differ by rounding only, bounded here by 1e-7 relative (measured: 1.3e-9 at most; see the
// worst_relative_loss_difference property and README "Elastic resume").
struct ElasticCase {
  const char* name;
  int from_nproc;
  std::vector<std::string> from_sets;
  int to_nproc;
  std::vector<std::string> to_sets;
  bool first_step_bit_exact;
  const char* world_change;  // the log's "elastic resume: ..." text
};

void PrintTo(const ElasticCase& k, std::ostream* os) { *os << k.name; }

class ElasticResume : public DistributedTrainTest, public ::testing::WithParamInterface<ElasticCase> {};

TEST_P(ElasticResume, ContinuesTheUninterruptedRun) {
  const ElasticCase& k = GetParam();
  const std::vector<std::string> common = {"train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0",
                                           "eval.batches=0", "train.batch_size=1", "train.threads=1",
                                           "data.prefetch=0"};
  auto sets = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> all = common;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  const std::string whole = std::string(k.name) + "_whole", resumed = std::string(k.name) + "_resumed";
  std::string out;
  ASSERT_EQ(launch_capture(k.from_nproc, train_args(whole, sets(k.from_sets)), out), 0) << out;
  const fs::path step2 = root_ / "runs" / whole / "checkpoints/step_2";
  fs::create_directories(root_ / "runs" / resumed / "checkpoints");
  fs::copy(step2, root_ / "runs" / resumed / "checkpoints/step_2", fs::copy_options::recursive);
  ASSERT_EQ(launch_capture(k.to_nproc, train_args(resumed, sets(k.to_sets)) + " --resume auto", out), 0) << out;

  const std::vector<double> a = logged_losses(root_ / "runs" / whole), b = logged_losses(root_ / "runs" / resumed);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 2u);
  if (k.first_step_bit_exact) {
    EXPECT_EQ(b[0], a[2]) << "step 3";
  }
  double worst = 0;
  for (size_t i = 0; i < 2; ++i) {
    const double rel = ::longtrain::test::scalar_relative_error(b[i], a[2 + i]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-7) << "step " << 3 + i << ": " << b[i] << " against " << a[2 + i];
  }
  ::testing::Test::RecordProperty("worst_relative_loss_difference", fmt::format("{:.2e}", worst));
  std::cout << k.name << fmt::format(": steps 3, 4: {:.17g} {:.17g} resumed, {:.17g} {:.17g} uninterrupted; worst "
                                     "relative difference {:.2e}\n", b[0], b[1], a[2], a[3], worst);

  const std::string log = test::read_file(root_ / "runs" / resumed / "train.log");
  EXPECT_NE(log.find(std::string("elastic resume: ") + k.world_change), std::string::npos) << log;
  // The loader stands where the uninterrupted run's does: the same positions of the same epoch taken.
  const fs::path want = root_ / "runs" / whole / "checkpoints/step_4", got = root_ / "runs" / resumed / "checkpoints/step_4";
  EXPECT_EQ(verify_checkpoint(got, CheckpointVerify::checksums), "");
  const auto loader = [](const fs::path& dir) {
    return nlohmann::json::parse(test::read_file(dir / "trainer_state.json")).at("loader");
  };
  const nlohmann::json la = loader(want), lb = loader(got);
  EXPECT_EQ(la.at("epoch"), lb.at("epoch"));
  EXPECT_EQ(la.at("cursor").get<int64_t>() * la.at("dp_size").get<int64_t>(),
            lb.at("cursor").get<int64_t>() * lb.at("dp_size").get<int64_t>());
  EXPECT_GT(lb.at("cursor").get<int64_t>(), 0);
  // One optimizer shard per rank of the new world.
  for (int r = 0; r < k.to_nproc; ++r) EXPECT_TRUE(fs::exists(got / fmt::format("optimizer.rank{}.safetensors", r)));
  EXPECT_FALSE(fs::exists(got / fmt::format("optimizer.rank{}.safetensors", k.to_nproc)));
}

INSTANTIATE_TEST_SUITE_P(
    WorldChanges, ElasticResume,
    ::testing::Values(
        ElasticCase{"dp2_to_dp1", 2, {"train.grad_accum=1"}, 1, {"train.grad_accum=2"}, true,
                    "2 ranks (data parallel 2 × sequence parallel 1) -> 1 rank (data parallel 1 × sequence parallel 1)"},
        ElasticCase{"dp1_to_dp2", 1, {"train.grad_accum=2"}, 2, {"train.grad_accum=1"}, true,
                    "1 rank (data parallel 1 × sequence parallel 1) -> 2 ranks (data parallel 2 × sequence parallel 1)"},
        ElasticCase{"sp2_to_sp4", 2, {"train.grad_accum=1", "parallel.sp_size=2"}, 4,
                    {"train.grad_accum=1", "parallel.sp_size=4"}, false,
                    "2 ranks (data parallel 1 × sequence parallel 2) -> 4 ranks (data parallel 1 × sequence parallel 4)"},
        ElasticCase{"dp2sp1_to_dp1sp2", 2, {"train.grad_accum=1"}, 2,
                    {"train.grad_accum=2", "parallel.sp_size=2"}, false,
                    "2 ranks (data parallel 2 × sequence parallel 1) -> 2 ranks (data parallel 1 × sequence parallel 2)"}),
    [](const auto& info) { return std::string(info.param.name); });

// The host of the store dies. Two launchers on this machine (--nnodes 2, one rank each) train; then
// node 0's rank, global rank 0, which serves the rendezvous store, is SIGKILLed (its sockets close), or
// node 0 is frozen with SIGSTOP, launcher and rank (a host that hung or lost its network: the
// connections stay open and nothing answers). Node 1's rank must fail within its store timeout
// (parallel.store_timeout_s = 2 here, not the 120 s collective timeout), non-zero, naming the
// store's address, and its launcher with it.
enum class StoreHostFate { killed, hung };

// The children of `pid` (Linux's /proc/PID/task/PID/children).
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/task/{}/children", pid, pid));
  std::vector<pid_t> out;
  for (pid_t c; in >> c;) out.push_back(c);
  return out;
}

void PrintTo(StoreHostFate f, std::ostream* os) { *os << (f == StoreHostFate::killed ? "killed" : "hung"); }

class StoreHostDies : public DistributedTrainTest, public ::testing::WithParamInterface<StoreHostFate> {};

TEST_P(StoreHostDies, EveryOtherRankFailsWithinItsStoreTimeoutNamingTheStore) {
  const StoreHostFate fate = GetParam();
  const std::string name = fate == StoreHostFate::killed ? "store_killed" : "store_hung";
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);  // node 0's orphaned rank is reaped here
  const int port = parallel::net::pick_free_port();
  const fs::path run = root_ / "runs" / name;
  const std::vector<std::string> sets = {"train.steps=1000000", "checkpoint.every=0", "eval.batches=0",
                                         "train.batch_size=1",  "train.grad_accum=1", "train.threads=1",
                                         "data.prefetch=0",     "logging.log_every=1", "parallel.timeout_s=120",
                                         "parallel.store_timeout_s=2"};
  std::vector<pid_t> launchers;
  std::vector<std::string> outs;
  for (int node : {0, 1}) {
    std::vector<std::string> argv = {LONGTRAIN_RUN_BINARY, "--nnodes", "2", "--node-rank", std::to_string(node),
                                     "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                     std::to_string(port), "--grace-period", "1", "--", LONGTRAIN_BINARY, "train",
                                     write_config(name).string()};
    for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
    outs.push_back((root_ / fmt::format("{}_node{}.log", name, node)).string());
    launchers.push_back(::longtrain::test::spawn(argv, {}, outs.back(), outs.back() + ".err"));
  }
  wait_for_steps(run, 2, launchers[1]);
  ASSERT_GE(logged_losses(run).size(), 2u) << test::read_file(outs[0] + ".err") << test::read_file(outs[1] + ".err");
  const std::vector<pid_t> node0_ranks = children_of(launchers[0]);
  ASSERT_EQ(node0_ranks.size(), 1u) << "node 0's launcher should have one rank";
  const pid_t store_host = node0_ranks[0];

  const auto t0 = std::chrono::steady_clock::now();
  if (fate == StoreHostFate::killed) {
    ::kill(store_host, SIGKILL);
  } else {
    ::kill(launchers[0], SIGSTOP);
    ::kill(store_host, SIGSTOP);
  }
  const std::optional<int> status = ::longtrain::test::wait_for_exit(launchers[1], std::chrono::seconds(20));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Node 0 goes away for good either way (SIGKILL ends stopped processes too).
  ::kill(store_host, SIGKILL);
  ::kill(launchers[0], SIGKILL);
  ::waitpid(launchers[0], nullptr, 0);
  ::waitpid(store_host, nullptr, 0);
  if (!status) ::longtrain::test::kill_and_reap(launchers[1]);
  const std::string node1 = test::read_file(outs[1] + ".err") + test::read_file(outs[1]);
  ASSERT_TRUE(status.has_value()) << "node 1 still running 20 s after the store host " << (fate == StoreHostFate::killed ? "died" : "hung") << "\n" << node1;
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << node1;
  std::cout << name << ": node 1's launcher exited with " << (WIFEXITED(*status) ? WEXITSTATUS(*status) : -1)
            << " after " << fmt::format("{:.2f}", waited) << " s\n";
  ::testing::Test::RecordProperty("seconds_to_fail", fmt::format("{:.2f}", waited));
  // Within the store timeout (2 s) and scheduling slack; a hung store is only noticed by its silence,
  // so not before the timeout either.
  EXPECT_LT(waited, 6.0) << node1;
  if (fate == StoreHostFate::hung) {
    EXPECT_GE(waited, 1.9) << node1;
  }
  const std::string address = fmt::format("rendezvous store at 127.0.0.1:{}", port);
  const size_t named = node1.find(address);
  if (named != std::string::npos) {
    const size_t line = node1.rfind('\n', named) + 1;
    std::cout << "  node 1: " << node1.substr(line, node1.find('\n', named) - line) << "\n";
  }
  EXPECT_NE(node1.find("[rank 1]"), std::string::npos) << node1;
  EXPECT_NE(node1.find(address), std::string::npos) << node1;
  if (fate == StoreHostFate::hung) {
    EXPECT_NE(node1.find("did not answer rank 1 for 2 s"), std::string::npos) << node1;
  }
}

INSTANTIATE_TEST_SUITE_P(Fates, StoreHostDies, ::testing::Values(StoreHostFate::killed, StoreHostFate::hung),
                         [](const auto& info) { return info.param == StoreHostFate::killed ? "Killed" : "Hung"; });

}  // namespace
}  // namespace longtrain::trainer
