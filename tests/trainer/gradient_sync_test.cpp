// The data-parallel gradient reduction overlapped with backward, in its two halves:
//   - the model's gradients-ready hook: the ranges it reports partition the flat gradient buffer,
//     come in backward order (head, last layer .. first, embedding), and what a range holds when it
//     is reported is what it holds when forward_backward returns (nothing writes it afterwards),
//     for every checkpoint policy, tied and untied embeddings, with accumulated micro-batches;
//   - the trainer's use of it: reducing each reported range over the ranks while backward goes on
//     (start_reduce_scatter_range, Gloo, real processes) leaves every rank's ZeRO-1 shard exactly as
//     one reduce_scatter after backward does, bit for bit, for 2 and 3 ranks.
// The executable carries the multiproc label for the second half; the first runs in one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include <fmt/format.h>

#include "model/llama.h"
#include "parallel/distributed.h"
#include "parallel/loopback_world.h"
#include "parallel/multiproc_util.h"
#include "parallel/net.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

using namespace std::chrono_literals;

LlamaConfig small_config(bool tied) {
  LlamaConfig c;
  c.vocab_size = 37;
  c.dim = 12;
  c.n_layers = 3;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.ffn_dim = 20;
  c.max_seq_len = 64;
  c.tie_embeddings = tied;
  return c;
}

// A micro-batch of T tokens drawn from `seed`; the last label is ignored.
struct MicroBatch {
  test::HostTensor<int32_t> tokens, labels, positions;
  MicroBatch(const LlamaConfig& c, int64_t T, uint64_t seed) : tokens({T}), labels({T}), positions({T}) {
    for (int64_t t = 0; t < T; ++t) {
      tokens[t] = static_cast<int32_t>((seed * 7919 + static_cast<uint64_t>(t) * 131 + t * t) %
                                       static_cast<uint64_t>(c.vocab_size));
      positions[t] = static_cast<int32_t>(t);
    }
    for (int64_t t = 0; t + 1 < T; ++t) labels[t] = tokens[t + 1];
    labels[T - 1] = LlamaModel::kIgnoreIndex;
  }
  TokenShard shard() const { return {tokens.view, labels.view, positions.view}; }
};

template <class T>
std::vector<T> host_copy(const Tensor& t) {
  const T* p = static_cast<const T*>(t.data);
  return std::vector<T>(p, p + t.numel());
}

// The element range of `name` in the gradient arena's flat view.
int64_t first_element(LlamaModel& m, const std::string& name) {
  return (static_cast<char*>(m.grads().get(name).data) - static_cast<char*>(m.grads().base())) /
         static_cast<std::ptrdiff_t>(dtype_size(m.precision().param));
}

struct Reported {
  int64_t begin, end;
  std::vector<double> values;  // grads().flat()[begin, end) at the moment it was reported
};

class GradientsReadyHook : public testing::TestWithParam<std::tuple<bool, CheckpointPolicy>> {};

