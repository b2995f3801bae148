// attention_bench: single-GPU causal attention forward and forward+backward through the path the
// model takes (LocalSequenceAttention: Q/K/V read in place from one fused QKV buffer, O in bf16, and
// a backward that hands cuDNN the final O and writes dQ/dK/dV in place into the fused dQKV buffer),
// at the shapes of bench/anchors/attn_anchor.py (batch 1, 32 query heads, 32 or 8 KV heads, head
// dim 128, bf16). Two more rows show what the contract's other paths cost: the block backward from
// delta accumulating into f32 dQ/dK/dV (what a distributed schedule's visiting query rows pay:
// attention_delta, the O stand-in, scratch and three accumulation passes), and the bare cuDNN graphs
// (cudnn_sdpa::forward/backward). Given the anchor's JSON from the same machine and run, it writes
// them side by side with ratios. --layouts adds the bare cuDNN graphs on separate buffers in other
// memory layouts (bshd: [S, H, D] per tensor; bhsd: head-major [H, S, D], as the anchor's tensors are),
// to show what the fused token-major layout costs cuDNN. --kernel picks what is timed: cudnn (the
// default: everything above), hopper (our sm_90a kernels on the same fused buffers: the forward,
// attention/cuda/hopper_attention.cu, in its default variant: overlap unless
// LONGTRAIN_HOPPER_FWD_VARIANT says otherwise; and forward + backward, the backward
// attention/cuda/hopper_attention_bwd.cu: delta from O by attention_delta, then dQ/dK/dV overwritten
// in the fused bf16 dQKV buffer, as the model's one-rank backward runs it under the hopper policy),
// hopper-<variant> (hopper-overlap, hopper-baseline: hopper_attention.h, FwdVariant), or a list of them, e.g. cudnn,hopper-overlap,hopper-baseline: each
// hopper forward variant is timed (its forward, and with our backward), our backward alone once per
// shape (delta + backward, after our forward); with cudnn in the list, each forward variant gets its
// speed ratios to cuDNN and the largest |O_hopper - O_cudnn| and |LSE_hopper - LSE_cudnn| of the two
// forwards, and our backward the largest dQ/dK/dV differences from cuDNN's backward (both from the
// same O and LSE, our forward's) and its speed ratio to cuDNN's backward (cuDNN-only fwd+bwd minus
// fwd, the same calls). Given an anchor, the hopper rows get their fwd and fwd+bwd ratios to torch's
// rows too.
//
//   attention_bench [--lengths 4096,16384,65536] [--anchor attn_anchor.json] [--out result.json]
//                   [--commit SHA] [--warmup 3] [--reps 10] [--rounds 2] [--kv-heads 32,8] [--head-dim 128]
//                   [--layouts bshd,bhsd] [--kernel cudnn,hopper,hopper-overlap,...] [--lse-layout token|head]
//
// --lse-layout: the LSE of the direct kernel calls (the hopper and cuDNN-only rows), token-major (the
// default) or head-major, as the model stores it for the "ours" rows.
//
// Timing as the anchor does it: CUDA events around each call, the median of the timed runs; and the
// rows of a shape interleaved: --rounds times each row once per round, the rounds in turn in the
// listed order and reversed, and reports the mean of its rounds' medians (each round's in the row).
// A row's place in the run matters on a power-capped GPU: at --reps 5 a forward timed first after the
// backward's timing ran up to 12% slower at 64K than the same kernel timed again
// (bench/results/attention-hopper-fwd-lazy-rescale-2026-12-05.json, position_probe), and "ours" timed
// after its trials ran 8% slower than cuDNN's rows timed before them
// (bench/results/attention-trial-warm-2026-12-07.json). All trials run before any row is timed.
// The anchor is another process; scripts/device/run-attention-vs-anchor.sh runs it before and after
// this one and compares with their mean.
// FLOPs count the causal half: fwd = 4·Hq·S²·D / 2, fwd+bwd = 3.5 × fwd.
//
// "ours" runs under the kernel choice a training run makes by default (bench_common.h:
// use_training_kernel_policies): auto, each call shape's trial run out before the timing and its
// choices recorded in the row; LONGTRAIN_ATTENTION_KERNEL=cudnn (or hopper) times that policy instead.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "attention/cuda/cudnn_sdpa.h"
#include "attention/cuda/hopper_attention.h"
#include "attention/cuda/kernel_choice.h"
#include "attention/local_attention.h"
#include "attention/sequence_attention.h"
#include "bench/bench_common.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

