// Every CUDA op (kernels/cuda) against the CPU reference (kernels/cpu) on the same random inputs: the
// inputs are rounded to the device dtype first, the CPU computes in double on those values, and the
// GPU result must be within gpu_tolerance(dtype) (gpu_test_util.h). Sizes are odd or prime so that
// tails and unaligned leading dimensions are exercised; accumulating outputs (dx of rmsnorm, every
// weight gradient) start from random values, so "+=" is checked, not just "=". Each test runs for
// bf16 (the training dtype) and f32, and skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/ops.h"
#include "runtime/cuda_graph.h"
#include "runtime/error.h"

#ifdef LONGTRAIN_HAS_CUDA
#include "kernels/cuda/gemm.h"
#endif

namespace longtrain::test {
namespace {

std::vector<int32_t> random_ints(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

HostTensor<int32_t> host_ints(std::initializer_list<int64_t> shape, const std::vector<int32_t>& values) {
  HostTensor<int32_t> h(shape);
  for (size_t i = 0; i < h.size(); ++i) h[i] = values[i];
  return h;
}

class GpuOps : public ::testing::TestWithParam<DType> {};

TEST_P(GpuOps, EmbeddingForwardBackwardAndBadToken) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t V = 97, C = 203, T = 131;
  const auto table = random_values(V * C, 1, dt);
  const auto tokens = random_ints(T, 2, 0, V);  // 131 draws from 97 ids: repeats guaranteed
  const auto d_table0 = random_values(V * C, 3, dt);
  const auto d_out = random_values(T * C, 4, dt);

  HostTensor<double> table_h = host_tensor({V, C}, table), out_h({T, C});
  HostTensor<int32_t> tok_h = host_ints({T}, tokens);
  ops::embedding_forward(out_h, tok_h, table_h);
  HostTensor<double> d_table_h = host_tensor({V, C}, d_table0), d_out_h = host_tensor({T, C}, d_out);
  ops::embedding_backward(d_table_h, tok_h, d_out_h);

  DeviceTensor table_d(dt, {V, C}), tok_d(DType::i32, {T}), out_d(dt, {T, C});
  DeviceTensor d_table_d(dt, {V, C}), d_out_d(dt, {T, C});
  upload(table_d, table);
  upload_ints(tok_d, tokens);
  upload(d_table_d, d_table0);
  upload(d_out_d, d_out);
  ops::embedding_forward(out_d, tok_d, table_d);
  ops::embedding_backward(d_table_d, tok_d, d_out_d);
  expect_close("embedding_forward out", dt, download(out_d), out_h.values);
  expect_close("embedding_backward d_table (+=)", dt, download(d_table_d), d_table_h.values);

  auto bad = tokens;
  bad[17] = static_cast<int32_t>(V + 3);
  upload_ints(tok_d, bad);
  expect_error([&] { ops::embedding_forward(out_d, tok_d, table_d); }, {"token id 100", "position 17"});
}

// Odd columns run the scalar kernels; 256 columns the widest vectorised ones (8 bf16 or 4 f32 per
// thread), 260 the 4-wide bf16 ones; 1031 rows spread the backward's dw partials over many blocks.
TEST_P(GpuOps, RmsnormForwardBackward) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  struct Shape {
    int64_t T, C;
  };
  for (Shape shape : {Shape{67, 203}, Shape{1031, 256}, Shape{33, 260}}) {
    const int64_t T = shape.T, C = shape.C;
    SCOPED_TRACE(fmt::format("T={} C={}", T, C));
    const double eps = 1e-5;
    const auto x = random_values(T * C, 11, dt, -2.0, 2.0);
    const auto w = random_values(C, 12, dt, 0.5, 1.5);
    const auto dy = random_values(T * C, 13, dt);
    const auto dx0 = random_values(T * C, 14, dt);
    const auto dw0 = random_values(C, 15, dt);

    HostTensor<double> x_h = host_tensor({T, C}, x), w_h = host_tensor({C}, w), y_h({T, C}), rstd_h({T});
    ops::rmsnorm_forward(y_h, rstd_h, x_h, w_h, eps);
    HostTensor<double> dy_h = host_tensor({T, C}, dy), dx_h = host_tensor({T, C}, dx0), dw_h = host_tensor({C}, dw0);
    ops::rmsnorm_backward(dx_h, dw_h, dy_h, x_h, w_h, rstd_h);

    DeviceTensor x_d(dt, {T, C}), w_d(dt, {C}), y_d(dt, {T, C}), rstd_d(DType::f32, {T});
    DeviceTensor dy_d(dt, {T, C}), dx_d(dt, {T, C}), dw_d(dt, {C});
    upload(x_d, x);
    upload(w_d, w);
    upload(dy_d, dy);
    upload(dx_d, dx0);
    upload(dw_d, dw0);
    ops::rmsnorm_forward(y_d, rstd_d, x_d, w_d, eps);
    ops::rmsnorm_backward(dx_d, dw_d, dy_d, x_d, w_d, rstd_d);
    expect_close("rmsnorm_forward y", dt, download(y_d), y_h.values);
    expect_close("rmsnorm_forward rstd (f32 statistic)", DType::f32, download(rstd_d), rstd_h.values);
    expect_close("rmsnorm_backward dx (+=)", dt, download(dx_d), dx_h.values);
    expect_close("rmsnorm_backward dw (+=)", dt, download(dw_d), dw_h.values);
  }
}

// RoPE in place on the K slice of a fused QKV buffer (a strided view at a column offset), at
// positions up to 2^20, where an fp32 angle would be off by tenths of a radian.
TEST_P(GpuOps, RopeOnStridedQkvViewAtLongPositions) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 37, Hq = 3, Hkv = 1, D = 64, W = (Hq + 2 * Hkv) * D;
  const auto qkv = random_values(T * W, 21, dt);
  const auto positions = random_ints(T, 22, 0, 1 << 20);
  const ops::RopeParams p{500000.0};

