// The whole model on the GPU: one training step of LlamaModel in Precision::cuda_mixed() (bf16
// parameters and activations, f32 statistics; cuBLASLt GEMMs, cuDNN attention) against the CPU
// reference model holding the same bf16-rounded parameters (computed in f64, so the reference's own
// error is nil); the three checkpoint policies against each other on the GPU; run-twice determinism;
// trainer::AdamW stepping device arenas against the same step on the CPU.
//
// Tolerance of a whole step (max|gpu - cpu| / max|cpu| per tensor): every op rounds its output to bf16
// (unit roundoff 2^-9), and a gradient at the first layer has passed through ~25 of them (embedding,
// 2 × (norm, QKV, RoPE, attention, o_proj, add, norm, gate/up, SwiGLU, down, add), final norm, LM
// head) forward and again backward, with weight gradients accumulated by bf16 GEMMs. Independent
// roundings of that count give a few 2^-9 on the largest entries; the tolerance is 8 bf16 ulps at
// the top of a binade, 8 × 2^-8 = 3.1e-2 (2× gpu_tolerance(bf16) of a single op). The loss, a mean
// over ~50 tokens in f32, must agree to 5e-3 relative. Measured on an H200 (cuDNN 9.19): loss 1.4e-4,
// gradients 5.5e-3 .. 1.45e-2 (worst: layer 0's post_attention_layernorm weight).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "model/llama.h"
#include "runtime/cuda_check.h"
#include "model/memory_plan.h"
#include "model/parameters.h"
#include "trainer/optimizer.h"

namespace longtrain::test {
namespace {

using model::CheckpointPolicy;
using model::LlamaConfig;
using model::LlamaModel;
using model::Precision;

constexpr double kStepTolerance = 8.0 / 256.0;
constexpr double kLossTolerance = 5e-3;

LlamaConfig tiny_config() {
  LlamaConfig c;
  c.vocab_size = 97;
  c.dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;  // TinyLlama's head dim (cuDNN takes multiples of 8 up to 256)
  c.ffn_dim = 176;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5;
  c.max_seq_len = 128;
  return c;
}

constexpr int64_t kTokens = 61;

// Token ids, next-token labels (every seventh ignored) and global positions of one shard.
struct Batch {
  std::vector<int32_t> tokens, labels, positions;
  int64_t valid = 0;
  attn::Documents documents;
  // With `doc_starts` (window positions where a document begins): positions restart at each document
  // and the label across a boundary is ignored, as the loader makes them under data.document_mask.
  Batch(int64_t T, int64_t vocab, int32_t first_position, const std::vector<int32_t>& doc_starts = {},
        uint64_t seed = 12345) {
    uint64_t s = seed;
    auto next = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(vocab));
    };
    for (int64_t t = 0; t <= T; ++t) tokens.push_back(next());
    if (!doc_starts.empty()) documents = attn::documents_from_starts(doc_starts, T);
    for (int64_t t = 0; t < T; ++t) {
      const bool last_of_document = !documents.empty() && documents.document_of(t) != documents.document_of(
                                                              std::min<int64_t>(t + 1, T - 1));
      labels.push_back(t % 7 == 6 || last_of_document ? LlamaModel::kIgnoreIndex : tokens[t + 1]);
      valid += labels.back() != LlamaModel::kIgnoreIndex;
      const int64_t start = documents.empty() ? -first_position : documents.offsets[documents.document_of(t)];
      positions.push_back(static_cast<int32_t>(t - start));
    }
    tokens.resize(static_cast<size_t>(T));
  }
};

// The shard as device tensors (owned).
struct DeviceShard {
  DeviceTensor tokens, labels, positions;
  explicit DeviceShard(const Batch& b)
      : tokens(DType::i32, {static_cast<int64_t>(b.tokens.size())}),
        labels(DType::i32, {static_cast<int64_t>(b.labels.size())}),
        positions(DType::i32, {static_cast<int64_t>(b.positions.size())}) {
    upload_ints(tokens, b.tokens);
    upload_ints(labels, b.labels);
    upload_ints(positions, b.positions);
    documents = b.documents;
  }
  attn::Documents documents;
  model::TokenShard shard() const { return {tokens, labels, positions, documents}; }
};

struct HostShard {
  HostTensor<int32_t> tokens, labels, positions;
  explicit HostShard(const Batch& b)
      : tokens({static_cast<int64_t>(b.tokens.size())}), labels({static_cast<int64_t>(b.labels.size())}),
        positions({static_cast<int64_t>(b.positions.size())}) {
    tokens.values = b.tokens;
    labels.values = b.labels;
    positions.values = b.positions;
    documents = b.documents;
  }
  attn::Documents documents;
  model::TokenShard shard() const { return {tokens, labels, positions, documents}; }
};

