// The whole model: gradients against central finite differences in double, the three checkpoint
// policies against each other, the parameter table and its initialisation.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "model/llama.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

using test::expect_error;

LlamaConfig tiny_config() {
  LlamaConfig c;
  c.vocab_size = 50;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.ffn_dim = 24;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5;
  c.max_seq_len = 64;
  return c;
}

// A shard of T tokens with global positions starting at `first_position` and a few ignored labels.
struct ShardData {
  test::HostTensor<int32_t> tokens, labels, positions;
  explicit ShardData(int64_t T, int64_t vocab, int32_t first_position = 0)
      : tokens({T}), labels({T}), positions({T}) {
    for (int64_t t = 0; t < T; ++t) {
      tokens[t] = static_cast<int32_t>((t * 7 + 3) % vocab);
      labels[t] = (t % 5 == 4) ? LlamaModel::kIgnoreIndex : static_cast<int32_t>((t * 11 + 5) % vocab);
      positions[t] = first_position + static_cast<int32_t>(t);
    }
  }
  TokenShard shard() const { return {tokens, labels, positions}; }
};

std::vector<double> arena_values(const Arena& a) {
  Tensor f = a.flat();
  return std::vector<double>(f.ptr<double>(), f.ptr<double>() + f.numel());
}

// dL/dθ for L = mean loss over valid labels, by central differences over every parameter, against
// the analytic gradient; for every policy and for tied embeddings.
void check_gradients(LlamaConfig config, CheckpointPolicy policy) {
  const int64_t T = 19;
  LlamaModel model(config, Precision::cpu(DType::f64), policy, T);
  model.initialize(/*seed=*/7, /*init_std=*/0.3);  // large weights so every term matters
  ShardData data(T, config.vocab_size, /*first_position=*/101);
  const int64_t valid = T - T / 5;
  const double scale = 1.0 / static_cast<double>(valid);

  model.zero_grads();
  LossSum ls = model.forward_backward(data.shard(), scale);
  EXPECT_EQ(ls.count, valid);
  std::vector<double> analytic = arena_values(model.grads());

  Tensor flat = model.params().flat();
  std::vector<double> theta(flat.ptr<double>(), flat.ptr<double>() + flat.numel());
  auto loss = [&] {
    std::memcpy(flat.data, theta.data(), theta.size() * sizeof(double));
    return model.forward(data.shard()).sum * scale;
  };
  std::vector<double> numeric = test::finite_difference(theta, loss, 1e-5);
  std::memcpy(flat.data, theta.data(), theta.size() * sizeof(double));

  double err = test::relative_error(analytic, numeric);
  EXPECT_LT(err, 1e-6) << "policy " << checkpoint_policy_name(policy);
  // Per parameter tensor too, so a small tensor's error is not hidden by a large one's scale.
  for (const ArenaEntry& e : model.params().table()) {
    size_t off = e.offset / sizeof(double);
    std::vector<double> a(analytic.begin() + off, analytic.begin() + off + e.numel);
    std::vector<double> n(numeric.begin() + off, numeric.begin() + off + e.numel);
    EXPECT_LT(test::relative_error(a, n), 1e-6) << e.name;
  }
  ::testing::Test::RecordProperty("max_relative_error", fmt::format("{:.3e}", err));
}

TEST(LlamaModel, GradientsMatchFiniteDifferences) { check_gradients(tiny_config(), CheckpointPolicy::remat_aware); }

TEST(LlamaModel, GradientsMatchFiniteDifferencesTiedEmbeddings) {
  LlamaConfig c = tiny_config();
  c.tie_embeddings = true;
  c.n_layers = 1;
  check_gradients(c, CheckpointPolicy::none);
}

TEST(LlamaModel, GradientsMatchFiniteDifferencesMqaFullCheckpoint) {
  LlamaConfig c = tiny_config();
  c.n_kv_heads = 1;
  c.n_layers = 1;
  check_gradients(c, CheckpointPolicy::full);
}

// Every RoPE scaling on: the scaled table and yarn's attention factor reach forward and backward
// alike. head_dim 8 and an original length of 16 put the shard's positions (101..119) well past it,
// and yarn's and llama3's bands inside the 4 frequency pairs.
RopeScaling scaling_for_test(const std::string& type) {
  RopeScaling s;
  s.type = type;
  if (type == "default") return s;
  s.factor = 4;
  if (type == "linear") return s;
  s.original_max_position_embeddings = 16;
  if (type == "llama3") {
    s.low_freq_factor = 1;
    s.high_freq_factor = 4;
  }
  if (type == "yarn") {
    s.beta_fast = 8;
    s.beta_slow = 0.5;
  }
  return s;
}