  HostTensor<double> qkv_h = host_tensor({T, W}, qkv);
  HostTensor<int32_t> pos_h = host_ints({T}, positions);
  DeviceTensor qkv_d(dt, {T, W}), pos_d(DType::i32, {T});
  upload(qkv_d, qkv);
  upload_ints(pos_d, positions);

  ops::rope_forward(head_view(qkv_h, Hq * D, Hkv, D), pos_h, p);
  ops::rope_forward(head_view(qkv_d, Hq * D, Hkv, D), pos_d, p);
  ops::rope_forward(head_view(qkv_h, 0, Hq, D), pos_h, p);
  ops::rope_forward(head_view(qkv_d, 0, Hq, D), pos_d, p);
  expect_close("rope_forward (Q and K views of QKV; V untouched)", dt, download(qkv_d), qkv_h.values);

  // The backward on the GPU's own output, against the CPU's backward of the same values.
  const auto rotated = download(qkv_d);
  HostTensor<double> back_h = host_tensor({T, W}, rotated);
  ops::rope_backward(head_view(back_h, Hq * D, Hkv, D), pos_h, p);
  ops::rope_backward(head_view(qkv_d, Hq * D, Hkv, D), pos_d, p);
  expect_close("rope_backward (K view of QKV)", dt, download(qkv_d), back_h.values);
}

// RoPE scaling's inputs: a scaled inverse-frequency table (here yarn-like: the slow half divided by 4)
// and an attention factor on cos and sin, forward and backward, against the CPU reference.
TEST_P(GpuOps, RopeWithScaledTableAndAttentionFactor) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 29, H = 2, D = 128;
  const auto x = random_values(T * H * D, 23, dt);
  const auto positions = random_ints(T, 24, 0, 1 << 17);
  std::vector<double> inv(D / 2);
  for (int64_t i = 0; i < D / 2; ++i) inv[i] = std::pow(1e6, -2.0 * i / D) / (i < D / 4 ? 1.0 : 4.0);
  const ops::RopeParams p{1e6, inv, 1.1386294361119891};

  HostTensor<double> x_h = host_tensor({T, H, D}, x);
  HostTensor<int32_t> pos_h = host_ints({T}, positions);
  DeviceTensor x_d(dt, {T, H, D}), pos_d(DType::i32, {T});
  upload(x_d, x);
  upload_ints(pos_d, positions);
  ops::rope_forward(x_h, pos_h, p);
  ops::rope_forward(x_d, pos_d, p);
  expect_close("rope_forward with a scaled table and attention factor", dt, download(x_d), x_h.values);
  const auto rotated = download(x_d);
  HostTensor<double> back_h = host_tensor({T, H, D}, rotated);
  ops::rope_backward(back_h, pos_h, p);
  ops::rope_backward(x_d, pos_d, p);
  expect_close("rope_backward with a scaled table and attention factor", dt, download(x_d), back_h.values);
}

// F odd: the scalar kernels; 172: 4 per thread; 176: 8 bf16 (4 f32) per thread.
TEST_P(GpuOps, SwigluForwardBackward) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  for (int64_t F : {173, 172, 176}) {
    SCOPED_TRACE(fmt::format("F={}", F));
    const int64_t T = 53;
    const auto gate_up = random_values(T * 2 * F, 31, dt, -3.0, 3.0);
    const auto d_out = random_values(T * F, 32, dt);

    HostTensor<double> gu_h = host_tensor({T, 2 * F}, gate_up), out_h({T, F}), dgu_h({T, 2 * F});
    HostTensor<double> dout_h = host_tensor({T, F}, d_out);
    ops::swiglu_forward(out_h, gu_h);
    ops::swiglu_backward(dgu_h, dout_h, gu_h);

    DeviceTensor gu_d(dt, {T, 2 * F}), out_d(dt, {T, F}), dgu_d(dt, {T, 2 * F}), dout_d(dt, {T, F});
    upload(gu_d, gate_up);
    upload(dout_d, d_out);
    ops::swiglu_forward(out_d, gu_d);
    ops::swiglu_backward(dgu_d, dout_d, gu_d);
    expect_close("swiglu_forward out", dt, download(out_d), out_h.values);
    expect_close("swiglu_backward d_gate_up", dt, download(dgu_d), dgu_h.values);
    // With the forward's output recomputed (the remat policies' path): bit for bit the forward's,
    // and the same gradient.
    DeviceTensor out2_d(dt, {T, F}), dgu2_d(dt, {T, 2 * F});
    ops::swiglu_backward(dgu2_d, dout_d, gu_d, out2_d);
    EXPECT_EQ(download(out2_d), download(out_d)) << "recomputed swiglu output";
    EXPECT_EQ(download(dgu2_d), download(dgu_d)) << "d_gate_up with the output recomputed";
  }
}

