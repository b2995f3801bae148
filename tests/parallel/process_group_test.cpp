// Rank arithmetic of the process groups, and the world read from torchrun's / Slurm's environment.
// Pure functions: no processes, no sockets.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "parallel/distributed.h"
#include "parallel/process_group.h"
#include "test_util.h"

namespace longtrain::parallel {
namespace {

using test::expect_error;

struct Shape {
  int world, per_node, sp;
};

std::string shape_name(const testing::TestParamInfo<Shape>& info) {
  return "world" + std::to_string(info.param.world) + "_node" + std::to_string(info.param.per_node) + "_sp" +
         std::to_string(info.param.sp);
}

class ProcessGroupShapes : public testing::TestWithParam<Shape> {
 protected:
  ParallelShape shape() const { return {GetParam().world, GetParam().per_node, GetParam().sp}; }
};

// Groups of one kind partition the world, and every rank's own group is the one that contains it.
TEST_P(ProcessGroupShapes, SpAndDpGroupsPartitionTheWorld) {
  const ParallelShape s = shape();
  std::vector<int> seen_sp(s.world_size, 0), seen_dp(s.world_size, 0);
  for (const auto& g : all_sp_groups(s)) {
    ASSERT_EQ(static_cast<int>(g.ranks.size()), s.sp_size);
    for (size_t i = 1; i < g.ranks.size(); ++i) EXPECT_EQ(g.ranks[i], g.ranks[i - 1] + 1) << "SP ranks are consecutive";
    for (int r : g.ranks) ++seen_sp[r];
  }
  for (const auto& g : all_dp_groups(s)) {
    ASSERT_EQ(static_cast<int>(g.ranks.size()), s.dp_size());
    for (int r : g.ranks) ++seen_dp[r];
  }
  for (int r = 0; r < s.world_size; ++r) {
    EXPECT_EQ(seen_sp[r], 1) << "rank " << r;
    EXPECT_EQ(seen_dp[r], 1) << "rank " << r;
    EXPECT_GE(sp_group(s, r).index_of(r), 0);
    EXPECT_GE(dp_group(s, r).index_of(r), 0);
  }
}

// A DP group holds one rank of every SP group, all at the same position: the ranks that hold the
// same tokens of different sequences, whose gradients are reduced together.
TEST_P(ProcessGroupShapes, DpGroupTakesTheSamePositionInEverySpGroup) {
  const ParallelShape s = shape();
  for (int r = 0; r < s.world_size; ++r) {
    const RankGroup dp = dp_group(s, r);
    std::set<std::string> sp_names;
    for (int q : dp.ranks) {
      const RankGroup sp = sp_group(s, q);
      EXPECT_EQ(sp.index_of(q), sp_group(s, r).index_of(r)) << "rank " << q << " in " << dp.name;
      sp_names.insert(sp.name);
    }
    EXPECT_EQ(static_cast<int>(sp_names.size()), s.dp_size());
  }
}

// The intra-node ring is the SP group's part on this node; the inter-node ring its ranks with this
// local rank. Together they tile the SP group as a (nodes x ranks-per-node-in-group) grid.
TEST_P(ProcessGroupShapes, RingsTileTheSpGroupByNodeAndLocalRank) {
  const ParallelShape s = shape();
  for (int r = 0; r < s.world_size; ++r) {
    const RankGroup sp = sp_group(s, r);
    const RankGroup intra = intra_node_ring(s, r);
    const RankGroup inter = inter_node_ring(s, r);
    EXPECT_GE(intra.index_of(r), 0);
    EXPECT_GE(inter.index_of(r), 0);
    for (int q : intra.ranks) {
      EXPECT_EQ(q / s.local_world_size, r / s.local_world_size) << intra.name << " leaves the node";
      EXPECT_GE(sp.index_of(q), 0) << intra.name << " leaves the SP group";
    }
    for (int q : inter.ranks) {
      EXPECT_EQ(q % s.local_world_size, r % s.local_world_size) << inter.name << " mixes local ranks";
      EXPECT_GE(sp.index_of(q), 0) << inter.name << " leaves the SP group";
    }
    // With regular rings, every member of the SP group is reached by exactly one (intra ring, inter
    // ring) pair; ragged shapes say so instead.
    std::multiset<int> grid;
    for (int a : intra.ranks) {
      for (int b : inter_node_ring(s, a).ranks) grid.insert(b);
    }
    const bool tiles = grid == std::multiset<int>(sp.ranks.begin(), sp.ranks.end());
    if (has_regular_rings(s)) {
      EXPECT_TRUE(tiles) << "rank " << r;
    }
    if (!tiles) {
      EXPECT_FALSE(has_regular_rings(s)) << "rank " << r;
    }
    // Group names are job-wide ids: two ranks get the same name exactly when they share the group.
    for (int q = 0; q < s.world_size; ++q) {
      EXPECT_EQ(intra_node_ring(s, q).name == intra.name, intra.index_of(q) >= 0);
      EXPECT_EQ(inter_node_ring(s, q).name == inter.name, inter.index_of(q) >= 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ProcessGroupShapes,
                         testing::Values(Shape{1, 1, 1}, Shape{2, 2, 2}, Shape{3, 3, 3}, Shape{3, 3, 1},
                                         Shape{6, 3, 2}, Shape{6, 2, 3}, Shape{8, 4, 2}, Shape{8, 4, 8},
                                         Shape{12, 4, 6}, Shape{16, 8, 4}, Shape{16, 4, 16}, Shape{15, 5, 5},
                                         Shape{24, 4, 12}),
                         shape_name);

TEST(ProcessGroups, RaggedRingsAreFlagged) {
  EXPECT_TRUE(has_regular_rings({8, 4, 2}));
  EXPECT_TRUE(has_regular_rings({16, 4, 8}));
  EXPECT_FALSE(has_regular_rings({6, 2, 3}));
  EXPECT_FALSE(has_regular_rings({12, 4, 6}));
}

TEST(ProcessGroups, WorkedExamplesFromTheHeader) {
  const ParallelShape two_nodes_sp8{8, 4, 8};
  EXPECT_EQ(intra_node_ring(two_nodes_sp8, 5).ranks, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(inter_node_ring(two_nodes_sp8, 5).ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(dp_group(two_nodes_sp8, 5).ranks, (std::vector<int>{5}));
  const ParallelShape two_nodes_sp2{8, 4, 2};
  EXPECT_EQ(sp_group(two_nodes_sp2, 5).ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(dp_group(two_nodes_sp2, 5).ranks, (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(intra_node_ring(two_nodes_sp2, 5).ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(inter_node_ring(two_nodes_sp2, 5).ranks, (std::vector<int>{5}));
}

// The 2D hybrid's groups: Ulysses groups of U consecutive SP ranks, and rings of the ranks at the same
// position in their groups; together they tile every SP group as a U x R grid.
TEST(ProcessGroups, UlyssesGroupsAndTheirRingsTileEachSpGroup) {
  const ParallelShape s{16, 8, 8, 2};  // two SP groups of 8, Ulysses over pairs
  EXPECT_EQ(ulysses_group(s, 5).ranks, (std::vector<int>{4, 5}));
  EXPECT_EQ(ulysses_group(s, 5).name, "sp0.ulysses2");
  EXPECT_EQ(ulysses_ring_group(s, 5).ranks, (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(ulysses_ring_group(s, 5).name, "sp0.across1");
  EXPECT_EQ(ulysses_group(s, 13).ranks, (std::vector<int>{12, 13}));
  EXPECT_EQ(ulysses_ring_group(s, 13).ranks, (std::vector<int>{9, 11, 13, 15}));
  for (int U : {1, 2, 4, 8}) {
    const ParallelShape shape{16, 8, 8, U};
    for (int r = 0; r < 16; ++r) {
      const RankGroup u = ulysses_group(shape, r), ring = ulysses_ring_group(shape, r);
      ASSERT_EQ(static_cast<int>(u.ranks.size()), U);
      ASSERT_EQ(static_cast<int>(ring.ranks.size()), 8 / U);
      // SP rank p = g·U + m is member m of group g and member g of its ring.
      const int p = r % 8;
      EXPECT_EQ(u.index_of(r), p % U);
      EXPECT_EQ(ring.index_of(r), p / U);
      for (int q : u.ranks) EXPECT_EQ(q / 8, r / 8) << "a Ulysses group leaves its SP group";
      for (int q : ring.ranks) EXPECT_EQ(q % U, r % U);
    }
  }
  EXPECT_THROW(check_parallel_shape(ParallelShape{8, 8, 8, 3}), Error);
}

// burst's double ring over the ring across the Ulysses groups: the header's example, and for every
// regular shape the two rings tile that ring as nodes x members per node, node-major in ring order.
TEST(ProcessGroups, RingAcrossUlyssesGroupsSplitsIntoNodesForTheDoubleRing) {
  const ParallelShape s{8, 4, 8, 2};  // 2 nodes x 4, sp 8, U 2
  EXPECT_EQ(ulysses_ring_nodes(s), 2);
  EXPECT_EQ(ulysses_ring_intra_node(s, 5).ranks, (std::vector<int>{5, 7}));
  EXPECT_EQ(ulysses_ring_intra_node(s, 5).name, "sp0.across1.node1");
  EXPECT_EQ(ulysses_ring_inter_node(s, 5).ranks, (std::vector<int>{1, 5}));
  EXPECT_EQ(ulysses_ring_inter_node(s, 5).name, "sp0.across1.local0");
  EXPECT_EQ(ulysses_ring_inter_node(s, 7).ranks, (std::vector<int>{3, 7}));
  // One node, no hybrid, groups spanning nodes (one member per node), ragged.
  EXPECT_EQ(ulysses_ring_nodes(ParallelShape{8, 8, 8, 2}), 1);
  EXPECT_EQ(ulysses_ring_nodes(ParallelShape{16, 4, 16, 1}), 1);
  EXPECT_EQ(ulysses_ring_nodes(ParallelShape{16, 4, 16, 8}), 2);
  EXPECT_EQ(ulysses_ring_nodes(ParallelShape{12, 3, 12, 2}), 1);
  for (const ParallelShape& shape : {ParallelShape{16, 4, 16, 2}, ParallelShape{32, 8, 16, 4},
                                     ParallelShape{16, 2, 16, 4}, ParallelShape{8, 2, 8, 2}}) {
    const int nodes = ulysses_ring_nodes(shape);
    ASSERT_GT(nodes, 1);
    for (int r = 0; r < shape.world_size; ++r) {
      const RankGroup ring = ulysses_ring_group(shape, r), intra = ulysses_ring_intra_node(shape, r),
                      inter = ulysses_ring_inter_node(shape, r);
      const int per_node = static_cast<int>(ring.ranks.size()) / nodes;
      ASSERT_EQ(static_cast<int>(intra.ranks.size()), per_node) << r;
      ASSERT_EQ(static_cast<int>(inter.ranks.size()), nodes) << r;
      // Ring position = node · per_node + position inside the node.
      EXPECT_EQ(ring.index_of(r), inter.index_of(r) * per_node + intra.index_of(r)) << r;
      for (int q : intra.ranks) EXPECT_EQ(q / shape.local_world_size, r / shape.local_world_size);
      for (int q : inter.ranks) EXPECT_NE(ring.index_of(q), -1);
    }
  }
}

TEST(ProcessGroups, BadShapesAreRejectedNamingTheValue) {
  expect_error([] { check_parallel_shape({6, 3, 4}); }, {"parallel.sp_size 4 does not divide the world size 6"});
  expect_error([] { check_parallel_shape({6, 4, 2}); }, {"world size 6 is not a multiple of the ranks per node 4"});
  expect_error([] { check_parallel_shape({4, 4, 0}); }, {"parallel.sp_size 0"});
  expect_error([] { sp_group({4, 4, 2}, 4); }, {"rank 4 is outside [0, world size 4)"});
}

// --- the world from the environment --------------------------------------------------------------

EnvLookup lookup(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(WorldFromEnv, TorchrunVariables) {
  WorldInfo w = world_from_env(lookup({{"RANK", "5"},
                                       {"WORLD_SIZE", "8"},
                                       {"LOCAL_RANK", "1"},
                                       {"LOCAL_WORLD_SIZE", "4"},
                                       {"MASTER_ADDR", "node0"},
                                       {"MASTER_PORT", "29511"}}));
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.master_addr, "node0");
  EXPECT_EQ(w.master_port, 29511);
}

TEST(WorldFromEnv, SlurmVariablesWhenNoLauncher) {
  WorldInfo w = world_from_env(lookup({{"SLURM_PROCID", "6"},
                                       {"SLURM_NTASKS", "8"},
                                       {"SLURM_LOCALID", "2"},
                                       {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                       {"SLURM_JOB_NODELIST", "gpu[07-08]"}}));
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 6);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.master_addr, "gpu07");
  EXPECT_EQ(w.master_port, 29500);
}

TEST(WorldFromEnv, NothingSetIsOneProcess) {
  WorldInfo w = world_from_env(lookup({}));
  EXPECT_EQ(w.source, "default");
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
}

TEST(WorldFromEnv, PartialOrInconsistentSetsAreErrors) {
  expect_error([] { world_from_env(lookup({{"RANK", "0"}, {"WORLD_SIZE", "2"}})); },
               {"LOCAL_RANK is not set", "longtrain-run"});
  expect_error(
      [] {
        world_from_env(lookup({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"},
                               {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}));
      },
      {"RANK 2 is outside [0, WORLD_SIZE 2)"});
  expect_error(
      [] {
        world_from_env(lookup({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                               {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}));
      },
      {"LOCAL_RANK 0 does not match RANK 3"});
  expect_error(
      [] {
        world_from_env(lookup({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}}));
      },
      {"MASTER_ADDR is not set"});
  expect_error([] { world_from_env(lookup({{"RANK", "x1"}})); }, {"RANK='x1' is not an integer"});
  expect_error([] { world_from_env(lookup({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}})); },
               {"SLURM_NTASKS_PER_NODE"});
}

TEST(SlurmNodelist, FirstHost) {
  EXPECT_EQ(first_host_of_nodelist("node01"), "node01");
  EXPECT_EQ(first_host_of_nodelist("a,b,c"), "a");
  EXPECT_EQ(first_host_of_nodelist("node[03-05,9]"), "node03");
  EXPECT_EQ(first_host_of_nodelist("rack[2-3]-gpu,login1"), "rack2-gpu");
  EXPECT_EQ(first_host_of_nodelist("gpu[10,12],cpu[1-4]"), "gpu10");
  EXPECT_EQ(first_tasks_per_node("8"), 8);
  EXPECT_EQ(first_tasks_per_node("4(x2),3"), 4);
}

}  // namespace
}  // namespace longtrain::parallel