TEST(LlamaModel, GradientsMatchFiniteDifferencesWithEachRopeScaling) {
  for (const std::string type : {"linear", "dynamic", "yarn", "llama3"}) {
    SCOPED_TRACE("rope_scaling " + type);
    LlamaConfig c = tiny_config();
    c.n_layers = 1;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 8;
    c.vocab_size = 20;  // small embedding and MLP: the differences are spent on attention's inputs
    c.ffn_dim = 8;
    c.rope_scaling = scaling_for_test(type);
    const RopeTable table = c.rope(c.max_seq_len);
    // The scaling does change the table (and yarn the attention factor), or this would test nothing.
    ASSERT_EQ(table.inv_freq.size(), 4u);
    EXPECT_NE(table.inv_freq.back(), std::pow(c.rope_theta, -6.0 / 8)) << type;
    if (type == "yarn") {
      EXPECT_GT(table.attention_factor, 1.1);
    }
    check_gradients(c, CheckpointPolicy::remat_aware);
  }
}

// Gradients (float) are bit-identical under the three policies; remat_aware runs attention forward
// once per layer per step, full twice, none once.
TEST(LlamaModel, CheckpointPoliciesGiveBitIdenticalGradients) {
  LlamaConfig c = tiny_config();
  c.n_layers = 3;
  const int64_t T = 33;
  ShardData data(T, c.vocab_size);
  std::vector<float> reference;
  for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
    LlamaModel model(c, Precision::cpu(DType::f32), policy, T);
    model.initialize(3);
    model.zero_grads();
    model.forward_backward(data.shard(), 1.0 / 27);
    const int64_t expected_forwards = c.n_layers * (policy == CheckpointPolicy::full ? 2 : 1);
    EXPECT_EQ(model.attention().counters.forward_calls, expected_forwards) << checkpoint_policy_name(policy);
    EXPECT_EQ(model.attention().counters.backward_calls, c.n_layers);
    Tensor g = model.grads().flat();
    std::vector<float> grads(g.ptr<float>(), g.ptr<float>() + g.numel());
    if (reference.empty()) {
      reference = grads;
      continue;
    }
    ASSERT_EQ(grads.size(), reference.size());
    EXPECT_EQ(std::memcmp(grads.data(), reference.data(), grads.size() * sizeof(float)), 0)
        << checkpoint_policy_name(policy) << " differs from none";
  }
}

