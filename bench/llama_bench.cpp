// llama_bench: training steps of LlamaModel on one GPU at the TinyLlama-1.1B shape of
// bench/anchors/llama_anchor.py (vocab 32000, dim 2048, 22 layers, 32 heads, 4 KV heads, head dim 64,
// ffn 5632, rope_theta 10000), batch 1, S tokens of synthetic ids, bf16 mixed precision (bf16
// parameters, gradients and activations, f32 master weights and Adam moments). One step is what the
// anchor times: zero the gradients, forward + backward, AdamW step (ours also computes the global
// gradient norm and clips at 1.0).
//
//   llama_bench [--lengths 8192,32768,65536] [--policies remat_aware,full] [--anchor llama_anchor.json]
//               [--out result.json] [--commit SHA] [--warmup 1] [--steps 3] [--plan-only]
//   llama_bench --merge result.json --anchor llama_anchor.json --out merged.json
//
// --merge adds the anchor's numbers and the ratios to a result written earlier in the same run (when
// the anchor ran after the benchmark); it needs no GPU.
//
// For each length (ascending) and checkpoint policy: the memory plan is printed and checked against
// the free device memory before anything is allocated (a config that does not fit is reported and
// skipped); then warm-up steps, then timed steps (wall clock between two device synchronisations, as
// the anchor times them), with CUDA events splitting each step into forward+backward, optimizer, and
// the attention calls inside forward+backward.
//
// FLOPs: the anchor counts 6·N_matmul + 6·L·S·d_model per token (N_matmul = all parameters except the
// embedding; causal attention at half of 12·L·S·d). model_tflops and MFU (against 989 TFLOP/s dense
// bf16) use that formula so the two are comparable; LlamaConfig::train_flops_per_token (same formula
// without the norm weights, 0.01% less) is reported beside it. Peak memory: device memory taken by the
// process after the timed steps (cudaMemGetInfo against the free memory at start; arenas and scratch
// never shrink during a step, so this is the step's peak), CUDA context excluded. The anchor reports
// torch.cuda.max_memory_allocated (its caching allocator's live tensors).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "attention/sequence_attention.h"
#include "bench/bench_common.h"
#include "model/llama.h"
#include "model/memory_plan.h"
#include "model/parameters.h"
#include "trainer/optimizer.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

struct Options {
  std::vector<int64_t> lengths{8192, 32768, 65536};
  std::vector<model::CheckpointPolicy> policies{model::CheckpointPolicy::remat_aware, model::CheckpointPolicy::full};
  std::string anchor, out, commit = "unknown", command, merge;
  int warmup = 1, steps = 3;
  bool plan_only = false;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      LT_CHECK(i + 1 < argc, "llama_bench: {} needs a value", a);
      return argv[++i];
    };
    if (a == "--lengths") {
      o.lengths = int_list(next());
      std::sort(o.lengths.begin(), o.lengths.end());  // ascending: scratch only grows, peaks stay honest
    } else if (a == "--policies") {
      o.policies.clear();
      for (const std::string& s : split_list(next())) o.policies.push_back(model::parse_checkpoint_policy(s));
    } else if (a == "--anchor") {
      o.anchor = next();
    } else if (a == "--out") {
      o.out = next();
    } else if (a == "--commit") {
      o.commit = next();
    } else if (a == "--warmup") {
      o.warmup = std::stoi(next());
    } else if (a == "--steps") {
      o.steps = std::stoi(next());
    } else if (a == "--merge") {
      o.merge = next();
    } else if (a == "--plan-only") {
      o.plan_only = true;
    } else {
      LT_FAIL("llama_bench: unknown argument {} (see the comment at the top of bench/llama_bench.cpp)", a);
    }
  }
  LT_CHECK(o.steps > 0 && o.warmup >= 0, "llama_bench: --steps must be positive and --warmup non-negative");
  return o;
}

