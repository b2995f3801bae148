// linear_forward / linear_backward (OpenBLAS) against a naive reference, strided row views,
// accumulation semantics, finite differences and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kIn = 13, kOut = 11;

// y [T, N] = x [T, K] · w [N, K]ᵀ
std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w) {
  std::vector<double> y(kTokens * kOut, 0.0);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t n = 0; n < kOut; ++n)
      for (int64_t k = 0; k < kIn; ++k) y[t * kOut + n] += x[t * kIn + k] * w[n * kIn + k];
  return y;
}

// dx [T, K] = dy · w;  dw [N, K] = dw0 + dyᵀ · x
std::vector<double> reference_dx(const std::vector<double>& dy, const std::vector<double>& w) {
  std::vector<double> dx(kTokens * kIn, 0.0);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t k = 0; k < kIn; ++k)
      for (int64_t n = 0; n < kOut; ++n) dx[t * kIn + k] += dy[t * kOut + n] * w[n * kIn + k];
  return dx;
}
std::vector<double> reference_dw(std::vector<double> dw, const std::vector<double>& dy, const std::vector<double>& x) {
  for (int64_t n = 0; n < kOut; ++n)
    for (int64_t k = 0; k < kIn; ++k)
      for (int64_t t = 0; t < kTokens; ++t) dw[n * kIn + k] += dy[t * kOut + n] * x[t * kIn + k];
  return dw;
}

template <class T>
class LinearTest : public ::testing::Test {};
TYPED_TEST_SUITE(LinearTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(LinearTest, ForwardAndBackwardMatchReference) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kIn}), w({kOut, kIn}), y({kTokens, kOut}), dy({kTokens, kOut});
  HostTensor<T> dx({kTokens, kIn}), dw({kOut, kIn});
  test::fill_uniform(x, 1);
  test::fill_uniform(w, 2);
  test::fill_uniform(dy, 3);
  test::fill_uniform(dx, 4);  // overwritten
  test::fill_uniform(dw, 5);  // accumulated into
  const auto ref_dw = reference_dw(test::as_double(dw), test::as_double(dy), test::as_double(x));
  ops::linear_forward(y, x, w);
  ops::linear_backward(dx, dw, dy, x, w);
  test::expect_close("linear y", y.values, reference_forward(test::as_double(x), test::as_double(w)));
  test::expect_close("linear dx", dx.values, reference_dx(test::as_double(dy), test::as_double(w)));
  test::expect_close("linear dw (+=)", dw.values, ref_dw);
}

TYPED_TEST(LinearTest, EmptyDxSkipsTheInputGradient) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kIn}), w({kOut, kIn}), dy({kTokens, kOut}), dw({kOut, kIn});
  test::fill_uniform(x, 6);
  test::fill_uniform(w, 7);
  test::fill_uniform(dy, 8);
  test::fill_uniform(dw, 9);
  const auto ref_dw = reference_dw(test::as_double(dw), test::as_double(dy), test::as_double(x));
  ops::linear_backward(Tensor(), dw, dy, x, w);
  test::expect_close("linear dw, dx empty", dw.values, ref_dw);
}

// dx alone, with dw empty: what the model runs before x exists (the recomputed SwiGLU output is
// written after the down projection's input gradient), so x must not be read: NaN here.
TYPED_TEST(LinearTest, EmptyDwSkipsTheWeightGradientAndNeverReadsX) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kIn}), w({kOut, kIn}), dy({kTokens, kOut}), dx({kTokens, kIn});
  std::fill(x.values.begin(), x.values.end(), std::numeric_limits<T>::quiet_NaN());
  test::fill_uniform(w, 10);
  test::fill_uniform(dy, 11);
  test::fill_uniform(dx, 12);  // overwritten
  ops::linear_backward(dx, Tensor(), dy, x, w);
  test::expect_close("linear dx, dw empty", dx.values, reference_dx(test::as_double(dy), test::as_double(w)));
}

// GradWrite::overwrite: dw = dyᵀ · x whatever dw held (NaN here), also with no tokens (dw = 0).
TYPED_TEST(LinearTest, OverwrittenWeightGradientIgnoresWhatDwHeld) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kIn}), w({kOut, kIn}), dy({kTokens, kOut}), dw({kOut, kIn});
  test::fill_uniform(x, 16);
  test::fill_uniform(w, 17);
  test::fill_uniform(dy, 18);
  std::fill(dw.values.begin(), dw.values.end(), std::numeric_limits<T>::quiet_NaN());
  const auto ref_dw = reference_dw(std::vector<double>(kOut * kIn, 0.0), test::as_double(dy), test::as_double(x));
  ops::linear_backward(Tensor(), dw, dy, x, w, ops::GradWrite::overwrite);
  test::expect_close("linear dw (=)", dw.values, ref_dw);
  std::fill(dw.values.begin(), dw.values.end(), std::numeric_limits<T>::quiet_NaN());
  ops::linear_backward(Tensor(), dw, dy.view.narrow(0, 0), x.view.narrow(0, 0), w, ops::GradWrite::overwrite);
  for (T v : dw.values) ASSERT_EQ(v, T(0)) << "no tokens: a zero gradient";
}

