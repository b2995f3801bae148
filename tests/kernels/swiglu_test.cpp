// swiglu_forward / swiglu_backward on the fused [T, 2F] gate/up buffer against a naive reference,
// finite differences, saturated gates and errors.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kFfn = 11;

double silu(double g) { return g / (1.0 + std::exp(-g)); }  // fine for the moderate gates used here

// out [T, F] from gate_up [T, 2F]; d_gate_up [T, 2F] from d_out [T, F].
std::vector<double> reference_forward(const std::vector<double>& gate_up) {
  std::vector<double> out(kTokens * kFfn);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t f = 0; f < kFfn; ++f)
      out[t * kFfn + f] = silu(gate_up[t * 2 * kFfn + f]) * gate_up[t * 2 * kFfn + kFfn + f];
  return out;
}

std::vector<double> reference_backward(const std::vector<double>& d_out, const std::vector<double>& gate_up) {
  std::vector<double> d(gate_up.size());
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t f = 0; f < kFfn; ++f) {
      const double g = gate_up[t * 2 * kFfn + f], u = gate_up[t * 2 * kFfn + kFfn + f], dy = d_out[t * kFfn + f];
      const double s = 1.0 / (1.0 + std::exp(-g));
      d[t * 2 * kFfn + f] = dy * u * (s + g * s * (1.0 - s));
      d[t * 2 * kFfn + kFfn + f] = dy * silu(g);
    }
  return d;
}

template <class T>
class SwigluTest : public ::testing::Test {};
TYPED_TEST_SUITE(SwigluTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(SwigluTest, ForwardAndBackwardMatchReference) {
  using T = TypeParam;
  HostTensor<T> gate_up({kTokens, 2 * kFfn}), out({kTokens, kFfn}), d_out({kTokens, kFfn});
  HostTensor<T> d_gate_up({kTokens, 2 * kFfn});
  test::fill_uniform(gate_up, 1, -6.0, 6.0);
  test::fill_uniform(d_out, 2);
  test::fill_uniform(d_gate_up, 3);  // an activation gradient is overwritten, whatever it held
  ops::swiglu_forward(out, gate_up);
  ops::swiglu_backward(d_gate_up, d_out, gate_up);
  test::expect_close("swiglu out", out.values, reference_forward(test::as_double(gate_up)));
  test::expect_close("swiglu d_gate_up", d_gate_up.values,
                     reference_backward(test::as_double(d_out), test::as_double(gate_up)));
}

// The remat policies' recompute: swiglu_backward given `out` writes the forward's output as well, bit
// for bit what swiglu_forward writes (down_proj's weight gradient reads it), and the same gradient as
// without it; also in place (d_gate_up = gate_up), as the backward may run.
TYPED_TEST(SwigluTest, BackwardRecomputesTheForwardOutputBitForBit) {
  using T = TypeParam;
  HostTensor<T> gate_up({kTokens, 2 * kFfn}), out({kTokens, kFfn}), d_out({kTokens, kFfn});
  HostTensor<T> d_gate_up({kTokens, 2 * kFfn}), d_gate_up_plain({kTokens, 2 * kFfn}), recomputed({kTokens, kFfn});
  test::fill_uniform(gate_up, 21, -6.0, 6.0);
  test::fill_uniform(d_out, 22);
  test::fill_uniform(recomputed, 23);  // overwritten
  ops::swiglu_forward(out, gate_up);
  ops::swiglu_backward(d_gate_up_plain, d_out, gate_up);
  ops::swiglu_backward(d_gate_up, d_out, gate_up, recomputed);
  EXPECT_EQ(recomputed.values, out.values);
  EXPECT_EQ(d_gate_up.values, d_gate_up_plain.values);
  HostTensor<T> in_place = gate_up;
  test::fill_uniform(recomputed, 24);
  ops::swiglu_backward(in_place, d_out, in_place, recomputed);
  EXPECT_EQ(recomputed.values, out.values);
  EXPECT_EQ(in_place.values, d_gate_up_plain.values);
}

TYPED_TEST(SwigluTest, StridedRowsOfAWiderBuffer) {
  // gate_up read from, and out written to, column slices of wider buffers.
  using T = TypeParam;
  constexpr int64_t kWide = 2 * kFfn + 3;
  HostTensor<T> gate_up({kTokens, 2 * kFfn}), wide_in({kTokens, kWide}), wide_out({kTokens, kWide});
  test::fill_uniform(gate_up, 4, -4.0, 4.0);
  test::fill_uniform(wide_out, 5);
  const HostTensor<T> wide_out_before = wide_out;
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t i = 0; i < 2 * kFfn; ++i) wide_in[t * kWide + 1 + i] = gate_up[t * 2 * kFfn + i];
  ops::swiglu_forward(Tensor(wide_out).narrow(1, 2, kFfn), Tensor(wide_in).narrow(1, 1, 2 * kFfn));
  const auto ref = reference_forward(test::as_double(gate_up));
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kWide; ++c) {
      const size_t i = t * kWide + c;
      if (c >= 2 && c < 2 + kFfn)
        EXPECT_NEAR(wide_out[i], ref[t * kFfn + c - 2], test::tolerance<T>() * 10);
      else
        EXPECT_EQ(wide_out[i], wide_out_before[i]) << "column " << c << " outside the view was written";
    }
}