// Token tiling (model.mlp_chunk_tokens, model.loss_chunk_tokens) changes only the order in which
// parameter gradients are summed: the loss and every gradient equal the untiled run's to 1e-12 in
// double, under every policy, for chunks of 1 token, chunks that do not divide T and chunks of T, and
// per parameter tensor (a small tensor's error is not hidden by a large one's). The chunks also reach
// the arena: a tiled model under a recomputing policy allocates less.
TEST(LlamaModel, TiledEqualsUntiled) {
  LlamaConfig c = tiny_config();
  c.n_layers = 3;
  const int64_t T = 37;
  ShardData data(T, c.vocab_size, /*first_position=*/5);
  const double scale = 1.0 / 30;
  double worst = 0.0;
  for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
    auto run = [&](Tiling tiling, std::vector<double>& grads, size_t& act_bytes) {
      LlamaModel model(c, Precision::cpu(DType::f64), policy, T, nullptr, 1, tiling);
      EXPECT_EQ(model.tiling().mlp_chunk_tokens, std::min<int64_t>(tiling.mlp_chunk_tokens, T));
      EXPECT_EQ(model.tiling().loss_chunk_tokens, std::min<int64_t>(tiling.loss_chunk_tokens, T));
      model.initialize(9, 0.3);
      model.zero_grads();
      LossSum ls = model.forward_backward(data.shard(), scale);
      grads = arena_values(model.grads());
      act_bytes = model.activation_bytes();
      // forward() (eval) tiles the head the same way.
      EXPECT_LT(test::scalar_relative_error(model.forward(data.shard()).sum, ls.sum), 1e-13);
      return ls;
    };
    std::vector<double> reference;
    size_t untiled_bytes = 0;
    const LossSum ref = run({T, T}, reference, untiled_bytes);
    ASSERT_TRUE(std::isfinite(ref.sum));
    for (const Tiling tiling : {Tiling{1, 1}, Tiling{5, 7}, Tiling{16, 37}, Tiling{36, 2}, Tiling{37, 10}, Tiling{100, 100}}) {
      const std::string what = fmt::format("{} mlp chunk {} loss chunk {}", checkpoint_policy_name(policy),
                                           tiling.mlp_chunk_tokens, tiling.loss_chunk_tokens);
      std::vector<double> grads;
      size_t bytes = 0;
      const LossSum ls = run(tiling, grads, bytes);
      EXPECT_EQ(ls.count, ref.count) << what;
      EXPECT_LT(test::scalar_relative_error(ls.sum, ref.sum), 1e-12) << what;
      EXPECT_LT(test::relative_error(grads, reference), 1e-12) << what;
      worst = std::max(worst, test::relative_error(grads, reference));
      LlamaModel probe(c, Precision::cpu(DType::f64), policy, T);
      for (const ArenaEntry& e : probe.grads().table()) {
        const size_t off = e.offset / sizeof(double);
        std::vector<double> a(grads.begin() + off, grads.begin() + off + e.numel);
        std::vector<double> r(reference.begin() + off, reference.begin() + off + e.numel);
        EXPECT_LT(test::relative_error(a, r), 1e-12) << what << ": " << e.name;
      }
      if (tiling.mlp_chunk_tokens < T && policy != CheckpointPolicy::none) {
        EXPECT_LT(bytes, untiled_bytes) << what;
      }
    }
  }
  std::printf("tiled against untiled: worst gradient relative error %.3e\n", worst);
  ::testing::Test::RecordProperty("max_relative_error", fmt::format("{:.3e}", worst));
}

// model.attention_head_groups reaches one rank's attention (resolved: auto is one group on CPU) and
// changes no bit of the loss or the gradients under any policy; a count that does not divide the kv
// heads is refused naming the key.
TEST(LlamaModel, AttentionHeadGroupsChangeNothing) {
  LlamaConfig c = tiny_config();
  const int64_t T = 23;
  ShardData data(T, c.vocab_size);
  for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
    std::vector<float> reference;
    for (int64_t groups : {int64_t{0}, c.n_kv_heads}) {
      LlamaModel model(c, Precision::cpu(DType::f32), policy, T, nullptr, 1, Tiling{0, 0, groups});
      const int64_t want = groups == 0 ? 1 : groups;
      EXPECT_EQ(model.tiling().attention_head_groups, want);
      EXPECT_EQ(model.attention().backward_head_groups(), want);
      model.initialize(4);
      model.zero_grads();
      const LossSum ls = model.forward_backward(data.shard(), 1.0 / T);
      ASSERT_TRUE(std::isfinite(ls.sum));
      const Tensor g = model.grads().flat();
      const std::vector<float> grads(g.ptr<float>(), g.ptr<float>() + g.numel());
      if (reference.empty()) {
        reference = grads;
      } else {
        EXPECT_EQ(grads, reference) << checkpoint_policy_name(policy) << ", " << groups << " head groups";
      }
    }
  }
  test::expect_error(
      [&] { LlamaModel bad(c, Precision::cpu(DType::f32), CheckpointPolicy::none, T, nullptr, 1, Tiling{0, 0, 3}); },
      {"model.attention_head_groups", "3"});
}

// The policies stay bit-identical to each other when tiled (they chunk alike).
TEST(LlamaModel, CheckpointPoliciesAreBitIdenticalWhenTiled) {
  LlamaConfig c = tiny_config();
  c.n_layers = 2;
  const int64_t T = 29;
  ShardData data(T, c.vocab_size);
  std::vector<float> reference;
  for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
    LlamaModel model(c, Precision::cpu(DType::f32), policy, T, nullptr, 1, Tiling{6, 11});
    model.initialize(3);
    model.zero_grads();
    model.forward_backward(data.shard(), 1.0 / 23);
    Tensor g = model.grads().flat();
    std::vector<float> grads(g.ptr<float>(), g.ptr<float>() + g.numel());
    if (reference.empty()) {
      reference = grads;
      continue;
    }
    EXPECT_EQ(std::memcmp(grads.data(), reference.data(), grads.size() * sizeof(float)), 0)
        << checkpoint_policy_name(policy) << " differs from none";
  }
}