// y = x·wᵀ, dx = dy·w, dw += dyᵀ·x; one shape with odd (unaligned) leading dimensions, one aligned.
TEST_P(GpuOps, LinearForwardBackward) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  struct Shape {
    int64_t T, K, N;
  };
  for (Shape s : {Shape{77, 131, 59}, Shape{64, 256, 128}}) {
    SCOPED_TRACE(fmt::format("T={} K={} N={}", s.T, s.K, s.N));
    const auto x = random_values(s.T * s.K, 41, dt);
    const auto w = random_values(s.N * s.K, 42, dt);
    const auto dy = random_values(s.T * s.N, 43, dt);
    const auto dw0 = random_values(s.N * s.K, 44, dt);

    HostTensor<double> x_h = host_tensor({s.T, s.K}, x), w_h = host_tensor({s.N, s.K}, w), y_h({s.T, s.N});
    HostTensor<double> dy_h = host_tensor({s.T, s.N}, dy), dx_h({s.T, s.K}), dw_h = host_tensor({s.N, s.K}, dw0);
    ops::linear_forward(y_h, x_h, w_h);
    ops::linear_backward(dx_h, dw_h, dy_h, x_h, w_h);

    DeviceTensor x_d(dt, {s.T, s.K}), w_d(dt, {s.N, s.K}), y_d(dt, {s.T, s.N});
    DeviceTensor dy_d(dt, {s.T, s.N}), dx_d(dt, {s.T, s.K}), dw_d(dt, {s.N, s.K});
    upload(x_d, x);
    upload(w_d, w);
    upload(dy_d, dy);
    upload(dw_d, dw0);
    ops::linear_forward(y_d, x_d, w_d);
    ops::linear_backward(dx_d, dw_d, dy_d, x_d, w_d);
    const std::string tag = fmt::format(" [{}x{}x{}]", s.T, s.K, s.N);
    expect_close("linear_forward y" + tag, dt, download(y_d), y_h.values);
    expect_close("linear_backward dx" + tag, dt, download(dx_d), dx_h.values);
    expect_close("linear_backward dw (+=)" + tag, dt, download(dw_d), dw_h.values);

    if (dt == DType::bf16) {  // bf16 activations with an fp32 weight-gradient accumulator
      DeviceTensor dw32_d(DType::f32, {s.N, s.K});
      upload(dw32_d, dw0);
      ops::linear_backward(Tensor(), dw32_d, dy_d, x_d, w_d);
      expect_close("linear_backward dw f32 accumulator (+=)" + tag, DType::f32, download(dw32_d), dw_h.values);
    }
  }
}

// y = residual + x·wᵀ through cuBLASLt's C (beta = 1): apart and in place, against the CPU in double.
TEST_P(GpuOps, LinearResidualForwardApartAndInPlace) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  for (auto [T, K, N] : {std::tuple<int64_t, int64_t, int64_t>{77, 131, 59}, {64, 256, 128}}) {
    SCOPED_TRACE(fmt::format("T={} K={} N={}", T, K, N));
    const auto x = random_values(T * K, 45, dt), w = random_values(N * K, 46, dt), r = random_values(T * N, 47, dt);
    HostTensor<double> x_h = host_tensor({T, K}, x), w_h = host_tensor({N, K}, w), r_h = host_tensor({T, N}, r),
                       y_h({T, N});
    ops::linear_residual_forward(y_h, x_h, w_h, r_h);
    DeviceTensor x_d(dt, {T, K}), w_d(dt, {N, K}), r_d(dt, {T, N}), y_d(dt, {T, N});
    upload(x_d, x);
    upload(w_d, w);
    upload(r_d, r);
    ops::linear_residual_forward(y_d, x_d, w_d, r_d);
    expect_close("linear_residual_forward into y", dt, download(y_d), y_h.values);
    EXPECT_EQ(download(r_d), r) << "the residual changed";
    ops::linear_residual_forward(r_d, x_d, w_d, r_d);
    expect_close("linear_residual_forward in place", dt, download(r_d), y_h.values);
  }
}

