// attention_bench: single-GPU causal attention forward and forward+backward through longtrain's
// block attention (attn::attention_block_forward / attention_delta / attention_block_backward, the
// calls a trainer makes, with f32 dQ/dK/dV accumulators), at the shapes of
// bench/anchors/attn_anchor.py (batch 1, 32 query heads, 32 or 8 KV heads, head dim 128, bf16).
// Also times the bare cuDNN graphs (cudnn_sdpa::forward/backward) to show what the contract's extra
// kernels cost. Given the anchor's JSON from the same machine and run, it writes both side by side
// with ratios.
//
//   attention_bench [--lengths 4096,16384,65536] [--anchor attn_anchor.json] [--out result.json]
//                   [--commit SHA] [--warmup 3] [--reps 10]
//
// Timing as the anchor does it: CUDA events around each call, the median of the timed runs.
// FLOPs count the causal half: fwd = 4·Hq·S²·D / 2, fwd+bwd = 3.5 × fwd.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "attention/cuda/cudnn_sdpa.h"
#include "attention/local_attention.h"
#include "bench/bench_common.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

struct Options {
  std::vector<int64_t> lengths{4096, 16384, 65536};
  std::string anchor, out, commit = "unknown";
  int warmup = 3, reps = 10;
  std::string command;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      LT_CHECK(i + 1 < argc, "attention_bench: {} needs a value", a);
      return argv[++i];
    };
    if (a == "--lengths") {
      o.lengths = int_list(next());
    } else if (a == "--anchor") {
      o.anchor = next();
    } else if (a == "--out") {
      o.out = next();
    } else if (a == "--commit") {
      o.commit = next();
    } else if (a == "--warmup") {
      o.warmup = std::stoi(next());
    } else if (a == "--reps") {
      o.reps = std::stoi(next());
    } else {
      LT_FAIL("attention_bench: unknown argument {} (see the comment at the top of bench/attention_bench.cpp)", a);
    }
  }
  return o;
}

// Fills a bf16 buffer with N(0, 1)-like values, generated on the host once.
void fill_bf16(const Tensor& t, uint32_t seed) {
  std::vector<bf16> host = normal_bf16(static_cast<size_t>(t.numel()), seed);
  Tensor src = t;
  src.data = host.data();
  src.device = Device::cpu;
  copy(t, src);
}

// Median milliseconds of fn over `reps` timed runs after `warmup` untimed ones.
double time_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  CudaEvents ev(2);  // start, stop
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    ev.record(0);
    fn();
    ev.record(1);
    ev.synchronize(1);
    ms.push_back(ev.ms(0, 1));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

