// ZeRO-1 optimizer state re-sharded between world sizes: every rank of W' ranks reads back exactly
// the bytes W ranks saved for its range (the padding, which differs with the world size, is zero),
// and state beyond this run's parameters that is not padding is refused.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "runtime/arena.h"
#include "test_util.h"
#include "trainer/optimizer_state.h"

namespace longtrain::trainer {
namespace {

namespace fs = std::filesystem;

// A parameter table of awkward sizes (so shard boundaries fall inside entries), padded for `world`.
Arena params_for(int world, DType dtype) {
  Arena a("params", Device::cpu);
  for (auto [name, n] : std::vector<std::pair<const char*, int64_t>>{
           {"model.embed_tokens.weight", 97}, {"model.norm.weight", 13}, {"lm_head.weight", 151}})
    a.add(name, {n}, dtype);
  a.pad_to_multiple(static_cast<size_t>(world) * dtype_size(dtype));
  a.allocate();
  return a;
}

// The unpadded length of the table above, the same for every world size.
int64_t table_numel(DType dtype) {
  const Arena a = params_for(1, dtype);
  const ArenaEntry& last = a.table().back();
  return static_cast<int64_t>(last.offset / dtype_size(dtype)) + last.numel;
}

struct World {
  Arena params;
  std::vector<std::unique_ptr<AdamW>> ranks;
};

World make_world(int world, DType dtype) {
  World w{params_for(world, dtype), {}};
  const int64_t shard = w.params.flat().numel() / world;
  for (int r = 0; r < world; ++r)
    w.ranks.push_back(std::make_unique<AdamW>(w.params, AdamWConfig{}, r * shard, (r + 1) * shard));
  return w;
}

// The state arenas of one rank, f32 values of its shard.
std::vector<std::vector<float>> shard_values(AdamW& opt) {
  std::vector<std::vector<float>> out;
  std::vector<Arena*> arenas = {&opt.m(), &opt.v()};
  if (opt.has_master()) arenas.push_back(&opt.master());
  const int64_t n = opt.shard_end() - opt.shard_begin();
  for (Arena* a : arenas) {
    const float* p = a->at(0).ptr<float>();
    out.emplace_back(p, p + n);
  }
  return out;
}

class OptimizerState : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("lt_optstate_{}_{}", ::getpid(), static_cast<int>(GetParam()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(OptimizerState, ReshardsBitExactlyBetweenAnyWorldSizes) {
  const DType dtype = GetParam();
  const int64_t used = table_numel(dtype);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  int checked = 0;
  for (int from = 1; from <= 4; ++from) {
    // The global state a run of `from` ranks holds: random over the parameters, zero in the padding.
    World saved = make_world(from, dtype);
    const int64_t total = saved.params.flat().numel();
    std::vector<std::vector<float>> global(dtype == DType::f32 ? 2 : 3, std::vector<float>(total, 0.f));
    for (auto& g : global)
      for (int64_t i = 0; i < used; ++i) g[i] = uni(rng);
    const fs::path ckpt = dir_ / fmt::format("from{}", from);
    fs::create_directories(ckpt);
    for (int r = 0; r < from; ++r) {
      AdamW& opt = *saved.ranks[r];
      std::vector<Arena*> arenas = {&opt.m(), &opt.v()};
      if (opt.has_master()) arenas.push_back(&opt.master());
      ASSERT_EQ(arenas.size(), global.size());
      const int64_t n = opt.shard_end() - opt.shard_begin();
      for (size_t k = 0; k < arenas.size(); ++k)
        std::memcpy(arenas[k]->at(0).data, global[k].data() + opt.shard_begin(), static_cast<size_t>(n) * 4);
      save_optimizer_state(ckpt / optimizer_state_file(r), opt, from, r);
    }
    for (int to = 1; to <= 4; ++to) {
      World resumed = make_world(to, dtype);
      const int64_t now_total = resumed.params.flat().numel();
      int files = 0;
      for (int r = 0; r < to; ++r) {
        AdamW& opt = *resumed.ranks[r];
        const SavedOptimizerLayout layout = load_optimizer_state(ckpt, opt, now_total);
        EXPECT_EQ(layout.world_size, from);
        EXPECT_EQ(layout.shard_numel, total / from);
        files += layout.files_read;
        const auto got = shard_values(opt);
        for (size_t k = 0; k < got.size(); ++k)
          for (int64_t i = 0; i < opt.shard_end() - opt.shard_begin(); ++i) {
            const int64_t flat = opt.shard_begin() + i;
            const float want = flat < total ? global[k][flat] : 0.f;
            // Bit for bit: the bytes saved, not a value close to them.
            ASSERT_EQ(std::memcmp(&got[k][i], &want, 4), 0)
                << "from " << from << " to " << to << " rank " << r << " state " << k << " element " << flat;
          }
      }
      // Every saved shard is read by at least one new rank, and none is read needlessly often.
      EXPECT_GE(files, (std::min(total, now_total) + total / from - 1) / (total / from));
      EXPECT_LE(files, from + to - 1);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 16);
}

TEST_P(OptimizerState, StateBeyondThisRunsParametersMustBePadding) {
  const DType dtype = GetParam();
  World saved = make_world(4, dtype);
  const int64_t total = saved.params.flat().numel();
  World resumed = make_world(1, dtype);
  const int64_t now_total = resumed.params.flat().numel();
  ASSERT_LT(now_total, total) << "the test needs a padded tail that 1 rank does not have";
  AdamW& last = *saved.ranks[3];
  last.m().at(0).ptr<float>()[last.shard_end() - last.shard_begin() - 1] = 1.0f;  // not padding any more
  fs::create_directories(dir_);
  for (int r = 0; r < 4; ++r) save_optimizer_state(dir_ / optimizer_state_file(r), *saved.ranks[r], 4, r);
  try {
    load_optimizer_state(dir_, *resumed.ranks[0], now_total);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not padding: it is another model's"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir_.string()), std::string::npos) << e.what();
  }
}

TEST_P(OptimizerState, AMissingOrForeignShardIsNamed) {
  const DType dtype = GetParam();
  World saved = make_world(3, dtype);
  fs::create_directories(dir_);
  for (int r = 0; r < 3; ++r) save_optimizer_state(dir_ / optimizer_state_file(r), *saved.ranks[r], 3, r);
  World resumed = make_world(2, dtype);
  fs::remove(dir_ / optimizer_state_file(2));
  try {
    load_optimizer_state(dir_, *resumed.ranks[1], resumed.params.flat().numel());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("written by 3 ranks but its optimizer shard of rank 2 "
                                         "(optimizer.rank2.safetensors) is missing"),
              std::string::npos)
        << e.what();
  }
  // A shard of another run's layout in rank 2's place.
  save_optimizer_state(dir_ / optimizer_state_file(2), *saved.ranks[1], 3, 1);
  try {
    load_optimizer_state(dir_, *resumed.ranks[1], resumed.params.flat().numel());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.rank2.safetensors does not hold shard 2 of 3"), std::string::npos)
        << e.what();
  }
}

// f32 parameters (m, v) and bf16 ones (m, v and f32 master weights).
INSTANTIATE_TEST_SUITE_P(Dtypes, OptimizerState, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace longtrain::trainer