// Entry `e` of an arena, whatever its device, as doubles.
std::vector<double> entry_values(const Arena& a, size_t i) {
  Tensor t = a.at(i);
  Tensor flat = t.reshape({t.numel()});
  if (a.device() == Device::cuda) return download(flat);
  std::vector<double> out(static_cast<size_t>(flat.numel()));
  for (size_t j = 0; j < out.size(); ++j) {
    switch (flat.dtype) {
      case DType::f64: out[j] = flat.ptr<double>()[j]; break;
      case DType::f32: out[j] = flat.ptr<float>()[j]; break;
      case DType::bf16: out[j] = static_cast<float>(flat.ptr<bf16>()[j]); break;
      default: break;
    }
  }
  return out;
}

// A GPU model with seeded bf16 parameters (init_std 0.08: attention patterns far from uniform).
std::unique_ptr<LlamaModel> gpu_model(CheckpointPolicy policy) {
  auto m = std::make_unique<LlamaModel>(tiny_config(), Precision::cuda_mixed(), policy, kTokens);
  m->initialize(/*seed=*/2024, /*init_std=*/0.08);
  return m;
}

// The CPU f64 model holding exactly the GPU model's (bf16) parameter values.
std::unique_ptr<LlamaModel> cpu_copy(const LlamaModel& gpu, CheckpointPolicy policy) {
  auto m = std::make_unique<LlamaModel>(tiny_config(), Precision::cpu(DType::f64), policy, kTokens);
  LlamaModel& g = const_cast<LlamaModel&>(gpu);
  for (size_t i = 0; i < g.params().table().size(); ++i) {
    EXPECT_EQ(g.params().table()[i].name, m->params().table()[i].name);
    const std::vector<double> v = entry_values(g.params(), i);
    Tensor dst = m->params().at(i);
    std::memcpy(dst.data, v.data(), v.size() * sizeof(double));
  }
  return m;
}

void expect_one_step_matches_cpu(const Batch& batch) {
  auto gpu = gpu_model(CheckpointPolicy::remat_aware);
  auto cpu = cpu_copy(*gpu, CheckpointPolicy::remat_aware);
  const double scale = 1.0 / static_cast<double>(batch.valid);

  DeviceShard ds(batch);
  HostShard hs(batch);
  // The GPU as the trainer runs it: its gradients discarded, NaN before (any gradient added to rather
  // than overwritten by its first contribution would stay NaN); the CPU's zeroed.
  for (size_t i = 0; i < gpu->grads().table().size(); ++i) {
    const Tensor g = gpu->grads().at(i);
    upload(g, std::vector<double>(static_cast<size_t>(g.numel()), std::nan("")));
  }
  gpu->discard_grads();
  cpu->zero_grads();
  const model::LossSum lg = gpu->forward_backward(ds.shard(), scale);
  const model::LossSum lc = cpu->forward_backward(hs.shard(), scale);
  EXPECT_EQ(lg.count, batch.valid);
  EXPECT_EQ(lc.count, batch.valid);
  const double loss_error = std::abs(lg.sum - lc.sum) / std::abs(lc.sum);
  std::printf("  loss: gpu %.6f cpu %.6f (mean over %lld labels), relative error %.2e (tolerance %.1e)\n",
              lg.sum * scale, lc.sum * scale, (long long)lc.count, loss_error, kLossTolerance);
  EXPECT_LT(loss_error, kLossTolerance);
  ::testing::Test::RecordProperty("loss_relative_error", std::to_string(loss_error));

  double worst = 0.0;
  std::string worst_name;
  const auto& table = gpu->grads().table();
  for (size_t i = 0; i < table.size(); ++i) {
    const std::vector<double> g = entry_values(gpu->grads(), i), r = entry_values(cpu->grads(), i);
    const double err = relative_error(g, r), norm_err = norm_relative_error(g, r);
    std::printf("  %-52s max|err|/max|ref| = %.3e, ||err||/||ref|| = %.3e\n", table[i].name.c_str(), err, norm_err);
    EXPECT_LT(err, kStepTolerance) << table[i].name;
    // A wrong row or head of small values stays under the max-normalised bound; not under this one.
    EXPECT_LT(norm_err, kStepTolerance) << table[i].name << " (norm-wise)";
    double ref_max = 0.0;
    for (double x : r) ref_max = std::max(ref_max, std::abs(x));
    EXPECT_GT(ref_max, 0.0) << table[i].name << ": a zero reference gradient tests nothing";
    for (double x : g) ASSERT_TRUE(std::isfinite(x)) << table[i].name;
    if (err > worst) worst = err, worst_name = table[i].name;
  }
  std::printf("  worst gradient: %s, %.3e (tolerance %.2e)\n", worst_name.c_str(), worst, kStepTolerance);
  ::testing::Test::RecordProperty("worst_gradient_relative_error", std::to_string(worst));
}

TEST(GpuModel, OneStepLossAndEveryGradientMatchTheCpuReference) {
  LT_REQUIRE_GPU();
  expect_one_step_matches_cpu(Batch(kTokens, tiny_config().vocab_size, /*first_position=*/3));
}

