// rope_forward / rope_backward: the Hugging Face rotate-half convention against a naive reference,
// strided Q/K views of the fused QKV buffer, global positions, inverse and finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

// GQA shape: 3 query heads, 1 KV head, head_dim 6; the fused QKV row holds (3 + 2·1) heads.
constexpr int64_t kTokens = 37, kHeads = 3, kKvHeads = 1, kHeadDim = 6;
constexpr int64_t kFusedHeads = kHeads + 2 * kKvHeads;
constexpr double kTheta = 10000.0;

// x [T, H, D] contiguous; pairs (i, i + D/2) rotated by positions[t] · theta^(-2i/D).
std::vector<double> reference_rope(const std::vector<double>& x, const std::vector<int32_t>& positions, int64_t heads,
                                   int64_t dim, double theta) {
  std::vector<double> out = x;
  const int64_t half = dim / 2;
  for (size_t t = 0; t < positions.size(); ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = positions[t] * std::pow(theta, -2.0 * i / dim);
        const size_t a = (t * heads + h) * dim + i, b = a + half;
        out[a] = x[a] * std::cos(angle) - x[b] * std::sin(angle);
        out[b] = x[b] * std::cos(angle) + x[a] * std::sin(angle);
      }
  return out;
}

HostTensor<int32_t> random_positions(uint64_t seed, int32_t lo, int32_t hi) {
  HostTensor<int32_t> positions({kTokens});
  test::fill_ints(positions, seed, lo, hi);
  return positions;
}

template <class T>
class RopeTest : public ::testing::Test {};
TYPED_TEST_SUITE(RopeTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(RopeTest, ForwardMatchesReference) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 1);
  HostTensor<int32_t> positions = random_positions(2, 0, 4096);
  const auto ref = reference_rope(test::as_double(x), positions.values, kHeads, kHeadDim, kTheta);
  ops::rope_forward(x, positions, {kTheta});
  test::expect_close("rope", x.values, ref);
}

TYPED_TEST(RopeTest, LargeGlobalPositions) {
  // Positions of a multi-million-token sequence: the angle must be formed in double even for f32
  // (in float an angle near 10^9 has an ulp of 64 rad).
  using T = TypeParam;
  HostTensor<T> x({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 3);
  HostTensor<int32_t> positions = random_positions(4, 1 << 20, 2000000000);
  const auto ref = reference_rope(test::as_double(x), positions.values, kHeads, kHeadDim, 500000.0);
  ops::rope_forward(x, positions, {500000.0});
  test::expect_close("rope at positions up to 2e9", x.values, ref);
}

TYPED_TEST(RopeTest, StridedQAndKViewsOfFusedQkv) {
  // qkv [T, (Hq + 2 Hkv) · D]: Q and K are rotated in place through their strided views, V and
  // everything else is untouched, and the rotated heads equal the contiguous results.
  using T = TypeParam;
  HostTensor<T> qkv({kTokens, kFusedHeads * kHeadDim});
  test::fill_uniform(qkv, 5);
  const HostTensor<T> before = qkv;
  const Tensor heads = Tensor(qkv).reshape({kTokens, kFusedHeads, kHeadDim});
  const Tensor q = heads.narrow(1, 0, kHeads), k = heads.narrow(1, kHeads, kKvHeads);
  ASSERT_EQ(q.stride[0], kFusedHeads * kHeadDim);
  HostTensor<int32_t> positions = random_positions(6, 0, 100000);

  // The same heads, copied out contiguously.
  HostTensor<T> q_ref({kTokens, kHeads, kHeadDim}), k_ref({kTokens, kKvHeads, kHeadDim});
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t i = 0; i < kHeads * kHeadDim; ++i) {
      q_ref[t * kHeads * kHeadDim + i] = before[t * kFusedHeads * kHeadDim + i];
      if (i < kKvHeads * kHeadDim)
        k_ref[t * kKvHeads * kHeadDim + i] = before[t * kFusedHeads * kHeadDim + kHeads * kHeadDim + i];
    }
  ops::rope_forward(q_ref, positions, {kTheta});
  ops::rope_forward(k_ref, positions, {kTheta});

  ops::rope_forward(q, positions, {kTheta});
  ops::rope_forward(k, positions, {kTheta});
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t i = 0; i < kFusedHeads * kHeadDim; ++i) {
      const T got = qkv[t * kFusedHeads * kHeadDim + i];
      if (i < kHeads * kHeadDim)
        EXPECT_EQ(got, q_ref[t * kHeads * kHeadDim + i]);
      else if (i < (kHeads + kKvHeads) * kHeadDim)
        EXPECT_EQ(got, k_ref[t * kKvHeads * kHeadDim + i - kHeads * kHeadDim]);
      else
        EXPECT_EQ(got, before[t * kFusedHeads * kHeadDim + i]) << "V changed at token " << t << ", element " << i;
    }
}