struct Options : RunRecord {
  std::vector<int64_t> lengths{4096, 16384, 65536};
  std::vector<int64_t> kv_heads{32, 8};
  int64_t head_dim = 128;
  std::vector<std::string> layouts;
  std::vector<std::string> kernels{"cudnn"};
  bool head_major_lse = false;  // --lse-layout head: the direct kernel calls' LSE as the model stores it
  int warmup = 3, reps = 10, rounds = 2;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for_each_flag(argc, argv, "attention_bench", [&](const std::string& a, const FlagValue& next) {
    if (record_flag(a, next, o)) return true;
    if (a == "--lengths") {
      o.lengths = next.integers();
    } else if (a == "--kv-heads") {
      o.kv_heads = next.integers();
    } else if (a == "--head-dim") {
      o.head_dim = next.integer();
    } else if (a == "--layouts") {
      o.layouts = split_list(next());
      for (const std::string& l : o.layouts)
        LT_CHECK(l == "bshd" || l == "bhsd" || l == "fused+hstats" || l == "bhsd+hstats",
                 "attention_bench: --layouts takes bshd, bhsd, bhsd+hstats and fused+hstats, got '{}'", l);
    } else if (a == "--kernel") {
      o.kernels = split_list(next());
      LT_CHECK(!o.kernels.empty(),
               "attention_bench: --kernel takes a list of cudnn, hopper, hopper-<variant>");
      for (const std::string& k : o.kernels)
        LT_CHECK(k == "cudnn" || k == "hopper" || k.rfind("hopper-", 0) == 0,
                 "attention_bench: --kernel takes a list of cudnn, hopper, hopper-<variant>, got '{}'",
                 k);
    } else if (a == "--lse-layout") {
      const std::string layout = next();
      LT_CHECK(layout == "token" || layout == "head", "attention_bench: --lse-layout takes token or head, got '{}'",
               layout);
      o.head_major_lse = layout == "head";
    } else if (a == "--warmup") {
      o.warmup = next.int32();
    } else if (a == "--reps") {
      o.reps = next.int32();
    } else if (a == "--rounds") {
      o.rounds = next.int32();
      LT_CHECK(o.rounds >= 1, "attention_bench: --rounds must be at least 1, got {}", o.rounds);
    } else {
      return false;
    }
    return true;
  });
  return o;
}

// Rows timed in rounds, interleaved (the file's header): add each row's callable, then run().
class InterleavedTimer {
 public:
  InterleavedTimer(int warmup, int reps, int rounds) : warmup_(warmup), reps_(reps), rounds_(rounds) {}
  void add(const std::string& name, std::function<void()> fn) { rows_.push_back({name, std::move(fn), {}}); }
  void run() {
    for (int r = 0; r < rounds_; ++r) {
      for (size_t i = 0; i < rows_.size(); ++i) {
        Row& row = rows_[r % 2 == 0 ? i : rows_.size() - 1 - i];
        row.round_ms.push_back(median_ms(row.fn, warmup_, reps_));
      }
    }
  }
  // The mean of the row's round medians.
  double ms(const std::string& name) const {
    const Row& row = find(name);
    double sum = 0;
    for (double m : row.round_ms) sum += m;
    LT_CHECK(!row.round_ms.empty(), "attention_bench: row {} was not timed", name);
    return sum / static_cast<double>(row.round_ms.size());
  }
  json rounds(const std::string& name) const {
    json out = json::array();
    for (double m : find(name).round_ms) out.push_back(round3(m));
    return out;
  }

 private:
  struct Row {
    std::string name;
    std::function<void()> fn;
    std::vector<double> round_ms;
  };
  const Row& find(const std::string& name) const {
    for (const Row& r : rows_)
      if (r.name == name) return r;
    LT_CHECK(false, "attention_bench: no timed row {}", name);
    return rows_.front();
  }
  int warmup_, reps_, rounds_;
  std::vector<Row> rows_;
};

attn::cudnn_sdpa::View view(const Tensor& t) {
  return {t.data, t.shape[0], t.shape[1], t.shape[2], t.stride[0], t.stride[1]};
}

// A [S, H, D] view of a separate buffer in `layout`: bshd (token-major) or bhsd (head-major).
attn::cudnn_sdpa::View layout_view(const CudaBuffer& b, const std::string& layout) {
  const Tensor& t = b.t;
  const int64_t S = t.shape[0], H = t.shape[1], D = t.shape[2];
  if (layout == "bhsd") return {t.data, S, H, D, D, S * D};
  return {t.data, S, H, D, H * D, D};
}

