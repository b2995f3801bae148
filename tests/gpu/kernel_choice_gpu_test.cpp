// The kernel policy auto (attention/cuda/kernel_choice.h): while a call shape is being measured its
// calls alternate between cuDNN and our Hopper kernel, each run once into the caller's outputs, so
// every call's result must be right; after the trial the shape has one recorded decision, with both
// kernels' times, naming the faster. Covers a plain forward, the merge into an f32 partial (the
// schedules' call), and the backward: accumulating into f32 dq/dk/dv from delta (the schedules'
// call) and overwriting bf16 ones from O (one rank's). Skips without an sm_90 GPU. The trial's schedule
// and decision (KernelChoiceTrial) run on the host, in CI too.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "attention/local_attention.h"
#include "gpu_test_util.h"

#ifdef LONGTRAIN_HAS_CUDA
#include "attention/cuda/hopper_attention.h"
#include "attention/cuda/kernel_choice.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"
#endif

namespace longtrain::test {
namespace {

#ifdef LONGTRAIN_HAS_CUDA

using attn::BlockMask;


const attn::KernelChoice* find_choice(const std::vector<attn::KernelChoice>& all, const std::string& part) {
  for (const auto& c : all)
    if (c.shape.find(part) != std::string::npos) return &c;
  return nullptr;
}

void expect_decision(const attn::KernelChoice* c, const std::string& what) {
  ASSERT_NE(c, nullptr) << "no decision recorded for " << what;
  EXPECT_TRUE(std::isfinite(c->cudnn_ms) && c->cudnn_ms > 0) << c->shape << ": cuDNN " << c->cudnn_ms << " ms";
  EXPECT_TRUE(std::isfinite(c->hopper_ms) && c->hopper_ms > 0) << c->shape << ": hopper " << c->hopper_ms << " ms";
  EXPECT_EQ(c->kernel, c->hopper_ms < c->cudnn_ms ? "hopper" : "cudnn") << c->shape;
  std::printf("  %s: %s (cuDNN %.3f ms, hopper %.3f ms)\n", c->shape.c_str(), c->kernel.c_str(), c->cudnn_ms,
              c->hopper_ms);
}

TEST(KernelChoiceAuto, EveryTrialCallIsRightAndTheFasterKernelIsRecorded) {
  LT_REQUIRE_GPU();
  if (!attn::hopper::supported(64, 1, 1)) GTEST_SKIP() << "the hopper attention kernel needs an sm_90 GPU";
  PolicyScope auto_policy(attn::KernelPolicy::autotune);
  // Shapes no other test in this process uses (a decided shape stays decided).
  const int64_t S = 1000, Hq = 8, Hkv = 2, D = 64;
  const double scale = 0.125;
  const auto q = random_values(S * Hq * D, 901, DType::bf16), k = random_values(S * Hkv * D, 902, DType::bf16);
  const auto v = random_values(S * Hkv * D, 903, DType::bf16);
  HostTensor<double> q_h = host_tensor({S, Hq, D}, q), k_h = host_tensor({S, Hkv, D}, k);
  HostTensor<double> v_h = host_tensor({S, Hkv, D}, v), o_h({S, Hq, D}), lse_h({S, Hq});
  attn::attention_block_forward(o_h, lse_h, q_h, k_h, v_h, BlockMask::causal_diagonal, scale);
  DeviceTensor qd(DType::bf16, {S, Hq, D}), kd(DType::bf16, {S, Hkv, D}), vd(DType::bf16, {S, Hkv, D});
  upload(qd, q);
  upload(kd, k);
  upload(vd, v);

  // A plain forward: the trial's calls and two more (the decided kernel), into a buffer reset to NaN.
  const int calls = attn::cuda::trial_length() + 2;
  DeviceTensor o(DType::bf16, {S, Hq, D}), lse(DType::f32, {S, Hq});
  for (int call = 0; call < calls; ++call) {
    upload(o, std::vector<double>(static_cast<size_t>(S * Hq * D), std::nan("")));
    attn::attention_block_forward(o, lse, qd, kd, vd, BlockMask::causal_diagonal, scale);
    expect_close("auto forward, call " + std::to_string(call), DType::bf16, download(o), o_h.values);
    expect_close("auto forward LSE, call " + std::to_string(call), DType::f32, download(lse), lse_h.values);
  }
  expect_decision(find_choice(attn::kernel_choices(), "forward causal Tq=1000 Tk=1000 heads 8/2 head_dim 64"),
                  "the causal forward");

  // The merge: keys split at 400 (the first part written, the second merged), fresh each call.
  const Tensor k1 = Tensor(kd).narrow(0, 0, 400), v1 = Tensor(vd).narrow(0, 0, 400);
  const Tensor k2 = Tensor(kd).narrow(0, 400, S - 400), v2 = Tensor(vd).narrow(0, 400, S - 400);
  HostTensor<double> on_h({S, Hq, D}), lsen_h({S, Hq});
  attn::attention_block_forward(on_h, lsen_h, q_h, k_h, v_h, BlockMask::none, scale);
  DeviceTensor acc(DType::f32, {S, Hq, D}), lse_acc(DType::f32, {S, Hq}), blk(DType::bf16, {S, Hq, D}),
      lse_blk(DType::f32, {S, Hq});
  for (int call = 0; call < calls; ++call) {
    attn::attention_block_forward(acc, lse_acc, qd, k1, v1, BlockMask::none, scale);
    attn::attention_block_forward_merge(acc, lse_acc, blk, lse_blk, qd, k2, v2, BlockMask::none, scale);
    expect_close("auto merge, call " + std::to_string(call), DType::bf16, download(acc), on_h.values);
    expect_close("auto merge LSE, call " + std::to_string(call), DType::f32, download(lse_acc), lsen_h.values);
  }
  const auto all = attn::kernel_choices();
  expect_decision(find_choice(all, "forward no-mask Tq=1000 Tk=600 heads 8/2 head_dim 64, f32 O, merged"),
                  "the merge");
  expect_decision(find_choice(all, "forward no-mask Tq=1000 Tk=400 heads 8/2 head_dim 64, f32 O"), "the f32 forward");
}

TEST(KernelChoiceAuto, EveryBackwardTrialCallIsRightAndTheFasterKernelIsRecorded) {
  LT_REQUIRE_GPU();
  if (!attn::hopper::supported(64, 1, 1)) GTEST_SKIP() << "the hopper attention kernel needs an sm_90 GPU";
  PolicyScope auto_policy(attn::KernelPolicy::autotune);
  // Shapes no other test in this process uses (a decided shape stays decided).
  const int64_t S = 1000, Hq = 8, Hkv = 2, D = 64;
  const double scale = 0.125;
  const auto q = random_values(S * Hq * D, 911, DType::bf16), k = random_values(S * Hkv * D, 912, DType::bf16);
  const auto v = random_values(S * Hkv * D, 913, DType::bf16), d_o = random_values(S * Hq * D, 914, DType::bf16);
  HostTensor<double> q_h = host_tensor({S, Hq, D}, q), k_h = host_tensor({S, Hkv, D}, k);
  HostTensor<double> v_h = host_tensor({S, Hkv, D}, v), do_h = host_tensor({S, Hq, D}, d_o);
  DeviceTensor qd(DType::bf16, {S, Hq, D}), kd(DType::bf16, {S, Hkv, D}), vd(DType::bf16, {S, Hkv, D});
  DeviceTensor gd(DType::bf16, {S, Hq, D});
  upload(qd, q);
  upload(kd, k);
  upload(vd, v);
  upload(gd, d_o);

  for (BlockMask mask : {BlockMask::causal_diagonal, BlockMask::none}) {
    const bool causal = mask == BlockMask::causal_diagonal;
    HostTensor<double> o_h({S, Hq, D}), lse_h({S, Hq}), dq_h({S, Hq, D}), dk_h({S, Hkv, D}), dv_h({S, Hkv, D});
    attn::attention_block_forward(o_h, lse_h, q_h, k_h, v_h, mask, scale);
    attn::attention_block_backward(dq_h, dk_h, dv_h, q_h, k_h, v_h, do_h, lse_h, o_h, Tensor{}, mask, scale,
                                   attn::GradMode::overwrite);
    DeviceTensor o(DType::f32, {S, Hq, D}), lse(DType::f32, {S, Hq}), delta(DType::f32, {S, Hq});
    upload(o, o_h.values);
    upload(lse, lse_h.values);
    attn::attention_delta(delta, o, gd);
    for (int call = 0; call < attn::cuda::trial_length() + 2; ++call) {
      const std::string tag = std::string(causal ? " causal" : " no-mask") + ", call " + std::to_string(call);
      if (causal) {
        // The schedules' call: from delta, accumulating into f32 dq/dk/dv that hold nonzero values.
        const auto dq0 = random_values(S * Hq * D, 920 + call, DType::f32);
        const auto dk0 = random_values(S * Hkv * D, 930 + call, DType::f32);
        const auto dv0 = random_values(S * Hkv * D, 940 + call, DType::f32);
        DeviceTensor dq(DType::f32, {S, Hq, D}), dk(DType::f32, {S, Hkv, D}), dv(DType::f32, {S, Hkv, D});
        upload(dq, dq0);
        upload(dk, dk0);
        upload(dv, dv0);
        attn::attention_block_backward(dq, dk, dv, qd, kd, vd, gd, lse, Tensor{}, delta, mask, scale,
                                       attn::GradMode::accumulate);
        auto minus = [](std::vector<double> a, const std::vector<double>& b) {
          for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
          return a;
        };
        expect_close("auto backward dQ increment" + tag, DType::bf16, minus(download(dq), dq0), dq_h.values);
        expect_close("auto backward dK increment" + tag, DType::bf16, minus(download(dk), dk0), dk_h.values);
        expect_close("auto backward dV increment" + tag, DType::bf16, minus(download(dv), dv0), dv_h.values);
      } else {
        // One rank's call: from O, overwriting bf16 dq/dk/dv that hold NaN.
        DeviceTensor dq(DType::bf16, {S, Hq, D}), dk(DType::bf16, {S, Hkv, D}), dv(DType::bf16, {S, Hkv, D});
        upload(dq, std::vector<double>(static_cast<size_t>(S * Hq * D), std::nan("")));
        upload(dk, std::vector<double>(static_cast<size_t>(S * Hkv * D), std::nan("")));
        upload(dv, std::vector<double>(static_cast<size_t>(S * Hkv * D), std::nan("")));
        attn::attention_block_backward(dq, dk, dv, qd, kd, vd, gd, lse, o, Tensor{}, mask, scale,
                                       attn::GradMode::overwrite);
        expect_close("auto backward dQ" + tag, DType::bf16, download(dq), dq_h.values);
        expect_close("auto backward dK" + tag, DType::bf16, download(dk), dk_h.values);
        expect_close("auto backward dV" + tag, DType::bf16, download(dv), dv_h.values);
      }
    }
  }
  const auto all = attn::kernel_choices();
  expect_decision(
      find_choice(all, "backward causal Tq=1000 Tk=1000 heads 8/2 head_dim 64, f32 grads, accumulated"),
      "the accumulating f32 backward");
  expect_decision(find_choice(all, "backward no-mask Tq=1000 Tk=1000 heads 8/2 head_dim 64"),
                  "the overwriting bf16 backward");
}

// The trial's schedule (host only, no GPU): cuDNN alone on the warm calls (the first step's
// transients), then an untimed call of each kernel; after that each kernel's timed calls sit at the
// same mean position (ABBA order), so a clock that falls at a steady rate while the trial runs (the GPU
// heating towards its power cap) slows both kernels' means alike.
TEST(KernelChoiceTrial, TimedCallsSitAtTheSameMeanPositionForBothKernels) {
  using attn::cuda::Kernel;
  const int n = attn::cuda::trial_length(), first_timed = attn::cuda::trial_first_timed_call();
  ASSERT_GE(first_timed, 2 + 22) << "the timing starts after a 22-layer model's first step";
  ASSERT_GE(n - first_timed, 8) << "four timed calls of each kernel";
  for (int call = 0; call < first_timed - 2; ++call) EXPECT_EQ(attn::cuda::trial_kernel(call), Kernel::cudnn) << call;
  EXPECT_EQ(attn::cuda::trial_kernel(first_timed - 2), Kernel::cudnn);
  EXPECT_EQ(attn::cuda::trial_kernel(first_timed - 1), Kernel::hopper);
  int count[2] = {0, 0}, position_sum[2] = {0, 0};
  for (int call = first_timed; call < n; ++call) {
    const int i = attn::cuda::trial_kernel(call) == Kernel::hopper ? 1 : 0;
    ++count[i];
    position_sum[i] += call;
  }
  EXPECT_EQ(count[0], count[1]);
  EXPECT_EQ(position_sum[0], position_sum[1]);
  EXPECT_THROW(attn::cuda::trial_kernel(n), Error);
  EXPECT_THROW(attn::cuda::trial_kernel(-1), Error);
}

// A kernel 1% faster is chosen though every call runs 3% slower than the one before (a falling clock),
// and two equal kernels get equal means; the decision reads the means (cuDNN on a tie). Under plain
// alternation with each kernel's fastest call, cuDNN (always first in a pair) would win the first case.
TEST(KernelChoiceTrial, AFallingClockFavoursNeitherKernel) {
  using attn::cuda::Kernel;
  auto trial = [](double cudnn_ms, double hopper_ms, double slowdown_per_call) {
    std::vector<std::pair<Kernel, double>> timed;
    for (int call = attn::cuda::trial_first_timed_call(); call < attn::cuda::trial_length(); ++call) {
      const Kernel k = attn::cuda::trial_kernel(call);
      const double base = k == Kernel::hopper ? hopper_ms : cudnn_ms;
      timed.emplace_back(k, base * (1.0 + slowdown_per_call * call));
    }
    return attn::cuda::decide_trial(timed);
  };
  const attn::cuda::TrialDecision faster_ours = trial(10.0, 9.9, 0.03);
  EXPECT_EQ(faster_ours.kernel, Kernel::hopper) << "cuDNN " << faster_ours.cudnn_ms << " ms, ours "
                                                << faster_ours.hopper_ms << " ms";
  const attn::cuda::TrialDecision faster_cudnn = trial(9.9, 10.0, 0.03);
  EXPECT_EQ(faster_cudnn.kernel, Kernel::cudnn);
  const attn::cuda::TrialDecision equal = trial(10.0, 10.0, 0.03);
  EXPECT_NEAR(equal.cudnn_ms, equal.hopper_ms, 1e-9);
  EXPECT_EQ(equal.kernel, Kernel::cudnn);
  // The means are what is recorded.
  const attn::cuda::TrialDecision flat = trial(4.0, 5.0, 0.0);
  EXPECT_DOUBLE_EQ(flat.cudnn_ms, 4.0);
  EXPECT_DOUBLE_EQ(flat.hopper_ms, 5.0);
}

// A timed call that is not a number, or a trial without one of the kernels, is an error, not a choice.
TEST(KernelChoiceTrial, ANonFiniteTimeOrAMissingKernelIsAnError) {
  using attn::cuda::Kernel;
  EXPECT_THROW(attn::cuda::decide_trial({{Kernel::cudnn, 1.0}, {Kernel::hopper, std::nan("")}}), Error);
  EXPECT_THROW(attn::cuda::decide_trial({{Kernel::cudnn, INFINITY}, {Kernel::hopper, 1.0}}), Error);
  EXPECT_THROW(attn::cuda::decide_trial({{Kernel::cudnn, 1.0}, {Kernel::cudnn, 2.0}}), Error);
}

#else
TEST(KernelChoiceAuto, EveryTrialCallIsRightAndTheFasterKernelIsRecorded) {
  GTEST_SKIP() << "longtrain was built without CUDA";
}
TEST(KernelChoiceAuto, EveryBackwardTrialCallIsRightAndTheFasterKernelIsRecorded) {
  GTEST_SKIP() << "longtrain was built without CUDA";
}
#endif

}  // namespace
}  // namespace longtrain::test