// Under GEMM algorithm auto (kernels/ops.h: GemmAlgoPolicy) a shape's first calls cycle through cuBLASLt's
// candidates, each call the real one: every call's result is right, accumulation in place (the
// residual through C = D, the f32 weight gradient with beta = 1) included, and the trials end in a
// decision for each shape.
TEST_P(GpuOps, LinearUnderAutoGemmAlgorithmIsRightOnEveryTrialCall) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const ops::GemmAlgoPolicy before = ops::gemm_algo_policy();
  ops::set_gemm_algo_policy(ops::GemmAlgoPolicy::autotune);
  struct Restore {
    ops::GemmAlgoPolicy p;
    ~Restore() { ops::set_gemm_algo_policy(p); }
  } restore{before};
  // Other tests' shapes may still be in their trials (under LONGTRAIN_GEMM_ALGO=auto): count from here.
  const size_t choices_before = ops::gemm_choices().size();
  const int pending_before = ops::gemm_trials_pending();
  // A shape of its own per dtype (no other test runs it under auto), large enough for several candidates.
  const int64_t T = dt == DType::bf16 ? 520 : 504, K = 384, N = 264;
  const auto x = random_values(T * K, 81, dt), w = random_values(N * K, 82, dt), dy = random_values(T * N, 83, dt);
  const auto r0 = random_values(T * N, 84, dt), dw0 = random_values(N * K, 85, dt);
  HostTensor<double> x_h = host_tensor({T, K}, x), w_h = host_tensor({N, K}, w), dy_h = host_tensor({T, N}, dy);
  HostTensor<double> xw_h({T, N}), dx_h({T, K}), g_h({N, K});
  ops::linear_forward(xw_h, x_h, w_h);
  ops::linear_backward(dx_h, g_h, dy_h, x_h, w_h);  // g_h = dyᵀ·x (it starts at zero)

  DeviceTensor x_d(dt, {T, K}), w_d(dt, {N, K}), dy_d(dt, {T, N}), y_d(dt, {T, N}), r_d(dt, {T, N});
  DeviceTensor dx_d(dt, {T, K}), dw_d(DType::f32, {N, K});
  upload(x_d, x);
  upload(w_d, w);
  upload(dy_d, dy);
  upload(r_d, r0);
  upload(dw_d, dw0);
  // 6 candidates × 3 rounds = 18 trial runs at most; 20 calls cover every trial and the decided algorithm.
  // The product into a y of its own (and dx) may rerun: its whole trial runs in the first call. The
  // in-place residual and the accumulated dw add into their outputs: one run per call, 18 calls.
  const int calls = 20;
  // r (in place, stored in dt) is compared with what it held before the call plus x·wᵀ; the f32 dw
  // with dw0 plus the calls' dyᵀ·x so far.
  std::vector<double> r_before(r0.begin(), r0.end()), dw_want(dw0.begin(), dw0.end());
  for (int i = 0; i < calls; ++i) {
    SCOPED_TRACE(fmt::format("call {}", i));
    ops::linear_forward(y_d, x_d, w_d);
    ops::linear_residual_forward(r_d, x_d, w_d, r_d);
    ops::linear_backward(dx_d, dw_d, dy_d, x_d, w_d);
    expect_close("linear_forward y", dt, download(y_d), xw_h.values);
    expect_close("linear_backward dx", dt, download(dx_d), dx_h.values);
    for (size_t j = 0; j < dw_want.size(); ++j) dw_want[j] += g_h.values[j];
    expect_close("linear_backward dw f32 accumulator (+=)", DType::f32, download(dw_d), dw_want);
    const std::vector<double> r_after = download(r_d);
    std::vector<double> r_want(r_before.size());
    for (size_t j = 0; j < r_want.size(); ++j) r_want[j] = r_before[j] + xw_h.values[j];
    expect_close("linear_residual_forward in place (+=)", dt, r_after, r_want);
    r_before = r_after;
    if (i == 0) {
      const std::vector<ops::GemmChoice> first = ops::gemm_choices();
      EXPECT_GT(first.size(), choices_before) << "no shape that may rerun ended its trial in its first call";
      for (size_t j = choices_before; j < first.size(); ++j)
        EXPECT_EQ(first[j].shape.find("beta 1"), std::string::npos)
            << first[j].shape << ": a shape adding into its output ended its trial in one call";
    }
  }
  EXPECT_EQ(ops::gemm_trials_pending(), pending_before) << "a shape of this test is still in its trial";
  const std::vector<ops::GemmChoice> choices = ops::gemm_choices();
  ASSERT_GT(choices.size(), choices_before) << "no GEMM shape of this test had more than one candidate";
  for (size_t i = choices_before; i < choices.size(); ++i) {
    const ops::GemmChoice& c = choices[i];
    EXPECT_TRUE(c.chosen >= 0 && c.chosen < c.candidates && c.candidates <= 6) << c.shape;
    EXPECT_TRUE(std::isfinite(c.chosen_ms) && c.chosen_ms > 0 && c.chosen_ms <= c.heuristic_ms) << c.shape;
  }
}

#ifdef LONGTRAIN_HAS_CUDA
// Host only (CI too): which GEMM calls may run their whole algorithm trial at once. Rerunning into D is
// the same result only when D shares no byte with A, B and (beta != 0) C; a call adding into D in place
// would add once per run.
TEST(GemmTrial, OnlyACallWhoseOutputOverlapsNoInputRunsItsWholeTrialAtOnce) {
  using cuda_util::MatrixBytes;
  std::vector<float> buf(4096);
  auto at = [&](size_t offset, int64_t rows, int64_t cols, int64_t ld) {
    return MatrixBytes{buf.data() + offset, rows, cols, ld, sizeof(float)};
  };
  const MatrixBytes a = at(0, 16, 8, 20), b = at(200, 8, 4, 8), c = at(300, 16, 4, 16);
  // a spans floats [0, 7·20 + 16) = [0, 156): its last column ends at row 16, not at the ld.
  EXPECT_TRUE(cuda_util::gemm_call_repeatable(a, b, c, at(400, 16, 4, 16), true)) << "D apart from everything";
  EXPECT_TRUE(cuda_util::gemm_call_repeatable(a, b, c, at(156, 16, 2, 16), true)) << "D right after A's last element";
  EXPECT_FALSE(cuda_util::gemm_call_repeatable(a, b, c, at(155, 16, 2, 16), true)) << "D on A's last element";
  EXPECT_FALSE(cuda_util::gemm_call_repeatable(a, b, c, at(190, 16, 2, 16), true)) << "D over B's start";
  EXPECT_FALSE(cuda_util::gemm_call_repeatable(a, b, c, c, true)) << "D = C with beta 1: the in-place add";
  EXPECT_TRUE(cuda_util::gemm_call_repeatable(a, b, c, c, false)) << "D = C with beta 0: C is never read";
  EXPECT_TRUE(cuda_util::gemm_call_repeatable(a, b, at(0, 0, 0, 1), at(400, 16, 4, 16), true)) << "an empty C";
  EXPECT_THROW(cuda_util::gemm_call_repeatable(a, b, c, at(400, 16, 4, 8), false), Error) << "ld < rows";
}