// data.document_mask at P = 1: the GPU's one segmented cuDNN call (a segment per document) against the
// CPU reference's per-document blocks, with a one-token document and documents of odd lengths.
TEST(GpuModel, OneStepWithPackedDocumentsMatchesTheCpuReference) {
  LT_REQUIRE_GPU();
  const Batch batch(kTokens, tiny_config().vocab_size, 0, /*doc_starts=*/{9, 10, 33, 47});
  ASSERT_EQ(batch.documents.count(), 5);
  expect_one_step_matches_cpu(batch);
}

// The three policies recompute with the same kernels on the same inputs: gradients agree within bf16
// rounding (and are normally bit-identical); attention forward runs once per layer under none and
// remat_aware, twice under full.
TEST(GpuModel, CheckpointPoliciesAgreeWithinBf16Rounding) {
  LT_REQUIRE_GPU();
  const Batch batch(kTokens, tiny_config().vocab_size, 0);
  DeviceShard ds(batch);
  std::vector<std::vector<double>> reference;
  for (CheckpointPolicy policy : {CheckpointPolicy::remat_aware, CheckpointPolicy::none, CheckpointPolicy::full}) {
    auto m = gpu_model(policy);
    m->zero_grads();
    m->forward_backward(ds.shard(), 1.0 / static_cast<double>(batch.valid));
    const int64_t L = tiny_config().n_layers;
    EXPECT_EQ(m->attention().counters.forward_calls, L * (policy == CheckpointPolicy::full ? 2 : 1));
    EXPECT_EQ(m->attention().counters.backward_calls, L);
    std::vector<std::vector<double>> grads;
    for (size_t i = 0; i < m->grads().table().size(); ++i) grads.push_back(entry_values(m->grads(), i));
    if (reference.empty()) {
      reference = grads;
      continue;
    }
    double worst = 0.0;
    bool identical = true;
    for (size_t i = 0; i < grads.size(); ++i) {
      const double err = relative_error(grads[i], reference[i]);
      worst = std::max(worst, err);
      identical = identical && grads[i] == reference[i];
      EXPECT_LT(err, 2.0 / 256.0) << checkpoint_policy_name(policy) << " vs remat_aware: "
                                  << m->grads().table()[i].name;
    }
    std::printf("  %-11s vs remat_aware: worst relative difference %.3e%s\n", checkpoint_policy_name(policy), worst,
                identical ? " (bit-identical)" : "");
  }
}