// The contiguous bf16 or f32 device tensor t as host floats.
std::vector<float> download_floats(const Tensor& t) {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<float> out(n);
  Tensor dst = t;
  dst.device = Device::cpu;
  if (t.dtype == DType::f32) {
    dst.data = out.data();
    copy(dst, t);
    return out;
  }
  std::vector<bf16> tmp(n);
  dst.data = tmp.data();
  copy(dst, t);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(tmp[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  LT_CHECK(cuda_available(), "attention_bench: no CUDA device is visible");
  json anchor = opt.anchor.empty() ? json() : read_json("attention_bench", "the anchor results", opt.anchor);

  // "ours" runs as a training run's attention does by default (auto: cuDNN or our kernels per call
  // shape, each timed after its first 48 calls), unless LONGTRAIN_ATTENTION_KERNEL names another policy.
  const KernelPolicies policies = use_training_kernel_policies();
  json result;
  result["attention_kernel_policy"] = std::string(attn::kernel_policy_name(policies.attention));
  result["direct_calls_lse_layout"] = opt.head_major_lse ? "head-major [Hq, S]" : "token-major [S, Hq]";
  result["benchmark"] =
      fmt::format("causal attention fwd and fwd+bwd, batch 1, 32 query heads, head dim {}, bf16", opt.head_dim);
  result["date"] = utc_date();
  result["machine"] = machine_json();
  result["commit"] = opt.commit;
  result["command"] = opt.command;
  result["timing"] = fmt::format(
      "CUDA events, median of {} runs after {} warm-ups (as attn_anchor.py); a shape's rows interleaved in {} "
      "rounds (in order, then reversed, in turn), each row the mean of its rounds' medians (round_ms)",
      opt.reps, opt.warmup, opt.rounds);
  result["flops"] = "fwd = 4*Hq*S^2*D/2 (causal half), fwd+bwd = 3.5*fwd";
  result["ours"] =
      "longtrain as the model calls it, under attention_kernel_policy (auto, as a training run by default: "
      "after each shape's trial, the kernels it chose): LocalSequenceAttention forward (Q/K/V views of a fused bf16 QKV buffer, "
      "bf16 O, f32 LSE stored head-major) and backward (the final O to cuDNN, dQ/dK/dV overwritten in place in a fused bf16 dQKV "
      "buffer)";
  result["ours_block_delta_f32"] =
      "the same forward; backward as a distributed schedule's visiting query rows run it: attention_delta, then "
      "attention_block_backward from delta (O stand-in where cuDNN takes no delta input) accumulating into f32 "
      "dQ/dK/dV";
  result["ours_cudnn_only"] =
      "the bare cuDNN forward and backward graphs on the same fused buffers (backward from O, bf16 dQ/dK/dV "
      "written in place), LSE token-major";
  const bool run_cudnn = std::find(opt.kernels.begin(), opt.kernels.end(), "cudnn") != opt.kernels.end();
  // The hopper forward variants to time, each once, with the row key its results go under.
  struct HopperRun {
    attn::hopper::FwdVariant variant;
    std::string key;
  };
  std::vector<HopperRun> hopper_runs;
  for (const std::string& k : opt.kernels) {
    if (k.rfind("hopper", 0) != 0) continue;
    const attn::hopper::FwdVariant variant =
        k == "hopper" ? attn::hopper::default_fwd_variant()
                      : attn::hopper::parse_fwd_variant(k.substr(std::string("hopper-").size()), "--kernel");
    // "hopper" keeps its key (earlier results compare by it); an explicit variant gets its own.
    std::string key = k == "hopper" ? "hopper" : "hopper_" + std::string(attn::hopper::fwd_variant_name(variant));
    std::replace(key.begin(), key.end(), '-', '_');
    bool seen = false;
    for (const HopperRun& r : hopper_runs) seen |= r.key == key;
    if (!seen) hopper_runs.push_back({variant, key});
  }
  const bool run_hopper = !hopper_runs.empty();
  result["kernels"] = opt.kernels;
  if (run_hopper) {
    LT_CHECK(attn::hopper::supported(opt.head_dim, 32, opt.kv_heads.empty() ? 1 : opt.kv_heads[0]),
             "attention_bench: --kernel hopper needs an sm_90 GPU and head dim 64 or 128, got head dim {}",
             opt.head_dim);
    result["hopper"] =
        "our sm_90a forward (attention/cuda/hopper_attention.cu) on the same fused QKV views, bf16 O, LSE "
        "token-major; fwd+bwd adds attention_delta and our sm_90a backward (attention/cuda/hopper_attention_bwd.cu) "
        "overwriting the fused bf16 dQKV views; hopper_bwd: delta + backward alone (2.5x the fwd FLOPs)";
    json variants = json::object();
    for (const HopperRun& r : hopper_runs) variants[r.key] = attn::hopper::fwd_variant_name(r.variant);
    result["hopper_variants"] = variants;
  }
  if (!anchor.is_null()) result["anchor"] = {{"script", "bench/anchors/attn_anchor.py"}, {"file", opt.anchor}};
  json rows = json::array();

  const int64_t Hq = 32, D = opt.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t hkv : opt.kv_heads) {
    for (int64_t S : opt.lengths) {
      // The model's buffers: fused QKV [S, (Hq + 2·Hkv), D] and dQKV of the same layout.
      const int64_t W = Hq + 2 * hkv;
      CudaBuffer qkv(DType::bf16, {S, W, D}), dqkv(DType::bf16, {S, W, D});
      CudaBuffer o(DType::bf16, {S, Hq, D}), d_o(DType::bf16, {S, Hq, D});
      CudaBuffer lse(DType::f32, {S, Hq}), delta(DType::f32, {S, Hq});
      CudaBuffer dq(DType::f32, {S, Hq, D}), dk(DType::f32, {S, hkv, D}), dv(DType::f32, {S, hkv, D});
      fill_normal_bf16(qkv.t, 1);
      fill_normal_bf16(d_o.t, 4);
      for (const CudaBuffer* b : {&dq, &dk, &dv}) zero(b->t);
      const Tensor q = qkv.t.narrow(1, 0, Hq), k = qkv.t.narrow(1, Hq, hkv), v = qkv.t.narrow(1, Hq + hkv, hkv);
      const Tensor gq = dqkv.t.narrow(1, 0, Hq), gk = dqkv.t.narrow(1, Hq, hkv), gv = dqkv.t.narrow(1, Hq + hkv, hkv);

      attn::LocalSequenceAttention model_attention(/*causal=*/true, scale);
      // The LSE as the model stores it for one rank's attention on CUDA: head-major [Hq, S] storage, a
      // buffer of its own (the direct calls' rows, interleaved with these, keep theirs in `lse`).
      CudaBuffer model_lse_buffer(DType::f32, {S, Hq});
      Tensor model_lse = model_lse_buffer.t;
      model_lse.stride = {1, S, 0, 0};
      auto fwd = [&] { model_attention.forward(o.t, model_lse, q, k, v); };
      auto fwd_bwd = [&] {
        model_attention.forward(o.t, model_lse, q, k, v);
        model_attention.backward(gq, gk, gv, q, k, v, o.t, model_lse, d_o.t);
      };
      const attn::BlockMask mask = attn::BlockMask::causal_diagonal;
      auto block_delta_fwd_bwd = [&] {
        attn::attention_block_forward(o.t, lse.t, q, k, v, mask, scale);
        attn::attention_delta(delta.t, o.t, d_o.t);
        attn::attention_block_backward(dq.t, dk.t, dv.t, q, k, v, d_o.t, lse.t, Tensor{}, delta.t, mask, scale,
                                       attn::GradMode::accumulate);
      };
      // The direct calls' LSE (hopper and cuDNN-only rows): token-major, or head-major as the model's.
      const attn::cudnn_sdpa::StatsView stats =
          opt.head_major_lse ? attn::cudnn_sdpa::StatsView{static_cast<float*>(lse.t.data), S, Hq, 1, S}
                             : attn::cudnn_sdpa::StatsView{static_cast<float*>(lse.t.data), S, Hq, Hq, 1};
      auto cudnn_fwd = [&] {
        attn::cudnn_sdpa::forward(view(o.t), stats, view(q), view(k), view(v), true, static_cast<float>(scale));
      };
      auto cudnn_fwd_bwd = [&] {
        cudnn_fwd();
        attn::cudnn_sdpa::backward(view(gq), view(gk), view(gv), view(q), view(k), view(v), view(o.t), view(d_o.t),
                                   stats, true, static_cast<float>(scale));
      };
      const double fwd_flops = 4.0 * Hq * double(S) * double(S) * D / 2.0;
      json row = {{"S", S}, {"hq", Hq}, {"hkv", hkv}, {"d", D}};
      std::vector<double> ms_hopper(hopper_runs.size(), 0.0), ms_hopper_fb(hopper_runs.size(), 0.0);
      // Our backward from the forward's O (delta first), dQ/dK/dV overwritten in the fused dQKV buffer.
      const attn::hopper::StatsView delta_view{static_cast<float*>(delta.t.data), S, Hq, Hq, 1};
      auto grad = [&](const Tensor& g) {
        return attn::hopper::OutView{g.data, false, g.shape[0], g.shape[1], g.shape[2], g.stride[0], g.stride[1]};
      };
      auto hopper_bwd = [&] {
        attn::attention_delta(delta.t, o.t, d_o.t);
        attn::hopper::backward(grad(gq), grad(gk), grad(gv), view(q), view(k), view(v), view(d_o.t), stats, delta_view,
                               true, static_cast<float>(scale), /*accumulate=*/false);
      };
      // The largest |dQ/dK/dV (ours) - cuDNN's| (and relative to the largest |cuDNN value|) into `out`,
      // both backwards from the O and LSE in o/lse now; our backward by run_ours.
      auto bwd_diffs = [&](const std::function<void()>& run_ours, json& out, const char* label) {
        attn::cudnn_sdpa::backward(view(gq), view(gk), view(gv), view(q), view(k), view(v), view(o.t), view(d_o.t),
                                   stats, true, static_cast<float>(scale));
        const std::vector<float> g_c = download_floats(dqkv.t);
        run_ours();
        const std::vector<float> g_h = download_floats(dqkv.t);
        // dqkv is [S, Hq + 2·hkv, D]: per token Hq·D of dQ, then hkv·D of dK, then of dV.
        double diff[3] = {0, 0, 0}, ref_max[3] = {0, 0, 0};
        int64_t grad_nonfinite = 0;
        for (size_t i = 0; i < g_h.size(); ++i) {
          const int64_t slot = static_cast<int64_t>(i % static_cast<size_t>(W * D)) / D;  // head slot
          const int which = slot < Hq ? 0 : (slot < Hq + hkv ? 1 : 2);
          grad_nonfinite += !std::isfinite(g_h[i]);
          diff[which] = std::max(diff[which], double(std::fabs(g_h[i] - g_c[i])));
          ref_max[which] = std::max(ref_max[which], double(std::fabs(g_c[i])));
        }
        const char* names[3] = {"dq", "dk", "dv"};
        for (int w = 0; w < 3; ++w) {
          out[fmt::format("max_abs_diff_{}_vs_cudnn", names[w])] = diff[w];
          out[fmt::format("max_rel_diff_{}_vs_cudnn", names[w])] = diff[w] / std::max(ref_max[w], 1e-30);
        }
        out["nonfinite_grads"] = grad_nonfinite;
        std::printf("hkv=%2lld S=%6lld: %s vs cuDNN backward: max|ddQ| %.3e (%.2e of max), max|ddK| %.3e "
                    "(%.2e), max|ddV| %.3e (%.2e), %lld NaN/Inf\n",
                    static_cast<long long>(hkv), static_cast<long long>(S), label, diff[0], diff[0] / ref_max[0],
                    diff[1], diff[1] / ref_max[1], diff[2], diff[2] / ref_max[2], static_cast<long long>(grad_nonfinite));
      };
      // A forward first, so that a backward timed before any forward reads a real O and LSE.
      if (run_hopper) {
        attn::hopper::forward({o.t.data, false, S, Hq, D, o.t.stride[0], o.t.stride[1]}, stats, view(q), view(k),
                              view(v), true, static_cast<float>(scale), false, hopper_runs[0].variant);
      } else if (run_cudnn) {
        cudnn_fwd();
      }
      // Under auto the first calls of each shape are its trial (attn::cuda::trial_length(): cuDNN
      // alone, then both kernels in turn, the host waiting once at the end): run them out before any
      // row is timed, so that "ours" (and the block calls from delta, shapes of their own) time the
      // chosen kernels and no row is timed on a GPU the trials warmed and others not.
      const size_t choices_before = attn::kernel_choices().size();
      auto run_out_trials = [](const std::function<void()>& fn) {
        const int max_calls = 4 * attn::cuda::trial_length();
        for (int i = 0; i < max_calls; ++i) {
          const int64_t trials = attn::kernel_trial_calls();
          fn();
          if (attn::kernel_trial_calls() == trials) return;
        }
        LT_CHECK(false, "attention_bench: the auto kernel trials did not end within {} calls", max_calls);
      };
      json row_choices = json::array();
      if (run_cudnn) {
        run_out_trials(fwd_bwd);
        run_out_trials(block_delta_fwd_bwd);
        const std::vector<attn::KernelChoice> all_choices = attn::kernel_choices();
        for (size_t i = choices_before; i < all_choices.size(); ++i) {
          const attn::KernelChoice& c = all_choices[i];
          row_choices.push_back(kernel_choice_json(c));
          std::printf("hkv=%2lld S=%6lld: ours under auto: %s -> %s (cuDNN %.3f ms, ours %.3f ms)\n",
                      static_cast<long long>(hkv), static_cast<long long>(S), c.shape.c_str(), c.kernel.c_str(),
                      c.cudnn_ms, c.hopper_ms);
        }
      }

      // Every compared row, timed interleaved (the file's header).
      InterleavedTimer timer(opt.warmup, opt.reps, opt.rounds);
      if (run_hopper) timer.add("hopper_bwd", hopper_bwd);
      std::vector<std::function<void()>> hopper_fwds;
      for (const HopperRun& run : hopper_runs) {
        // Our kernel's forward, on the views the cuDNN rows use (the direct calls' LSE).
        auto hopper_fwd = [&, variant = run.variant] {
          attn::hopper::forward({o.t.data, false, S, Hq, D, o.t.stride[0], o.t.stride[1]}, stats, view(q), view(k),
                                view(v), true, static_cast<float>(scale), false, variant);
        };
        hopper_fwds.push_back(hopper_fwd);
        timer.add(run.key + "_fwd", hopper_fwd);
        timer.add(run.key + "_fwdbwd", [hopper_fwd, &hopper_bwd] {
          hopper_fwd();
          hopper_bwd();
        });
      }
      if (run_cudnn) {
        timer.add("ours_fwd", fwd);
        timer.add("ours_fwdbwd", fwd_bwd);
        timer.add("ours_block_delta_f32", block_delta_fwd_bwd);
        timer.add("cudnn_fwd", cudnn_fwd);
        timer.add("cudnn_fwdbwd", cudnn_fwd_bwd);
      }
      timer.run();

      if (run_hopper) {
        const double ms_b = timer.ms("hopper_bwd");
        row["hopper_bwd"] = {{"bwd_ms", round3(ms_b)},
                             {"bwd_tflops", round1(2.5 * fwd_flops / ms_b / 1e9)},
                             {"round_ms", timer.rounds("hopper_bwd")}};
        std::printf("hkv=%2lld S=%6lld: hopper backward %8.3f ms (%5.1f TFLOP/s)\n", static_cast<long long>(hkv),
                    static_cast<long long>(S), ms_b, 2.5 * fwd_flops / ms_b / 1e9);
      }
      for (size_t r = 0; r < hopper_runs.size(); ++r) {
        const HopperRun& run = hopper_runs[r];
        const char* vname = attn::hopper::fwd_variant_name(run.variant);
        ms_hopper[r] = timer.ms(run.key + "_fwd");
        ms_hopper_fb[r] = timer.ms(run.key + "_fwdbwd");
        row[run.key] = {{"variant", vname},
                        {"fwd_kv_heads_per_section",
                         attn::hopper::fwd_kv_heads_per_section(S, S, Hq, hkv, D, true, run.variant)},
                        {"bwd_kv_heads_per_section", attn::hopper::bwd_kv_heads_per_section(S, S, Hq, hkv, D, true)},
                        {"fwd_ms", round3(ms_hopper[r])},
                        {"fwd_tflops", round1(fwd_flops / ms_hopper[r] / 1e9)},
                        {"fwd_round_ms", timer.rounds(run.key + "_fwd")},
                        {"fwdbwd_ms", round3(ms_hopper_fb[r])},
                        {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_hopper_fb[r] / 1e9)},
                        {"fwdbwd_round_ms", timer.rounds(run.key + "_fwdbwd")}};
        std::printf("hkv=%2lld S=%6lld: hopper %-12s fwd %8.3f ms (%5.1f TFLOP/s), fwd+bwd %8.3f ms (%5.1f), "
                    "sections %d/%d\n",
                    static_cast<long long>(hkv), static_cast<long long>(S), vname, ms_hopper[r],
                    fwd_flops / ms_hopper[r] / 1e9, ms_hopper_fb[r], 3.5 * fwd_flops / ms_hopper_fb[r] / 1e9,
                    row[run.key]["fwd_kv_heads_per_section"].get<int>(),
                    row[run.key]["bwd_kv_heads_per_section"].get<int>());
        // Against the anchor's torch rows (the speed target is torch's cuDNN SDPA fwd+bwd).
        for (const char* backend : {"cudnn", "flash"}) {
          const std::string key = fmt::format("{}_hkv{}_S{}", backend, hkv, S);
          if (!anchor.contains(key) || !anchor[key].is_object()) continue;
          const json& a = anchor[key];
          row[run.key][fmt::format("ratio_fwdbwd_vs_torch_{}", backend)] =
              round3(a["fwdbwd_ms"].get<double>() / ms_hopper_fb[r]);
          row[run.key][fmt::format("ratio_fwd_vs_torch_{}", backend)] = round3(a["fwd_ms"].get<double>() / ms_hopper[r]);
          std::printf("hkv=%2lld S=%6lld: hopper %-12s fwd+bwd %.3fx torch %s\n", static_cast<long long>(hkv),
                      static_cast<long long>(S), vname, a["fwdbwd_ms"].get<double>() / ms_hopper_fb[r], backend);
        }
        if (run_cudnn) {
          // The two kernels' outputs on the same inputs: the largest difference of O (bf16) and LSE.
          hopper_fwds[r]();
          const std::vector<float> o_h = download_floats(o.t), l_h = download_floats(lse.t);
          cudnn_fwd();
          const std::vector<float> o_c = download_floats(o.t), l_c = download_floats(lse.t);
          double do_max = 0.0, dl_max = 0.0;
          int64_t nonfinite = 0;  // NaN/Inf in hopper's O or LSE (std::max would hide a NaN)
          for (size_t i = 0; i < o_h.size(); ++i) {
            nonfinite += !std::isfinite(o_h[i]);
            do_max = std::max(do_max, double(std::fabs(o_h[i] - o_c[i])));
          }
          for (size_t i = 0; i < l_h.size(); ++i) {
            nonfinite += !std::isfinite(l_h[i]);
            dl_max = std::max(dl_max, double(std::fabs(l_h[i] - l_c[i])));
          }
          row[run.key]["max_abs_diff_o_vs_cudnn"] = do_max;
          row[run.key]["max_abs_diff_lse_vs_cudnn"] = dl_max;
          row[run.key]["nonfinite_outputs"] = nonfinite;
          std::printf("hkv=%2lld S=%6lld: hopper %-12s vs cuDNN forward: max|dO| %.3e, max|dLSE| %.3e, %lld NaN/Inf\n",
                      static_cast<long long>(hkv), static_cast<long long>(S), vname, do_max, dl_max,
                      static_cast<long long>(nonfinite));
          if (r == 0) {
            // Both backwards from this forward's O and LSE.
            hopper_fwds[r]();
            bwd_diffs(hopper_bwd, row["hopper_bwd"], "hopper_bwd");
          }
        }
      }
      if (!run_cudnn) {
        rows.push_back(row);
        std::fflush(stdout);
        continue;
      }
      const double ms_f = timer.ms("ours_fwd"), ms_fb = timer.ms("ours_fwdbwd");
      const double ms_db = timer.ms("ours_block_delta_f32");
      const double ms_cf = timer.ms("cudnn_fwd"), ms_cfb = timer.ms("cudnn_fwdbwd");
      // cuDNN's backward alone, as the fwd+bwd call pays it (the two timings' difference).
      const double ms_cb = ms_cfb - ms_cf;
      row["cudnn_bwd_from_difference"] = {{"bwd_ms", round3(ms_cb)}, {"bwd_tflops", round1(2.5 * fwd_flops / ms_cb / 1e9)}};
      auto bwd_ratio = [&](const std::string& key, double ms_ours) {
        row[key]["bwd_speedup_vs_cudnn_only"] = round3(ms_cb / ms_ours);
        std::printf("hkv=%2lld S=%6lld: %-28s bwd %.3fx cuDNN-only (%.3f ms against %.3f ms)\n",
                    static_cast<long long>(hkv), static_cast<long long>(S), key.c_str(), ms_cb / ms_ours, ms_ours,
                    ms_cb);
      };
      if (row.contains("hopper_bwd")) bwd_ratio("hopper_bwd", row["hopper_bwd"]["bwd_ms"].get<double>());

      for (size_t r = 0; r < hopper_runs.size(); ++r) {
        row[hopper_runs[r].key]["fwd_speedup_vs_cudnn_only"] = round3(ms_cf / ms_hopper[r]);
        row[hopper_runs[r].key]["fwdbwd_speedup_vs_cudnn_only"] = round3(ms_cfb / ms_hopper_fb[r]);
        std::printf("hkv=%2lld S=%6lld: hopper %-12s fwd+bwd %.3fx cuDNN-only (%.3f ms against %.3f ms)\n",
                    static_cast<long long>(hkv), static_cast<long long>(S),
                    attn::hopper::fwd_variant_name(hopper_runs[r].variant), ms_cfb / ms_hopper_fb[r], ms_hopper_fb[r],
                    ms_cfb);
        std::printf("hkv=%2lld S=%6lld: hopper %-12s fwd %.3fx cuDNN-only (%.3f ms against %.3f ms)\n",
                    static_cast<long long>(hkv), static_cast<long long>(S),
                    attn::hopper::fwd_variant_name(hopper_runs[r].variant), ms_cf / ms_hopper[r], ms_hopper[r], ms_cf);
      }
      row.update(json{{"ours", {{"policy", std::string(attn::kernel_policy_name(policies.attention))},
                                {"auto_choices", row_choices},
                                {"fwd_ms", round3(ms_f)},
                                {"fwd_tflops", round1(fwd_flops / ms_f / 1e9)},
                                {"fwd_round_ms", timer.rounds("ours_fwd")},
                                {"fwdbwd_ms", round3(ms_fb)},
                                {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_fb / 1e9)},
                                {"fwdbwd_round_ms", timer.rounds("ours_fwdbwd")}}},
                      {"ours_block_delta_f32", {{"fwdbwd_ms", round3(ms_db)},
                                                {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_db / 1e9)},
                                                {"fwdbwd_round_ms", timer.rounds("ours_block_delta_f32")}}},
                      {"ours_cudnn_only", {{"fwd_ms", round3(ms_cf)},
                                           {"fwd_tflops", round1(fwd_flops / ms_cf / 1e9)},
                                           {"fwd_round_ms", timer.rounds("cudnn_fwd")},
                                           {"fwdbwd_ms", round3(ms_cfb)},
                                           {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_cfb / 1e9)},
                                           {"fwdbwd_round_ms", timer.rounds("cudnn_fwdbwd")}}}});
      for (const std::string& layout : opt.layouts) {
        // Separate Q/K/V/O/dO and dQ/dK/dV buffers in this layout, the bare cuDNN graphs.
        CudaBuffer lq(DType::bf16, {S, Hq, D}), lk(DType::bf16, {S, hkv, D}), lv(DType::bf16, {S, hkv, D});
        CudaBuffer lo(DType::bf16, {S, Hq, D}), ldo(DType::bf16, {S, Hq, D});
        CudaBuffer ldq(DType::bf16, {S, Hq, D}), ldk(DType::bf16, {S, hkv, D}), ldv(DType::bf16, {S, hkv, D});
        fill_normal_bf16(lq.t, 11);
        fill_normal_bf16(lk.t, 12);
        fill_normal_bf16(lv.t, 13);
        fill_normal_bf16(ldo.t, 14);
        const float sc = static_cast<float>(scale);
        // "+hstats": the LSE stored head-major ([Hq, S], as torch keeps it) instead of token-major.
        const bool head_stats = layout.find("+hstats") != std::string::npos;
        const bool fused = layout.rfind("fused", 0) == 0;
        const std::string base = layout.substr(0, layout.find('+'));
        CudaBuffer lse_h(DType::f32, {Hq, S});
        const attn::cudnn_sdpa::StatsView lstats =
            head_stats ? attn::cudnn_sdpa::StatsView{static_cast<float*>(lse_h.t.data), S, Hq, 1, S} : stats;
        auto pick = [&](const CudaBuffer& b, const Tensor& model_view) {
          return fused ? view(model_view) : layout_view(b, base);
        };
        auto lf = [&] {
          attn::cudnn_sdpa::forward(pick(lo, o.t), lstats, pick(lq, q), pick(lk, k), pick(lv, v), true, sc);
        };
        auto lfb = [&] {
          lf();
          attn::cudnn_sdpa::backward(pick(ldq, gq), pick(ldk, gk), pick(ldv, gv), pick(lq, q), pick(lk, k),
                                     pick(lv, v), pick(lo, o.t), pick(ldo, d_o.t), lstats, true, sc);
        };
        const double lms_f = median_ms(lf, opt.warmup, opt.reps), lms_fb = median_ms(lfb, opt.warmup, opt.reps);
        row["cudnn_only_" + layout] = {{"fwd_ms", round3(lms_f)},
                                       {"fwd_tflops", round1(fwd_flops / lms_f / 1e9)},
                                       {"fwdbwd_ms", round3(lms_fb)},
                                       {"fwdbwd_tflops", round1(3.5 * fwd_flops / lms_fb / 1e9)}};
        std::printf("hkv=%2lld S=%6lld: cuDNN-only %s fwd %8.3f ms, fwd+bwd %8.3f ms (fused: %8.3f, %8.3f)\n",
                    static_cast<long long>(hkv), static_cast<long long>(S), layout.c_str(), lms_f, lms_fb, ms_cf,
                    ms_cfb);
      }
      std::string line = fmt::format("hkv={:2} S={:6}: ours fwd {:8.3f} ms ({:5.1f} TFLOP/s), fwd+bwd {:8.3f} ms "
                                     "({:5.1f}); from delta into f32 {:8.3f} ms ({:5.1f}); cuDNN-only fwd+bwd {:8.3f} ms "
                                     "({:5.1f})",
                                     hkv, S, ms_f, fwd_flops / ms_f / 1e9, ms_fb, 3.5 * fwd_flops / ms_fb / 1e9, ms_db,
                                     3.5 * fwd_flops / ms_db / 1e9, ms_cfb, 3.5 * fwd_flops / ms_cfb / 1e9);
      for (const char* backend : {"cudnn", "flash"}) {
        const std::string key = fmt::format("{}_hkv{}_S{}", backend, hkv, S);
        if (anchor.contains(key) && anchor[key].is_object()) {
          const json& a = anchor[key];
          json entry = {{"fwd_ms", a["fwd_ms"]}, {"fwd_tflops", a["fwd_tflops"]}, {"fwdbwd_ms", a["fwdbwd_ms"]},
                        {"fwdbwd_tflops", a["fwdbwd_tflops"]}};
          const double ratio_fb = a["fwdbwd_ms"].get<double>() / ms_fb;
          const double ratio_f = a["fwd_ms"].get<double>() / ms_f;
          entry["ratio_fwdbwd"] = round3(ratio_fb);  // ours / anchor throughput (anchor time / our time)
          entry["ratio_fwd"] = round3(ratio_f);
          entry["ratio_fwdbwd_block_delta_f32"] = round3(a["fwdbwd_ms"].get<double>() / ms_db);
          entry["ratio_fwdbwd_cudnn_only"] = round3(a["fwdbwd_ms"].get<double>() / ms_cfb);
          row[fmt::format("anchor_torch_{}", backend)] = entry;
          line += fmt::format("; vs torch {} fwd+bwd {:.3f}x", backend, ratio_fb);
        } else if (anchor.contains(key)) {
          row[fmt::format("anchor_torch_{}", backend)] = anchor[key];
        }
      }
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      rows.push_back(row);
    }
  }
  result["rows"] = rows;
  if (!anchor.is_null()) {
    json ceilings;
    for (const char* key : {"gemm_bf16_tflops", "copy_GBps"})
      if (anchor.contains(key)) ceilings[key] = anchor[key];
    result["anchor_ceilings"] = ceilings;
  }
  if (!opt.out.empty()) write_json("attention_bench", opt.out, result);
  std::printf("%s\n", result.dump(1).c_str());
  return 0;
} catch (const std::exception& e) {
  return report_failure("attention_bench", e);
}
