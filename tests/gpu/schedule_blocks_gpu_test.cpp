// The distributed schedules' block calls run in sequence on one GPU: what each rank of a P = 2 zigzag
// ring computes (its local query rows against every rank's key rows, in ring order, merged into one
// running partial), without the communication, against the whole sequence in one call (P = 1) and
// the double-precision CPU reference. It shows what the partials' precision costs:
// - our Hopper kernel merging each block into an f32 running partial in its epilogue
//   (attention_block_forward_merge's fused path) must keep the P = 2 error at P = 1's;
// - cuDNN writing each block's O in bf16 and lse_merge adding it (the two-step path the schedules
//   take with cuDNN) is printed beside it: that extra rounding per block is why two GPUs' error
//   exceeded one GPU's.
// The same for the backward: each rank's block calls (its query rows against every rank's keys, in
// ring order) accumulate dQ into the rank's f32 accumulator and dK/dV into f32 accumulators of the
// keys' home rank, as the ring's travelling dK/dV partials do:
// - our Hopper backward (kernel policy hopper) adds each block's f32 sums straight into the f32
//   accumulators: the P = 2 error of dq/dk/dv against the f64 reference must stay at P = 1's;
// - cuDNN (policy cudnn) rounds each block's gradients to bf16 before they are added: printed beside.
// Skips without an sm_90 GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention/distributed/block_plan.h"
#include "attention/local_attention.h"
#include "gpu_test_util.h"
#include "parallel/layout.h"

#ifdef LONGTRAIN_HAS_CUDA
#include "attention/cuda/cudnn_sdpa.h"
#include "attention/cuda/hopper_attention.h"
#include "runtime/cuda_check.h"
#endif