TYPED_TEST(SwigluTest, SaturatedGatesStayFinite) {
  // silu(g) → g for g ≫ 0 and → 0 for g ≪ 0; its derivative → 1 and → 0. exp(±1000) overflows
  // double and exp(±100) float, so a naive sigmoid would give inf/inf = NaN here.
  using T = TypeParam;
  const double big = std::is_same_v<T, double> ? 1000.0 : 100.0;
  HostTensor<T> gate_up({1, 4}), out({1, 2}), d_out({1, 2}), d_gate_up({1, 4});
  gate_up[0] = static_cast<T>(big);   // gate 0
  gate_up[1] = static_cast<T>(-big);  // gate 1
  gate_up[2] = T(3);                  // up 0
  gate_up[3] = T(5);                  // up 1
  d_out[0] = d_out[1] = T(2);
  ops::swiglu_forward(out, gate_up);
  ops::swiglu_backward(d_gate_up, d_out, gate_up);
  // Towards -big the results are e^-big-small (a float denormal at 100), not necessarily 0.
  EXPECT_EQ(out[0], static_cast<T>(3 * big));
  EXPECT_NEAR(out[1], 0.0, 1e-30);
  EXPECT_EQ(d_gate_up[0], T(6));                     // d_out · up · silu'(big) = 2 · 3 · 1
  EXPECT_NEAR(d_gate_up[1], 0.0, 1e-30);             // d_out · up · silu'(-big) ≈ 0
  EXPECT_EQ(d_gate_up[2], static_cast<T>(2 * big));  // d_out · silu(big)
  EXPECT_NEAR(d_gate_up[3], 0.0, 1e-30);             // d_out · silu(-big) ≈ 0
}

TEST(Swiglu, GradientMatchesFiniteDifferences) {
  HostTensor<double> gate_up({kTokens, 2 * kFfn}), out({kTokens, kFfn}), g({kTokens, kFfn});
  HostTensor<double> d_gate_up({kTokens, 2 * kFfn});
  test::fill_uniform(gate_up, 6, -5.0, 5.0);
  test::fill_uniform(g, 7);
  auto loss = [&] {
    ops::swiglu_forward(out, gate_up);
    return test::weighted_sum(g, out);
  };
  const auto numeric = test::finite_difference(gate_up.values, loss);
  ops::swiglu_backward(d_gate_up, g, gate_up);
  const double err = test::relative_error(d_gate_up.values, numeric);
  test::report_error("swiglu d_gate_up vs finite differences", err);
  EXPECT_LT(err, test::kGradientTolerance);
}

TEST(Swiglu, Errors) {
  HostTensor<float> gate_up({kTokens, 2 * kFfn + 1}), out({kTokens, kFfn}), d_out({kTokens, kFfn});
  HostTensor<double> gate_up64({kTokens, 2 * kFfn});
  HostTensor<float> d_gate_up({kTokens, 2 * kFfn}), gate_up_ok({kTokens, 2 * kFfn});
  HostTensor<bf16> out16({kTokens, kFfn}), gate_up16({kTokens, 2 * kFfn});
  test::expect_error([&] { ops::swiglu_forward(out, gate_up); },
                     {"swiglu_forward", "gate_up f32[37, 23] cpu", "[T, 2F]", "out f32[37, 11] cpu"});
  test::expect_error([&] { ops::swiglu_forward(out, gate_up64); }, {"same dtype", "f64[37, 22]"});
  test::expect_error([&] { ops::swiglu_forward(out16, gate_up16); }, {"dtype bf16 is not supported"});
  test::expect_error([&] { ops::swiglu_backward(gate_up, d_out, gate_up_ok); },
                     {"swiglu_backward", "d_gate_up f32[37, 23] cpu"});
  HostTensor<float> out_wide({kTokens, kFfn + 1});
  test::expect_error([&] { ops::swiglu_backward(d_gate_up, d_out, gate_up_ok, out_wide); },
                     {"swiglu_backward", "out f32[37, 12] cpu", "d_out f32[37, 11] cpu"});
}

}  // namespace
}  // namespace longtrain