// A bad label in the last loss chunk is an error before any gradient is written (the labels are
// checked once per shard, not per chunk).
TEST(LlamaModel, BadLabelInALaterLossChunkLeavesGradientsUntouched) {
  LlamaConfig c = tiny_config();
  const int64_t T = 12;
  ShardData data(T, c.vocab_size);
  data.labels[T - 1] = static_cast<int32_t>(c.vocab_size);
  LlamaModel model(c, Precision::cpu(DType::f64), CheckpointPolicy::remat_aware, T, nullptr, 1, Tiling{4, 4});
  model.initialize(1);
  model.zero_grads();
  try {
    model.forward_backward(data.shard(), 1.0);
    ADD_FAILURE() << "a label outside the vocabulary was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("label 50 at token index 11"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.vocab_size"), std::string::npos) << e.what();
  }
  for (double v : arena_values(model.grads())) ASSERT_EQ(v, 0.0);
  EXPECT_THROW(LlamaModel(c, Precision::cpu(DType::f64), CheckpointPolicy::none, T, nullptr, 1, Tiling{-1, 0}), Error);
}

// Ids checked when the batch is made (what the trainer does): the count of labels that count, and the
// same errors the model's own checks give, naming the position and the id; a checked shard trains the
// same loss as an unchecked one.
TEST(LlamaModel, TokenIdsCheckedOnTheHostCountTheLabelsAndRefuseBadIds) {
  LlamaConfig c = tiny_config();
  const int64_t T = 12;
  ShardData data(T, c.vocab_size);
  data.labels[3] = LlamaModel::kIgnoreIndex;  // with ShardData's own: labels 3, 4 and 9 are ignored
  const TokenShard shard = data.shard();
  const int64_t valid = T - 3;
  EXPECT_EQ(check_token_ids(shard.tokens, shard.labels, c.vocab_size, LlamaModel::kIgnoreIndex), valid);
  LlamaModel model(c, Precision::cpu(DType::f64), CheckpointPolicy::remat_aware, T, nullptr, 1, Tiling{4, 4});
  model.initialize(1);
  model.zero_grads();
  const LossSum unchecked = model.forward_backward(shard, 1.0);
  TokenShard checked = shard;
  checked.valid_labels = valid;
  model.zero_grads();
  const LossSum with_check = model.forward_backward(checked, 1.0);
  EXPECT_EQ(with_check.count, valid);
  EXPECT_EQ(with_check.count, unchecked.count);
  EXPECT_EQ(with_check.sum, unchecked.sum);

  data.tokens[7] = static_cast<int32_t>(c.vocab_size + 2);
  expect_error([&] { check_token_ids(shard.tokens, shard.labels, c.vocab_size, LlamaModel::kIgnoreIndex); },
               {"token id 52 at position 7", "model.vocab_size"});
  data.tokens[7] = 1;
  data.labels[5] = -3;
  expect_error([&] { check_token_ids(shard.tokens, shard.labels, c.vocab_size, LlamaModel::kIgnoreIndex); },
               {"label -3 at token index 5", "model.vocab_size"});
}

