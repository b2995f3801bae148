// lm_head_cross_entropy: the fused, chunked LM head + cross-entropy against a naive reference that
// materialises all [T, V] logits; chunk-size invariance, ignored labels, accumulation, eval mode,
// large logits, finite differences and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kDim = 13, kVocab = 50;
constexpr int32_t kIgnore = -100;

struct Reference {
  std::vector<double> losses, dx, dw;
};

// Full logits, a plain log-sum-exp, and the gradient of grad_scale · Σ losses added to dw0.
Reference reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& labels,
                    double grad_scale, std::vector<double> dw0) {
  Reference r{std::vector<double>(kTokens, 0.0), std::vector<double>(kTokens * kDim, 0.0), std::move(dw0)};
  for (int64_t t = 0; t < kTokens; ++t) {
    if (labels[t] == kIgnore) continue;
    std::vector<double> logits(kVocab, 0.0);
    for (int64_t v = 0; v < kVocab; ++v)
      for (int64_t c = 0; c < kDim; ++c) logits[v] += x[t * kDim + c] * w[v * kDim + c];
    double m = logits[0];
    for (double l : logits) m = std::max(m, l);
    double sum = 0.0;
    for (double l : logits) sum += std::exp(l - m);
    const double lse = m + std::log(sum);
    r.losses[t] = lse - logits[labels[t]];
    for (int64_t v = 0; v < kVocab; ++v) {
      const double d = grad_scale * (std::exp(logits[v] - lse) - (v == labels[t] ? 1.0 : 0.0));
      for (int64_t c = 0; c < kDim; ++c) {
        r.dx[t * kDim + c] += d * w[v * kDim + c];
        r.dw[v * kDim + c] += d * x[t * kDim + c];
      }
    }
  }
  return r;
}

// Labels in [0, V) with every fifth token (and the last) ignored.
HostTensor<int32_t> random_labels(uint64_t seed) {
  HostTensor<int32_t> labels({kTokens});
  test::fill_ints(labels, seed, 0, kVocab);
  for (int64_t t = 0; t < kTokens; t += 5) labels[t] = kIgnore;
  labels[kTokens - 1] = kIgnore;
  labels[1] = 0;
  labels[2] = kVocab - 1;
  return labels;
}

double valid_count(const HostTensor<int32_t>& labels) {
  double n = 0;
  for (int32_t l : labels.values) n += l != kIgnore;
  return n;
}

ops::CrossEntropyParams params(double grad_scale, int64_t chunk) {
  ops::CrossEntropyParams p;
  p.ignore_index = kIgnore;
  p.grad_scale = grad_scale;
  p.chunk_tokens = chunk;
  return p;
}

template <class T>
class CrossEntropyTest : public ::testing::Test {};
TYPED_TEST_SUITE(CrossEntropyTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(CrossEntropyTest, MatchesFullLogitsReference) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim}), dw({kVocab, kDim});
  test::fill_uniform(x, 1, -2.0, 2.0);
  test::fill_uniform(w, 2);
  test::fill_uniform(dx, 3);  // overwritten
  test::fill_uniform(dw, 4);  // accumulated into
  const HostTensor<int32_t> labels = random_labels(5);
  const double scale = 1.0 / valid_count(labels);
  const Reference ref = reference(test::as_double(x), test::as_double(w), labels.values, scale, test::as_double(dw));
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(scale, 7));
  test::expect_close("cross-entropy losses", losses.values, ref.losses);
  test::expect_close("cross-entropy dx", dx.values, ref.dx);
  test::expect_close("cross-entropy dw (+=)", dw.values, ref.dw);
  for (int64_t t = 0; t < kTokens; ++t) {
    if (labels[t] == kIgnore) {
      EXPECT_EQ(losses[t], T(0)) << "ignored token " << t << " has a loss";
    }
  }
}