TYPED_TEST(LinearTest, StridedRowViews) {
  // x is read from columns [2, 2 + K) of a wider buffer and y written into columns [5, 5 + N) of
  // another (how Q, K and V GEMMs address one fused buffer); dy and dx are strided views too.
  // Nothing outside the views changes.
  using T = TypeParam;
  constexpr int64_t kWideIn = kIn + 7, kWideOut = kOut + 9;
  HostTensor<T> x_wide({kTokens, kWideIn}), y_wide({kTokens, kWideOut}), w({kOut, kIn});
  HostTensor<T> dy_wide({kTokens, kWideOut}), dx_wide({kTokens, kWideIn}), dw({kOut, kIn});
  test::fill_uniform(x_wide, 10);
  test::fill_uniform(y_wide, 11);
  test::fill_uniform(w, 12);
  test::fill_uniform(dy_wide, 13);
  test::fill_uniform(dx_wide, 14);
  const HostTensor<T> y_before = y_wide, dx_before = dx_wide;
  const Tensor x = Tensor(x_wide).narrow(1, 2, kIn), y = Tensor(y_wide).narrow(1, 5, kOut);
  const Tensor dy = Tensor(dy_wide).narrow(1, 3, kOut), dx = Tensor(dx_wide).narrow(1, 4, kIn);

  std::vector<double> xc(kTokens * kIn), dyc(kTokens * kOut);  // the views' contents, contiguous
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t k = 0; k < kIn; ++k) xc[t * kIn + k] = x_wide[t * kWideIn + 2 + k];
    for (int64_t n = 0; n < kOut; ++n) dyc[t * kOut + n] = dy_wide[t * kWideOut + 3 + n];
  }
  const auto ref_y = reference_forward(xc, test::as_double(w));
  const auto ref_dx = reference_dx(dyc, test::as_double(w));
  const auto ref_dw = reference_dw(std::vector<double>(kOut * kIn, 0.0), dyc, xc);

  ops::linear_forward(y, x, w);
  ops::linear_backward(dx, dw, dy, x, w);
  std::vector<T> got_y(kTokens * kOut), got_dx(kTokens * kIn);  // the views, copied out
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t c = 0; c < kWideOut; ++c) {
      if (c >= 5 && c < 5 + kOut)
        got_y[t * kOut + c - 5] = y_wide[t * kWideOut + c];
      else
        EXPECT_EQ(y_wide[t * kWideOut + c], y_before[t * kWideOut + c]) << "y column " << c << " written";
    }
    for (int64_t c = 0; c < kWideIn; ++c) {
      if (c >= 4 && c < 4 + kIn)
        got_dx[t * kIn + c - 4] = dx_wide[t * kWideIn + c];
      else
        EXPECT_EQ(dx_wide[t * kWideIn + c], dx_before[t * kWideIn + c]) << "dx column " << c << " written";
    }
  }
  test::expect_close("linear y, strided", got_y, ref_y);
  test::expect_close("linear dx, strided", got_dx, ref_dx);
  test::expect_close("linear dw, strided", dw.values, ref_dw);
}

