// docmask_bench: document-masked causal attention forward+backward on one GPU, through the path the
// model takes with data.document_mask (LocalSequenceAttention with the window's documents: one
// segmented cuDNN call over ragged rows, Q/K/V read in place from a fused QKV buffer, dQ/dK/dV
// written in place), against bench/anchors/docmask_anchor.py (torch.compile'd flex_attention with a
// document BlockMask) in the same run. The windows are the anchor's: its JSON gives each length's
// document lengths (log-normal, median 2048, seeded) and its shape (heads, KV heads, head dim).
// Beside it, our unmasked causal attention over the whole window (the dense kernel, and what the
// mask saves), and the seconds the first call of a new window shape spends building cuDNN plans.
//
//   docmask_bench --anchor docmask_anchor.json [--out result.json] [--commit SHA] [--warmup 3] [--reps 10]
//
// TFLOP/s count the pairs really computed, as the anchor does: Σ_d L_d(L_d+1)/2 · 4·H·D · 3.5 for
// fwd+bwd (the unmasked row counts its own S(S+1)/2).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "attention/sequence_attention.h"
#include "bench/bench_common.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

struct Options : RunRecord {
  int warmup = 3, reps = 10;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for_each_flag(argc, argv, "docmask_bench", [&](const std::string& a, const FlagValue& next) {
    if (record_flag(a, next, o)) return true;
    if (a == "--warmup") {
      o.warmup = next.int32();
    } else if (a == "--reps") {
      o.reps = next.int32();
    } else {
      return false;
    }
    return true;
  });
  LT_CHECK(!o.anchor.empty(), "docmask_bench: --anchor docmask_anchor.json is required (it holds the windows' "
           "document lengths)");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  LT_CHECK(cuda_available(), "docmask_bench: no CUDA device is visible");
  const json anchor = read_json("docmask_bench", "the anchor results", opt.anchor);
  for (const char* key : {"heads", "kv_heads", "head_dim"})
    LT_CHECK(anchor.contains(key), "docmask_bench: {} has no '{}'; is it docmask_anchor.py's output?", opt.anchor, key);
  const int64_t Hq = anchor["heads"].get<int64_t>(), hkv = anchor["kv_heads"].get<int64_t>(),
                D = anchor["head_dim"].get<int64_t>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  json result;
  result["benchmark"] = fmt::format(
      "document-masked causal attention fwd+bwd, batch 1, {} query heads, {} KV heads, head dim {}, bf16", Hq, hkv, D);
  result["date"] = utc_date();
  result["machine"] = machine_json();
  result["commit"] = opt.commit;
  result["command"] = opt.command;
  result["timing"] = fmt::format("CUDA events, median of {} runs after {} warm-ups (as docmask_anchor.py)", opt.reps,
                                 opt.warmup);
  result["flops"] = "pairs really computed: sum over documents of L(L+1)/2, times 4*H*D, times 3.5 for fwd+bwd";
  result["ours_masked"] =
      "LocalSequenceAttention with the window's documents (data.document_mask): one segmented cuDNN call "
      "(ragged offsets, per-document lengths, padding + causal mask) forward and one backward";
  result["ours_unmasked"] = "the same attention without documents: one causal block over the whole window";
  result["anchor"] = {{"script", "bench/anchors/docmask_anchor.py"}, {"file", opt.anchor},
                      {"torch", anchor.value("torch", "")}};
  json rows = json::array();
  for (const auto& [key, a] : anchor.items()) {
    if (!a.is_object() || !a.contains("doc_lengths")) continue;
    const int64_t S = std::stoll(key);
    attn::Documents docs;
    docs.offsets = {0};
    for (const auto& len : a["doc_lengths"]) docs.offsets.push_back(docs.offsets.back() + len.get<int64_t>());
    attn::check_documents(docs, S, "docmask_bench: " + opt.anchor + " length " + key);

    const int64_t W = Hq + 2 * hkv;
    CudaBuffer qkv(DType::bf16, {S, W, D}), dqkv(DType::bf16, {S, W, D});
    CudaBuffer o(DType::bf16, {S, Hq, D}), d_o(DType::bf16, {S, Hq, D}), lse(DType::f32, {S, Hq});
    fill_normal_bf16(qkv.t, 1);
    fill_normal_bf16(d_o.t, 4);
    const Tensor q = qkv.t.narrow(1, 0, Hq), k = qkv.t.narrow(1, Hq, hkv), v = qkv.t.narrow(1, Hq + hkv, hkv);
    const Tensor gq = dqkv.t.narrow(1, 0, Hq), gk = dqkv.t.narrow(1, Hq, hkv), gv = dqkv.t.narrow(1, Hq + hkv, hkv);

    attn::LocalSequenceAttention masked(/*causal=*/true, scale), dense(/*causal=*/true, scale);
    Tensor model_lse = lse.t;  // head-major, as the model stores it for one rank on CUDA
    model_lse.stride = {1, S, 0, 0};
    masked.set_documents(docs);
    auto run = [&](attn::LocalSequenceAttention& a) {
      return [&] {
        a.forward(o.t, model_lse, q, k, v);
        a.backward(gq, gk, gv, q, k, v, o.t, model_lse, d_o.t);
      };
    };
    // The first call of this window shape builds the segmented plans (forward and backward).
    const auto t0 = std::chrono::steady_clock::now();
    run(masked)();
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    const double first_call_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ms_masked = median_ms(run(masked), opt.warmup, opt.reps);
    const double ms_dense = median_ms(run(dense), opt.warmup, opt.reps);

    const double pairs = static_cast<double>(attn::document_pairs(docs, S, true));
    const double dense_pairs = static_cast<double>(S) * static_cast<double>(S + 1) / 2.0;
    const double per_pair = 3.5 * 4.0 * Hq * D;
    const double tf_masked = per_pair * pairs / ms_masked / 1e9, tf_dense = per_pair * dense_pairs / ms_dense / 1e9;
    json row = {{"S", S},
                {"documents", docs.count()},
                {"useful_pairs_fraction", round4(pairs / dense_pairs)},
                {"ours_masked", {{"fwdbwd_ms", round3(ms_masked)}, {"fwdbwd_tflops", round1(tf_masked)},
                                 {"first_call_s", round3(first_call_s)}}},
                {"ours_unmasked", {{"fwdbwd_ms", round3(ms_dense)}, {"fwdbwd_tflops", round1(tf_dense)}}},
                {"masked_per_useful_flop_vs_unmasked", round3(tf_masked / tf_dense)}};
    std::string line = fmt::format("S={:6} docs={:3}: masked {:8.3f} ms ({:5.1f} TFLOP/s useful), unmasked {:8.3f} ms "
                                   "({:5.1f}), first call {:.2f} s",
                                   S, docs.count(), ms_masked, tf_masked, ms_dense, tf_dense, first_call_s);
    if (a.contains("flex_fwdbwd_ms")) {
      const double flex = a["flex_fwdbwd_ms"].get<double>();
      row["anchor_flex"] = {{"fwdbwd_ms", flex}, {"fwdbwd_tflops", a.value("flex_tflops", json())}};
      row["ratio_vs_flex"] = round3(flex / ms_masked);  // > 1: ours is faster
      line += fmt::format(", flex {:.3f} ms: {:.3f}x", flex, flex / ms_masked);
    }
    if (a.contains("cudnn_full_causal_fwdbwd_ms")) {
      const double full = a["cudnn_full_causal_fwdbwd_ms"].get<double>();
      row["anchor_torch_cudnn_unmasked_fwdbwd_ms"] = full;
      row["ratio_unmasked_vs_torch_cudnn"] = round3(full / ms_dense);
    }
    std::printf("%s\n", line.c_str());
    rows.push_back(row);
  }
  LT_CHECK(!rows.empty(), "docmask_bench: {} holds no window with doc_lengths", opt.anchor);
  result["rows"] = rows;
  if (!opt.out.empty()) write_json("docmask_bench", opt.out, result);
  return 0;
} catch (const std::exception& e) {
  return report_failure("docmask_bench", e);
}