TYPED_TEST(CrossEntropyTest, EvalComputesOnlyLosses) {
  // dx empty: the same losses as training, and dw (here empty too) is not needed.
  using T = TypeParam;
  HostTensor<T> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), eval_losses({kTokens});
  HostTensor<T> dx({kTokens, kDim}), dw({kVocab, kDim});
  test::fill_uniform(x, 6);
  test::fill_uniform(w, 7);
  const HostTensor<int32_t> labels = random_labels(8);
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(1.0, 5));
  ops::lm_head_cross_entropy(eval_losses, Tensor(), Tensor(), x, w, labels, params(1.0, 5));
  EXPECT_EQ(eval_losses.values, losses.values);
}

TEST(CrossEntropy, ChunkSizeDoesNotChangeTheResult) {
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim});
  test::fill_uniform(x, 9, -2.0, 2.0);
  test::fill_uniform(w, 10);
  const HostTensor<int32_t> labels = random_labels(11);
  HostTensor<double> losses_all({kTokens}), dx_all({kTokens, kDim}), dw_all({kVocab, kDim});
  ops::lm_head_cross_entropy(losses_all, dx_all, dw_all, x, w, labels, params(0.5, 1000));  // one chunk
  for (int64_t chunk : {int64_t{1}, int64_t{7}, kTokens}) {
    HostTensor<double> losses({kTokens}), dx({kTokens, kDim}), dw({kVocab, kDim});
    ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(0.5, chunk));
    EXPECT_LT(test::relative_error(losses.values, losses_all.values), 1e-12) << "chunk " << chunk;
    EXPECT_LT(test::relative_error(dx.values, dx_all.values), 1e-12) << "chunk " << chunk;
    EXPECT_LT(test::relative_error(dw.values, dw_all.values), 1e-12) << "chunk " << chunk;
  }
}

// GradWrite::overwrite: the first chunk overwrites dw (NaN before), the others add: the same dw as
// accumulating into zeros, for every chunk size.
TEST(CrossEntropy, OverwrittenWeightGradientEqualsAccumulatedIntoZeros) {
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim});
  test::fill_uniform(x, 19, -2.0, 2.0);
  test::fill_uniform(w, 20);
  const HostTensor<int32_t> labels = random_labels(21);
  for (int64_t chunk : {int64_t{1}, int64_t{7}, kTokens}) {
    HostTensor<double> losses({kTokens}), dx({kTokens, kDim}), dw_zeroed({kVocab, kDim}), dw({kVocab, kDim});
    ops::lm_head_cross_entropy(losses, dx, dw_zeroed, x, w, labels, params(0.5, chunk));
    std::fill(dw.values.begin(), dw.values.end(), std::nan(""));
    ops::CrossEntropyParams p = params(0.5, chunk);
    p.dw_write = ops::GradWrite::overwrite;
    ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, p);
    EXPECT_EQ(dw.values, dw_zeroed.values) << "chunk " << chunk;
  }
  // No tokens: dw is the empty sum.
  HostTensor<double> losses({kTokens}), dx({kTokens, kDim}), dw({kVocab, kDim});
  std::fill(dw.values.begin(), dw.values.end(), std::nan(""));
  ops::CrossEntropyParams p = params(0.5, 7);
  p.dw_write = ops::GradWrite::overwrite;
  ops::lm_head_cross_entropy(losses.view.narrow(0, 0), dx.view.narrow(0, 0), dw, x.view.narrow(0, 0), w,
                             labels.view.narrow(0, 0), p);
  for (double v : dw.values) ASSERT_EQ(v, 0.0) << "no tokens: a zero gradient";
}