TYPED_TEST(LinearTest, ResidualForwardAddsTheResidualInPlaceOrApart) {
  // y = residual + x·wᵀ, into a separate buffer and into the residual itself (the model's h = x + Wo·O).
  using T = TypeParam;
  HostTensor<T> x({kTokens, kIn}), w({kOut, kIn}), residual({kTokens, kOut}), y({kTokens, kOut});
  test::fill_uniform(x, 41);
  test::fill_uniform(w, 42);
  test::fill_uniform(residual, 43);
  test::fill_uniform(y, 44);  // overwritten
  std::vector<double> expected = reference_forward(test::as_double(x), test::as_double(w));
  const std::vector<double> r = test::as_double(residual);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += r[i];
  ops::linear_residual_forward(y, x, w, residual);
  test::expect_close("linear_residual_forward into y", y.values, expected);
  EXPECT_EQ(test::as_double(residual), r) << "the residual changed";
  ops::linear_residual_forward(residual, x, w, residual);
  test::expect_close("linear_residual_forward in place", residual.values, expected);
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  HostTensor<double> x({kTokens, kIn}), w({kOut, kIn}), y({kTokens, kOut}), g({kTokens, kOut});
  HostTensor<double> dx({kTokens, kIn}), dw({kOut, kIn});
  test::fill_uniform(x, 15);
  test::fill_uniform(w, 16);
  test::fill_uniform(g, 17);
  auto loss = [&] {
    ops::linear_forward(y, x, w);
    return test::weighted_sum(g, y);
  };
  const auto numeric_dx = test::finite_difference(x.values, loss);
  const auto numeric_dw = test::finite_difference(w.values, loss);
  ops::linear_backward(dx, dw, g, x, w);
  const double err_dx = test::relative_error(dx.values, numeric_dx);
  const double err_dw = test::relative_error(dw.values, numeric_dw);
  test::report_error("linear dx vs finite differences", err_dx);
  test::report_error("linear dw vs finite differences", err_dw);
  EXPECT_LT(err_dx, test::kGradientTolerance);
  EXPECT_LT(err_dw, test::kGradientTolerance);
}

TEST(Linear, Errors) {
  HostTensor<float> x({kTokens, kIn}), w({kOut, kIn + 1}), w_ok({kOut, kIn}), y({kTokens, kOut});
  HostTensor<float> dy({kTokens, kOut}), dx_bad({kTokens, kIn + 2}), dw({kOut, kIn});
  HostTensor<double> w64({kOut, kIn});
  HostTensor<bf16> x16({kTokens, kIn}), w16({kOut, kIn}), y16({kTokens, kOut});
  test::expect_error([&] { ops::linear_forward(y, x, w); },
                     {"linear_forward", "shapes disagree", "x f32[37, 13] cpu", "w f32[11, 14] cpu"});
  test::expect_error([&] { ops::linear_forward(y, x, w64); }, {"w f64[11, 13] cpu", "must have dtype f32"});
  test::expect_error([&] { ops::linear_forward(y16, x16, w16); }, {"dtype bf16 is not supported"});
  test::expect_error([&] { ops::linear_backward(dx_bad, dw, dy, x, w_ok); },
                     {"linear_backward", "dx f32[37, 15] cpu"});
  test::expect_error([&] { ops::linear_backward(Tensor(), Tensor(), dy, x, w_ok); },
                     {"linear_backward", "dx and dw are both empty"});
  HostTensor<float> dw_bad({kOut + 1, kIn});
  test::expect_error([&] { ops::linear_backward(Tensor(), dw_bad, dy, x, w_ok); },
                     {"linear_backward", "dw f32[12, 13] cpu", "w f32[11, 13] cpu"});
}

// A run's requested GEMM algorithm policy (its config's train.gemm_algorithm: trainer.cpp,
// set_kernel_choices; the benchmarks' use_training_kernel_policies) takes effect unless
// LONGTRAIN_GEMM_ALGO names one, which wins; a bad value there names the variable.
TEST(GemmAlgoPolicy, TheEnvironmentsPolicyWinsOverTheRequestedOne) {
  const ops::GemmAlgoPolicy saved = ops::gemm_algo_policy();
  test::with_env("LONGTRAIN_GEMM_ALGO", nullptr, [] {
    EXPECT_EQ(ops::set_gemm_algo_policy_unless_overridden(ops::GemmAlgoPolicy::autotune), ops::GemmAlgoPolicy::autotune);
    EXPECT_EQ(ops::gemm_algo_policy(), ops::GemmAlgoPolicy::autotune);
  });
  test::with_env("LONGTRAIN_GEMM_ALGO", "heuristic", [] {
    EXPECT_EQ(ops::set_gemm_algo_policy_unless_overridden(ops::GemmAlgoPolicy::autotune), ops::GemmAlgoPolicy::heuristic);
    EXPECT_EQ(ops::gemm_algo_policy(), ops::GemmAlgoPolicy::heuristic);
  });
  test::with_env("LONGTRAIN_GEMM_ALGO", "fastest", [] {
    test::expect_error([] { ops::set_gemm_algo_policy_unless_overridden(ops::GemmAlgoPolicy::heuristic); },
                       {"LONGTRAIN_GEMM_ALGO: the GEMM algorithm policy must be heuristic or auto, got 'fastest'"});
  });
  ops::set_gemm_algo_policy(saved);
}

}  // namespace
}  // namespace longtrain
