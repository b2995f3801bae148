// AdamW against a plain transcription of PyTorch's torch.optim.AdamW, the learning-rate schedules,
// clipping, no-decay patterns, bf16 parameters with f32 master weights, and the flat-range ops.
#include <cmath>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "test_util.h"
#include "trainer/optimizer.h"

namespace longtrain::trainer {
namespace {

AdamWConfig base_config() {
  AdamWConfig c;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  c.warmup_steps = 2;
  c.total_steps = 10;
  c.schedule = LrSchedule::cosine;
  c.grad_clip = 0.0;
  c.no_decay = {"norm"};
  return c;
}

TEST(LearningRate, WarmupThenCosineLinearOrConstant) {
  AdamWConfig c = base_config();
  EXPECT_DOUBLE_EQ(learning_rate(c, 1), 0.5e-2);
  EXPECT_DOUBLE_EQ(learning_rate(c, 2), 1e-2);
  EXPECT_NEAR(learning_rate(c, 6), 1e-3 + 0.5 * 9e-3, 1e-15);  // halfway through the decay
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1e-3);
  c.schedule = LrSchedule::linear;
  EXPECT_NEAR(learning_rate(c, 4), 1e-3 + 0.75 * 9e-3, 1e-15);
  c.schedule = LrSchedule::constant;
  EXPECT_DOUBLE_EQ(learning_rate(c, 9), 1e-2);
}

// A schedule re-shaped at a resume (restart R, L) starts at L and ends where its schedule ends, for
// every schedule and restart point (inside warmup, after it, at the end); no step divides by zero.
TEST(LearningRate, ARestartStartsAtItsLrAndEndsAtTheSchedulesEnd) {
  for (LrSchedule schedule : {LrSchedule::cosine, LrSchedule::linear, LrSchedule::constant}) {
    for (int64_t R : {0, 1, 2, 5, 10}) {
      AdamWConfig c = base_config();  // lr 1e-2, min_lr 1e-3, warmup 2, 10 steps
      c.schedule = schedule;
      c.total_steps = 10;
      c.restart = LrRestart{R, 4e-3};
      SCOPED_TRACE(fmt::format("{} R={}", enum_name(schedule), R));
      EXPECT_EQ(learning_rate(c, R), 4e-3);
      const double end = schedule == LrSchedule::constant ? c.lr : c.min_lr;
      EXPECT_NEAR(learning_rate(c, 10), R < 10 ? end : 4e-3, 1e-15);
      for (int64_t s = R + 1; s <= 10; ++s) EXPECT_TRUE(std::isfinite(learning_rate(c, s))) << s;
      if (R == 10) continue;
      // No jump: step R+1 moves from L by at most the steepest slope of its piece (warmup: linear
      // to lr by step 2; cosine: (pi/2)·range per whole decay; linear and constant: range / steps).
      const double first = std::abs(learning_rate(c, R + 1) - 4e-3);
      const double slope = R < c.warmup_steps ? std::abs(c.lr - 4e-3) / static_cast<double>(c.warmup_steps - R)
                                              : std::abs(end - 4e-3) * M_PI / 2 / static_cast<double>(10 - R);
      EXPECT_LE(first, slope + 1e-15);
    }
  }
  // After warmup the restart decays from L: halfway through, cosine gives the middle.
  AdamWConfig c = base_config();
  c.total_steps = 10;
  c.restart = LrRestart{4, 4e-3};
  EXPECT_NEAR(learning_rate(c, 7), 1e-3 + 0.5 * 3e-3, 1e-15);
  // Inside warmup it first climbs linearly to lr at warmup_steps.
  c.warmup_steps = 6;
  EXPECT_NEAR(learning_rate(c, 5), 4e-3 + 0.5 * 6e-3, 1e-15);
  EXPECT_NEAR(learning_rate(c, 6), 1e-2, 1e-15);
}

// PyTorch's AdamW, one parameter tensor, in double.
struct ReferenceAdamW {
  std::vector<double> w, m, v;
  void step(const std::vector<double>& g, double lr, double b1, double b2, double eps, double wd, int t) {
    for (size_t i = 0; i < w.size(); ++i) {
      w[i] *= 1.0 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

TEST(AdamW, MatchesPyTorchsAdamWWithScheduleAndNoDecay) {
  Arena params("parameters", Device::cpu), grads("gradients", Device::cpu);
  for (Arena* a : {&params, &grads}) {
    a->add("layers.0.weight", {5, 3}, DType::f64);
    a->add("layers.0.norm.weight", {7}, DType::f64);
    a->allocate();
  }
  test::HostTensor<double> init({22});
  test::fill_uniform(init, 3);
  std::copy(init.values.begin(), init.values.begin() + 15, params.get("layers.0.weight").ptr<double>());
  std::copy(init.values.begin() + 15, init.values.end(), params.get("layers.0.norm.weight").ptr<double>());
  ReferenceAdamW ref_w{std::vector<double>(init.values.begin(), init.values.begin() + 15), std::vector<double>(15),
                       std::vector<double>(15)};
  ReferenceAdamW ref_n{std::vector<double>(init.values.begin() + 15, init.values.end()), std::vector<double>(7),
                       std::vector<double>(7)};
  AdamWConfig c = base_config();
  AdamW opt(params, c);
  for (int t = 1; t <= 6; ++t) {
    test::HostTensor<double> g({22});
    test::fill_uniform(g, 100 + t);
    std::copy(g.values.begin(), g.values.begin() + 15, grads.get("layers.0.weight").ptr<double>());
    std::copy(g.values.begin() + 15, g.values.end(), grads.get("layers.0.norm.weight").ptr<double>());
    AdamW::StepInfo info = opt.step(params, grads);
    EXPECT_DOUBLE_EQ(info.lr, learning_rate(c, t));
    ref_w.step({g.values.begin(), g.values.begin() + 15}, info.lr, c.beta1, c.beta2, c.eps, c.weight_decay, t);
    ref_n.step({g.values.begin() + 15, g.values.end()}, info.lr, c.beta1, c.beta2, c.eps, 0.0, t);
  }
  const double* w = params.get("layers.0.weight").ptr<double>();
  const double* n = params.get("layers.0.norm.weight").ptr<double>();
  for (int i = 0; i < 15; ++i) EXPECT_NEAR(w[i], ref_w.w[i], 1e-14);
  for (int i = 0; i < 7; ++i) EXPECT_NEAR(n[i], ref_n.w[i], 1e-14);
}

TEST(AdamW, ClipsByTheGlobalNorm) {
  Arena params("parameters", Device::cpu), grads("gradients", Device::cpu);
  for (Arena* a : {&params, &grads}) {
    a->add("w", {4}, DType::f32);
    a->allocate();
  }
  float* g = grads.get("w").ptr<float>();
  g[0] = 3;
  g[1] = 4;  // norm 5
  AdamWConfig c = base_config();
  c.grad_clip = 1.0;
  AdamW opt(params, c);
  AdamW::StepInfo info = opt.step(params, grads);
  EXPECT_FLOAT_EQ(info.grad_norm, 5.0);
  EXPECT_FLOAT_EQ(info.clip_scale, 0.2);
  // The first Adam step moves each weight by lr·sign(g) whatever the scale (bias-corrected).
  EXPECT_NEAR(params.get("w").ptr<float>()[0], -learning_rate(c, 1), 1e-6);
}

TEST(AdamW, Bf16ParametersKeepF32MasterWeights) {
  Arena params("parameters", Device::cpu), grads("gradients", Device::cpu);
  params.add("w", {64}, DType::bf16);
  grads.add("w", {64}, DType::bf16);
  params.allocate();
  grads.allocate();
  for (int i = 0; i < 64; ++i) {
    params.get("w").ptr<bf16>()[i] = bf16(0.1f * static_cast<float>(i));
    grads.get("w").ptr<bf16>()[i] = bf16(std::sin(static_cast<float>(i)));
  }
  AdamWConfig c = base_config();
  c.lr = 1e-4;  // smaller than bf16 resolution near 1: only the master weights can hold the change
  AdamW opt(params, c);
  ASSERT_TRUE(opt.has_master());
  for (int t = 0; t < 3; ++t) opt.step(params, grads);
  const float* master = opt.master().flat().ptr<float>();
  for (int i = 0; i < 64; ++i) EXPECT_EQ(params.get("w").ptr<bf16>()[i].bits, bf16(master[i]).bits) << i;
  EXPECT_NE(master[40], static_cast<float>(bf16(4.0f)));
}

// One update over a flat buffer with no-decay ranges is, element for element, the update of each run
// on its own with its weight decay: what lets the trainer update every tensor in one call.
TEST(FlatOps, AdamWNoDecayRangesEqualUpdatesRunByRun) {
  const int64_t n = 103;
  test::HostTensor<float> w0({n}), g({n});
  test::fill_uniform(w0, 4);
  test::fill_uniform(g, 5);
  ops::AdamWParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.5;
  p.bias_correction1 = 0.1;
  p.bias_correction2 = 0.05;
  const std::vector<ops::ElementRange> ranges = {{0, 3}, {10, 11}, {11, 40}, {97, 103}};
  test::HostTensor<float> w = w0, m({n}), v({n});
  ops::AdamWParams with_ranges = p;
  with_ranges.no_decay = ranges;
  ops::adamw_update(w, Tensor{}, m, v, g, with_ranges);

  test::HostTensor<float> wr = w0, mr({n}), vr({n});
  auto run = [&](int64_t b, int64_t e, double decay) {
    ops::AdamWParams q = p;
    q.weight_decay = decay;
    Tensor tw = wr, tm = mr, tv = vr, tg = g;
    ops::adamw_update(tw.narrow(0, b, e - b), Tensor{}, tm.narrow(0, b, e - b), tv.narrow(0, b, e - b),
                      tg.narrow(0, b, e - b), q);
  };
  run(0, 3, 0.0);
  run(3, 10, 0.5);
  run(10, 40, 0.0);
  run(40, 97, 0.5);
  run(97, 103, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(w[i], wr[i]) << i;
    EXPECT_EQ(m[i], mr[i]) << i;
    EXPECT_EQ(v[i], vr[i]) << i;
  }
  EXPECT_NE(w[5], w0[5]);  // the update did run

  ops::AdamWParams bad = p;
  bad.no_decay = {{10, 20}, {15, 30}};
  test::expect_error([&] { ops::adamw_update(w, Tensor{}, m, v, g, bad); }, {"no-decay range [15, 30)"});
  bad.no_decay = {{90, 104}};
  test::expect_error([&] { ops::adamw_update(w, Tensor{}, m, v, g, bad); }, {"outside the 103 elements"});
}

TEST(FlatOps, SumSquaresAndConvert) {
  test::HostTensor<float> x({1001});
  test::fill_uniform(x, 9);
  double ref = 0;
  for (float v : x.values) ref += double(v) * v;
  EXPECT_NEAR(ops::sum_squares(x), ref, 1e-12 * ref);
  x[17] = NAN;
  EXPECT_TRUE(std::isnan(ops::sum_squares(x)));
  test::HostTensor<bf16> b({1001});
  test::HostTensor<double> d({1001});
  x[17] = 1.0f;
  ops::convert(b, x);
  ops::convert(d, b);
  for (int i = 0; i < 1001; ++i) EXPECT_EQ(d[i], static_cast<float>(bf16(x[i])));
  test::HostTensor<float> wrong({1000});
  EXPECT_THROW(ops::convert(wrong, x), Error);
}

TEST(FlatOps, FillRoundsTheValueAsConvertDoes) {
  const double value = 1.0 / 3.0;
  test::HostTensor<double> d({7});
  test::HostTensor<float> f({5});
  test::HostTensor<bf16> b({3});
  ops::fill(d, value);
  ops::fill(f, value);
  ops::fill(b, value);
  for (double v : d.values) EXPECT_EQ(v, value);
  for (float v : f.values) EXPECT_EQ(v, static_cast<float>(value));
  for (bf16 v : b.values) EXPECT_EQ(v.bits, bf16(static_cast<float>(value)).bits);
  test::HostTensor<int32_t> ints({2});
  EXPECT_THROW(ops::fill(ints, 1.0), Error);
  test::HostTensor<float> m({4, 4});
  EXPECT_THROW(ops::fill(Tensor(m).narrow(1, 0, 2), 1.0), Error);  // not contiguous
}

}  // namespace
}  // namespace longtrain::trainer