// Token tiling and checkpoint offload on the GPU (model.offload: checkpoints: pinned host memory, a copy
// stream, events): a 6-layer model, so that layers come back from the host a layer ahead, with MLP
// chunks of 16 and loss chunks of 24 tokens (neither divides 61), and the attention backward in two
// kv-head groups (model.attention_head_groups: views of the fused buffers and of the head-major LSE).
// Offloaded equals kept in the same tiling to the loss bits (the forward is bitwise reproducible; the
// copies are exact), gradients within bf16 rounding (cuDNN's dQ atomics); tiled equals untiled (one
// chunk, one head group) within bf16 rounding; and the tiled,
// offloaded model still matches the CPU f64 reference within the step tolerance. Two steps each, so the
// second reuses slots and events of the first.
TEST(GpuModel, TiledAndOffloadedStepsMatchKeptUntiledAndTheCpuReference) {
  LT_REQUIRE_GPU();
  LlamaConfig c = tiny_config();
  c.n_layers = 6;
  const Batch batch(kTokens, c.vocab_size, /*first_position=*/5);
  DeviceShard ds(batch);
  HostShard hs(batch);
  const double scale = 1.0 / static_cast<double>(batch.valid);
  const model::Tiling tiled{16, 24, 2}, untiled{kTokens, kTokens, 1};
  struct Result {
    double loss;
    std::vector<std::vector<double>> grads;
  };
  // Room for 64 tokens (a multiple of 4: each head group's slice of the head-major LSE starts 16-byte
  // aligned), steps of 61.
  constexpr int64_t kRoom = 64;
  auto run = [&](CheckpointPolicy policy, model::Tiling tiling, model::Offload offload) {
    auto m = std::make_unique<LlamaModel>(c, Precision::cuda_mixed(), policy, kRoom, nullptr, 1, tiling, offload);
    m->initialize(/*seed=*/77, /*init_std=*/0.08);
    m->zero_grads();
    m->forward_backward(ds.shard(), scale);
    const double loss = m->forward_backward(ds.shard(), scale).sum;  // gradients of two steps
    Result r{loss, {}};
    for (size_t i = 0; i < m->grads().table().size(); ++i) r.grads.push_back(entry_values(m->grads(), i));
    EXPECT_EQ(m->offload_host_bytes() > 0, offload == model::Offload::checkpoints);
    EXPECT_EQ(m->attention().backward_head_groups(), tiling.attention_head_groups);
    return r;
  };
  auto worst = [&](const Result& a, const Result& b) {
    double w = 0.0;
    for (size_t i = 0; i < a.grads.size(); ++i) w = std::max(w, relative_error(a.grads[i], b.grads[i]));
    return w;
  };
  for (CheckpointPolicy policy : {CheckpointPolicy::remat_aware, CheckpointPolicy::full, CheckpointPolicy::none}) {
    const char* name = checkpoint_policy_name(policy);
    const Result kept = run(policy, tiled, model::Offload::none);
    const Result off = run(policy, tiled, model::Offload::checkpoints);
    const Result plain = run(policy, untiled, model::Offload::none);
    EXPECT_EQ(std::memcmp(&kept.loss, &off.loss, sizeof(double)), 0) << name << ": " << kept.loss << " vs " << off.loss;
    const double w_off = worst(off, kept), w_tile = worst(kept, plain);
    std::printf("  %-11s offloaded vs kept: %.3e; tiled vs untiled: %.3e; loss %.6f / %.6f\n", name, w_off, w_tile,
                off.loss * scale, plain.loss * scale);
    EXPECT_LT(w_off, 2.0 / 256.0) << name;
    EXPECT_LT(w_tile, 4.0 / 256.0) << name;
    EXPECT_LT(std::abs(off.loss - plain.loss) / std::abs(plain.loss), kLossTolerance) << name;
  }
  // Head groups with room for 61 tokens would start the second group's LSE 488 bytes in: refused.
  test::expect_error([&] { LlamaModel bad(c, Precision::cuda_mixed(), CheckpointPolicy::none, kTokens, nullptr, 1, tiled); },
                     {"model.attention_head_groups", "multiple of 4"});
  // The tiled, offloaded remat_aware model against the CPU reference (one step).
  auto gpu = std::make_unique<LlamaModel>(c, Precision::cuda_mixed(), CheckpointPolicy::remat_aware, kRoom, nullptr, 1,
                                          tiled, model::Offload::checkpoints);
  gpu->initialize(2024, 0.08);
  auto cpu = std::make_unique<LlamaModel>(c, Precision::cpu(DType::f64), CheckpointPolicy::remat_aware, kTokens);
  for (size_t i = 0; i < gpu->params().table().size(); ++i) {
    const std::vector<double> v = entry_values(gpu->params(), i);
    std::memcpy(cpu->params().at(i).data, v.data(), v.size() * sizeof(double));
  }
  gpu->zero_grads();
  cpu->zero_grads();
  const model::LossSum lg = gpu->forward_backward(ds.shard(), scale), lc = cpu->forward_backward(hs.shard(), scale);
  EXPECT_LT(std::abs(lg.sum - lc.sum) / std::abs(lc.sum), kLossTolerance);
  double w = 0.0;
  for (size_t i = 0; i < gpu->grads().table().size(); ++i) {
    const std::vector<double> g = entry_values(gpu->grads(), i), r = entry_values(cpu->grads(), i);
    EXPECT_LT(relative_error(g, r), kStepTolerance) << gpu->grads().table()[i].name;
    EXPECT_LT(norm_relative_error(g, r), kStepTolerance) << gpu->grads().table()[i].name << " (norm-wise)";
    w = std::max(w, relative_error(g, r));
  }
  std::printf("  tiled + offloaded remat_aware vs CPU f64: worst gradient %.3e (tolerance %.2e)\n", w, kStepTolerance);
  ::testing::Test::RecordProperty("offload_worst_gradient_relative_error", std::to_string(w));
}