namespace longtrain::test {
namespace {

#ifdef LONGTRAIN_HAS_CUDA

using attn::BlockMask;

constexpr int kRanks = 2;

// Rows `rows` (global token indices) of a host [T, H, D] array, in that order.
std::vector<double> take_rows(const std::vector<double>& all, const std::vector<int64_t>& rows, int64_t width) {
  std::vector<double> out;
  out.reserve(rows.size() * static_cast<size_t>(width));
  for (int64_t r : rows)
    out.insert(out.end(), all.begin() + r * width, all.begin() + (r + 1) * width);
  return out;
}

// Writes `local` (rows in `rows` order) back into a global [T, width] array.
void put_rows(std::vector<double>& all, const std::vector<double>& local, const std::vector<int64_t>& rows,
              int64_t width) {
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy(local.begin() + static_cast<int64_t>(i) * width, local.begin() + static_cast<int64_t>(i + 1) * width,
              all.begin() + rows[i] * width);
}

attn::cudnn_sdpa::View view_of(const Tensor& t) {
  return {t.data, t.shape[0], t.shape[1], t.shape[2], t.stride[0], t.stride[1]};
}
attn::cudnn_sdpa::StatsView stats_of(const Tensor& t) {
  return {static_cast<float*>(t.data), t.shape[0], t.shape[1], t.stride[0], t.stride[1]};
}

// How each rank's partial is formed.
enum class Blocks {
  hopper_f32_merge,  // hopper::attention_block_forward_merge: the block merged into f32 in the kernel
  cudnn_bf16_then_merge,  // cuDNN writes the block's O in bf16, lse_merge adds it to the f32 partial
};

struct Problem {
  int64_t S, Hq, Hkv, D;
  double scale;
  std::vector<double> q, k, v;  // bf16-rounded, [S, H, D]
};

// The P = 2 zigzag forward of `p`, every rank's block calls in ring order on this one GPU; the
// global O (f32 partials, as the schedule's accumulator holds them) and LSE.
void two_ranks_in_sequence(const Problem& p, Blocks blocks, std::vector<double>& o_out, std::vector<double>& lse_out) {
  const int64_t T = p.S / kRanks, wq = p.Hq * p.D, wk = p.Hkv * p.D;
  o_out.assign(static_cast<size_t>(p.S * wq), std::numeric_limits<double>::quiet_NaN());
  lse_out.assign(static_cast<size_t>(p.S * p.Hq), std::numeric_limits<double>::quiet_NaN());
  std::vector<std::vector<int64_t>> rows(kRanks);
  for (int r = 0; r < kRanks; ++r) rows[r] = layout_global_indices(SeqLayout::zigzag, p.S, kRanks, r);
  for (int r = 0; r < kRanks; ++r) {
    DeviceTensor q(DType::bf16, {T, p.Hq, p.D}), o_acc(DType::f32, {T, p.Hq, p.D}), lse_acc(DType::f32, {T, p.Hq});
    DeviceTensor o_blk(DType::bf16, {T, p.Hq, p.D}), lse_blk(DType::f32, {T, p.Hq});
    upload(q, take_rows(p.q, rows[r], wq));
    upload(o_acc, std::vector<double>(static_cast<size_t>(T * wq), 0.0));
    upload(lse_acc, std::vector<double>(static_cast<size_t>(T * p.Hq), -std::numeric_limits<double>::infinity()));
    for (int step = 0; step < kRanks; ++step) {
      const int src = (r - step + kRanks) % kRanks;  // the ring brings rank r - step's keys at step `step`
      DeviceTensor k(DType::bf16, {T, p.Hkv, p.D}), v(DType::bf16, {T, p.Hkv, p.D});
      upload(k, take_rows(p.k, rows[src], wk));
      upload(v, take_rows(p.v, rows[src], wk));
      for (const attn::BlockCall& c : attn::plan_block_calls(SeqLayout::zigzag, kRanks, T, r, src, true)) {
        auto qr = [&](const Tensor& t) { return t.narrow(0, c.q_start, c.q_len); };
        auto kr = [&](const Tensor& t) { return t.narrow(0, c.k_start, c.k_len); };
        if (blocks == Blocks::hopper_f32_merge) {
          attn::hopper::attention_block_forward_merge(qr(o_acc), qr(lse_acc), qr(q), kr(k), kr(v), c.mask, p.scale);
        } else {
          attn::cudnn_sdpa::forward(view_of(qr(o_blk)), stats_of(qr(lse_blk)), view_of(qr(q)), view_of(kr(k)),
                                    view_of(kr(v)), c.mask == BlockMask::causal_diagonal,
                                    static_cast<float>(p.scale));
          attn::lse_merge(qr(o_acc), qr(lse_acc), qr(o_blk), qr(lse_blk));
        }
      }
    }
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    put_rows(o_out, download(o_acc), rows[r], wq);
    put_rows(lse_out, download(lse_acc), rows[r], p.Hq);
  }
}

struct Errors {
  double max_rel, norm_rel;
};
Errors errors(const std::vector<double>& got, const std::vector<double>& ref) {
  return {relative_error(got, ref), norm_relative_error(got, ref)};
}

TEST(ScheduleBlocksInSequence, HopperF32PartialsKeepTwoRanksErrorAtOneRanks) {
  LT_REQUIRE_GPU();
  if (!attn::hopper::supported(64, 1, 1)) GTEST_SKIP() << "the hopper attention kernel needs an sm_90 GPU";
  // Chunks of 300 tokens (not a multiple of the 128-row tiles); GQA. Inputs in [-2, 2) give peaked
  // softmax rows, where a block's O differs most from the whole's.
  for (int64_t D : {64, 128}) {
    Problem p{2 * kRanks * 300, 8, 2, D, 1.0 / std::sqrt(static_cast<double>(D)), {}, {}, {}};
    SCOPED_TRACE("D = " + std::to_string(D));
    p.q = random_values(static_cast<size_t>(p.S * p.Hq * D), 801 + D, DType::bf16, -2.0, 2.0);
    p.k = random_values(static_cast<size_t>(p.S * p.Hkv * D), 802 + D, DType::bf16, -2.0, 2.0);
    p.v = random_values(static_cast<size_t>(p.S * p.Hkv * D), 803 + D, DType::bf16);

    HostTensor<double> q_h = host_tensor({p.S, p.Hq, D}, p.q), k_h = host_tensor({p.S, p.Hkv, D}, p.k);
    HostTensor<double> v_h = host_tensor({p.S, p.Hkv, D}, p.v), o_ref({p.S, p.Hq, D}), lse_ref({p.S, p.Hq});
    attn::attention_block_forward(o_ref, lse_ref, q_h, k_h, v_h, BlockMask::causal_diagonal, p.scale);

    // P = 1: the whole sequence in one call, f32 O.
    DeviceTensor q(DType::bf16, {p.S, p.Hq, D}), k(DType::bf16, {p.S, p.Hkv, D}), v(DType::bf16, {p.S, p.Hkv, D});
    upload(q, p.q);
    upload(k, p.k);
    upload(v, p.v);
    DeviceTensor o1(DType::f32, {p.S, p.Hq, D}), lse1(DType::f32, {p.S, p.Hq});
    attn::hopper::forward({o1.view.data, true, p.S, p.Hq, D, p.Hq * D, D}, stats_of(lse1), view_of(q), view_of(k),
                          view_of(v), true, static_cast<float>(p.scale), false);
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    const Errors one = errors(download(o1), o_ref.values);

    std::vector<double> o2, lse2, o2_cudnn, lse2_cudnn;
    two_ranks_in_sequence(p, Blocks::hopper_f32_merge, o2, lse2);
    two_ranks_in_sequence(p, Blocks::cudnn_bf16_then_merge, o2_cudnn, lse2_cudnn);
    const Errors two = errors(o2, o_ref.values), two_cudnn = errors(o2_cudnn, o_ref.values);
    const double lse_err = relative_error(lse2, lse_ref.values);
    std::printf("  D=%lld O error vs f64, max|err|/max|ref| (norm-wise): P=1 hopper %.3e (%.3e); P=2 hopper f32 "
                "partials %.3e (%.3e); P=2 cuDNN bf16 blocks + lse_merge %.3e (%.3e); P=2 hopper LSE %.3e\n",
                static_cast<long long>(D), one.max_rel, one.norm_rel, two.max_rel, two.norm_rel, two_cudnn.max_rel,
                two_cudnn.norm_rel, lse_err);
    // Every element was written and is finite (relative_error is NaN-propagating, but say it plainly).
    for (const std::vector<double>* t : {&o2, &lse2})
      for (double x : *t) ASSERT_TRUE(std::isfinite(x)) << "a P = 2 output element is not finite";
    // At or below P = 1: the merges' f32 arithmetic may move the largest error by a few f32 ulps of
    // O, never by a bf16 rounding (2^-9 relative, which is what the cuDNN path adds).
    EXPECT_LE(two.max_rel, one.max_rel * 1.02 + 1e-6) << "P = 2 with f32 partials exceeds P = 1's error";
    EXPECT_LE(two.norm_rel, one.norm_rel * 1.02 + 1e-7) << "P = 2 with f32 partials exceeds P = 1's error";
    EXPECT_LE(lse_err, gpu_tolerance(DType::f32));
  }
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

// The P = 2 zigzag backward, every rank's block calls in ring order on this one GPU, under `policy`:
// the final O and LSE of the whole sequence (o_all f32 [S, Hq, D], lse_all [S, Hq]) give each rank's
// delta once (attention_delta), then every block call accumulates into f32 accumulators: dQ of the
// rank's rows, dK/dV of the keys' home rank.
Grads two_ranks_backward_in_sequence(const Problem& p, const std::vector<double>& d_o, const std::vector<double>& o_all,
                                     const std::vector<double>& lse_all, attn::KernelPolicy policy) {
  PolicyScope scope(policy);
  const int64_t T = p.S / kRanks, wq = p.Hq * p.D, wk = p.Hkv * p.D;
  std::vector<std::vector<int64_t>> rows(kRanks);
  for (int r = 0; r < kRanks; ++r) rows[r] = layout_global_indices(SeqLayout::zigzag, p.S, kRanks, r);
  std::vector<std::unique_ptr<DeviceTensor>> k, v, dk, dv;  // per home rank
  for (int r = 0; r < kRanks; ++r) {
    k.push_back(std::make_unique<DeviceTensor>(DType::bf16, std::initializer_list<int64_t>{T, p.Hkv, p.D}));
    v.push_back(std::make_unique<DeviceTensor>(DType::bf16, std::initializer_list<int64_t>{T, p.Hkv, p.D}));
    dk.push_back(std::make_unique<DeviceTensor>(DType::f32, std::initializer_list<int64_t>{T, p.Hkv, p.D}));
    dv.push_back(std::make_unique<DeviceTensor>(DType::f32, std::initializer_list<int64_t>{T, p.Hkv, p.D}));
    upload(*k[r], take_rows(p.k, rows[r], wk));
    upload(*v[r], take_rows(p.v, rows[r], wk));
    upload(*dk[r], std::vector<double>(static_cast<size_t>(T * wk), 0.0));
    upload(*dv[r], std::vector<double>(static_cast<size_t>(T * wk), 0.0));
  }
  Grads out;
  out.dq.assign(static_cast<size_t>(p.S * wq), std::numeric_limits<double>::quiet_NaN());
  out.dk.assign(static_cast<size_t>(p.S * wk), std::numeric_limits<double>::quiet_NaN());
  out.dv.assign(static_cast<size_t>(p.S * wk), std::numeric_limits<double>::quiet_NaN());
  for (int r = 0; r < kRanks; ++r) {
    DeviceTensor q(DType::bf16, {T, p.Hq, p.D}), g(DType::bf16, {T, p.Hq, p.D}), o(DType::f32, {T, p.Hq, p.D});
    DeviceTensor lse(DType::f32, {T, p.Hq}), delta(DType::f32, {T, p.Hq}), dq(DType::f32, {T, p.Hq, p.D});
    upload(q, take_rows(p.q, rows[r], wq));
    upload(g, take_rows(d_o, rows[r], wq));
    upload(o, take_rows(o_all, rows[r], wq));
    upload(lse, take_rows(lse_all, rows[r], p.Hq));
    upload(dq, std::vector<double>(static_cast<size_t>(T * wq), 0.0));
    attn::attention_delta(delta, o, g);
    for (int step = 0; step < kRanks; ++step) {
      const int src = (r - step + kRanks) % kRanks;
      for (const attn::BlockCall& c : attn::plan_block_calls(SeqLayout::zigzag, kRanks, T, r, src, true)) {
        auto qr = [&](const Tensor& t) { return t.narrow(0, c.q_start, c.q_len); };
        auto kr = [&](const Tensor& t) { return t.narrow(0, c.k_start, c.k_len); };
        attn::attention_block_backward(qr(dq), kr(*dk[src]), kr(*dv[src]), qr(q), kr(*k[src]), kr(*v[src]), qr(g),
                                       qr(lse), Tensor{}, qr(delta), c.mask, p.scale, attn::GradMode::accumulate);
      }
    }
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    put_rows(out.dq, download(dq), rows[r], wq);
  }
  for (int r = 0; r < kRanks; ++r) {
    put_rows(out.dk, download(*dk[r]), rows[r], wk);
    put_rows(out.dv, download(*dv[r]), rows[r], wk);
  }
  return out;
}

TEST(ScheduleBlocksInSequence, HopperBackwardF32PartialsKeepTwoRanksErrorAtOneRanks) {
  LT_REQUIRE_GPU();
  if (!attn::hopper::supported(64, 1, 1)) GTEST_SKIP() << "the hopper attention kernel needs an sm_90 GPU";
  for (int64_t D : {64, 128}) {
    Problem p{2 * kRanks * 300, 8, 2, D, 1.0 / std::sqrt(static_cast<double>(D)), {}, {}, {}};
    SCOPED_TRACE("D = " + std::to_string(D));
    p.q = random_values(static_cast<size_t>(p.S * p.Hq * D), 811 + D, DType::bf16, -2.0, 2.0);
    p.k = random_values(static_cast<size_t>(p.S * p.Hkv * D), 812 + D, DType::bf16, -2.0, 2.0);
    p.v = random_values(static_cast<size_t>(p.S * p.Hkv * D), 813 + D, DType::bf16);
    const auto d_o = random_values(static_cast<size_t>(p.S * p.Hq * D), 814 + D, DType::bf16);

    // The f64 reference: forward, then the backward from its own O and LSE.
    HostTensor<double> q_h = host_tensor({p.S, p.Hq, D}, p.q), k_h = host_tensor({p.S, p.Hkv, D}, p.k);
    HostTensor<double> v_h = host_tensor({p.S, p.Hkv, D}, p.v), do_h = host_tensor({p.S, p.Hq, D}, d_o);
    HostTensor<double> o_ref({p.S, p.Hq, D}), lse_ref({p.S, p.Hq});
    attn::attention_block_forward(o_ref, lse_ref, q_h, k_h, v_h, BlockMask::causal_diagonal, p.scale);
    HostTensor<double> dq_ref({p.S, p.Hq, D}), dk_ref({p.S, p.Hkv, D}), dv_ref({p.S, p.Hkv, D});
    attn::attention_block_backward(dq_ref, dk_ref, dv_ref, q_h, k_h, v_h, do_h, lse_ref, o_ref, Tensor{},
                                   BlockMask::causal_diagonal, p.scale, attn::GradMode::overwrite);

    // P = 1 on the GPU: our forward (f32 O, as the schedules' accumulator holds it), then our backward of
    // the whole sequence from that O into f32 dq/dk/dv. Both P = 1 and P = 2 use this O and LSE.
    DeviceTensor q(DType::bf16, {p.S, p.Hq, D}), k(DType::bf16, {p.S, p.Hkv, D}), v(DType::bf16, {p.S, p.Hkv, D});
    DeviceTensor g(DType::bf16, {p.S, p.Hq, D});
    upload(q, p.q);
    upload(k, p.k);
    upload(v, p.v);
    upload(g, d_o);
    DeviceTensor o1(DType::f32, {p.S, p.Hq, D}), lse1(DType::f32, {p.S, p.Hq});
    attn::hopper::forward({o1.view.data, true, p.S, p.Hq, D, p.Hq * D, D}, stats_of(lse1), view_of(q), view_of(k),
                          view_of(v), true, static_cast<float>(p.scale), false);
    DeviceTensor dq1(DType::f32, {p.S, p.Hq, D}), dk1(DType::f32, {p.S, p.Hkv, D}), dv1(DType::f32, {p.S, p.Hkv, D});
    {
      PolicyScope hopper(attn::KernelPolicy::hopper);
      attn::attention_block_backward(dq1, dk1, dv1, q, k, v, g, lse1, o1, Tensor{}, BlockMask::causal_diagonal,
                                     p.scale, attn::GradMode::overwrite);
      LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    }
    const std::vector<double> o_all = download(o1), lse_all = download(lse1);
    const Grads one{download(dq1), download(dk1), download(dv1)};
    const Grads two = two_ranks_backward_in_sequence(p, d_o, o_all, lse_all, attn::KernelPolicy::hopper);
    const Grads two_cudnn = two_ranks_backward_in_sequence(p, d_o, o_all, lse_all, attn::KernelPolicy::cudnn);

    const char* names[3] = {"dQ", "dK", "dV"};
    const std::vector<double>* refs[3] = {&dq_ref.values, &dk_ref.values, &dv_ref.values};
    for (int i = 0; i < 3; ++i) {
      auto pick = [&](const Grads& gr) -> const std::vector<double>& { return i == 0 ? gr.dq : i == 1 ? gr.dk : gr.dv; };
      const Errors e1 = errors(pick(one), *refs[i]), e2 = errors(pick(two), *refs[i]),
                   e2c = errors(pick(two_cudnn), *refs[i]);
      std::printf("  D=%lld %s error vs f64, max|err|/max|ref| (norm-wise): P=1 hopper %.3e (%.3e); P=2 hopper f32 "
                  "partials %.3e (%.3e); P=2 cuDNN bf16 blocks %.3e (%.3e)\n",
                  static_cast<long long>(D), names[i], e1.max_rel, e1.norm_rel, e2.max_rel, e2.norm_rel, e2c.max_rel,
                  e2c.norm_rel);
      for (double x : pick(two)) ASSERT_TRUE(std::isfinite(x)) << "a P = 2 " << names[i] << " element is not finite";
      // The blocks' f32 sums are the whole's, reassociated: a few f32 ulps, never a bf16 rounding.
      EXPECT_LE(e2.max_rel, e1.max_rel * 1.02 + 1e-6) << names[i] << ": P = 2 with f32 partials exceeds P = 1's error";
      EXPECT_LE(e2.norm_rel, e1.norm_rel * 1.02 + 1e-7)
          << names[i] << ": P = 2 with f32 partials exceeds P = 1's error";
      EXPECT_LT(e1.max_rel, gpu_tolerance(DType::bf16)) << names[i];
    }
  }
}

#else
TEST(ScheduleBlocksInSequence, HopperF32PartialsKeepTwoRanksErrorAtOneRanks) {
  GTEST_SKIP() << "longtrain was built without CUDA";
}
TEST(ScheduleBlocksInSequence, HopperBackwardF32PartialsKeepTwoRanksErrorAtOneRanks) {
  GTEST_SKIP() << "longtrain was built without CUDA";
}
#endif

}  // namespace
}  // namespace longtrain::test
