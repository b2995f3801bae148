// rmsnorm_forward / rmsnorm_backward against a naive reference, finite differences and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kDim = 13;
constexpr double kEps = 1e-5;

struct Reference {
  std::vector<double> y, rstd, dx, dw;
};

// Forward, and backward of L = Σ dy ⊙ y added to (dx0, dw0), written out element by element.
Reference reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& dy,
                    std::vector<double> dx0, std::vector<double> dw0) {
  Reference r{std::vector<double>(x.size()), std::vector<double>(kTokens), std::move(dx0), std::move(dw0)};
  for (int64_t t = 0; t < kTokens; ++t) {
    const double* xt = &x[t * kDim];
    double mean_sq = 0.0;
    for (int64_t c = 0; c < kDim; ++c) mean_sq += xt[c] * xt[c] / kDim;
    const double rstd = 1.0 / std::sqrt(mean_sq + kEps);
    r.rstd[t] = rstd;
    for (int64_t c = 0; c < kDim; ++c) r.y[t * kDim + c] = xt[c] * rstd * w[c];
    // dy_c/dx_j = w_c (δ_cj rstd - x_c x_j rstd³ / C)
    for (int64_t j = 0; j < kDim; ++j) {
      double g = 0.0;
      for (int64_t c = 0; c < kDim; ++c)
        g += dy[t * kDim + c] * w[c] * ((c == j ? rstd : 0.0) - xt[c] * xt[j] * rstd * rstd * rstd / kDim);
      r.dx[t * kDim + j] += g;
    }
    for (int64_t c = 0; c < kDim; ++c) r.dw[c] += dy[t * kDim + c] * xt[c] * rstd;
  }
  return r;
}

template <class T>
class RmsnormTest : public ::testing::Test {};
TYPED_TEST_SUITE(RmsnormTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(RmsnormTest, ForwardAndBackwardMatchReference) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kDim}), w({kDim}), y({kTokens, kDim}), rstd({kTokens});
  HostTensor<T> dy({kTokens, kDim}), dx({kTokens, kDim}), dw({kDim});
  test::fill_uniform(x, 1, -2.0, 2.0);
  test::fill_uniform(w, 2, 0.5, 1.5);
  test::fill_uniform(dy, 3);
  test::fill_uniform(dx, 4);  // dx and dw hold earlier gradients: both accumulate
  test::fill_uniform(dw, 5);
  const Reference ref =
      reference(test::as_double(x), test::as_double(w), test::as_double(dy), test::as_double(dx), test::as_double(dw));

  ops::rmsnorm_forward(y, rstd, x, w, kEps);
  ops::rmsnorm_backward(dx, dw, dy, x, w, rstd);
  test::expect_close("rmsnorm y", y.values, ref.y);
  test::expect_close("rmsnorm rstd", rstd.values, ref.rstd);
  test::expect_close("rmsnorm dx (+=)", dx.values, ref.dx);
  test::expect_close("rmsnorm dw (+=)", dw.values, ref.dw);
}

// GradWrite::overwrite: dw is this call's Σ_t whatever it held (NaN here); dx still accumulates.
TYPED_TEST(RmsnormTest, OverwrittenWeightGradientIgnoresWhatDwHeld) {
  using T = TypeParam;
  HostTensor<T> x({kTokens, kDim}), w({kDim}), y({kTokens, kDim}), rstd({kTokens});
  HostTensor<T> dy({kTokens, kDim}), dx({kTokens, kDim}), dw({kDim});
  test::fill_uniform(x, 11, -2.0, 2.0);
  test::fill_uniform(w, 12, 0.5, 1.5);
  test::fill_uniform(dy, 13);
  test::fill_uniform(dx, 14);
  const Reference ref = reference(test::as_double(x), test::as_double(w), test::as_double(dy), test::as_double(dx),
                                  std::vector<double>(kDim, 0.0));
  std::fill(dw.values.begin(), dw.values.end(), std::numeric_limits<T>::quiet_NaN());
  ops::rmsnorm_forward(y, rstd, x, w, kEps);
  ops::rmsnorm_backward(dx, dw, dy, x, w, rstd, ops::GradWrite::overwrite);
  test::expect_close("rmsnorm dx (+=)", dx.values, ref.dx);
  test::expect_close("rmsnorm dw (=)", dw.values, ref.dw);
}