// train.grad_dtype f32: gradients in f32 beside bf16 parameters. Four micro-batches, each run in
// token chunks of 16 (MLP) and 24 (loss), add into one gradient buffer; with f32 gradients every
// weight-gradient GEMM and reduction adds into f32, so the sum is never rounded to bf16 between
// chunks or micro-batches. Against the CPU f64 sum of the same four: every f32 gradient within the
// step tolerance, and the f32 buffer's error norm-wise below the bf16 buffer's (the same model in
// bf16 gradients, same inputs), tensor by tensor on the weight matrices where chunks and micro-batches
// add up. The f32 buffer is what the plan counts: 4 bytes a parameter.
TEST(GpuModel, F32GradientsSumChunksAndMicroBatchesWithoutBf16Rounding) {
  LT_REQUIRE_GPU();
  const LlamaConfig c = tiny_config();
  const model::Tiling tiled{16, 24};
  std::vector<Batch> batches;
  int64_t valid = 0;
  for (uint64_t i = 0; i < 4; ++i) {
    batches.emplace_back(kTokens, c.vocab_size, static_cast<int32_t>(7 * i), std::vector<int32_t>{}, 1000 + 77 * i);
    valid += batches.back().valid;
  }
  const double scale = 1.0 / static_cast<double>(valid);
  auto gpu_run = [&](bool f32_grads) {
    auto m = std::make_unique<LlamaModel>(c, Precision::cuda_mixed(f32_grads), CheckpointPolicy::remat_aware, kTokens,
                                          nullptr, 1, tiled);
    m->initialize(/*seed=*/2024, /*init_std=*/0.08);
    m->zero_grads();
    for (const Batch& b : batches) m->forward_backward(DeviceShard(b).shard(), scale);
    return m;
  };
  auto bf = gpu_run(false), f32 = gpu_run(true);
  EXPECT_EQ(bf->grads().table()[0].dtype, DType::bf16);
  EXPECT_EQ(f32->grads().table()[0].dtype, DType::f32);
  EXPECT_EQ(f32->grads().flat().numel(), bf->grads().flat().numel());
  EXPECT_EQ(f32->grads().bytes(), 2 * bf->grads().bytes());
  const model::MemoryPlan plan = model::plan_memory(c, Precision::cuda_mixed(true), CheckpointPolicy::remat_aware,
                                                    kTokens, 1, {}, tiled);
  EXPECT_EQ(plan.gradients, f32->grads().bytes());
  auto cpu = cpu_copy(*bf, CheckpointPolicy::remat_aware);
  cpu->zero_grads();
  for (const Batch& b : batches) cpu->forward_backward(HostShard(b).shard(), scale);
  int matrices = 0, f32_better = 0;
  double worst = 0.0;
  for (size_t i = 0; i < f32->grads().table().size(); ++i) {
    const std::string& name = f32->grads().table()[i].name;
    const std::vector<double> r = entry_values(cpu->grads(), i), g32 = entry_values(f32->grads(), i),
                              g16 = entry_values(bf->grads(), i);
    for (double x : g32) ASSERT_TRUE(std::isfinite(x)) << name;
    const double e32 = norm_relative_error(g32, r), e16 = norm_relative_error(g16, r);
    std::printf("  %-52s ||err||/||ref||: f32 gradients %.3e, bf16 gradients %.3e\n", name.c_str(), e32, e16);
    EXPECT_LT(relative_error(g32, r), kStepTolerance) << name;
    EXPECT_LT(e32, kStepTolerance) << name << " (norm-wise)";
    worst = std::max(worst, relative_error(g32, r));
    if (f32->grads().table()[i].shape.size() == 2) {
      ++matrices;
      f32_better += e32 < e16;
    }
  }
  std::printf("  f32 gradients closer to the f64 sum than bf16 ones on %d of %d weight matrices; worst %.3e\n",
              f32_better, matrices, worst);
  EXPECT_EQ(f32_better, matrices);
}

// Same model, same batch, twice: the same loss bits (the forward pass is bitwise reproducible). The
// gradients agree within bf16 rounding; they may differ in a few bits because cuDNN's attention
// backward accumulates dQ with atomics (tests/gpu/attention_gpu_test.cpp, RunTwice): the number of
// differing elements is printed.
TEST(GpuModel, RunTwiceGivesIdenticalLossBits) {
  LT_REQUIRE_GPU();
  const Batch batch(kTokens, tiny_config().vocab_size, 0);
  DeviceShard ds(batch);
  auto m = gpu_model(CheckpointPolicy::remat_aware);
  auto run = [&] {
    m->zero_grads();
    const model::LossSum l = m->forward_backward(ds.shard(), 1.0 / static_cast<double>(batch.valid));
    return std::make_pair(l.sum, download(m->grads().flat()));
  };
  const auto first = run(), second = run();
  EXPECT_EQ(std::memcmp(&first.first, &second.first, sizeof(double)), 0)
      << "loss " << first.first << " then " << second.first;
  size_t differ = 0;
  for (size_t i = 0; i < first.second.size(); ++i) differ += first.second[i] != second.second[i];
  std::printf("  run twice: loss bits identical (%.9g); gradients differ in %zu of %zu elements, max %.3e relative\n",
              first.first, differ, first.second.size(), relative_error(second.second, first.second));
  EXPECT_LT(relative_error(second.second, first.second), 2.0 / 256.0);
  // A second model built the same way gives the same loss bits too (no state carried in caches).
  auto other = gpu_model(CheckpointPolicy::remat_aware);
  other->zero_grads();
  const model::LossSum l3 = other->forward_backward(ds.shard(), 1.0 / static_cast<double>(batch.valid));
  EXPECT_EQ(std::memcmp(&first.first, &l3.sum, sizeof(double)), 0);
}