model::LlamaConfig tinyllama() {
  model::LlamaConfig c;
  c.vocab_size = 32000;
  c.dim = 2048;
  c.n_layers = 22;
  c.n_heads = 32;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.ffn_dim = 5632;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5;
  c.max_seq_len = 1 << 20;
  return c;
}

// The attention of the model with CUDA events around every call: the time attention takes inside a
// step, without synchronising.
class TimedAttention final : public attn::SequenceAttention {
 public:
  explicit TimedAttention(double scale) : inner_(/*causal=*/true, scale) {}
  ~TimedAttention() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    ++counters.forward_calls;
    const size_t i = begin();
    inner_.forward(o, lse, q, k, v);
    end(i);
  }
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override {
    ++counters.backward_calls;
    const size_t i = begin();
    inner_.backward(dq, dk, dv, q, k, v, o, lse, d_o);
    end(i);
  }
  void reset() { used_ = 0; }
  // Milliseconds of every call since reset() (events are kept, one pair per call); the device must
  // have passed the last call.
  double elapsed_ms() const {
    double ms = 0.0;
    for (size_t i = 0; i + 1 < used_; i += 2) {
      float v = 0.0f;
      LT_CUDA_CHECK(cudaEventElapsedTime(&v, events_[i], events_[i + 1]));
      ms += v;
    }
    return ms;
  }

 private:
  size_t begin() {
    while (events_.size() < used_ + 2) {
      cudaEvent_t e;
      LT_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    LT_CUDA_CHECK(cudaEventRecord(events_[used_], cuda_stream()));
    used_ += 2;
    return used_ - 2;
  }
  void end(size_t i) { LT_CUDA_CHECK(cudaEventRecord(events_[i + 1], cuda_stream())); }

  attn::LocalSequenceAttention inner_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
};

// A host image of the bf16 parameter arena: weights ~ N(0, 0.02) (sum of four uniforms), norm weights
// 1, as Hugging Face initialises; filled by all cores once, uploaded into every model.
std::vector<bf16> parameter_image(const model::LlamaConfig& c) {
  Arena table("parameters", Device::cuda);  // only the table: never allocated
  model::add_parameter_entries(table, c, DType::bf16);
  std::vector<bf16> image(table.bytes() / sizeof(bf16));
  for (const ArenaEntry& e : table.table()) {
    bf16* dst = image.data() + e.offset / sizeof(bf16);
    const bool norm = e.name.find("norm.weight") != std::string::npos;
    const unsigned workers = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < workers; ++w) {
      pool.emplace_back([=] {
        const int64_t begin = e.numel * w / workers, end = e.numel * (w + 1) / workers;
        uint64_t s = (static_cast<uint64_t>(e.offset) << 8) ^ (w * 0x9e3779b97f4a7c15ull) ^ 0x2545f4914f6cdd1dull;
        for (int64_t i = begin; i < end; ++i) {
          if (norm) {
            dst[i] = bf16(1.0f);
            continue;
          }
          float acc = 0.0f;
          for (int k = 0; k < 4; ++k) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            acc += static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
          }
          dst[i] = bf16(acc * 1.7320508f * 0.02f);  // variance 4/12 → 1, then std 0.02
        }
      });
    }
    for (std::thread& t : pool) t.join();
  }
  return image;
}