TYPED_TEST(RopeTest, PositionsAreGlobalTokenIds) {
  // Token t of a shard at global position p rotates exactly as a lone token at position p, and
  // another position gives another result.
  using T = TypeParam;
  HostTensor<T> x({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 7);
  const HostTensor<T> original = x;
  HostTensor<int32_t> positions = random_positions(8, 0, 1 << 30);
  ops::rope_forward(x, positions, {kTheta});
  for (int64_t t = 0; t < kTokens; ++t) {
    HostTensor<T> one({1, kHeads, kHeadDim}), shifted({1, kHeads, kHeadDim});
    HostTensor<int32_t> p({1}), p_next({1});
    p[0] = positions[t];
    p_next[0] = positions[t] + 1;
    for (int64_t i = 0; i < kHeads * kHeadDim; ++i) one[i] = shifted[i] = original[t * kHeads * kHeadDim + i];
    ops::rope_forward(one, p, {kTheta});
    ops::rope_forward(shifted, p_next, {kTheta});
    double moved = 0.0;
    for (int64_t i = 0; i < kHeads * kHeadDim; ++i) {
      EXPECT_EQ(one[i], x[t * kHeads * kHeadDim + i]) << "token " << t;
      moved = std::max(moved, std::abs(static_cast<double>(shifted[i]) - static_cast<double>(one[i])));
    }
    EXPECT_GT(moved, 1e-3) << "positions " << p[0] << " and " << p_next[0] << " rotate token " << t << " alike";
  }
}

TYPED_TEST(RopeTest, BackwardInvertsForward) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 9);
  const HostTensor<T> original = x;
  HostTensor<int32_t> positions = random_positions(10, 0, 1 << 24);
  ops::rope_forward(x, positions, {kTheta});
  ops::rope_backward(x, positions, {kTheta});
  test::expect_close("rope_backward(rope_forward(x)) vs x", x.values, test::as_double(original));
}

TEST(Rope, GradientMatchesFiniteDifferences) {
  HostTensor<double> x({kTokens, kHeads, kHeadDim}), y({kTokens, kHeads, kHeadDim}), g({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 11);
  test::fill_uniform(g, 12);
  HostTensor<int32_t> positions = random_positions(13, 0, 65536);
  auto loss = [&] {
    y = x;
    ops::rope_forward(y, positions, {kTheta});
    return test::weighted_sum(g, y);
  };
  const auto numeric = test::finite_difference(x.values, loss);
  HostTensor<double> dx = g;
  ops::rope_backward(dx, positions, {kTheta});
  const double err = test::relative_error(dx.values, numeric);
  test::report_error("rope dx vs finite differences", err);
  EXPECT_LT(err, test::kGradientTolerance);
}

// A scaled table (RoPE scaling) and an attention factor: angle = position · inv_freq[i], and cos and
// sin are both multiplied by the factor; backward is the transpose, checked by finite differences.
std::vector<double> scaled_table() {
  std::vector<double> inv(kHeadDim / 2);
  for (int64_t i = 0; i < kHeadDim / 2; ++i) inv[i] = std::pow(kTheta, -2.0 * i / kHeadDim) / (1.0 + i);
  return inv;
}

TYPED_TEST(RopeTest, ScaledTableAndAttentionFactor) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 21);
  HostTensor<int32_t> positions = random_positions(22, 0, 100000);
  const std::vector<double> inv = scaled_table();
  const double a = 1.1386;
  std::vector<double> ref = test::as_double(x);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t i = 0; i < kHeadDim / 2; ++i) {
        const double angle = positions[t] * inv[i];
        const size_t p = (t * kHeads + h) * kHeadDim + i, q = p + kHeadDim / 2;
        const double x1 = ref[p], x2 = ref[q];
        ref[p] = a * (x1 * std::cos(angle) - x2 * std::sin(angle));
        ref[q] = a * (x2 * std::cos(angle) + x1 * std::sin(angle));
      }
  ops::rope_forward(x, positions, {kTheta, inv, a});
  test::expect_close("rope with a scaled table and attention factor", x.values, ref);
}

