// The memory plan's figure for a sequence-parallel schedule (attention/distributed/workspace.h) is
// what the schedule really keeps: for every schedule over 2 and 3 real processes (Gloo on loopback),
// burst's double ring over 2 nodes x 2 ranks, and Ulysses with and without its kept forward,
// the bytes a forward + backward leaves allocated through device_alloc (runtime/device.h
// allocation_stats) equal schedule_workspace_bytes exactly; a second step allocates nothing more, and
// destroying the attention gives everything back.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <utility>

#include "attention/distributed/distributed_attention.h"
#include "attention/distributed/ulysses_attention.h"
#include "attention/distributed/workspace.h"
#include "parallel/distributed.h"
#include "parallel/loopback_world.h"
#include "parallel/multiproc_util.h"
#include "parallel/net.h"
#include "runtime/device.h"
#include "test_util.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace longtrain::attn {
namespace {

using namespace std::chrono_literals;
using test::HostTensor;

struct Case {
  Schedule schedule;
  SeqLayout layout;
  bool causal;
};
constexpr Case kCases[] = {
    {Schedule::ring, SeqLayout::contiguous, true},     {Schedule::zigzag, SeqLayout::zigzag, true},
    {Schedule::distflash, SeqLayout::contiguous, true}, {Schedule::distflash, SeqLayout::contiguous, false},
    {Schedule::burst, SeqLayout::zigzag, true},
};

// P ranks as P / per_node nodes (burst runs its double ring over them when per_node < P).
std::string rank_main(int rank, int P, int per_node, int port) {
  openblas_set_num_threads(1);
  parallel::Distributed d(test::loopback_world(rank, P, port, per_node), test::distributed_options(P));

  const int64_t S = 48, T = S / P, Hq = 4, Hkv = 2, D = 8;
  HostTensor<float> q({T, Hq, D}), k({T, Hkv, D}), v({T, Hkv, D}), o_({T, Hq, D}), lse({T, Hq}), d_o({T, Hq, D}),
      dq({T, Hq, D}), dk({T, Hkv, D}), dv({T, Hkv, D});
  test::fill_uniform(q, 1 + rank);
  test::fill_uniform(k, 11 + rank);
  test::fill_uniform(v, 21 + rank);
  test::fill_uniform(d_o, 31 + rank);

  const int nodes = P / per_node;
  std::ostringstream rep;
  ScheduleWorkspaceShape cpu_shape;
  cpu_shape.tokens = T;
  cpu_shape.q_heads = Hq;
  cpu_shape.kv_heads = Hkv;
  cpu_shape.head_dim = D;
  cpu_shape.dtype = DType::f32;
  cpu_shape.stat = DType::f32;
  cpu_shape.device = Device::cpu;
  // Two steps of `step` on an attention made from `spec` (`prepare` runs first), reported against the
  // plan: what the first step leaves allocated, what the second adds, what destroying it leaves.
  auto measure = [&](const std::string& name, size_t planned, const SequenceAttentionSpec& spec,
                     const std::function<void(SequenceAttention&)>& prepare,
                     const std::function<void(SequenceAttention&)>& step) {
    const size_t live0 = allocation_stats(Device::cpu).live;
    size_t live1 = 0, live2 = 0;
    {
      std::unique_ptr<SequenceAttention> a = make_sequence_attention(spec);
      prepare(*a);
      step(*a);
      live1 = allocation_stats(Device::cpu).live;
      step(*a);
      live2 = allocation_stats(Device::cpu).live;
    }
    const size_t live3 = allocation_stats(Device::cpu).live;
    rep << name << " planned " << planned << " kept " << (live1 - live0) << " second_step " << (live2 - live1)
        << " after_destroy " << (live3 - live0) << "\n";
  };
  for (const Case& c : kCases) {
    if (nodes > 1 && c.schedule != Schedule::burst) continue;  // only burst changes with the topology
    const std::string name =
        fmt::format("{}{}/P{}x{}", schedule_name(c.schedule), c.causal ? "" : "_full", nodes, per_node);
    SequenceAttentionSpec spec;
    spec.schedule = c.schedule;
    spec.layout = c.layout;
    spec.causal = c.causal;
    spec.scale = 1.0 / std::sqrt(static_cast<double>(D));
    spec.sp = &d.sp();
    spec.intra_node = &d.intra_node();
    spec.inter_node = &d.inter_node();
    measure(name, schedule_workspace_bytes(c.schedule, c.causal, P, nodes, cpu_shape), spec,
            [](SequenceAttention&) {},
            [&](SequenceAttention& a) {
              a.forward(o_, lse, q, k, v);
              a.backward(dq, dk, dv, q, k, v, o_, lse, d_o);
            });
  }
  // Ulysses over the whole group (one node), with and without keep_forward over two layers: the
  // schedule's buffers plus, kept, a slot of head-layout Q, K, V, O, LSE per layer.
  for (bool keep : {false, true}) {
    if (nodes > 1 || Hq % P != 0) break;  // heads that split over the group
    const std::string name = fmt::format("ulysses{}/P{}", keep ? "_kept" : "", P);
    SequenceAttentionSpec spec;
    spec.schedule = Schedule::ulysses;
    spec.layout = SeqLayout::contiguous;
    spec.scale = 1.0 / std::sqrt(static_cast<double>(D));
    spec.sp = &d.sp();
    ScheduleWorkspaceShape shape = cpu_shape;
    shape.ulysses_keeps_forward = keep;
    const int layers = 2;
    const size_t planned =
        schedule_workspace_bytes(Schedule::ulysses, true, P, 1, shape) +
        (keep ? layers * ulysses_kept_bytes(P, T, Hq, Hkv, D, DType::f32, DType::f32, Device::cpu) : 0);
    measure(name, planned, spec,
            [&](SequenceAttention& a) {
              if (keep) a.keep_forward(layers);
            },
            [&](SequenceAttention& a) {
              for (int l = 0; l < layers; ++l) {
                a.set_layer(l);
                a.forward(o_, lse, q, k, v);
              }
              for (int l = layers - 1; l >= 0; --l) {
                a.set_layer(l);
                a.backward(dq, dk, dv, q, k, v, o_, lse, d_o);
              }
            });
  }
  return rep.str();
}

// (ranks, ranks per node)
class ScheduleWorkspace : public testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ScheduleWorkspace, PlanEqualsWhatTheScheduleKeeps) {
  const auto [P, per_node] = GetParam();
  const int port = parallel::net::pick_free_port();
  const auto out = test::run_ranks(P, [&](int r) { return rank_main(r, P, per_node, port); }, 60s);
  int lines = 0;
  for (int r = 0; r < P; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].exited(0)) << "rank " << r << ": " << out[static_cast<size_t>(r)].text;
    std::istringstream in(out[static_cast<size_t>(r)].text);
    long long planned = 0, kept = 0, second = 0, after = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      std::istringstream ls(line);
      std::string name, w1, w2, w3, w4;
      ls >> name >> w1;
      EXPECT_TRUE(test::read_fields(ls, planned)) << "rank " << r << ": malformed line: " << line;
      ls >> w2;
      EXPECT_TRUE(test::read_fields(ls, kept)) << "rank " << r << ": malformed line: " << line;
      ls >> w3;
      EXPECT_TRUE(test::read_fields(ls, second)) << "rank " << r << ": malformed line: " << line;
      ls >> w4;
      EXPECT_TRUE(test::read_fields(ls, after)) << "rank " << r << ": malformed line: " << line;
      ++lines;
      // Every rank keeps what the plan says (the plan is the worst rank's; all ranks allocate alike).
      EXPECT_EQ(kept, planned) << name << " rank " << r;
      EXPECT_GT(planned, 0) << name;
      EXPECT_EQ(second, 0) << name << " rank " << r << ": buffers must persist across calls";
      EXPECT_EQ(after, 0) << name << " rank " << r << ": destroying the attention must free its buffers";
    }
  }
  int expected = 0;
  for (const Case& c : kCases) expected += per_node == P || c.schedule == Schedule::burst;
  if (per_node == P && P % 2 == 0) expected += 2;  // ulysses, ulysses_kept (4 query heads split over P)
  EXPECT_EQ(lines, P * expected);
}

// One node of 2 and of 3 ranks; burst's double ring over 2 nodes x 2 ranks (LOCAL_WORLD_SIZE = 2).
INSTANTIATE_TEST_SUITE_P(Gloo, ScheduleWorkspace,
                         testing::Values(std::pair{2, 2}, std::pair{3, 3}, std::pair{4, 2}),
                         [](const testing::TestParamInfo<std::pair<int, int>>& i) {
                           return fmt::format("{}ranks_{}per_node", i.param.first, i.param.second);
                         });

}  // namespace
}  // namespace longtrain::attn
