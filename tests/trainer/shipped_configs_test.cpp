// The configs in configs/ are what users start from: each must load (every key known, every value in
// range, the combinations consistent), and the long-context ones must fit the GPU they are written for
// by the memory plan `longtrain train --plan` prints and train() checks: an H200's 139.8 GiB, of which
// about 138.7 GiB are free to a process (measured), less the plan's headroom.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/memory_plan.h"
#include "trainer/config.h"
#include "test_util.h"
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

// The configs that start from a Hugging Face directory (model.init_from) name one that
// scripts/gpu/make_random_hf_llama.py writes on the GPU machine; here its config.json, as that
// script writes it (TinyLlama-1.1B's shape with the demo's 4096-token vocabulary), stands in for it.
std::vector<std::string> overrides_for(const fs::path& config) {
  if (::longtrain::test::read_file(config).find("init_from:") == std::string::npos) return {};
  const fs::path dir = fs::temp_directory_path() / "longtrain-shipped-configs-tinyllama";
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 4096, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": null,
    "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false, "torch_dtype": "bfloat16"})";
  return {"model.init_from=" + dir.string()};
}

TEST(ShippedConfigs, EveryConfigLoads) {
  const std::vector<fs::path> files = shipped_configs();
  ASSERT_GE(files.size(), 3u);
  for (const fs::path& f : files) {
    SCOPED_TRACE(f.string());
    TrainConfig c;
    ASSERT_NO_THROW(c = load_config(f.string(), overrides_for(f)));
    EXPECT_EQ(c.data.seq_len % c.parallel.sp_size, 0);
    EXPECT_LE(c.data.seq_len, c.model.max_seq_len);
  }
}

TEST(ShippedConfigs, LongContextConfigsFitAnH200ByPlan) {
  model::DeviceMemory h200;
  h200.total = static_cast<size_t>(139.8 * 1073741824.0);
  h200.free = static_cast<size_t>(138.7 * 1073741824.0);
  for (const char* name : {"llama-1b-128k.yaml", "llama-1b-256k-2gpu.yaml", "extend-tinyllama-64k-llama3.yaml",
                           "extend-tinyllama-64k-yarn.yaml"}) {
    SCOPED_TRACE(name);
    const fs::path f = fs::path(LONGTRAIN_SOURCE_DIR) / "configs" / name;
    TrainConfig c = load_config(f.string(), overrides_for(f));
    ASSERT_EQ(c.train.device, DeviceChoice::cuda);
    const int world = static_cast<int>(c.parallel.sp_size);
    const model::DeviceMemory host{size_t{120} << 30, size_t{128} << 30};  // the H200 machine's
    const model::MemoryChoice choice = plan_training_memory(c, world, h200, host);
    EXPECT_TRUE(choice.fits) << choice.reason;
    const model::MemoryPlan& plan = choice.plan;
    EXPECT_EQ(plan.tokens, c.data.seq_len / c.parallel.sp_size);
    EXPECT_EQ(plan.sp.sp_size, world);
    if (world > 1) {
      EXPECT_GT(plan.schedule_workspace, 0u);
    }
    EXPECT_NO_THROW(model::check_memory_fits(plan, h200, &host)) << plan.table();
    // Each is sized to use the GPU: at least a fifth of it.
    EXPECT_GT(plan.total(), h200.total / 5) << plan.table();
  }
}

}  // namespace
}  // namespace longtrain::trainer