// model.offload: checkpoints moves what each policy keeps per layer to host memory and back (on CPU
// through the same slot schedule, with plain copies): loss and gradients are bit-identical to keeping
// them, for every policy, over two accumulated steps (the second reuses slots the first left behind),
// with tiling on, and with enough layers (6) that layers come back from the host; eval too.
TEST(LlamaModel, OffloadedCheckpointsGiveBitIdenticalGradients) {
  LlamaConfig c = tiny_config();
  c.n_layers = 6;
  const int64_t T = 23;
  ShardData first(T, c.vocab_size), second(T, c.vocab_size, /*first_position=*/40);
  for (int i = 0; i < T; ++i) second.tokens[i] = static_cast<int32_t>((i * 13 + 1) % c.vocab_size);
  for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
    std::vector<float> grads[2];
    double losses[2][3] = {};
    size_t act_bytes[2] = {};
    for (Offload offload : {Offload::none, Offload::checkpoints}) {
      const int o = offload == Offload::checkpoints;
      LlamaModel model(c, Precision::cpu(DType::f32), policy, T, nullptr, 1, Tiling{7, 9}, offload);
      EXPECT_EQ(model.offload(), offload);
      EXPECT_EQ(model.offload_host_bytes() > 0, o == 1);
      model.initialize(21, 0.2);
      model.zero_grads();
      losses[o][0] = model.forward_backward(first.shard(), 1.0 / 19).sum;
      losses[o][1] = model.forward_backward(second.shard(), 1.0 / 19).sum;
      losses[o][2] = model.forward(first.shard()).sum;
      Tensor g = model.grads().flat();
      grads[o].assign(g.ptr<float>(), g.ptr<float>() + g.numel());
      act_bytes[o] = model.activation_bytes();
    }
    const char* name = checkpoint_policy_name(policy);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    EXPECT_TRUE(test::comparable(grads[0], grads[1])) << name;
    EXPECT_EQ(std::memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)), 0) << name;
    for (int k = 0; k < 3; ++k) EXPECT_EQ(losses[0][k], losses[1][k]) << name << " loss " << k;
    EXPECT_LT(act_bytes[1], act_bytes[0]) << name << ": 3 slots instead of 6 layers on the device";
  }
}

TEST(LlamaModel, GradientsAccumulateAcrossCalls) {
  LlamaConfig c = tiny_config();
  const int64_t T = 11;
  ShardData data(T, c.vocab_size);
  LlamaModel model(c, Precision::cpu(DType::f64), CheckpointPolicy::remat_aware, T);
  model.initialize(5);
  model.zero_grads();
  model.forward_backward(data.shard(), 0.5);
  std::vector<double> once = arena_values(model.grads());
  model.forward_backward(data.shard(), 0.5);
  std::vector<double> twice = arena_values(model.grads());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(twice[i], 2 * once[i], 1e-14 + 1e-12 * std::abs(once[i]));
}

// discard_grads() then forward_backward gives exactly what zero_grads() does, though every gradient
// holds NaN beforehand (so any gradient added to rather than overwritten, or left unwritten, shows):
// untied and tied embeddings, every policy, token chunks (the first chunk overwrites, the rest add), a
// second micro-batch (adds), and each range as the gradients-ready hook reports it. Until then the
// values are stale; zero_grads() after a discard zeroes everything again.
TEST(LlamaModel, DiscardedGradientsEqualZeroedOnes) {
  const int64_t T = 23;
  for (const bool tied : {false, true}) {
    for (CheckpointPolicy policy : {CheckpointPolicy::none, CheckpointPolicy::full, CheckpointPolicy::remat_aware}) {
      for (const Tiling tiling : {Tiling{T, T}, Tiling{5, 7}}) {
        const std::string what = fmt::format("{}{}, mlp chunk {} loss chunk {}", tied ? "tied, " : "",
                                             checkpoint_policy_name(policy), tiling.mlp_chunk_tokens,
                                             tiling.loss_chunk_tokens);
        LlamaConfig c = tiny_config();
        c.tie_embeddings = tied;
        ShardData first(T, c.vocab_size), second(T, c.vocab_size, /*first_position=*/3);
        auto run = [&](bool discard, std::vector<std::vector<double>>* reported) {
          LlamaModel model(c, Precision::cpu(DType::f64), policy, T, nullptr, 1, tiling);
          model.initialize(4, 0.3);
          Tensor flat = model.grads().flat();
          // NaN in every gradient tensor (not the alignment gaps, which nothing writes).
          for (const ArenaEntry& e : model.grads().table()) {
            double* p = flat.ptr<double>() + e.offset / sizeof(double);
            std::fill(p, p + e.numel, std::nan(""));
          }
          if (discard) {
            model.discard_grads();
          } else {
            model.zero_grads();
          }
          if (reported != nullptr) {
            model.set_gradients_ready([&](int64_t begin, int64_t end) {
              reported->emplace_back(flat.ptr<double>() + begin, flat.ptr<double>() + end);
            });
          }
          model.forward_backward(first.shard(), 0.05);
          model.set_gradients_ready(nullptr);
          std::vector<double> one = arena_values(model.grads());
          model.forward_backward(second.shard(), 0.05);
          return std::make_pair(one, arena_values(model.grads()));
        };
        std::vector<std::vector<double>> reported_zeroed, reported_discarded;
        const auto zeroed = run(false, &reported_zeroed), discarded = run(true, &reported_discarded);
        for (double v : zeroed.first) ASSERT_TRUE(std::isfinite(v)) << what << ": the reference itself";
        EXPECT_EQ(discarded.first, zeroed.first) << what << ", one micro-batch";
        EXPECT_EQ(discarded.second, zeroed.second) << what << ", two micro-batches";
        EXPECT_EQ(reported_discarded, reported_zeroed) << what << ", the ranges as reported";
      }
    }
  }
  // A discard leaves stale values until forward_backward; zero_grads() clears them all.
  LlamaModel model(tiny_config(), Precision::cpu(DType::f64), CheckpointPolicy::none, T);
  Tensor flat = model.grads().flat();
  std::fill(flat.ptr<double>(), flat.ptr<double>() + flat.numel(), 1.0);
  model.discard_grads();
  model.zero_grads();
  for (double v : arena_values(model.grads())) ASSERT_EQ(v, 0.0);
}