attn::cudnn_sdpa::View view(const Tensor& t) {
  return {t.data, t.shape[0], t.shape[1], t.shape[2], t.stride[0], t.stride[1]};
}

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  LT_CHECK(cuda_available(), "attention_bench: no CUDA device is visible");
  json anchor = opt.anchor.empty() ? json() : read_json("attention_bench", "the anchor results", opt.anchor);

  json result;
  result["benchmark"] = "causal attention fwd and fwd+bwd, batch 1, 32 query heads, head dim 128, bf16";
  result["date"] = utc_date();
  result["machine"] = machine_json();
  result["commit"] = opt.commit;
  result["command"] = opt.command;
  result["timing"] = fmt::format("CUDA events, median of {} runs after {} warm-ups (as attn_anchor.py)", opt.reps,
                                 opt.warmup);
  result["flops"] = "fwd = 4*Hq*S^2*D/2 (causal half), fwd+bwd = 3.5*fwd";
  result["ours"] =
      "longtrain: attention_block_forward (bf16 O, f32 LSE); fwd+bwd adds attention_delta and "
      "attention_block_backward accumulating into f32 dQ/dK/dV";
  result["ours_cudnn_only"] =
      "the bare cuDNN forward and backward graphs (bf16 dQ/dK/dV, no accumulation; the backward takes delta as "
      "an input where cuDNN accepts that graph, else forms it from the real O)";
  if (!anchor.is_null()) result["anchor"] = {{"script", "bench/anchors/attn_anchor.py"}, {"file", opt.anchor}};
  json rows = json::array();

  const int64_t Hq = 32, D = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t hkv : {int64_t{32}, int64_t{8}}) {
    for (int64_t S : opt.lengths) {
      CudaBuffer q(DType::bf16, {S, Hq, D}), k(DType::bf16, {S, hkv, D}), v(DType::bf16, {S, hkv, D});
      CudaBuffer o(DType::bf16, {S, Hq, D}), d_o(DType::bf16, {S, Hq, D});
      CudaBuffer lse(DType::f32, {S, Hq}), delta(DType::f32, {S, Hq});
      CudaBuffer dq(DType::f32, {S, Hq, D}), dk(DType::f32, {S, hkv, D}), dv(DType::f32, {S, hkv, D});
      CudaBuffer dq16(DType::bf16, {S, Hq, D}), dk16(DType::bf16, {S, hkv, D}), dv16(DType::bf16, {S, hkv, D});
      fill_bf16(q.t, 1);
      fill_bf16(k.t, 2);
      fill_bf16(v.t, 3);
      fill_bf16(d_o.t, 4);
      for (const CudaBuffer* b : {&dq, &dk, &dv}) zero(b->t);

      const attn::BlockMask mask = attn::BlockMask::causal_diagonal;
      auto fwd = [&] { attn::attention_block_forward(o.t, lse.t, q.t, k.t, v.t, mask, scale); };
      auto fwd_bwd = [&] {
        attn::attention_block_forward(o.t, lse.t, q.t, k.t, v.t, mask, scale);
        attn::attention_delta(delta.t, o.t, d_o.t);
        attn::attention_block_backward(dq.t, dk.t, dv.t, q.t, k.t, v.t, d_o.t, lse.t, delta.t, mask, scale);
      };
      const attn::cudnn_sdpa::StatsView stats{static_cast<float*>(lse.t.data), S, Hq, Hq, 1};
      auto cudnn_fwd = [&] {
        attn::cudnn_sdpa::forward(view(o.t), stats, view(q.t), view(k.t), view(v.t), true, static_cast<float>(scale));
      };
      const attn::cudnn_sdpa::StatsView delta_view{static_cast<float*>(delta.t.data), S, Hq, Hq, 1};
      auto cudnn_fwd_bwd = [&] {
        cudnn_fwd();
        attn::cudnn_sdpa::backward(view(dq16.t), view(dk16.t), view(dv16.t), view(q.t), view(k.t), view(v.t),
                                   view(d_o.t), stats, delta_view, [&] { return view(o.t); }, true,
                                   static_cast<float>(scale));
      };
      cudnn_fwd();
      attn::attention_delta(delta.t, o.t, d_o.t);  // real values for the delta-input graph
      const double fwd_flops = 4.0 * Hq * double(S) * double(S) * D / 2.0;
      const double ms_f = time_ms(fwd, opt.warmup, opt.reps);
      const double ms_fb = time_ms(fwd_bwd, opt.warmup, opt.reps);
      const double ms_cf = time_ms(cudnn_fwd, opt.warmup, opt.reps);
      const double ms_cfb = time_ms(cudnn_fwd_bwd, opt.warmup, opt.reps);

      json row = {{"S", S},
                  {"hq", Hq},
                  {"hkv", hkv},
                  {"d", D},
                  {"ours", {{"fwd_ms", round3(ms_f)},
                            {"fwd_tflops", round1(fwd_flops / ms_f / 1e9)},
                            {"fwdbwd_ms", round3(ms_fb)},
                            {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_fb / 1e9)}}},
                  {"ours_cudnn_only", {{"fwd_ms", round3(ms_cf)},
                                       {"fwd_tflops", round1(fwd_flops / ms_cf / 1e9)},
                                       {"fwdbwd_ms", round3(ms_cfb)},
                                       {"fwdbwd_tflops", round1(3.5 * fwd_flops / ms_cfb / 1e9)}}}};
      std::string line = fmt::format("hkv={:2} S={:6}: ours fwd {:8.3f} ms ({:5.1f} TFLOP/s), fwd+bwd {:8.3f} ms "
                                     "({:5.1f}); cuDNN-only fwd+bwd {:8.3f} ms ({:5.1f})",
                                     hkv, S, ms_f, fwd_flops / ms_f / 1e9, ms_fb, 3.5 * fwd_flops / ms_fb / 1e9, ms_cfb,
                                     3.5 * fwd_flops / ms_cfb / 1e9);
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
  std::fprintf(stderr, "attention_bench: %s\n", e.what());
  return 1;
}