size_t free_bytes() {
  LT_CUDA_CHECK(cudaDeviceSynchronize());
  return model::device_memory(Device::cuda).free;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  const model::LlamaConfig cfg = tinyllama();
  const model::Precision prec = model::Precision::cuda_mixed();

  if (!opt.merge.empty()) {  // the anchor's numbers beside a result written earlier: runs without a GPU
    json result = read_json("llama_bench --merge", "the result", opt.merge);
    json anchor = read_json("llama_bench --merge", "the anchor", opt.anchor);
    result["anchor"] = {{"script", "bench/anchors/llama_anchor.py"}, {"file", opt.anchor}};
    if (anchor.contains("params")) result["anchor_params"] = anchor["params"];
    for (json& row : result["rows"]) {
      const std::string key = std::to_string(row["S"].get<int64_t>());
      if (!anchor.contains(key)) continue;
      row["anchor"] = anchor[key];
      if (anchor[key].is_object() && anchor[key].contains("tok_per_s") && row.contains("tok_per_s"))
        row["ratio_tok_per_s"] = round3(row["tok_per_s"].get<double>() / anchor[key]["tok_per_s"].get<double>());
      std::printf("S=%6lld %-11s: %s tok/s vs anchor %s → %s\n", (long long)row["S"].get<int64_t>(),
                  row["policy"].get<std::string>().c_str(), row.value("tok_per_s", json()).dump().c_str(),
                  anchor[key].is_object() ? anchor[key].value("tok_per_s", json()).dump().c_str() : "failed",
                  row.value("ratio_tok_per_s", json()).dump().c_str());
    }
    write_json("llama_bench --merge", opt.out.empty() ? opt.merge : opt.out, result);
    return 0;
  }

  if (opt.plan_only) {  // the plans alone: runs without a GPU
    for (int64_t S : opt.lengths)
      for (model::CheckpointPolicy p : opt.policies) std::printf("%s\n", model::plan_memory(cfg, prec, p, S).table().c_str());
    return 0;
  }

  LT_CHECK(cuda_available(), "llama_bench: no CUDA device is visible");
  LT_CUDA_CHECK(cudaFree(nullptr));  // create the context before measuring free memory
  const size_t baseline_free = free_bytes();
  const json machine = machine_json();

  json anchor;
  if (!opt.anchor.empty()) {
    std::ifstream in(opt.anchor);
    if (in.good()) {
      in >> anchor;
    } else {  // the anchor failed or was not run: measure ours anyway, and say so in the result
      std::fprintf(stderr, "llama_bench: cannot read the anchor results %s; reporting without ratios\n",
                   opt.anchor.c_str());
    }
  }

  const double n_all = static_cast<double>(cfg.num_parameters());
  const double n_matmul = n_all - static_cast<double>(cfg.vocab_size * cfg.dim);  // as the anchor: all but the embedding
  auto anchor_flops_per_token = [&](int64_t S) {
    return 6.0 * n_matmul + 6.0 * static_cast<double>(cfg.n_layers) * static_cast<double>(S) * cfg.dim;
  };

  json result;
  result["benchmark"] =
      "Llama training step on one GPU, TinyLlama-1.1B shape (vocab 32000, dim 2048, 22 layers, 32 heads, 4 KV "
      "heads, head dim 64, ffn 5632), batch 1, bf16 mixed precision, AdamW";
  result["date"] = utc_date();
  result["machine"] = machine;
  result["commit"] = opt.commit;
  result["command"] = opt.command;
  result["parameters"] = cfg.num_parameters();
  result["timing"] = fmt::format("wall clock over {} steps after {} warm-up steps, device synchronised before and "
                                 "after (the anchor: 4 steps after 2)",
                                 opt.steps, opt.warmup);
  result["flops"] =
      "model FLOPs per token = 6*N_matmul + 6*L*S*d_model (N_matmul = parameters except the embedding; causal "
      "attention at half), the anchor's formula; MFU against 989 TFLOP/s dense bf16";
  result["peak_memory"] =
      "ours: device memory taken by the process after the timed steps (cudaMemGetInfo vs. the start; no frees "
      "inside a step), CUDA context excluded; anchor: torch.cuda.max_memory_allocated";
  result["ours"] =
      "longtrain LlamaModel (cuBLASLt GEMMs, cuDNN fused attention, chunked LM head + cross-entropy) + "
      "trainer::AdamW (f32 master weights and moments, global-norm clipping at 1.0); zero_grads + "
      "forward_backward + AdamW step";
  if (!anchor.is_null()) result["anchor"] = {{"script", "bench/anchors/llama_anchor.py"}, {"file", opt.anchor}};

  std::printf("llama_bench: %s, %d SMs, %.1f GiB; %.0f parameters\n", machine["gpu"].get<std::string>().c_str(),
              machine["sms"].get<int>(), machine["gpu_memory_gib"].get<double>(), n_all);
  const std::vector<bf16> image = parameter_image(cfg);
  json rows = json::array();
  std::vector<std::string> summary;
  if (!anchor.is_null() && anchor.contains("params")) result["anchor_params"] = anchor["params"];
  auto write_result = [&](const json& r) {
    if (opt.out.empty()) return;
    result["rows"] = r;
    write_json("llama_bench", opt.out, result);
  };

  for (int64_t S : opt.lengths) {
    // Synthetic ids; labels are the next token (the last one ignored), as HF shifts them; positions 0..S-1.
    std::vector<int32_t> ids(static_cast<size_t>(S)), labels(ids.size()), positions(ids.size());
    uint64_t s = 0x853c49e6748fea9bull ^ static_cast<uint64_t>(S);
    for (auto& id : ids) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(cfg.vocab_size));
    }
    for (int64_t t = 0; t < S; ++t) {
      labels[t] = t + 1 < S ? ids[t + 1] : model::LlamaModel::kIgnoreIndex;
      positions[t] = static_cast<int32_t>(t);
    }
    const int64_t valid = S - 1;
    const json* anchor_row = nullptr;
    const std::string key = std::to_string(S);
    if (anchor.contains(key)) anchor_row = &anchor[key];

    for (model::CheckpointPolicy policy : opt.policies) {
      json row = {{"S", S}, {"policy", model::checkpoint_policy_name(policy)}};
      const model::MemoryPlan plan = model::plan_memory(cfg, prec, policy, S);
      std::printf("\n%s", plan.table().c_str());
      row["plan_GiB"] = round3(plan.total() / kGiB);
      try {
        model::check_memory_fits(plan, model::device_memory(Device::cuda));
        const size_t free_before = free_bytes();
        auto attention = std::make_unique<TimedAttention>(1.0 / std::sqrt(static_cast<double>(cfg.head_dim)));
        TimedAttention* timed = attention.get();
        model::LlamaModel m(cfg, prec, policy, S, std::move(attention));
        copy(Tensor(m.params().base(), DType::bf16, {static_cast<int64_t>(image.size())}, Device::cuda),
             Tensor(const_cast<bf16*>(image.data()), DType::bf16, {static_cast<int64_t>(image.size())}));
        trainer::AdamWConfig ocfg;  // torch.optim.AdamW's defaults, as the anchor uses them, lr 1e-4
        ocfg.lr = 1e-4;
        ocfg.beta1 = 0.9;
        ocfg.beta2 = 0.999;
        ocfg.eps = 1e-8;
        ocfg.weight_decay = 0.01;
        ocfg.schedule = trainer::LrSchedule::constant;
        ocfg.grad_clip = 1.0;
        ocfg.no_decay = {};
        trainer::AdamW adamw(m.params(), ocfg);
        CudaBuffer d_ids(ids), d_labels(labels), d_pos(positions);
        const model::TokenShard shard{d_ids.t, d_labels.t, d_pos.t};

        // Three events per timed step (start, after forward+backward, after the optimizer), read after
        // the wall-clock measurement so that reading them adds no synchronisation inside it.
        CudaEvents events(static_cast<size_t>(3 * opt.steps));
        double loss = 0.0, grad_norm = 0.0;
        // Timed step i records events 3i (start), 3i + 1 (after forward+backward) and 3i + 2 (after the
        // optimizer); i < 0 is an untimed step.
        auto step = [&](int i) {
          const size_t e = static_cast<size_t>(3 * std::max(i, 0));
          if (i >= 0) events.record(e);
          m.zero_grads();
          const model::LossSum l = m.forward_backward(shard, 1.0 / static_cast<double>(valid));
          if (i >= 0) events.record(e + 1);
          const trainer::AdamW::StepInfo info = adamw.step(m.params(), m.grads());
          if (i >= 0) events.record(e + 2);
          loss = l.sum / static_cast<double>(l.count);
          grad_norm = info.grad_norm;
        };
        const auto t_warm = std::chrono::steady_clock::now();
        for (int i = 0; i < opt.warmup; ++i) step(-1);
        LT_CUDA_CHECK(cudaDeviceSynchronize());
        const double warm_s = seconds_since(t_warm);
        timed->reset();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < opt.steps; ++i) step(i);
        LT_CUDA_CHECK(cudaDeviceSynchronize());
        const double step_s = seconds_since(t0) / opt.steps;
        double fb_ms = 0.0, opt_ms = 0.0;
        for (int i = 0; i < opt.steps; ++i) {
          const size_t e = static_cast<size_t>(3 * i);
          fb_ms += events.ms(e, e + 1) / opt.steps;
          opt_ms += events.ms(e + 1, e + 2) / opt.steps;
        }
        const double attn_ms = timed->elapsed_ms() / opt.steps;
        const size_t free_after = free_bytes();

        const double tok_s = static_cast<double>(S) / step_s;
        const double flops = anchor_flops_per_token(S) * static_cast<double>(S);
        const double ours_flops = cfg.train_flops_per_token(S) * static_cast<double>(S);
        const double peak = static_cast<double>(baseline_free - free_after);
        row["step_s"] = round3(step_s);
        row["tok_per_s"] = std::round(tok_s);
        row["model_tflops"] = round1(flops / step_s / 1e12);
        row["model_tflops_longtrain_formula"] = round1(ours_flops / step_s / 1e12);
        row["mfu_989"] = round3(flops / step_s / 989e12);
        row["peak_GiB"] = round1(peak / kGiB);
        row["model_GiB"] = round1(static_cast<double>(free_before - free_after) / kGiB);
        row["loss"] = round3(loss);
        row["grad_norm"] = round3(grad_norm);
        row["first_steps_s"] = round3(warm_s);
        row["split_ms"] = {{"forward_backward", round1(fb_ms)},
                           {"attention_in_forward_backward", round1(attn_ms)},
                           {"optimizer", round1(opt_ms)}};
        std::string line = fmt::format(
            "S={:6} {:11}: {:7.3f} s/step, {:7.0f} tok/s, {:5.1f} TFLOP/s, MFU {:.3f}, peak {:5.1f} GiB (plan {:5.1f}); "
            "fwd+bwd {:.0f} ms (attention {:.0f}), optimizer {:.0f} ms; loss {:.3f}",
            S, model::checkpoint_policy_name(policy), step_s, tok_s, flops / step_s / 1e12, flops / step_s / 989e12,
            peak / kGiB, plan.total() / kGiB, fb_ms, attn_ms, opt_ms, loss);
        if (anchor_row != nullptr && anchor_row->is_object() && anchor_row->contains("tok_per_s")) {
          const double a_tok = (*anchor_row)["tok_per_s"].get<double>();
          row["anchor"] = *anchor_row;
          row["ratio_tok_per_s"] = round3(tok_s / a_tok);
          line += fmt::format("; anchor {:.0f} tok/s → {:.2f}x", a_tok, tok_s / a_tok);
        } else if (anchor_row != nullptr) {
          row["anchor"] = *anchor_row;
        }
        std::printf("%s\n", line.c_str());
        summary.push_back(line);
      } catch (const std::exception& e) {
        row["skipped"] = e.what();
        std::printf("S=%lld %s: skipped: %s\n", (long long)S, model::checkpoint_policy_name(policy), e.what());
        summary.push_back(fmt::format("S={:6} {:11}: skipped: {}", S, model::checkpoint_policy_name(policy), e.what()));
      }
      std::fflush(stdout);
      rows.push_back(row);
      write_result(rows);  // after every configuration: a run stopped at its time limit keeps what it measured
    }
  }
  std::printf("\n");
  for (const std::string& l : summary) std::printf("%s\n", l.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "llama_bench: %s\n", e.what());
  return 1;
}