TEST(LlamaModel, ParameterTableUsesHuggingFaceNamesInOneArena) {
  LlamaConfig c = tiny_config();
  LlamaModel model(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 8);
  int64_t total = 0;
  for (const ArenaEntry& e : model.params().table()) total += e.numel;
  EXPECT_EQ(total, c.num_parameters());
  EXPECT_TRUE(model.params().contains("model.embed_tokens.weight"));
  EXPECT_TRUE(model.params().contains("model.layers.1.self_attn.k_proj.weight"));
  EXPECT_TRUE(model.params().contains("model.layers.0.mlp.up_proj.weight"));
  EXPECT_TRUE(model.params().contains("lm_head.weight"));
  // The fused QKV view is q_proj, k_proj, v_proj back to back.
  Tensor q = model.params().get("model.layers.1.self_attn.q_proj.weight");
  Tensor k = model.params().get("model.layers.1.self_attn.k_proj.weight");
  Tensor v = model.params().get("model.layers.1.self_attn.v_proj.weight");
  EXPECT_EQ(static_cast<float*>(k.data), static_cast<float*>(q.data) + q.numel());
  EXPECT_EQ(static_cast<float*>(v.data), static_cast<float*>(k.data) + k.numel());
  EXPECT_EQ(model.param_views().layers[1].qkv.data, q.data);
  EXPECT_EQ(model.param_views().layers[1].qkv.size(0), c.qkv_dim());
}

TEST(LlamaModel, InitialisationIsSeededAndFollowsHuggingFace) {
  LlamaConfig c = tiny_config();
  c.dim = 64;
  c.vocab_size = 500;
  LlamaModel a(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 4);
  LlamaModel b(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 4);
  a.initialize(11);
  b.initialize(11);
  EXPECT_EQ(std::memcmp(a.params().base(), b.params().base(), a.params().bytes()), 0);
  b.initialize(12);
  EXPECT_NE(std::memcmp(a.params().base(), b.params().base(), a.params().bytes()), 0);

  Tensor norm = a.params().get("model.layers.0.input_layernorm.weight");
  for (int64_t i = 0; i < norm.numel(); ++i) EXPECT_EQ(norm.ptr<float>()[i], 1.0f);
  Tensor emb = a.params().get("model.embed_tokens.weight");
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < emb.numel(); ++i) {
    sum += emb.ptr<float>()[i];
    sq += double(emb.ptr<float>()[i]) * emb.ptr<float>()[i];
  }
  const double n = static_cast<double>(emb.numel()), mean = sum / n, stddev = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(stddev, 0.02, 0.0005);
}

TEST(LlamaModel, BadShapesAreErrorsNamingTheKey) {
  LlamaConfig c = tiny_config();
  c.n_kv_heads = 3;
  try {
    LlamaModel m(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 8);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_heads (4) must be a multiple of model.n_kv_heads (3)"),
              std::string::npos)
        << e.what();
  }
  c = tiny_config();
  c.head_dim = 5;
  EXPECT_THROW(LlamaModel(c, Precision::cpu(DType::f32), CheckpointPolicy::none, 8), Error);
  EXPECT_THROW(parse_checkpoint_policy("selective"), Error);

  LlamaModel m(tiny_config(), Precision::cpu(DType::f32), CheckpointPolicy::none, 8);
  ShardData too_long(9, 50);
  EXPECT_THROW(m.forward(too_long.shard()), Error);
}

}  // namespace
}  // namespace longtrain::model