TEST(GemmTrial, ARepeatableCallRunsTheRestOfItsTrialAnotherRunsOne) {
  EXPECT_EQ(cuda_util::gemm_trial_length(6), 18);
  EXPECT_EQ(cuda_util::gemm_trial_length(1), 3);
  EXPECT_EQ(cuda_util::gemm_trial_runs(6, 0, true), 18);
  EXPECT_EQ(cuda_util::gemm_trial_runs(6, 5, true), 13);
  EXPECT_EQ(cuda_util::gemm_trial_runs(6, 0, false), 1);
  EXPECT_EQ(cuda_util::gemm_trial_runs(6, 17, false), 1);
  EXPECT_THROW(cuda_util::gemm_trial_runs(6, 18, true), Error) << "past the trial";
  EXPECT_THROW(cuda_util::gemm_trial_runs(0, 0, true), Error) << "no candidates";
}
#endif

// The model's RoPE: one table per step (f32 on the GPU), Q and K of the fused buffer as one view:
// bit for bit what rope_forward / rope_backward give on the GPU, and V untouched. Head dims 64 and
// 128, head counts with and without a remainder of 4 (rope_apply's vector kernel loads 4 heads at a
// time), and a view 2 elements into its buffer, which only the scalar kernel can take.
TEST_P(GpuOps, RopeTableAndApplyEqualRopeForwardAndBackwardBitForBit) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  struct Case {
    int64_t D, Hq, Hkv, lead;
  };
  for (const Case& k : {Case{64, 8, 2, 0}, Case{128, 12, 4, 0}, Case{64, 5, 1, 2}}) {
    const int64_t T = 53, Hq = k.Hq, Hkv = k.Hkv, D = k.D, W = k.lead + (Hq + 2 * Hkv) * D;
    SCOPED_TRACE("D " + std::to_string(D) + ", " + std::to_string(Hq + Hkv) + " heads, view at column " +
                 std::to_string(k.lead));
    const auto qkv = random_values(T * W, 48, dt);
    const auto positions = random_ints(T, 49, 0, 1 << 21);
    std::vector<double> inv(D / 2);
    for (int64_t i = 0; i < D / 2; ++i) inv[i] = std::pow(5e5, -2.0 * i / D) / (i < D / 4 ? 1.0 : 8.0);
    const ops::RopeParams p{5e5, inv, 1.07};
    DeviceTensor a_d(dt, {T, W}), b_d(dt, {T, W}), pos_d(DType::i32, {T}), table_d(DType::f32, {T, D});
    upload(a_d, qkv);
    upload(b_d, qkv);
    upload_ints(pos_d, positions);
    ops::rope_forward(head_view(a_d, k.lead, Hq, D), pos_d, p);
    ops::rope_forward(head_view(a_d, k.lead + Hq * D, Hkv, D), pos_d, p);
    ops::rope_table(table_d, pos_d, p);
    ops::rope_apply(head_view(b_d, k.lead, Hq + Hkv, D), table_d, /*inverse=*/false);
    const auto a = download(a_d), b = download(b_d);
    EXPECT_EQ(a, b) << "rope_apply differs from rope_forward";
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < W; ++c) {
        if (c >= k.lead && c < k.lead + (Hq + Hkv) * D) continue;
        ASSERT_EQ(b[t * W + c], qkv[t * W + c]) << "column " << c << " outside Q and K changed";
      }
    }
    // Against the CPU's double reference too, so that both GPU paths are not wrong the same way.
    HostTensor<double> ref = host_tensor({T, W}, qkv);
    HostTensor<int32_t> pos_h = host_ints({T}, positions);
    ops::rope_forward(head_view(ref, k.lead, Hq + Hkv, D), pos_h, p);
    expect_close("rope_apply vs the CPU's rope_forward", dt, b, ref.values);
    ops::rope_backward(head_view(a_d, k.lead, Hq + Hkv, D), pos_d, p);
    ops::rope_apply(head_view(b_d, k.lead, Hq + Hkv, D), table_d, /*inverse=*/true);
    EXPECT_EQ(download(a_d), download(b_d)) << "rope_apply (inverse) differs from rope_backward";
  }
}

TEST_P(GpuOps, ResidualAdd) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 41, C = 211;
  const auto y0 = random_values(T * C, 51, dt), x = random_values(T * C, 52, dt);
  HostTensor<double> y_h = host_tensor({T, C}, y0), x_h = host_tensor({T, C}, x);
  ops::add_inplace(y_h, x_h);

  DeviceTensor y_d(dt, {T, C}), x_d(dt, {T, C});
  upload(y_d, y0);
  upload(x_d, x);
  ops::add_inplace(y_d, x_d);
  expect_close("add_inplace y", dt, download(y_d), y_h.values);

  // A row-strided view: columns [5, 5 + 100) of both.
  DeviceTensor y2_d(dt, {T, C});
  upload(y2_d, y0);
  ops::add_inplace(Tensor(y2_d).narrow(1, 5, 100), Tensor(x_d).narrow(1, 5, 100));
  HostTensor<double> y2_h = host_tensor({T, C}, y0);
  ops::add_inplace(Tensor(y2_h).narrow(1, 5, 100), Tensor(x_h).narrow(1, 5, 100));
  expect_close("add_inplace strided view", dt, download(y2_d), y2_h.values);

  if (dt == DType::bf16) {  // a bf16 branch into an fp32 residual stream
    DeviceTensor y32_d(DType::f32, {T, C});
    upload(y32_d, y0);
    ops::add_inplace(y32_d, x_d);
    expect_close("add_inplace f32 += bf16", DType::f32, download(y32_d), y_h.values);
  }
}