TEST_P(GradientsReadyHook, ReportsAPartitionInBackwardOrderAndEachRangeIsFinalWhenReported) {
  const auto [tied, policy] = GetParam();
  const LlamaConfig c = small_config(tied);
  const int64_t T = 19;
  LlamaModel m(c, Precision::cpu(DType::f64), policy, T, nullptr, /*flat_shards=*/3);
  m.initialize(11, 0.3);
  m.zero_grads();
  const MicroBatch first(c, T, 1), second(c, T, 2);
  m.forward_backward(first.shard(), 1.0 / 36);  // accumulated before: the hook only sees the last micro-batch

  std::vector<Reported> reported;
  const Tensor flat = m.grads().flat();
  m.set_gradients_ready([&](int64_t begin, int64_t end) {
    const double* p = static_cast<const double*>(flat.data);
    reported.push_back({begin, end, std::vector<double>(p + begin, p + end)});
  });
  m.forward_backward(second.shard(), 1.0 / 36);
  m.set_gradients_ready(nullptr);
  const std::vector<double> final_grads = host_copy<double>(flat);

  // Head, the layers from the last down, the embedding: ranges from the top of the buffer down,
  // each starting where the next one ends, covering [0, numel).
  ASSERT_EQ(reported.size(), static_cast<size_t>(c.n_layers + 2));
  const auto& ranges = m.gradient_ranges();
  ASSERT_EQ(ranges.size(), reported.size());
  EXPECT_EQ(reported.front().end, flat.numel());
  EXPECT_EQ(reported.back().begin, 0);
  for (size_t i = 0; i < reported.size(); ++i) {
    EXPECT_EQ(reported[i].begin, ranges[i].begin) << "range " << i;
    EXPECT_EQ(reported[i].end, ranges[i].end) << "range " << i;
    EXPECT_LT(reported[i].begin, reported[i].end) << "range " << i;
    if (i + 1 < reported.size()) {
      EXPECT_EQ(reported[i + 1].end, reported[i].begin) << "range " << i;
    }
  }
  // Where the tensors sit: the LM head (untied) goes with the head, layer l's parameters with
  // range 1 + (L - 1 - l), the embedding (and with it a tied LM head) last.
  auto range_of = [&](const std::string& name) {
    const int64_t e = first_element(m, name);
    for (size_t i = 0; i < reported.size(); ++i)
      if (reported[i].begin <= e && e < reported[i].end) return static_cast<int64_t>(i);
    return int64_t{-1};
  };
  EXPECT_EQ(range_of("model.norm.weight"), 0);
  if (!tied) {
    EXPECT_EQ(range_of("lm_head.weight"), 0);
  }
  for (int64_t l = 0; l < c.n_layers; ++l) {
    EXPECT_EQ(range_of(layer_param_name(l, "self_attn.q_proj.weight")), c.n_layers - l);
    EXPECT_EQ(range_of(layer_param_name(l, "mlp.down_proj.weight")), c.n_layers - l);
  }
  EXPECT_EQ(range_of("model.embed_tokens.weight"), c.n_layers + 1);

  // Nothing changes a range after it was reported (bit for bit), and every range holds gradient
  // (a range reported before its backward ran would hold the first micro-batch's values only).
  for (size_t i = 0; i < reported.size(); ++i) {
    const Reported& r = reported[i];
    EXPECT_EQ(std::memcmp(r.values.data(), final_grads.data() + r.begin, r.values.size() * sizeof(double)), 0)
        << "range " << i << " [" << r.begin << ", " << r.end << ") changed after it was reported";
    EXPECT_TRUE(std::any_of(r.values.begin(), r.values.end(), [](double v) { return v != 0.0; })) << "range " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, GradientsReadyHook,
                         testing::Combine(testing::Bool(), testing::Values(CheckpointPolicy::none, CheckpointPolicy::full,
                                                                           CheckpointPolicy::remat_aware)),
                         [](const testing::TestParamInfo<std::tuple<bool, CheckpointPolicy>>& i) {
                           return std::string(std::get<0>(i.param) ? "tied_" : "untied_") +
                                  checkpoint_policy_name(std::get<1>(i.param));
                         });

TEST(GradientsReadyHookUnset, ForwardBackwardRunsWithoutIt) {
  const LlamaConfig c = small_config(false);
  LlamaModel m(c, Precision::cpu(DType::f32), CheckpointPolicy::remat_aware, 8);
  m.initialize(3);
  int calls = 0;
  m.set_gradients_ready([&](int64_t, int64_t) { ++calls; });
  m.set_gradients_ready(nullptr);
  m.forward_backward(MicroBatch(c, 8, 4).shard(), 1.0 / 7);
  EXPECT_EQ(calls, 0);
}

// ---- over the ranks --------------------------------------------------------------------------

// One rank: two micro-batches of its own tokens, reduced (a) range by range during the second
// one's backward, as the trainer does, and (b) by one reduce_scatter after it. Reports the
// difference of the two shards ("CASE ..." lines, asserted by the parent) and how many reported
// ranges straddled a shard boundary.
std::string bucketed_against_whole(int rank, int p, int port) {
  parallel::Distributed d(test::loopback_world(rank, p, port), test::distributed_options(1, 20s));
  parallel::Communicator& world = d.world();
  const LlamaConfig c = small_config(false);
  const int64_t T = 13;
  LlamaModel m(c, Precision::cpu(DType::f32), CheckpointPolicy::remat_aware, T, nullptr, p);
  m.initialize(5, 0.3);
  const MicroBatch first(c, T, 10 + static_cast<uint64_t>(rank)), second(c, T, 20 + static_cast<uint64_t>(rank));
  const Tensor flat = m.grads().flat();
  const int64_t n = flat.numel() / p;
  const Tensor shard = flat.narrow(0, rank * n, n);

  m.zero_grads();
  m.forward_backward(first.shard(), 1.0 / 50);
  std::vector<std::unique_ptr<parallel::CollectiveWork>> works;
  int straddling = 0;
  m.set_gradients_ready([&](int64_t begin, int64_t end) {
    straddling += begin / n != (end - 1) / n;
    works.push_back(world.start_reduce_scatter_range(flat, begin, end));
  });
  m.forward_backward(second.shard(), 1.0 / 50);
  m.set_gradients_ready(nullptr);
  for (auto& w : works) w->wait();
  const std::vector<float> bucketed = host_copy<float>(shard);

  m.zero_grads();
  m.forward_backward(first.shard(), 1.0 / 50);
  m.forward_backward(second.shard(), 1.0 / 50);
  world.reduce_scatter(shard, flat);
  const std::vector<float> whole = host_copy<float>(shard);

  int64_t differing = 0;
  for (size_t i = 0; i < whole.size(); ++i) differing += std::memcmp(&whole[i], &bucketed[i], sizeof(float)) != 0;
  std::ostringstream rep;
  rep << "CASE differing_elements " << differing << " 0\n";
  rep << "CASE reductions " << std::abs(static_cast<int64_t>(works.size()) - (c.n_layers + 2)) << " 0\n";
  rep << "CASE straddling_ranges_missing " << (straddling == 0) << " 0\n";
  return rep.str();
}

class BucketedReduction : public testing::TestWithParam<int> {};

TEST_P(BucketedReduction, DuringBackwardEqualsOneReduceScatterAfterIt) {
  const int p = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(p, [&](int r) { return bucketed_against_whole(r, p, port); }, 60s);
  for (int r = 0; r < p; ++r) {
    ASSERT_TRUE(out[r].exited(0)) << "rank " << r << ":\n" << out[r].text;
    const std::vector<test::CaseLine> cases = test::case_lines(out[r].text, "rank " + std::to_string(r));
    for (const test::CaseLine& c : cases) EXPECT_LE(c.error, c.tolerance) << "rank " << r << ": " << c.name;
    EXPECT_EQ(cases.size(), 3u) << "rank " << r << ":\n" << out[r].text;
  }
}

INSTANTIATE_TEST_SUITE_P(Gloo, BucketedReduction, testing::Values(2, 3),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

}  // namespace
}  // namespace longtrain::model