// trainer::AdamW runs through the ops, so it steps device arenas: two steps on the GPU model's bf16
// parameters (f32 master weights) equal the same two steps on CPU copies of the arenas, with gradient
// clipping active (the global norm comes from the GPU's sum_squares).
TEST(GpuModel, AdamWStepOnDeviceArenasEqualsTheCpuStep) {
  LT_REQUIRE_GPU();
  const Batch batch(kTokens, tiny_config().vocab_size, 0);
  DeviceShard ds(batch);
  auto m = gpu_model(CheckpointPolicy::remat_aware);
  m->zero_grads();
  m->forward_backward(ds.shard(), 1.0 / static_cast<double>(batch.valid));

  // CPU arenas with the same table (same dtype, same offsets), holding the same bytes.
  Arena cpu_params("parameters", Device::cpu), cpu_grads("gradients", Device::cpu);
  model::add_parameter_entries(cpu_params, tiny_config(), DType::bf16);
  model::add_parameter_entries(cpu_grads, tiny_config(), DType::bf16);
  cpu_params.allocate();
  cpu_grads.allocate();
  ASSERT_EQ(cpu_params.bytes(), m->params().bytes());
  const std::vector<unsigned char> pbytes = download_bytes(m->params().flat());
  std::memcpy(cpu_params.base(), pbytes.data(), pbytes.size());
  const std::vector<unsigned char> gbytes = download_bytes(m->grads().flat());
  std::memcpy(cpu_grads.base(), gbytes.data(), gbytes.size());

  trainer::AdamWConfig cfg;
  cfg.lr = 1e-2;
  cfg.min_lr = 1e-3;
  cfg.warmup_steps = 0;
  cfg.total_steps = 10;
  cfg.weight_decay = 0.1;
  const double norm = trainer::global_norm(m->grads());
  cfg.grad_clip = 0.5 * norm;  // clipping active
  trainer::AdamW gpu_opt(m->params(), cfg), cpu_opt(cpu_params, cfg);
  ASSERT_TRUE(gpu_opt.has_master());
  for (int step = 0; step < 2; ++step) {
    const auto gi = gpu_opt.step(m->params(), m->grads());
    const auto ci = cpu_opt.step(cpu_params, cpu_grads);
    EXPECT_NEAR(gi.grad_norm, ci.grad_norm, 1e-12 * ci.grad_norm);
    EXPECT_NEAR(gi.clip_scale, ci.clip_scale, 1e-12);
    EXPECT_LT(gi.clip_scale, 1.0);
  }
  auto compare = [&](const Arena& g, const Arena& c, const char* what) {
    int64_t n = 0, identical = 0, beyond = 0;
    for (size_t i = 0; i < g.table().size(); ++i) {
      const std::vector<double> a = entry_values(g, i), b = entry_values(c, i);
      for (size_t j = 0; j < a.size(); ++j, ++n) {
        if (a[j] == b[j]) {
          ++identical;
          continue;
        }
        const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(b[j]), 1e-38)) - 23);
        beyond += !(std::abs(a[j] - b[j]) <= ulp);
      }
    }
    std::printf("  adamw %-15s %lld of %lld elements bit-identical to the CPU step, %lld beyond one f32 ulp\n", what,
                (long long)identical, (long long)n, (long long)beyond);
    EXPECT_EQ(beyond, 0) << what;
  };
  compare(gpu_opt.master(), cpu_opt.master(), "master weights");
  compare(gpu_opt.m(), cpu_opt.m(), "m");
  compare(gpu_opt.v(), cpu_opt.v(), "v");
  // bf16 parameters: the rounded master weights, so equal wherever the master weights are.
  const std::vector<double> gp = download(m->params().flat()), gw = download(gpu_opt.master().flat());
  ASSERT_EQ(gp.size(), gw.size());
  for (size_t j = 0; j < gp.size(); ++j) ASSERT_EQ(gp[j], round_to(gw[j], DType::bf16)) << "flat element " << j;
}


// ---- CUDA graphs (LlamaModel::set_cuda_graphs, model/step_graphs.h) --------------------------------

// An attention that waits for the device before each forward: a host sync, which a capture cannot hold.
class HostSyncingAttention final : public attn::SequenceAttention {
 public:
  HostSyncingAttention(std::unique_ptr<attn::SequenceAttention> inner, bool claims_capturable)
      : inner_(std::move(inner)), claims_capturable_(claims_capturable) {}
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    ++counters.forward_calls;
    pass_state();
    inner_->forward(o, lse, q, k, v);
  }
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override {
    ++counters.backward_calls;
    pass_state();
    inner_->backward(dq, dk, dv, q, k, v, o, lse, d_o);
  }
  bool head_major_lse() const override { return inner_->head_major_lse(); }
  // Claimed wrongly, the capture is tried and fails; told truly, the model refuses graphs up front.
  bool graph_capturable() const override { return claims_capturable_; }
  void set_backward_head_groups(int64_t groups) override { inner_->set_backward_head_groups(groups); }
  int64_t backward_head_groups() const override { return inner_->backward_head_groups(); }
  void keep_forward(int64_t n_layers) override { inner_->keep_forward(n_layers); }
  bool keeps_forward() const override { return inner_->keeps_forward(); }

 private:
  void pass_state() {
    inner_->set_documents(documents());
    inner_->set_layer(layer_);
  }
  std::unique_ptr<attn::SequenceAttention> inner_;
  bool claims_capturable_;
};

// `steps` training steps as the trainer runs them: gradients discarded, two micro-batches (new tokens
// each step) copied into the same device buffers (the trainer's staging arena) and run with their
// labels counted on the host and the loss summed on the device, then AdamW. Before step
// `free_before_step` a device buffer is allocated and freed (graphs hold raw pointers: all dropped).
// With `masked_prompts` each micro-batch's first few labels (a different number every step) are
// ignored, as a fine-tuning set masks its prompts: the step's label count, and so grad_scale, changes.
struct GraphRun {
  std::vector<double> losses;  // per step, the loss summed over both micro-batches
  std::vector<double> params;  // after the last step
  int64_t attention_forwards = 0, attention_backwards = 0;  // the attention's call counters at the end
  LlamaModel::GraphStats stats;
  std::string refused;  // set_cuda_graphs' answer
};