// Several chunks (45 tokens in chunks of 16), ignored labels, grad_scale, dw accumulated.
TEST_P(GpuOps, LmHeadCrossEntropyChunkedAndBadLabel) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 45, C = 67, V = 501;
  const auto x = random_values(T * C, 61, dt);
  const auto w = random_values(V * C, 62, dt, -0.5, 0.5);
  const auto dw0 = random_values(V * C, 63, dt);
  auto labels = random_ints(T, 64, 0, V);
  for (int64_t t : {0, 7, 8, 30, 44}) labels[t] = -100;
  ops::CrossEntropyParams p;
  p.chunk_tokens = 16;
  p.grad_scale = 1.0 / (T - 5);

  HostTensor<double> x_h = host_tensor({T, C}, x), w_h = host_tensor({V, C}, w), dw_h = host_tensor({V, C}, dw0);
  HostTensor<double> loss_h({T}), dx_h({T, C});
  HostTensor<int32_t> lab_h = host_ints({T}, labels);
  ops::lm_head_cross_entropy(loss_h, dx_h, dw_h, x_h, w_h, lab_h, p);

  DeviceTensor x_d(dt, {T, C}), w_d(dt, {V, C}), dw_d(dt, {V, C}), loss_d(DType::f32, {T}), dx_d(dt, {T, C});
  DeviceTensor lab_d(DType::i32, {T});
  upload(x_d, x);
  upload(w_d, w);
  upload(dw_d, dw0);
  upload_ints(lab_d, labels);
  ops::lm_head_cross_entropy(loss_d, dx_d, dw_d, x_d, w_d, lab_d, p);
  expect_close("lm_head_cross_entropy losses (f32)", DType::f32, download(loss_d), loss_h.values);
  expect_close("lm_head_cross_entropy dx", dt, download(dx_d), dx_h.values);
  expect_close("lm_head_cross_entropy dw (+=)", dt, download(dw_d), dw_h.values);

  if (dt == DType::bf16) {  // bf16 activations with an fp32 weight-gradient accumulator: the increment
    DeviceTensor dw32_d(DType::f32, {V, C});
    zero(dw32_d);
    ops::lm_head_cross_entropy(loss_d, dx_d, dw32_d, x_d, w_d, lab_d, p);
    std::vector<double> increment(dw_h.values.size());
    for (size_t i = 0; i < increment.size(); ++i) increment[i] = dw_h.values[i] - dw0[i];
    expect_close("lm_head_cross_entropy dw f32 accumulator", dt, download(dw32_d), increment);
  }

  // Evaluation (no dx): losses only, dw untouched.
  DeviceTensor loss2_d(DType::f32, {T});
  const auto dw_before = download(dw_d);
  ops::lm_head_cross_entropy(loss2_d, Tensor(), Tensor(), x_d, w_d, lab_d, p);
  expect_close("lm_head_cross_entropy eval losses (f32)", DType::f32, download(loss2_d), loss_h.values);
  EXPECT_EQ(download(dw_d), dw_before);

  auto bad = labels;
  bad[9] = static_cast<int32_t>(V);
  upload_ints(lab_d, bad);
  expect_error([&] { ops::lm_head_cross_entropy(loss_d, dx_d, dw_d, x_d, w_d, lab_d, p); }, {"label 501", "position 9"});
  EXPECT_EQ(download(dw_d), dw_before) << "a bad label must be reported before anything is written";
}

// The loss row kernel at real vocabulary sizes: one CTA, a cluster of 2 with idle threads, 8 CTAs of 8
// / 32 / 64 elements a thread (Llama 2's 32,000 and Llama 3's 128,256), and past what 8 CTAs hold
// (262,148) or not a multiple of 4 (4,098), where one block per row reads it twice. With x the
// identity (C = T), logits[t, v] = w[v, t] and dw (from zero) = dlogitsᵀ, so every d(loss)/d(logit)
// is checked, each row on its own scale (the label's entry, -(1 - p)·scale, would hide the rest
// max-normalised), besides the losses and dx. Labels sit at 0, V - 1, at and beside 4,096-element
// slice edges, and one row is ignored; two chunks of 4 rows.
TEST_P(GpuOps, LmHeadCrossEntropyAtVocabularySizes) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 6, C = T;
  std::vector<double> eye(T * C, 0.0);
  for (int64_t t = 0; t < T; ++t) eye[t * C + t] = 1.0;
  for (int64_t V : {256, 4098, 4100, 32000, 128256, 200000, 262148}) {
    SCOPED_TRACE("V = " + std::to_string(V));
    const auto w = random_values(V * C, 90 + V, dt, -3.0, 3.0);
    auto below_v = [&](int64_t i) { return static_cast<int32_t>(std::min<int64_t>(V - 1, i)); };
    const std::vector<int32_t> labels = {0, below_v(V - 1), below_v(4096), -100, below_v(16383), below_v(4095)};
    ops::CrossEntropyParams p;
    p.chunk_tokens = 4;
    p.grad_scale = 0.2;

    HostTensor<double> x_h = host_tensor({T, C}, eye), w_h = host_tensor({V, C}, w), dw_h({V, C});
    HostTensor<double> loss_h({T}), dx_h({T, C});
    HostTensor<int32_t> lab_h = host_ints({T}, labels);
    ops::lm_head_cross_entropy(loss_h, dx_h, dw_h, x_h, w_h, lab_h, p);

    DeviceTensor x_d(dt, {T, C}), w_d(dt, {V, C}), dw_d(dt, {V, C}), loss_d(DType::f32, {T}), dx_d(dt, {T, C});
    DeviceTensor lab_d(DType::i32, {T});
    upload(x_d, eye);
    upload(w_d, w);
    zero(dw_d);
    upload_ints(lab_d, labels);
    ops::lm_head_cross_entropy(loss_d, dx_d, dw_d, x_d, w_d, lab_d, p);
    expect_close("losses (f32)", DType::f32, download(loss_d), loss_h.values);
    expect_close("dx", dt, download(dx_d), dx_h.values);
    const auto dw = download(dw_d);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> got(V), want(V);
      for (int64_t v = 0; v < V; ++v) {
        got[v] = dw[v * C + t];
        want[v] = dw_h.values[v * C + t];
      }
      if (labels[t] < 0) {
        EXPECT_EQ(*std::max_element(got.begin(), got.end()), 0.0) << "ignored row " << t;
        EXPECT_EQ(*std::min_element(got.begin(), got.end()), 0.0) << "ignored row " << t;
        continue;
      }
      expect_close("d(loss)/d(logit) row " + std::to_string(t), dt, got, want);
      got.erase(got.begin() + labels[t]);
      want.erase(want.begin() + labels[t]);
      expect_close("d(loss)/d(logit) row " + std::to_string(t) + " without its label", dt, got, want);
    }
  }
}