TEST(CrossEntropy, IgnoredTokensContributeNothing) {
  // Changing the hidden state of an ignored token changes no loss and no weight gradient, and its
  // dx row is zero.
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim});
  test::fill_uniform(x, 12);
  test::fill_uniform(w, 13);
  const HostTensor<int32_t> labels = random_labels(14);
  HostTensor<double> losses({kTokens}), dx({kTokens, kDim}), dw({kVocab, kDim});
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(1.0, 4));
  HostTensor<double> x2 = x;
  for (int64_t t = 0; t < kTokens; ++t)
    if (labels[t] == kIgnore)
      for (int64_t c = 0; c < kDim; ++c) x2[t * kDim + c] *= -3.0;
  HostTensor<double> losses2({kTokens}), dx2({kTokens, kDim}), dw2({kVocab, kDim});
  ops::lm_head_cross_entropy(losses2, dx2, dw2, x2, w, labels, params(1.0, 4));
  EXPECT_EQ(losses2.values, losses.values);
  EXPECT_EQ(dw2.values, dw.values);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kDim && labels[t] == kIgnore; ++c) EXPECT_EQ(dx[t * kDim + c], 0.0) << "token " << t;
}

TEST(CrossEntropy, WeightGradientAccumulates) {
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<double> dw_once({kVocab, kDim}), dw_twice({kVocab, kDim});
  test::fill_uniform(x, 15);
  test::fill_uniform(w, 16);
  const HostTensor<int32_t> labels = random_labels(17);
  ops::lm_head_cross_entropy(losses, dx, dw_once, x, w, labels, params(1.0, 6));
  ops::lm_head_cross_entropy(losses, dx, dw_twice, x, w, labels, params(1.0, 6));
  ops::lm_head_cross_entropy(losses, dx, dw_twice, x, w, labels, params(1.0, 6));
  std::vector<double> doubled(dw_once.size());
  for (size_t i = 0; i < doubled.size(); ++i) doubled[i] = 2.0 * dw_once[i];
  EXPECT_LT(test::relative_error(dw_twice.values, doubled), 1e-15);
}

TEST(CrossEntropy, LargeLogitsAreStable) {
  // Logits in the thousands: exp(logit) overflows double (beyond 709) unless the row maximum is
  // subtracted first.
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<double> dw({kVocab, kDim});
  test::fill_uniform(x, 18, -100.0, 100.0);
  test::fill_uniform(w, 19, -10.0, 10.0);
  const HostTensor<int32_t> labels = random_labels(20);
  const Reference ref = reference(x.values, w.values, labels.values, 1.0, std::vector<double>(kVocab * kDim, 0.0));
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(1.0, 8));
  for (double l : losses.values) ASSERT_TRUE(std::isfinite(l));
  for (double d : dx.values) ASSERT_TRUE(std::isfinite(d));
  EXPECT_LT(test::relative_error(losses.values, ref.losses), 1e-12);
  EXPECT_LT(test::relative_error(dx.values, ref.dx), 1e-12);
}

TEST(CrossEntropy, GradientsMatchFiniteDifferences) {
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<double> dw({kVocab, kDim});
  test::fill_uniform(x, 21, -2.0, 2.0);
  test::fill_uniform(w, 22);
  test::fill_uniform(dw, 23);  // accumulated into: the test takes the difference
  const std::vector<double> dw0 = dw.values;
  const HostTensor<int32_t> labels = random_labels(24);
  const double scale = 1.0 / valid_count(labels);
  auto loss = [&] {  // L = grad_scale · Σ losses, evaluated in eval mode
    ops::lm_head_cross_entropy(losses, Tensor(), Tensor(), x, w, labels, params(scale, 7));
    double sum = 0.0;
    for (double l : losses.values) sum += l;
    return scale * sum;
  };
  const auto numeric_dx = test::finite_difference(x.values, loss);
  const auto numeric_dw = test::finite_difference(w.values, loss);
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(scale, 7));
  const double err_dx = test::relative_error(dx.values, numeric_dx);
  const double err_dw = test::relative_error(test::difference(dw.values, dw0), numeric_dw);
  test::report_error("cross-entropy dx vs finite differences", err_dx);
  test::report_error("cross-entropy dw vs finite differences", err_dw);
  EXPECT_LT(err_dx, test::kGradientTolerance);
  EXPECT_LT(err_dw, test::kGradientTolerance);
}