TYPED_TEST(RopeTest, TableOnceThenApplyEqualsRopeForwardAndBackwardBitForBit) {
  // What the model does each step: one f64 table of cos | sin (scaled inverse frequencies and an
  // attention factor), then Q and K of the fused buffer as one view, forward and the transpose.
  using T = TypeParam;
  HostTensor<T> qkv({kTokens, kFusedHeads * kHeadDim});
  test::fill_uniform(qkv, 31);
  HostTensor<T> expected = qkv;
  HostTensor<int32_t> positions = random_positions(32, 0, 1 << 20);
  const ops::RopeParams p{kTheta, scaled_table(), 1.1386};
  auto qk_view = [&](HostTensor<T>& buffer) {
    return Tensor(buffer).reshape({kTokens, kFusedHeads, kHeadDim}).narrow(1, 0, kHeads + kKvHeads);
  };
  HostTensor<double> table({kTokens, kHeadDim});
  ops::rope_table(table, positions, p);
  ops::rope_forward(qk_view(expected), positions, p);
  ops::rope_apply(qk_view(qkv), table, /*inverse=*/false);
  EXPECT_EQ(qkv.values, expected.values) << "rope_apply differs from rope_forward";
  ops::rope_backward(qk_view(expected), positions, p);
  ops::rope_apply(qk_view(qkv), table, /*inverse=*/true);
  EXPECT_EQ(qkv.values, expected.values) << "rope_apply (inverse) differs from rope_backward";
  // V was never touched by either.
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t i = (kHeads + kKvHeads) * kHeadDim; i < kFusedHeads * kHeadDim; ++i)
      ASSERT_TRUE(std::isfinite(static_cast<double>(qkv[t * kFusedHeads * kHeadDim + i])));
}

TEST(Rope, ScaledGradientMatchesFiniteDifferences) {
  HostTensor<double> x({kTokens, kHeads, kHeadDim}), y({kTokens, kHeads, kHeadDim}), g({kTokens, kHeads, kHeadDim});
  test::fill_uniform(x, 23);
  test::fill_uniform(g, 24);
  HostTensor<int32_t> positions = random_positions(25, 0, 65536);
  const ops::RopeParams p{kTheta, scaled_table(), 1.25};
  auto loss = [&] {
    y = x;
    ops::rope_forward(y, positions, p);
    return test::weighted_sum(g, y);
  };
  const auto numeric = test::finite_difference(x.values, loss);
  HostTensor<double> dx = g;
  ops::rope_backward(dx, positions, p);
  const double err = test::relative_error(dx.values, numeric);
  test::report_error("scaled rope dx vs finite differences", err);
  EXPECT_LT(err, test::kGradientTolerance);
}

TEST(Rope, TableErrors) {
  HostTensor<int32_t> positions = random_positions(33, 0, 100);
  HostTensor<double> table({kTokens, kHeadDim}), short_table({kTokens - 1, kHeadDim});
  HostTensor<float> x({kTokens, kHeads, kHeadDim});
  test::expect_error([&] { ops::rope_apply(x, short_table, false); }, {"rope_apply", "RoPE table", "f64[36, 6]"});
  test::expect_error([&] { ops::rope_table(short_table, positions, {}); }, {"rope_table", "positions must be i32 [T]"});
  positions[3] = -2;
  test::expect_error([&] { ops::rope_table(table, positions, {}); }, {"position -2 at token index 3"});
}

TEST(Rope, Errors) {
  HostTensor<int32_t> positions = random_positions(14, 0, 100);
  HostTensor<float> odd({kTokens, kHeads, 7}), x({kTokens, kHeads, kHeadDim}), flat({kTokens, kHeads * kHeadDim});
  HostTensor<bf16> x16({kTokens, kHeads, kHeadDim});
  HostTensor<int32_t> short_positions({kTokens - 1});
  HostTensor<float> float_positions({kTokens});
  test::expect_error([&] { ops::rope_forward(odd, positions, {}); }, {"rope_forward", "even", "f32[37, 3, 7]"});
  test::expect_error([&] { ops::rope_forward(flat, positions, {}); }, {"[T, H, D]", "f32[37, 18]"});
  test::expect_error([&] { ops::rope_forward(x16, positions, {}); }, {"dtype bf16 is not supported"});
  test::expect_error([&] { ops::rope_backward(x, short_positions, {}); },
                     {"rope_backward", "positions must be i32 [T] with T = 37", "i32[36]"});
  test::expect_error([&] { ops::rope_forward(x, float_positions, {}); }, {"positions must be i32", "f32[37]"});
  test::expect_error([&] { ops::rope_forward(x, positions, {kTheta, {1.0, 0.5}}); },
                     {"inverse-frequency table has 2 entries", "head_dim 6 needs 3"});
  test::expect_error([&] { ops::rope_forward(x, positions, {kTheta, {}, 0.0}); }, {"attention factor", "> 0"});
  positions[4] = -1;
  test::expect_error([&] { ops::rope_forward(x, positions, {}); }, {"position -1 at token index 4"});
}

}  // namespace
}  // namespace longtrain