// The gradient factor read on the device (CrossEntropyParams::grad_scale_from, written by ops::fill):
// the same bits as the factor given by value; and a captured call, replayed after the factor was
// written again, scales by the new factor (what lets a training step with another label count replay
// its CUDA graph).
TEST_P(GpuOps, LmHeadCrossEntropyReadsItsFactorOnTheDeviceWhenItRuns) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 45, C = 67, V = 501;
  DeviceTensor x_d(dt, {T, C}), w_d(dt, {V, C}), dw_d(dt, {V, C}), loss_d(DType::f32, {T}), dx_d(dt, {T, C});
  DeviceTensor lab_d(DType::i32, {T}), factor(DType::f32, {1});
  upload(x_d, random_values(T * C, 71, dt));
  upload(w_d, random_values(V * C, 72, dt, -0.5, 0.5));
  auto labels = random_ints(T, 73, 0, V);
  for (int64_t t : {2, 9, 40}) labels[t] = -100;
  upload_ints(lab_d, labels);
  ops::CrossEntropyParams by_value;
  by_value.chunk_tokens = 16;
  by_value.labels_checked = true;  // no host read: capturable
  by_value.dw_write = ops::GradWrite::overwrite;
  ops::CrossEntropyParams on_device = by_value;
  on_device.grad_scale = 99.0;  // not used
  on_device.grad_scale_from = factor;
  auto grads = [&] { return std::pair{download_bytes(dx_d), download_bytes(dw_d)}; };
  auto run = [&](const ops::CrossEntropyParams& p) { ops::lm_head_cross_entropy(loss_d, dx_d, dw_d, x_d, w_d, lab_d, p); };

  by_value.grad_scale = 1.0 / 42.0;
  run(by_value);
  const auto at_42 = grads();
  by_value.grad_scale = 1.0 / 30.0;
  run(by_value);
  const auto at_30 = grads();
  ASSERT_NE(at_42, at_30);  // the factor shows in both gradients

  ops::fill(factor, 1.0 / 42.0);
  run(on_device);
  EXPECT_EQ(grads(), at_42) << "the factor read on the device scales differently from the value";

  const CudaGraph graph = CudaGraph::capture([&] { run(on_device); });
  ops::fill(factor, 1.0 / 30.0);
  zero(dx_d);
  graph.launch();
  EXPECT_EQ(grads(), at_30) << "the replayed call did not scale by the factor written after its capture";
  ops::fill(factor, 1.0 / 42.0);
  graph.launch();
  EXPECT_EQ(grads(), at_42);

  DeviceTensor f64_factor(DType::f64, {1});
  on_device.grad_scale_from = f64_factor;
  expect_error([&] { run(on_device); }, {"grad_scale_from", "f64"});
}