TYPED_TEST(RmsnormTest, StridedRows) {
  // x, y, dx and dy are column slices of wider buffers (as when a norm reads part of a fused
  // activation); results equal the contiguous ones and nothing outside the views is written.
  using T = TypeParam;
  constexpr int64_t kWide = kDim + 5;
  HostTensor<T> x({kTokens, kDim}), w({kDim}), dy({kTokens, kDim});
  test::fill_uniform(x, 6);
  test::fill_uniform(w, 7);
  test::fill_uniform(dy, 8);
  HostTensor<T> y({kTokens, kDim}), rstd({kTokens}), dx({kTokens, kDim}), dw({kDim});
  ops::rmsnorm_forward(y, rstd, x, w, kEps);
  ops::rmsnorm_backward(dx, dw, dy, x, w, rstd);

  HostTensor<T> x_wide({kTokens, kWide}), y_wide({kTokens, kWide}), dx_wide({kTokens, kWide}),
      dy_wide({kTokens, kWide});
  test::fill_uniform(y_wide, 9);
  const HostTensor<T> y_before = y_wide;
  const Tensor xs = Tensor(x_wide).narrow(1, 2, kDim), ys = Tensor(y_wide).narrow(1, 3, kDim),
               dxs = Tensor(dx_wide).narrow(1, 1, kDim), dys = Tensor(dy_wide).narrow(1, 4, kDim);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kDim; ++c) {
      x_wide[t * kWide + 2 + c] = x[t * kDim + c];
      dy_wide[t * kWide + 4 + c] = dy[t * kDim + c];
    }
  HostTensor<T> rstd_s({kTokens}), dw_s({kDim});
  ops::rmsnorm_forward(ys, rstd_s, xs, w, kEps);
  ops::rmsnorm_backward(dxs, dw_s, dys, xs, w, rstd_s);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kWide; ++c) {
      const size_t i = t * kWide + c;
      if (c >= 3 && c < 3 + kDim)
        EXPECT_EQ(y_wide[i], y[t * kDim + c - 3]);
      else
        EXPECT_EQ(y_wide[i], y_before[i]) << "y column " << c << " outside the view was written";
      if (c >= 1 && c < 1 + kDim)
        EXPECT_EQ(dx_wide[i], dx[t * kDim + c - 1]);
      else
        EXPECT_EQ(dx_wide[i], T(0)) << "dx column " << c << " outside the view was written";
    }
  EXPECT_EQ(dw_s.values, dw.values);
  EXPECT_EQ(rstd_s.values, rstd.values);
}

TEST(Rmsnorm, GradientsMatchFiniteDifferences) {
  HostTensor<double> x({kTokens, kDim}), w({kDim}), y({kTokens, kDim}), rstd({kTokens}), g({kTokens, kDim});
  HostTensor<double> dx({kTokens, kDim}), dw({kDim});
  test::fill_uniform(x, 10, -2.0, 2.0);
  test::fill_uniform(w, 11, 0.5, 1.5);
  test::fill_uniform(g, 12);
  test::fill_uniform(dx, 13);  // accumulated into: the test takes the difference
  test::fill_uniform(dw, 14);
  const std::vector<double> dx0 = dx.values, dw0 = dw.values;
  auto loss = [&] {
    ops::rmsnorm_forward(y, rstd, x, w, kEps);
    return test::weighted_sum(g, y);
  };
  const auto numeric_dx = test::finite_difference(x.values, loss);
  const auto numeric_dw = test::finite_difference(w.values, loss);
  ops::rmsnorm_forward(y, rstd, x, w, kEps);
  ops::rmsnorm_backward(dx, dw, g, x, w, rstd);
  const double err_dx = test::relative_error(test::difference(dx.values, dx0), numeric_dx);
  const double err_dw = test::relative_error(test::difference(dw.values, dw0), numeric_dw);
  test::report_error("rmsnorm dx vs finite differences", err_dx);
  test::report_error("rmsnorm dw vs finite differences", err_dw);
  EXPECT_LT(err_dx, test::kGradientTolerance);
  EXPECT_LT(err_dw, test::kGradientTolerance);
}

TEST(Rmsnorm, ShapeAndDtypeErrors) {
  HostTensor<float> x({kTokens, kDim}), y({kTokens, kDim}), rstd({kTokens}), w({kDim}), w_long({kDim + 1});
  HostTensor<float> rstd_short({kTokens - 2});
  HostTensor<double> w64({kDim});
  HostTensor<bf16> x16({kTokens, kDim}), y16({kTokens, kDim}), w16({kDim}), rstd16({kTokens});
  test::expect_error([&] { ops::rmsnorm_forward(y, rstd, x, w_long, kEps); },
                     {"rmsnorm_forward", "w f32[14] cpu", "x f32[37, 13] cpu"});
  test::expect_error([&] { ops::rmsnorm_forward(y, rstd_short, x, w, kEps); }, {"rstd f32[35] cpu"});
  test::expect_error([&] { ops::rmsnorm_forward(y, rstd, x, w64, kEps); }, {"w f64[13] cpu", "dtype"});
  test::expect_error([&] { ops::rmsnorm_forward(y16, rstd16, x16, w16, kEps); }, {"dtype bf16 is not supported"});
  HostTensor<float> dx({kTokens, kDim}), dy({kTokens + 1, kDim}), dw({kDim});
  test::expect_error([&] { ops::rmsnorm_backward(dx, dw, dy, x, w, rstd); },
                     {"rmsnorm_backward", "dy f32[38, 13] cpu"});
}

}  // namespace
}  // namespace longtrain