// The factor read from a tensor when the op runs (what a replayed CUDA graph sees change) scales as the
// same factor given by value, and grad_scale is then not used.
TEST(CrossEntropy, GradScaleFromATensorEqualsTheValue) {
  HostTensor<double> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<double> dw({kVocab, kDim}), losses2({kTokens}), dx2({kTokens, kDim}), dw2({kVocab, kDim});
  test::fill_uniform(x, 31, -2.0, 2.0);
  test::fill_uniform(w, 32);
  const HostTensor<int32_t> labels = random_labels(33);
  const double scale = 1.0 / valid_count(labels);
  ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(scale, 7));
  HostTensor<double> factor({1});
  factor[0] = scale;
  ops::CrossEntropyParams p = params(123.0, 7);  // not used
  p.grad_scale_from = factor;
  ops::lm_head_cross_entropy(losses2, dx2, dw2, x, w, labels, p);
  EXPECT_EQ(losses2.values, losses.values);
  EXPECT_EQ(dx2.values, dx.values);
  EXPECT_EQ(dw2.values, dw.values);
  HostTensor<int32_t> int_factor({1});
  p.grad_scale_from = int_factor;
  test::expect_error([&] { ops::lm_head_cross_entropy(losses2, dx2, dw2, x, w, labels, p); },
                     {"grad_scale_from must be f32 or f64", "i32[1]"});
  HostTensor<double> two({2});
  p.grad_scale_from = two;
  test::expect_error([&] { ops::lm_head_cross_entropy(losses2, dx2, dw2, x, w, labels, p); },
                     {"grad_scale_from must be one element", "f64[2]"});
}

TEST(CrossEntropy, LabelOutOfRangeIsAnErrorAndWritesNothing) {
  HostTensor<float> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<float> dw({kVocab, kDim});
  test::fill_uniform(x, 25);
  test::fill_uniform(w, 26);
  HostTensor<int32_t> labels = random_labels(27);
  labels[3] = kVocab;
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(1.0, 4)); },
                     {"lm_head_cross_entropy", "label 50 at token index 3", "[0, 50)", "ignore_index (-100)"});
  labels[3] = 4;
  labels[30] = -1;  // negative but not ignore_index
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, Tensor(), Tensor(), x, w, labels, params(1.0, 4)); },
                     {"label -1 at token index 30"});
  for (float v : dw.values) ASSERT_EQ(v, 0.0f) << "dw changed by a rejected batch";
}

TEST(CrossEntropy, ShapeAndDtypeErrors) {
  HostTensor<float> x({kTokens, kDim}), w({kVocab, kDim}), losses({kTokens}), dx({kTokens, kDim});
  HostTensor<float> dw({kVocab, kDim}), w_narrow({kVocab, kDim - 1}), losses_short({kTokens - 1});
  HostTensor<double> w64({kVocab, kDim});
  HostTensor<bf16> x16({kTokens, kDim}), w16({kVocab, kDim}), losses16({kTokens});
  const HostTensor<int32_t> labels = random_labels(28);
  HostTensor<int32_t> labels_short({kTokens - 2});
  const auto p = params(1.0, 4);
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, dw, x, w_narrow, labels, p); },
                     {"lm_head_cross_entropy", "x f32[37, 13] cpu", "w f32[50, 12] cpu"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses_short, dx, dw, x, w, labels, p); },
                     {"losses must be [T]", "f32[36]"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels_short, p); },
                     {"labels must be i32 [T] with T = 37", "i32[35]"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, Tensor(), x, w, labels, p); },
                     {"dw (empty) must have the shape and dtype of w"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, dw, x, w64, labels, p); },
                     {"same dtype", "f64[50, 13]"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses16, Tensor(), Tensor(), x16, w16, labels, p); },
                     {"dtype bf16 is not supported"});
  test::expect_error([&] { ops::lm_head_cross_entropy(losses, dx, dw, x, w, labels, params(1.0, 0)); },
                     {"chunk_tokens must be >= 1, got 0"});
}

}  // namespace
}  // namespace longtrain
