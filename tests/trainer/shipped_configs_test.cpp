// The configs in configs/ are what users start from: each must load (every key known, every value in
// range, the combinations consistent), and the long-context ones must fit the GPU they are written for
// by the memory plan `longtrain train --plan` prints and train() checks: an H200's 139.8 GiB, of which
// about 138.7 GiB are free to a process (measured), less the plan's headroom.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "model/memory_plan.h"
#include "trainer/config.h"
#include "trainer/trainer.h"

namespace longtrain::trainer {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> shipped_configs() {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fs::path(LONGTRAIN_SOURCE_DIR) / "configs"))
    if (e.path().extension() == ".yaml") files.push_back(e.path());
  return files;
}

TEST(ShippedConfigs, EveryConfigLoads) {
  const std::vector<fs::path> files = shipped_configs();
  ASSERT_GE(files.size(), 3u);
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.string());
    TrainConfig c;
    ASSERT_NO_THROW(c = load_config(f.string(), {}));
    EXPECT_EQ(c.data.seq_len % c.parallel.sp_size, 0);
    EXPECT_LE(c.data.seq_len, c.model.max_seq_len);
  }
}

TEST(ShippedConfigs, LongContextConfigsFitAnH200ByPlan) {
  model::DeviceMemory h200;
  h200.total = static_cast<size_t>(139.8 * 1073741824.0);
  h200.free = static_cast<size_t>(138.7 * 1073741824.0);
  for (const char* name : {"llama-1b-128k.yaml", "llama-1b-256k-2gpu.yaml"}) {
    SCOPED_TRACE(name);
    TrainConfig c = load_config((fs::path(LONGTRAIN_SOURCE_DIR) / "configs" / name).string(), {});
    ASSERT_EQ(c.train.device, DeviceChoice::cuda);
    const int world = static_cast<int>(c.parallel.sp_size);
    const model::MemoryPlan plan = plan_training_memory(c, world);
    EXPECT_EQ(plan.tokens, c.data.seq_len / c.parallel.sp_size);
    EXPECT_EQ(plan.sp.sp_size, world);
    if (world > 1) {
      EXPECT_GT(plan.schedule_workspace, 0u);
    }
    EXPECT_NO_THROW(model::check_memory_fits(plan, h200)) << plan.table();
    // Both are sized to use the GPU: at least a third of it.
    EXPECT_GT(plan.total(), h200.total / 3) << plan.table();
  }
}

}  // namespace
}  // namespace longtrain::trainer