GraphRun run_graph_steps(bool graphs, int steps, int free_before_step, bool host_syncing_attention = false,
                         bool masked_prompts = false) {
  const LlamaConfig c = tiny_config();
  // Graphs are captured after an eager call free of GEMM trials: under LONGTRAIN_GEMM_ALGO=auto this
  // small model's trials would outlast the steps. The heuristic's algorithm, as the other tests run.
  const GemmPolicyScope gemm(ops::GemmAlgoPolicy::heuristic);
  std::unique_ptr<attn::SequenceAttention> attention;
  if (host_syncing_attention)
    attention = std::make_unique<HostSyncingAttention>(
        std::make_unique<attn::LocalSequenceAttention>(true, 1.0 / std::sqrt(static_cast<double>(c.head_dim))),
        /*claims_capturable=*/true);
  LlamaModel m(c, Precision::cuda_mixed(), CheckpointPolicy::remat_aware, kTokens, std::move(attention));
  m.initialize(/*seed=*/2024, /*init_std=*/0.08);
  GraphRun r;
  r.refused = m.set_cuda_graphs(graphs);
  trainer::AdamWConfig cfg;
  cfg.lr = 1e-2;
  cfg.min_lr = 1e-3;
  cfg.warmup_steps = 0;
  cfg.total_steps = steps;
  cfg.weight_decay = 0.1;
  cfg.grad_clip = 1.0;
  trainer::AdamW opt(m.params(), cfg);
  DeviceTensor ids(DType::i32, {kTokens}), labels(DType::i32, {kTokens}), positions(DType::i32, {kTokens}),
      loss_sum(DType::f64, {1});
  for (int step = 0; step < steps; ++step) {
    if (step == free_before_step) {
      const DeviceTensor freed(DType::f32, {256});
    }
    std::vector<Batch> micro;
    int64_t valid = 0;
    for (uint64_t i = 0; i < 2; ++i) {
      micro.emplace_back(kTokens, c.vocab_size, 0, std::vector<int32_t>{}, 500 + 31 * static_cast<uint64_t>(step) + i);
      Batch& b = micro.back();
      const size_t prompt = masked_prompts ? static_cast<size_t>(5 * step + 3 * static_cast<int>(i)) % 13 + 1 : 0;
      for (size_t t = 0; t < prompt; ++t) {
        b.valid -= b.labels[t] != LlamaModel::kIgnoreIndex;
        b.labels[t] = LlamaModel::kIgnoreIndex;
      }
      valid += b.valid;
    }
    m.discard_grads();
    zero(loss_sum);
    for (const Batch& b : micro) {
      upload_ints(ids, b.tokens);
      upload_ints(labels, b.labels);
      upload_ints(positions, b.positions);
      m.forward_backward(model::TokenShard{ids, labels, positions, {}, b.valid}, 1.0 / static_cast<double>(valid),
                         loss_sum);
    }
    r.losses.push_back(download(loss_sum)[0]);
    opt.step(m.params(), m.grads());
  }
  r.params = download(m.params().flat());
  r.attention_forwards = m.attention().counters.forward_calls;
  r.attention_backwards = m.attention().counters.backward_calls;
  r.stats = m.graph_stats();
  return r;
}

// Graphed steps against eager steps: bit for bit where the eager steps repeat bit for bit (cuDNN's
// backward adds dQ with atomics, so its runs may differ in the last bits), else within what two eager
// runs differ by.
void expect_same_training(const GraphRun& graphed, const GraphRun& eager, const GraphRun& eager_again) {
  ASSERT_EQ(graphed.losses.size(), eager.losses.size());
  // A replay counts the attention calls its capture made (the step log's attention forwards per layer).
  EXPECT_EQ(graphed.attention_forwards, eager.attention_forwards);
  EXPECT_EQ(graphed.attention_backwards, eager.attention_backwards);
  EXPECT_GT(eager.attention_forwards, 0);
  const bool repeatable = eager.losses == eager_again.losses && eager.params == eager_again.params;
  const double noise = relative_error(eager_again.params, eager.params);
  std::printf("  eager steps %s; graphed vs eager parameters %.3e relative (eager vs eager %.3e)\n",
              repeatable ? "repeat bit for bit" : "differ run to run", relative_error(graphed.params, eager.params),
              noise);
  for (size_t i = 0; i < eager.losses.size(); ++i) {
    ASSERT_TRUE(std::isfinite(graphed.losses[i])) << "step " << i;
    std::printf("  step %zu loss sum: graphed %.9g, eager %.9g\n", i, graphed.losses[i], eager.losses[i]);
    if (repeatable || i == 0) {  // step 0 starts from identical parameters: its forward is the same bits
      EXPECT_EQ(graphed.losses[i], eager.losses[i]) << "step " << i;
    } else {
      EXPECT_NEAR(graphed.losses[i], eager.losses[i], kLossTolerance * std::abs(eager.losses[i])) << "step " << i;
    }
  }
  for (double x : graphed.params) ASSERT_TRUE(std::isfinite(x));
  if (repeatable) {
    EXPECT_TRUE(graphed.params == eager.params) << "graphed parameters differ from the repeatable eager ones";
  } else {
    EXPECT_LT(relative_error(graphed.params, eager.params), std::max(4.0 * noise, 1.0 / 256.0));
  }
}

