// Training with several processes through the real launcher (Gloo on this machine): data parallel
// with batch b per rank equals one rank with batch 2b.
#include <sys/wait.h>

#include <cstdlib>

#include <nlohmann/json.hpp>

#include "parallel/net.h"
#include "train_fixture.h"

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

int launch(int nproc, const std::string& args) {
  const std::string cmd = fmt::format("{} --nproc-per-node {} --master-addr 127.0.0.1 --master-port {} -- {} {} 2>&1",
                                      LONGTRAIN_RUN_BINARY, nproc, parallel::net::pick_free_port(), LONGTRAIN_BINARY, args);
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class DistributedTrainTest : public TrainTest {};

TEST_F(DistributedTrainTest, DataParallelEqualsOneRankWithTheWholeBatch) {
  const std::vector<std::string> common = {"train.steps=10", "eval.batches=0", "checkpoint.every=0",
                                           "train.grad_accum=1"};
  std::vector<std::string> one = common, two = common;
  one.push_back("train.batch_size=4");
  TrainSummary single = train(config("dp_single", one));

  two.push_back("train.batch_size=2");
  std::string args = "train " + write_config("dp_two").string();
  for (const std::string& s : two) args += " --set " + s;
  ASSERT_EQ(launch(2, args), 0);
  std::vector<double> parallel = logged_losses(root_ / "runs/dp_two");
  ASSERT_EQ(parallel.size(), single.losses.size());
  double worst = 0;
  for (size_t i = 0; i < parallel.size(); ++i) {
    worst = std::max(worst, std::abs(parallel[i] - single.losses[i]) / std::abs(single.losses[i]));
    EXPECT_NEAR(parallel[i], single.losses[i], 1e-5 * std::abs(single.losses[i])) << "step " << i + 1;
  }
  ::testing::Test::RecordProperty("worst_relative_loss_difference", fmt::format("{:.2e}", worst));
  // The replicas wrote one run directory (rank 0's) and one checkpoint.
  EXPECT_TRUE(fs::exists(root_ / "runs/dp_two/checkpoints/step_10/model.safetensors"));
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

}  // namespace
}  // namespace longtrain::trainer