// GradWrite::overwrite (the first write after LlamaModel::discard_grads): the weight gradients of the
// GEMM (cuBLASLt's beta = 0, bf16 and f32 dw), the norm and the chunked LM head (its first chunk
// overwrites, the others add) are the CPU's from zero, whatever dw held: NaN here.
TEST_P(GpuOps, OverwrittenWeightGradientsIgnoreWhatTheyHeld) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 45, C = 67, N = 29, V = 120;
  const auto x = random_values(T * C, 81, dt), dy = random_values(T * N, 82, dt), w = random_values(N * C, 83, dt);
  const std::vector<double> nan_nc(N * C, std::nan("")), nan_c(C, std::nan("")), nan_vc(V * C, std::nan(""));
  DeviceTensor x_d(dt, {T, C}), dy_d(dt, {T, N}), w_d(dt, {N, C});
  upload(x_d, x);
  upload(dy_d, dy);
  upload(w_d, w);

  HostTensor<double> x_h = host_tensor({T, C}, x), dy_h = host_tensor({T, N}, dy), w_h = host_tensor({N, C}, w);
  HostTensor<double> dw_h({N, C});
  ops::linear_backward(Tensor(), dw_h, dy_h, x_h, w_h);
  for (DType gt : {dt, DType::f32}) {
    DeviceTensor dw_d(gt, {N, C});
    upload(dw_d, nan_nc);
    ops::linear_backward(Tensor(), dw_d, dy_d, x_d, w_d, ops::GradWrite::overwrite);
    expect_close(std::string("linear_backward dw (=) into ") + name_of(gt), dt, download(dw_d), dw_h.values);
  }

  const auto nw = random_values(C, 84, dt, 0.5, 1.5), ndy = random_values(T * C, 85, dt);
  HostTensor<double> nw_h = host_tensor({C}, nw), ndy_h = host_tensor({T, C}, ndy), ny_h({T, C}), rstd_h({T});
  HostTensor<double> ndx_h({T, C}), ndw_h({C});
  ops::rmsnorm_forward(ny_h, rstd_h, x_h, nw_h, 1e-5);
  ops::rmsnorm_backward(ndx_h, ndw_h, ndy_h, x_h, nw_h, rstd_h);
  DeviceTensor nw_d(dt, {C}), ndy_d(dt, {T, C}), ny_d(dt, {T, C}), rstd_d(DType::f32, {T}), ndx_d(dt, {T, C});
  DeviceTensor ndw_d(dt, {C});
  upload(nw_d, nw);
  upload(ndy_d, ndy);
  zero(ndx_d);
  upload(ndw_d, nan_c);
  ops::rmsnorm_forward(ny_d, rstd_d, x_d, nw_d, 1e-5);
  ops::rmsnorm_backward(ndx_d, ndw_d, ndy_d, x_d, nw_d, rstd_d, ops::GradWrite::overwrite);
  expect_close("rmsnorm_backward dw (=)", dt, download(ndw_d), ndw_h.values);

  const auto lm = random_values(V * C, 86, dt, -0.5, 0.5);
  const auto labels = random_ints(T, 87, 0, V);
  ops::CrossEntropyParams p;
  p.chunk_tokens = 16;
  p.grad_scale = 1.0 / T;
  HostTensor<double> lm_h = host_tensor({V, C}, lm), dlm_h({V, C}), loss_h({T}), dxl_h({T, C});
  ops::lm_head_cross_entropy(loss_h, dxl_h, dlm_h, x_h, lm_h, host_ints({T}, labels), p);
  DeviceTensor lm_d(dt, {V, C}), dlm_d(dt, {V, C}), loss_d(DType::f32, {T}), dxl_d(dt, {T, C}), lab_d(DType::i32, {T});
  upload(lm_d, lm);
  upload(dlm_d, nan_vc);
  upload_ints(lab_d, labels);
  p.dw_write = ops::GradWrite::overwrite;
  ops::lm_head_cross_entropy(loss_d, dxl_d, dlm_d, x_d, lm_d, lab_d, p);
  expect_close("lm_head_cross_entropy dw (= first chunk, += the rest)", dt, download(dlm_d), dlm_h.values);
}

// Every backward that reduces (embedding rows, rmsnorm dw, GEMMs, the chunked LM head) gives the same
// bits when run twice from the same state.
TEST_P(GpuOps, BackwardsAreBitwiseDeterministic) {
  LT_REQUIRE_GPU();
  const DType dt = GetParam();
  const int64_t T = 257, C = 96, V = 1000;
  const auto x = random_values(T * C, 71, dt), dy = random_values(T * C, 72, dt);
  const auto w = random_values(C, 73, dt, 0.5, 1.5), lm = random_values(V * C, 74, dt, -0.5, 0.5);
  const auto tokens = random_ints(T, 75, 0, 13);  // heavy repetition
  const auto labels = random_ints(T, 76, 0, V);

  DeviceTensor x_d(dt, {T, C}), dy_d(dt, {T, C}), w_d(dt, {C}), lm_d(dt, {V, C}), rstd_d(DType::f32, {T});
  DeviceTensor y_d(dt, {T, C}), tok_d(DType::i32, {T}), lab_d(DType::i32, {T}), loss_d(DType::f32, {T});
  upload(x_d, x);
  upload(dy_d, dy);
  upload(w_d, w);
  upload(lm_d, lm);
  upload_ints(tok_d, tokens);
  upload_ints(lab_d, labels);
  ops::rmsnorm_forward(y_d, rstd_d, x_d, w_d, 1e-5);

  auto run = [&]() {
    DeviceTensor dx_d(dt, {T, C}), dw_d(dt, {C}), dtab_d(dt, {V, C}), dlm_d(dt, {V, C}), dxl_d(dt, {T, C});
    DeviceTensor dwl_d(dt, {C, C}), dxx_d(dt, {T, C}), wl_d(dt, {C, C});
    for (DeviceTensor* t : {&dx_d, &dw_d, &dtab_d, &dlm_d, &dxl_d, &dwl_d, &dxx_d}) zero(*t);
    upload(wl_d, random_values(C * C, 77, dt));
    ops::rmsnorm_backward(dx_d, dw_d, dy_d, x_d, w_d, rstd_d);
    ops::embedding_backward(dtab_d, tok_d, dy_d);
    ops::CrossEntropyParams ce;
    ce.grad_scale = 0.01;
    ce.chunk_tokens = 64;
    ops::lm_head_cross_entropy(loss_d, dxl_d, dlm_d, x_d, lm_d, lab_d, ce);
    ops::linear_backward(dxx_d, dwl_d, dy_d, x_d, wl_d);
    std::vector<std::vector<unsigned char>> out;
    for (DeviceTensor* t : {&dx_d, &dw_d, &dtab_d, &dlm_d, &dxl_d, &dwl_d, &dxx_d, &loss_d})
      out.push_back(download_bytes(*t));
    return out;
  };
  const auto first = run(), second = run();
  const char* names[] = {"rmsnorm dx", "rmsnorm dw", "embedding d_table", "lm head dw", "lm head dx",
                         "linear dw", "linear dx", "losses"};
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(first[i] == second[i]) << names[i] << " differs between runs";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuOps, ::testing::Values(DType::bf16, DType::f32),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(name_of(info.param)); });

}  // namespace
}  // namespace longtrain::test