class GpuModelCudaGraphs : public ::testing::TestWithParam<attn::KernelPolicy> {};

// Five steps of two micro-batches: step 0 runs both micro-batch keys eagerly (first seen: plans and
// buffers are made), step 1 captures both (the first overwrites the discarded gradients, the second
// adds: two graphs), step 2 replays them; a buffer freed before step 3 drops both, so step 3 captures
// again and step 4 replays. The training equals eager training (two eager runs give the noise).
// Returns the eager run.
GraphRun expect_graphed_steps_train_as_eager_steps(bool masked_prompts) {
  const GraphRun eager = run_graph_steps(false, 5, 3, false, masked_prompts);
  const GraphRun eager_again = run_graph_steps(false, 5, 3, false, masked_prompts);
  const GraphRun graphed = run_graph_steps(true, 5, 3, false, masked_prompts);
  EXPECT_EQ(graphed.refused, "");
  std::printf("  graphs: %lld captured, %lld replays, %lld dropped%s%s\n", (long long)graphed.stats.captures,
              (long long)graphed.stats.replays, (long long)graphed.stats.dropped,
              graphed.stats.off_reason.empty() ? "" : "; off: ", graphed.stats.off_reason.c_str());
  EXPECT_EQ(graphed.stats.off_reason, "");
  EXPECT_EQ(graphed.stats.captures, 4);
  EXPECT_EQ(graphed.stats.replays, 4);
  EXPECT_EQ(graphed.stats.dropped, 2);
  EXPECT_EQ(eager.stats.captures, 0);
  // The steps moved the parameters well past the comparison's tolerance (H100: 0.023 relative): a replay
  // that did nothing would be seen.
  const std::vector<double> initial = download(gpu_model(CheckpointPolicy::remat_aware)->params().flat());
  EXPECT_GT(relative_error(eager.params, initial), 4.0 / 256.0);
  expect_same_training(graphed, eager, eager_again);
  return eager;
}

TEST_P(GpuModelCudaGraphs, ReplayedStepsTrainAsEagerSteps) {
  LT_REQUIRE_GPU();
  const PolicyScope policy(GetParam());
  expect_graphed_steps_train_as_eager_steps(/*masked_prompts=*/false);
}

// Masked prompts: every step has its own label count, so its own grad_scale, which the graphs read on
// the device: the same captures and replays as above, and eager training's results.
TEST_P(GpuModelCudaGraphs, StepsWithChangingLabelCountsReplayWithTheirOwnScale) {
  LT_REQUIRE_GPU();
  const PolicyScope policy(GetParam());
  const GraphRun masked = expect_graphed_steps_train_as_eager_steps(/*masked_prompts=*/true);
  // The masked steps train differently from the unmasked ones (the masking took effect).
  EXPECT_NE(masked.losses, run_graph_steps(false, 5, 3).losses);
}

INSTANTIATE_TEST_SUITE_P(Kernels, GpuModelCudaGraphs,
                         ::testing::Values(attn::KernelPolicy::cudnn, attn::KernelPolicy::hopper),
                         [](const ::testing::TestParamInfo<attn::KernelPolicy>& i) {
                           return std::string(attn::kernel_policy_name(i.param));
                         });

// A capture that fails (here: an attention that syncs with the host) leaves nothing half-done: the
// call runs eagerly, graphs turn off for the model with the reason, and training is eager training.
// An attention that says it cannot be captured is refused up front.
TEST(GpuModel, CudaGraphCaptureThatFailsFallsBackToEagerSteps) {
  LT_REQUIRE_GPU();
  {
    LlamaModel refusing(tiny_config(), Precision::cuda_mixed(), CheckpointPolicy::remat_aware, kTokens,
                        std::make_unique<HostSyncingAttention>(
                            std::make_unique<attn::LocalSequenceAttention>(true, 0.125), /*claims_capturable=*/false));
    EXPECT_NE(refusing.set_cuda_graphs(true).find("the attention cannot be captured"), std::string::npos);
  }
  const GraphRun eager = run_graph_steps(false, 3, -1, true), eager_again = run_graph_steps(false, 3, -1, true);
  const GraphRun graphed = run_graph_steps(true, 3, -1, true);
  ASSERT_EQ(graphed.refused, "");
  std::printf("  off reason: %s\n", graphed.stats.off_reason.c_str());
  EXPECT_NE(graphed.stats.off_reason.find("capturing a CUDA graph failed"), std::string::npos)
      << graphed.stats.off_reason;
  EXPECT_EQ(graphed.stats.captures, 0);
  EXPECT_EQ(graphed.stats.replays, 0);
  expect_same_training(graphed, eager, eager_again);
}

}  // namespace
}  // namespace longtrain::test
