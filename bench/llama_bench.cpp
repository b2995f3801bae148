// llama_bench: training steps of LlamaModel on one GPU, or on the GPUs of one sequence-parallel group,
// at the TinyLlama-1.1B shape of bench/anchors/llama_anchor.py (vocab 32000, dim 2048, 22 layers, 32
// heads, 4 KV heads, head dim 64, ffn 5632, rope_theta 10000), batch 1, S tokens of synthetic ids,
// bf16 mixed precision (bf16 parameters, gradients and activations, f32 master weights and Adam
// moments). One step is what the anchor times: zero the gradients, forward + backward, AdamW step
// (ours also computes the global gradient norm and clips at 1.0).
//
//   llama_bench [--lengths 8192,32768,65536] [--policies remat_aware,full] [--anchor llama_anchor.json]
//               [--out result.json] [--commit SHA] [--warmup 1] [--steps 3] [--plan-only]
//               [--schedule zigzag] [--chunk-calls merged|per_chunk] [--longest] [--gpus P]
//               [--memory FREE_GIB,TOTAL_GIB] [--documents docmask_anchor.json]
//               [--offload none,checkpoints] [--mlp-chunk N] [--loss-chunk N] [--head-groups N] [--shape tinyllama|llama3.2-3b]
//               [--profile] [--cuda-graphs off|on|off,on]
//   longtrain-run --nproc-per-node 2 -- llama_bench ...     (sequence parallel over 2 GPUs)
//   llama_bench --merge result.json --anchor llama_anchor.json --out merged.json
//   llama_bench --merge result.json --anchor compiled_llama_anchor_1b.json   (rows matched by length and policy)
//
// Under the launcher (WORLD_SIZE = P > 1) the P ranks form one sequence-parallel group over NCCL: each
// holds S/P tokens in the schedule's layout (zigzag for ring, zigzag and burst; contiguous for
// distflash) with global positions, attention runs the distributed schedule, and the step is the
// trainer's ZeRO-1 step: gradients reduce-scattered over the ranks, AdamW on this rank's shard,
// parameters all-gathered; the reduce-scatter runs after backward here, not overlapped with it as in
// the trainer (with sequence parallelism alone the gradient traffic is small next to attention's). S in --lengths is the whole sequence; times are the slowest rank's, memory the
// largest rank's; rank 0 prints and writes the result.
//
// --documents: each window packs the documents of bench/anchors/docmask_anchor.py's doc_lengths for
// that length, with data.document_mask's positions, labels and per-document attention.
//
// --merge adds the anchor's numbers and the ratios to a result written earlier in the same run (when
// the anchor ran after the benchmark); it needs no GPU.
//
// --longest: no training; for each policy, the longest sequence whose memory plan fits this device's
// free memory (the check `longtrain train` makes before it allocates): the largest power of two, and
// the largest multiple of 8192·P. Run the normal mode at those lengths to show they train. --gpus P
// plans for a group of P GPUs outside the launcher (as does --plan-only); --memory FREE,TOTAL (GiB)
// plans for a GPU that is not here.
//
// --policies takes auto as well: the policy and offload model::choose_memory picks for the free
// memory (what `longtrain train` does with model.checkpoint: auto); its row names the choice and why.
// --offload lists the offload settings each fixed policy runs with (model.offload; checkpoints: the
// kept tensors in pinned host memory, checked against /proc/meminfo). --mlp-chunk, --loss-chunk and
// --head-groups set model.mlp_chunk_tokens, model.loss_chunk_tokens and model.attention_head_groups
// (0 = auto). --shape llama3.2-3b: dim 3072, 28
// layers, 24 heads, 8 KV heads, head dim 128, ffn 8192, vocab 128256, tied embeddings.
//
// For each length (ascending) and checkpoint policy: the memory plan is printed and checked against
// the free device memory before anything is allocated (a config that does not fit is reported and
// skipped); then warm-up steps (under auto more of them, up to 32, until every GEMM shape's trial has
// ended and a step ran no attention trial call: the row's trial_steps, after which the parameters and optimizer
// are rewound and the warm-up steps run again), then timed steps (wall clock between two
// device synchronisations, as the anchor times them), with CUDA events splitting each step into
// forward+backward, optimizer, and the attention calls inside forward+backward. The attention
// forwards per layer and step are counted (remat_aware and none: 1, full: 2).
//
// --cuda-graphs on (one GPU, no --documents): each step's forward and backward is a CUDA graph
// (LlamaModel::set_cuda_graphs, train.cuda_graphs), captured in the warm-up and replayed by every timed
// step (checked; the row's cuda_graph); the attention inside it is then not timed (null). off,on
// runs each policy both ways, one row each, for an A/B in one process.
//
// Kernel choices: as a training run with the default config makes them (bench_common.h:
// use_training_kernel_policies): auto for attention (cuDNN or ours per call shape) and GEMMs, unless
// LONGTRAIN_ATTENTION_KERNEL or LONGTRAIN_GEMM_ALGO names another; the result records both.
//
// FLOPs: the anchor counts 6·N_matmul + 6·L·S·d_model per token (N_matmul = all parameters except the
// embedding; causal attention at half of 12·L·S·d). model_tflops and MFU (against 989 TFLOP/s dense
// bf16) use that formula so the two are comparable; per GPU it is divided by P. LlamaConfig::
// train_flops_per_token (same formula without the norm weights, 0.01% less) is reported beside it.
// Peak memory: device memory taken by the process after the timed steps (cudaMemGetInfo against the
// free memory at start; arenas and scratch never shrink during a step, so this is the step's peak),
// CUDA context excluded, NCCL's and cuBLAS/cuDNN's own buffers included; and allocated_peak, the
// most longtrain itself had allocated at once (runtime/device.h allocation_stats: every arena and
// scratch buffer), which is what the memory plan predicts. The anchor reports torch.cuda.max_memory_allocated
// (its caching allocator's live tensors).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "attention/distributed/distributed_attention.h"
#include "attention/local_attention.h"
#include "attention/sequence_attention.h"
#include "bench/bench_common.h"
#include "parallel/distributed.h"
#include "parallel/layout.h"
#include "model/llama.h"
#include "model/memory_plan.h"
#include "model/parameters.h"
#include "runtime/profile.h"
#include "trainer/optimizer.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

struct Options : RunRecord {
  std::vector<int64_t> lengths{8192, 32768, 65536};
  std::vector<std::string> policies{"remat_aware", "full"};  // or auto
  std::vector<model::Offload> offloads{model::Offload::none};
  std::vector<bool> cuda_graphs{false};  // --cuda-graphs off,on: each setting a row of its own
  model::Tiling tiling;
  std::string shape = "tinyllama";
  std::string merge;
  int warmup = 1, steps = 3;
  bool plan_only = false, longest = false;
  bool profile = false;  // --profile: one more step after the timed ones, timed op by op (runtime/profile.h)
  int plan_gpus = 0;  // --gpus: the group size --plan-only and --longest plan for outside the launcher
  double free_gib = 0.0, total_gib = 0.0;  // --memory FREE,TOTAL: --longest for a GPU that is not here
  attn::Schedule schedule = attn::Schedule::zigzag;
  attn::ChunkCalls chunk_calls = attn::ChunkCalls::merged;
  std::string documents;  // --documents: docmask_anchor.json, whose doc_lengths pack each window
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for_each_flag(argc, argv, "llama_bench", [&](const std::string& a, const FlagValue& next) {
    if (record_flag(a, next, o)) return true;
    if (a == "--documents") {
      o.documents = next();
    } else if (a == "--lengths") {
      o.lengths = next.integers();
      std::sort(o.lengths.begin(), o.lengths.end());  // ascending: scratch only grows, peaks stay honest
    } else if (a == "--policies") {
      o.policies.clear();
      for (const std::string& s : split_list(next())) {
        if (s != "auto") model::parse_checkpoint_policy(s);  // a clear error for a bad name
        o.policies.push_back(s);
      }
    } else if (a == "--offload") {
      o.offloads.clear();
      for (const std::string& s : split_list(next())) o.offloads.push_back(model::parse_offload(s));
    } else if (a == "--cuda-graphs") {
      o.cuda_graphs.clear();
      for (const std::string& s : split_list(next())) {
        LT_CHECK(s == "on" || s == "off", "llama_bench: --cuda-graphs takes on, off or both (off,on), got '{}'", s);
        o.cuda_graphs.push_back(s == "on");
      }
    } else if (a == "--mlp-chunk") {
      o.tiling.mlp_chunk_tokens = next.integer();
    } else if (a == "--loss-chunk") {
      o.tiling.loss_chunk_tokens = next.integer();
    } else if (a == "--head-groups") {
      o.tiling.attention_head_groups = next.integer();
    } else if (a == "--shape") {
      o.shape = next();
      LT_CHECK(o.shape == "tinyllama" || o.shape == "llama3.2-3b", "llama_bench: --shape is tinyllama or llama3.2-3b, got '{}'", o.shape);
    } else if (a == "--warmup") {
      o.warmup = next.int32();
    } else if (a == "--steps") {
      o.steps = next.int32();
    } else if (a == "--merge") {
      o.merge = next();
    } else if (a == "--plan-only") {
      o.plan_only = true;
    } else if (a == "--profile") {
      o.profile = true;
    } else if (a == "--longest") {
      o.longest = true;
    } else if (a == "--memory") {
      const std::vector<std::string> v = split_list(next());
      LT_CHECK(v.size() == 2, "llama_bench: --memory takes FREE_GIB,TOTAL_GIB");
      o.free_gib = parse_number("llama_bench", "--memory", v[0]);
      o.total_gib = parse_number("llama_bench", "--memory", v[1]);
    } else if (a == "--gpus") {
      o.plan_gpus = next.int32();
    } else if (a == "--schedule") {
      o.schedule = attn::parse_schedule(next());
    } else if (a == "--chunk-calls") {
      o.chunk_calls = attn::parse_chunk_calls(next());
    } else {
      return false;
    }
    return true;
  });
  LT_CHECK(o.steps > 0 && o.warmup >= 0, "llama_bench: --steps must be positive and --warmup non-negative");
  return o;
}

model::LlamaConfig tinyllama() {
  model::LlamaConfig c = model::tinyllama_1b_shape();
  c.max_seq_len = 1 << 20;  // the benchmark's lengths, not TinyLlama's trained 2048
  return c;
}

// Llama-3.2-3B's shape (rope scaling left out: it does not change time or memory).
model::LlamaConfig llama32_3b() {
  model::LlamaConfig c;
  c.vocab_size = 128256;
  c.dim = 3072;
  c.n_layers = 28;
  c.n_heads = 24;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.ffn_dim = 8192;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-5;
  c.tie_embeddings = true;
  c.max_seq_len = 1 << 23;
  return c;
}

// One configuration to run: a fixed policy with a fixed offload, or auto (both chosen per length).
struct Setup {
  std::optional<model::CheckpointPolicy> policy;  // empty: auto
  model::Offload offload = model::Offload::none;
  bool cuda_graphs = false;  // forward_backward replayed as CUDA graphs (LlamaModel::set_cuda_graphs)
  std::string label() const {
    const std::string graphs = cuda_graphs ? "+graphs" : "";
    if (!policy) return "auto" + graphs;
    return fmt::format("{}{}{}", model::checkpoint_policy_name(*policy),
                       offload == model::Offload::none ? "" : "+offload", graphs);
  }
};
std::vector<Setup> setups(const Options& o) {
  std::vector<Setup> out;
  for (const std::string& p : o.policies) {
    for (bool graphs : o.cuda_graphs) {
      if (p == "auto") {
        out.push_back({std::nullopt, model::Offload::none, graphs});
        continue;
      }
      for (model::Offload off : o.offloads) out.push_back({model::parse_checkpoint_policy(p), off, graphs});
    }
  }
  return out;
}

// The attention of the model (one GPU's, or the group's distributed schedule) with CUDA events around
// every call: the time attention takes inside a step, without synchronising.
class TimedAttention final : public attn::SequenceAttention {
 public:
  explicit TimedAttention(std::unique_ptr<attn::SequenceAttention> inner) : inner_(std::move(inner)) {}
  ~TimedAttention() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    ++counters.forward_calls;
    inner_->set_documents(documents());  // the model sets them (and the layer) on this wrapper
    inner_->set_layer(layer_);
    if (!timing_) return inner_->forward(o, lse, q, k, v);
    const size_t i = begin();
    inner_->forward(o, lse, q, k, v);
    end(i);
  }
  void backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                Tensor d_o) override {
    ++counters.backward_calls;
    inner_->set_documents(documents());
    inner_->set_layer(layer_);
    if (!timing_) return inner_->backward(dq, dk, dv, q, k, v, o, lse, d_o);
    const size_t i = begin();
    inner_->backward(dq, dk, dv, q, k, v, o, lse, d_o);
    end(i);
  }
  bool head_major_lse() const override { return inner_->head_major_lse(); }
  // Its events time nothing inside a capture: only untimed.
  bool graph_capturable() const override { return !timing_ && inner_->graph_capturable(); }
  void set_backward_head_groups(int64_t groups) override { inner_->set_backward_head_groups(groups); }
  int64_t backward_head_groups() const override { return inner_->backward_head_groups(); }
  // Ulysses keeps each layer's head-layout forward for its backward: without these the model would
  // recompute Q, K, V and Ulysses re-send them, a step the model never runs (and the memory plan,
  // which counts the kept layers, would not match).
  void keep_forward(int64_t n_layers) override { inner_->keep_forward(n_layers); }
  bool keeps_forward() const override { return inner_->keeps_forward(); }
  void reset() { used_ = 0; }
  // Off under CUDA graphs: an event recorded during a capture times nothing, and a replay records none.
  void set_timing(bool on) { timing_ = on; }
  bool timing() const { return timing_; }
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

  std::unique_ptr<attn::SequenceAttention> inner_;
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
  bool timing_ = true;
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

// The layout a schedule's tokens are laid out in (what `longtrain train` pairs them with).
SeqLayout layout_for(attn::Schedule s) {
  return s == attn::Schedule::distflash ? SeqLayout::contiguous : SeqLayout::zigzag;
}

// In place over the group, if there is one: the max or sum of a few host values.
void reduce_host(parallel::Communicator* comm, std::vector<double>& v, parallel::ReduceOp op) {
  if (comm != nullptr) parallel::all_reduce_host_values(*comm, v.data(), static_cast<int64_t>(v.size()), op);
}

}  // namespace

int main(int argc, char** argv) try {
  const Options opt = parse(argc, argv);
  const model::LlamaConfig cfg = opt.shape == "tinyllama" ? tinyllama() : llama32_3b();
  const model::Precision prec = model::Precision::cuda_mixed();
  const parallel::WorldInfo world = parallel::world_from_env();
  const bool planning = opt.plan_only || opt.longest;
  const int P = planning && opt.plan_gpus > 0 && world.world_size == 1 ? opt.plan_gpus : world.world_size;
  const int rank = world.rank;
  const bool main_rank = rank == 0;
  const SeqLayout layout = layout_for(opt.schedule);
  model::SequenceParallelPlan sp_plan;
  sp_plan.sp_size = P;
  sp_plan.schedule = opt.schedule;
  const model::DeviceMemory host = model::device_memory(Device::cpu);
  // The plan of a setup at S (auto: chosen for `mem`), with whether it fits `mem` and this host.
  auto plan_for = [&](const Setup& setup, int64_t S, const model::DeviceMemory& mem) {
    return model::choose_memory(cfg, prec, setup.policy, setup.policy ? std::optional(setup.offload) : std::nullopt,
                                S / P, P, sp_plan, opt.tiling, mem, host);
  };
  const std::vector<Setup> runs = setups(opt);
  const char* shape_text = opt.shape == "tinyllama"
                               ? "TinyLlama-1.1B shape (vocab 32000, dim 2048, 22 layers, 32 heads, 4 KV heads, head dim 64, ffn 5632)"
                               : "Llama-3.2-3B shape (vocab 128256, dim 3072, 28 layers, 24 heads, 8 KV heads, head dim 128, ffn 8192, tied)";

  if (!opt.merge.empty()) {  // the anchor's numbers beside a result written earlier: runs without a GPU
    json result = read_json("llama_bench --merge", "the result", opt.merge);
    json anchor = read_json("llama_bench --merge", "the anchor", opt.anchor);
    // llama_anchor.py keys its rows by length ("8192"), compiled_llama_anchor.py by length and policy
    // ("8192:remat_aware", each policy against its PyTorch twin; it also records the shape).
    const bool compiled = anchor.contains("shape");
    result["anchor"] = {
        {"script", compiled ? "bench/anchors/compiled_llama_anchor.py" : "bench/anchors/llama_anchor.py"},
        {"file", opt.anchor}};
    if (anchor.contains("params")) result["anchor_params"] = anchor["params"];
    for (json& row : result["rows"]) {
      const std::string by_length = std::to_string(row["S"].get<int64_t>());
      // A row under CUDA graphs ("none+graphs") has its policy's PyTorch twin.
      std::string policy = row["policy"].get<std::string>();
      if (policy.ends_with("+graphs")) policy.resize(policy.size() - std::string_view("+graphs").size());
      const std::string key = compiled ? by_length + ":" + policy : by_length;
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

  if (opt.plan_only) {  // the plans alone: runs without a GPU (auto needs --memory there)
    model::DeviceMemory mem{~size_t{0} / 4, ~size_t{0} / 4};
    if (opt.free_gib > 0) {
      mem = {static_cast<size_t>(opt.free_gib * kGiB), static_cast<size_t>(opt.total_gib * kGiB)};
    } else if (cuda_available()) {
      LT_CUDA_CHECK(cudaFree(nullptr));
      mem = model::device_memory(Device::cuda);
    } else {
      for (const Setup& r : runs)
        LT_CHECK(r.policy.has_value(), "llama_bench --plan-only --policies auto: no GPU here; give --memory FREE,TOTAL");
    }
    for (int64_t S : opt.lengths)
      for (const Setup& r : runs) {
        const model::MemoryChoice c = plan_for(r, S, mem);
        std::printf("%s%s%s%s\n\n", c.plan.table().c_str(), r.policy ? "" : "memory: ", c.reason.c_str(),
                    c.fits ? "" : " (does not fit)");
      }
    return 0;
  }

  if (opt.longest) {
    // The plan is exact to within a fraction of a percent of the measured peak
    // (bench/results/llama-h200-*.json), so the longest length is found on the plan, then shown to
    // train by a normal run at that length.
    model::DeviceMemory mem;
    if (opt.free_gib > 0) {
      mem.free = static_cast<size_t>(opt.free_gib * kGiB);
      mem.total = static_cast<size_t>(opt.total_gib * kGiB);
    } else {
      LT_CHECK(cuda_available(), "llama_bench --longest: no CUDA device is visible (or give --memory FREE,TOTAL)");
      LT_CUDA_CHECK(cudaFree(nullptr));
      mem = model::device_memory(Device::cuda);
    }
    const json machine = opt.free_gib > 0 ? json{{"memory", "given with --memory"}} : machine_json();
    const int64_t granule = 8192LL * P;
    json rows = json::array();
    for (const Setup& setup : runs) {
      auto fits = [&](int64_t S) { return plan_for(setup, S, mem).fits; };
      int64_t pow2 = 0;
      for (int64_t S = granule; S <= (int64_t{1} << 26) && fits(S); S *= 2) pow2 = S;
      int64_t lo = pow2 / granule, hi = std::max<int64_t>(lo, 1) * 2;  // fits(lo·g); !fits(hi·g) (pow2 · 2 fails)
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (fits(mid * granule) ? lo : hi) = mid;
      }
      const int64_t largest = lo * granule;
      json row = {{"policy", setup.label()}, {"largest_power_of_two", pow2}, {"largest_multiple_of_8192P", largest}};
      std::string chosen;
      if (largest > 0) {
        const model::MemoryChoice c = plan_for(setup, largest, mem);
        row["plan_GiB_at_largest"] = round3(c.plan.total() / kGiB);
        row["host_offload_GiB_at_largest"] = round3(c.plan.host_offload / kGiB);
        row["choice_at_largest"] = c.reason;
        chosen = c.reason;
      }
      if (main_rank)
        std::printf("longest by plan, %d GPU(s), %-11s: power of two %lld, largest %lld (plan %.2f GiB; free %.2f GiB) %s\n",
                    P, setup.label().c_str(), (long long)pow2, (long long)largest,
                    largest > 0 ? plan_for(setup, largest, mem).plan.total() / kGiB : 0.0, mem.free / kGiB, chosen.c_str());
      rows.push_back(row);
    }
    if (main_rank && !opt.out.empty())
      write_json("llama_bench", opt.out,
                 json{{"benchmark", fmt::format("longest sequence whose memory plan fits, {}", shape_text)},
                      {"host_free_GiB", round3(host.free / kGiB)}, {"tiling", {{"mlp_chunk_tokens", opt.tiling.mlp_chunk_tokens}, {"loss_chunk_tokens", opt.tiling.loss_chunk_tokens}}},
                      {"gpus", P}, {"schedule", P > 1 ? std::string(attn::schedule_name(opt.schedule)) : "local"},
                      {"free_GiB", round3(mem.free / kGiB)}, {"date", utc_date()}, {"machine", machine},
                      {"commit", opt.commit}, {"command", opt.command}, {"rows", rows}});
    return 0;
  }

  LT_CHECK(cuda_available(), "llama_bench: no CUDA device is visible");
  if (P > 1) select_cuda_device(world.local_rank);
  LT_CUDA_CHECK(cudaFree(nullptr));  // create the context before measuring free memory
  const size_t baseline_free = free_bytes();
  const json machine = machine_json();

  // The sequence-parallel group (NCCL), one GPU per rank; none on one GPU.
  std::unique_ptr<parallel::Distributed> dist;
  parallel::Communicator* group = nullptr;
  if (P > 1) {
    parallel::DistributedOptions o;
    o.sp_size = P;
    o.backend = parallel::Backend::nccl;
    dist = std::make_unique<parallel::Distributed>(world, parallel::options_from_env(o));
    group = &dist->world();
  }

  json anchor;
  if (!opt.anchor.empty()) {
    std::ifstream in(opt.anchor);
    if (in.good()) {
      in >> anchor;
    } else if (main_rank) {  // the anchor failed or was not run: measure ours anyway, and say so in the result
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
  result["benchmark"] = fmt::format(
      "Llama training step on {} GPU(s){}, {}, batch 1, bf16 mixed precision, AdamW",
      P, P > 1 ? fmt::format(" (one sequence-parallel group, {} schedule, {} layout, ZeRO-1 over the group)",
                             attn::schedule_name(opt.schedule), layout_name(layout))
               : std::string(),
      shape_text);
  result["gpus"] = P;
  if (P > 1) result["chunk_calls"] = std::string(attn::chunk_calls_name(opt.chunk_calls));
  result["date"] = utc_date();
  result["machine"] = machine;
  result["commit"] = opt.commit;
  result["command"] = opt.command;
  result["parameters"] = cfg.num_parameters();
  result["timing"] = fmt::format("wall clock over {} steps after {} warm-up steps (and trial_steps more), device "
                                 "synchronised before and after, slowest rank (the anchor: 4 steps after 2)",
                                 opt.steps, opt.warmup);
  result["flops"] =
      "model FLOPs per token = 6*N_matmul + 6*L*S*d_model (N_matmul = parameters except the embedding; causal "
      "attention at half), the anchor's formula, over the whole sequence; per GPU divided by the GPUs; MFU "
      "against 989 TFLOP/s dense bf16 per GPU";
  result["peak_memory"] =
      "ours: device memory taken by the process after the timed steps (cudaMemGetInfo vs. the start; no frees "
      "inside a step), CUDA context excluded, NCCL buffers included, largest rank; anchor: "
      "torch.cuda.max_memory_allocated";
  result["ours"] =
      "longtrain LlamaModel (cuBLASLt GEMMs, attention by cuDNN or our Hopper kernels as attention_kernel_policy "
      "says, chunked LM head + cross-entropy) + "
      "trainer::AdamW (f32 master weights and moments, global-norm clipping at 1.0); discard_grads + "
      "forward_backward + AdamW step";
  if (!anchor.is_null()) result["anchor"] = {{"script", "bench/anchors/llama_anchor.py"}, {"file", opt.anchor}};

  // Which attention kernel ran the block calls and, under auto, what each call shape chose and both
  // kernels' times; likewise the GEMMs' cuBLASLt algorithm and auto's choices. Both as a training run
  // with the default config picks them (auto), unless LONGTRAIN_ATTENTION_KERNEL (cudnn, hopper, auto)
  // or LONGTRAIN_GEMM_ALGO (heuristic, auto) says otherwise.
  const KernelPolicies policies = use_training_kernel_policies();
  result["attention_kernel_policy"] = std::string(attn::kernel_policy_name(policies.attention));
  result["gemm_algo_policy"] = std::string(ops::gemm_algo_policy_name(policies.gemm));
  if (main_rank)
    std::printf("llama_bench: %d x %s, %d SMs, %.1f GiB; %.0f parameters%s; attention kernel %s, GEMM algorithm %s\n",
                P, machine["gpu"].get<std::string>().c_str(), machine["sms"].get<int>(),
                machine["gpu_memory_gib"].get<double>(), n_all,
                P > 1 ? fmt::format("; sequence parallel, {} schedule", attn::schedule_name(opt.schedule)).c_str() : "",
                std::string(attn::kernel_policy_name(policies.attention)).c_str(),
                std::string(ops::gemm_algo_policy_name(policies.gemm)).c_str());
  const std::vector<bf16> image = parameter_image(cfg);
  json rows = json::array();
  std::vector<std::string> summary;
  if (!anchor.is_null() && anchor.contains("params")) result["anchor_params"] = anchor["params"];
  auto write_result = [&](const json& r) {
    if (opt.out.empty() || !main_rank) return;
    result["rows"] = r;
    json choices = json::array();
    for (const attn::KernelChoice& c : attn::kernel_choices()) choices.push_back(kernel_choice_json(c));
    if (!choices.empty()) result["attention_kernel_choices"] = choices;
    json gemm_choices = json::array();
    for (const ops::GemmChoice& c : ops::gemm_choices())
      gemm_choices.push_back({{"shape", c.shape}, {"algorithm", c.chosen + 1}, {"candidates", c.candidates},
                              {"ms", c.chosen_ms}, {"heuristic_first_ms", c.heuristic_ms}});
    if (!gemm_choices.empty()) result["gemm_choices"] = gemm_choices;
    write_json("llama_bench", opt.out, result);
  };

  for (int64_t S : opt.lengths) {
    LT_CHECK(S % P == 0, "llama_bench: length {} does not split over {} GPUs", S, P);
    check_layout(layout, S, P);
    // Synthetic ids; labels are the next token (the last one ignored), as HF shifts them; global
    // positions 0..S-1. This rank keeps the tokens its layout gives it.
    std::vector<int32_t> all_ids(static_cast<size_t>(S));
    uint64_t s = 0x853c49e6748fea9bull ^ static_cast<uint64_t>(S);
    for (auto& id : all_ids) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(cfg.vocab_size));
    }
    // --documents: the window packs documents of the anchor's lengths (data.document_mask as the loader
    // makes it): positions restart at each document, the label across a boundary is ignored.
    attn::Documents docs;
    if (!opt.documents.empty()) {
      const json d = read_json("llama_bench", "the document lengths (docmask_anchor.json)", opt.documents);
      LT_CHECK(d.contains(std::to_string(S)) && d[std::to_string(S)].contains("doc_lengths"),
               "llama_bench: {} has no doc_lengths for length {}; run docmask_anchor.py with that length",
               opt.documents, S);
      docs.offsets = {0};
      for (const auto& len : d[std::to_string(S)]["doc_lengths"]) docs.offsets.push_back(docs.offsets.back() + len.get<int64_t>());
      attn::check_documents(docs, S, "llama_bench --documents " + opt.documents);
    }
    auto start_of = [&](int64_t t) { return docs.empty() ? 0 : docs.offsets[docs.document_of(t)]; };
    const std::vector<int64_t> mine = layout_global_indices(layout, S, P, rank);
    const int64_t T = static_cast<int64_t>(mine.size());
    std::vector<int32_t> ids(mine.size()), labels(mine.size()), positions(mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      const int64_t t = mine[i];
      ids[i] = all_ids[static_cast<size_t>(t)];
      const bool crosses = t + 1 >= S || start_of(t + 1) == t + 1;
      labels[i] = crosses ? model::LlamaModel::kIgnoreIndex : all_ids[static_cast<size_t>(t + 1)];
      positions[i] = static_cast<int32_t>(t - start_of(t));
    }
    // Over the whole sequence: the loss is normalised by the global count.
    const int64_t valid = S - (docs.empty() ? 1 : docs.count());
    const json* anchor_row = nullptr;
    const std::string key = std::to_string(S);
    if (anchor.contains(key)) anchor_row = &anchor[key];

    for (const Setup& setup : runs) {
      const model::DeviceMemory free_now = model::device_memory(Device::cuda);
      const model::MemoryChoice choice = plan_for(setup, S, free_now);
      const model::MemoryPlan& plan = choice.plan;
      const model::CheckpointPolicy policy = choice.policy;
      const std::string label = setup.policy ? setup.label() : fmt::format("auto={}{}{}", model::checkpoint_policy_name(policy),
                                                                          choice.offload == model::Offload::none ? "" : "+offload",
                                                                          setup.cuda_graphs ? "+graphs" : "");
      json row = {{"S", S}, {"gpus", P}, {"tokens_per_gpu", T}, {"policy", setup.label()},
                  {"checkpoint", model::checkpoint_policy_name(policy)}, {"offload", model::offload_name(choice.offload)},
                  {"choice", choice.reason}, {"mlp_chunk_tokens", plan.tiling.mlp_chunk_tokens},
                  {"loss_chunk_tokens", plan.tiling.loss_chunk_tokens},
                  {"attention_head_groups", plan.tiling.attention_head_groups}};
      if (!docs.empty()) row["documents"] = docs.count();
      if (main_rank) std::printf("\n%s%s\n", plan.table().c_str(), choice.reason.c_str());
      row["plan_GiB"] = round3(plan.total() / kGiB);
      if (plan.host_offload > 0) row["host_offload_GiB"] = round3(plan.host_offload / kGiB);
      // Every rank decides the same way (same plan, same GPUs); a failure on one rank after this point
      // is a real error, not a skip.
      std::string skip;
      if (!choice.fits) {
        skip = choice.reason;
        try {
          model::check_memory_fits(plan, free_now, &host);
        } catch (const std::exception& e) {
          skip = e.what();
        }
      }
      std::vector<double> skip_any = {skip.empty() ? 0.0 : 1.0};
      reduce_host(group, skip_any, parallel::ReduceOp::max);
      if (skip.empty() && skip_any[0] > 0) skip = "another rank's memory plan does not fit";
      if (!skip.empty()) {
        row["skipped"] = skip;
        if (main_rank) std::printf("S=%lld %s: skipped: %s\n", (long long)S, label.c_str(), skip.c_str());
        summary.push_back(fmt::format("S={:7} {:11}: skipped: {}", S, label, skip));
        rows.push_back(row);
        write_result(rows);
        continue;
      }
      {
        const size_t free_before = free_bytes();
        reset_allocation_peak(Device::cuda);
        attn::SequenceAttentionSpec spec;
        spec.schedule = opt.schedule;
        spec.causal = true;
        spec.scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
        spec.layout = layout;
        spec.chunk_calls = opt.chunk_calls;
        if (dist) {
          spec.sp = &dist->sp();
          spec.intra_node = &dist->intra_node();
          spec.inter_node = &dist->inter_node();
        }
        auto attention = std::make_unique<TimedAttention>(attn::make_sequence_attention(spec));
        TimedAttention* timed = attention.get();
        model::LlamaModel m(cfg, prec, policy, T, std::move(attention), P, opt.tiling, choice.offload);
        if (setup.cuda_graphs) {
          LT_CHECK(P == 1, "llama_bench: --cuda-graphs on runs on one GPU (the distributed schedules' transfers are "
                   "host calls between the kernels)");
          LT_CHECK(docs.empty(), "llama_bench: --cuda-graphs on does not combine with --documents (the document "
                   "mask's block pairs are decided on the host for each batch)");
          timed->set_timing(false);
          const std::string why_not = m.set_cuda_graphs(true);
          LT_CHECK(why_not.empty(), "llama_bench: --cuda-graphs on for {}: {}", label, why_not);
        }
        LT_CHECK(static_cast<size_t>(m.params().flat().numel()) >= image.size(), "llama_bench: parameter image larger than the arena");
        auto load_image = [&] {
          copy(Tensor(m.params().base(), DType::bf16, {static_cast<int64_t>(image.size())}, Device::cuda),
               Tensor(const_cast<bf16*>(image.data()), DType::bf16, {static_cast<int64_t>(image.size())}));
        };
        load_image();
        trainer::AdamWConfig ocfg;  // torch.optim.AdamW's defaults, as the anchor uses them, lr 1e-4
        ocfg.lr = 1e-4;
        ocfg.beta1 = 0.9;
        ocfg.beta2 = 0.999;
        ocfg.eps = 1e-8;
        ocfg.weight_decay = 0.01;
        ocfg.schedule = trainer::LrSchedule::constant;
        ocfg.grad_clip = 1.0;
        ocfg.no_decay = {};
        // ZeRO-1 as the trainer shards it: rank r owns the r-th of P equal shards of the flat buffer.
        const int64_t flat = m.params().flat().numel(), shard = flat / P;
        trainer::AdamW adamw(m.params(), ocfg, rank * shard, (rank + 1) * shard);
        CudaBuffer d_ids(ids), d_labels(labels), d_pos(positions);
        // Checked on the host as the trainer checks a batch when it makes it (no device read in the step).
        const int64_t valid_labels = model::check_token_ids(
            Tensor(ids.data(), DType::i32, {static_cast<int64_t>(ids.size())}),
            Tensor(labels.data(), DType::i32, {static_cast<int64_t>(labels.size())}), cfg.vocab_size,
            model::LlamaModel::kIgnoreIndex);
        const model::TokenShard tokens{d_ids.t, d_labels.t, d_pos.t, docs, valid_labels};
        // The step's loss and squared gradient norm stay on the device until its one host read, as in
        // the trainer.
        CudaBuffer sums(DType::f64, {2});

        // Three events per timed step (start, after forward+backward, after the optimizer), read after
        // the wall-clock measurement so that reading them adds no synchronisation inside it.
        CudaEvents events(static_cast<size_t>(3 * opt.steps));
        double loss_sum = 0.0, grad_norm = 0.0;
        // Timed step i records events 3i (start), 3i + 1 (after forward+backward) and 3i + 2 (after the
        // optimizer); i < 0 is an untimed step.
        auto step = [&](int i) {
          const size_t e = static_cast<size_t>(3 * std::max(i, 0));
          if (i >= 0) events.record(e);
          m.discard_grads();  // as the trainer: the backward overwrites them
          zero(sums.t);
          m.forward_backward(tokens, 1.0 / static_cast<double>(valid), sums.t.narrow(0, 0, 1));
          if (i >= 0) events.record(e + 1);
          const profile::Region optimizer_region("optimizer", Device::cuda);
          // The trainer's step: (reduce-scatter,) Σ of squares (over the group), the one host read,
          // the shard update (, all-gather).
          const Tensor grads = m.grads().flat();
          const Tensor grad_shard = grads.narrow(0, adamw.shard_begin(), shard);
          if (group != nullptr) group->reduce_scatter(grad_shard, grads);
          ops::sum_into(sums.t.narrow(0, 1, 1), grad_shard, ops::SumOf::squares, /*accumulate=*/false);
          if (group != nullptr) group->all_reduce(sums.t);
          double host[2];
          copy(Tensor(host, DType::f64, {2}), sums.t);
          grad_norm = std::sqrt(host[1]);
          adamw.step_shard(m.params(), grad_shard, grad_norm);
          if (group != nullptr) {
            const Tensor params = m.params().flat();
            group->all_gather(params, params.narrow(0, adamw.shard_begin(), shard));
          }
          if (i >= 0) events.record(e + 2);
          loss_sum = host[0];  // over the group already
        };
        const auto t_warm = std::chrono::steady_clock::now();
        int64_t attention_trial_calls = attn::kernel_trial_calls();
        for (int i = 0; i < opt.warmup; ++i) step(-1);
        // Under auto, trials may still run: GEMM shapes that add into their output in place and run a
        // few times a step (the LM head's weight gradient over the loss chunks after the first: one
        // trial run per call), and attention shapes (whose timing starts at their 49th call, in the
        // second step). Warm up until every GEMM trial has ended and a step ran no attention trial
        // call, so none runs in a timed step. The ranks of a group agree on it (a rank stepping alone
        // would hang the collectives).
        auto trials_pending = [&] {
          const int64_t calls = attn::kernel_trial_calls();
          const bool attention_trials = calls != attention_trial_calls;  // in the steps since the last look
          attention_trial_calls = calls;
          std::vector<double> pending = {static_cast<double>(ops::gemm_trials_pending() + (attention_trials ? 1 : 0))};
          reduce_host(group, pending, parallel::ReduceOp::max);
          return pending[0] > 0;
        };
        int trial_steps = 0;
        for (; trial_steps < 32 && trials_pending(); ++trial_steps) step(-1);
        // Under CUDA graphs a step's forward and backward is captured after an eager call that ran no
        // kernel trial: warm up until the graph exists, so that every timed step replays it.
        int graph_steps = 0;
        if (setup.cuda_graphs) {
          for (; graph_steps < 3 && m.graph_stats().captures == 0 && m.graph_stats().off_reason.empty(); ++graph_steps)
            step(-1);
          const model::LlamaModel::GraphStats g = m.graph_stats();
          LT_CHECK(g.captures > 0 && g.off_reason.empty(), "llama_bench: no CUDA graph for {} at S={}: {}", label, S,
                   g.off_reason.empty() ? std::string("none captured in 3 more warm-up steps") : g.off_reason);
        }
        if (trial_steps > 0 || graph_steps > 0) {
          // Back to the initial parameters and an untouched optimizer, then the warm-up steps again: the
          // timed steps start from the same state whatever the trials (and the graph's capture) took.
          // (Steps on this one batch memorise it; a model near zero loss steps measurably slower: 2-3%
          // at 8K after 17 steps against 8, bench/results/step-ce-rope-discard-h200-2026-12-04.json.)
          // Nothing is freed, so a captured graph stays valid and the warm-up steps replay it.
          load_image();
          zero(adamw.m().flat());
          zero(adamw.v().flat());
          if (adamw.master().bytes() > 0) {
            const Tensor own = m.params().flat().narrow(0, adamw.shard_begin(), shard);
            ops::convert(adamw.master().flat().narrow(0, shard), own);
          }
          adamw.set_steps_taken(0);
          for (int i = 0; i < opt.warmup; ++i) step(-1);
        }
        LT_CUDA_CHECK(cudaDeviceSynchronize());
        if (group) group->barrier();
        const double warm_s = seconds_since(t_warm);
        timed->reset();
        const int64_t forwards_timed_before = timed->counters.forward_calls;
        const int64_t replays_before = m.graph_stats().replays;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < opt.steps; ++i) step(i);
        LT_CUDA_CHECK(cudaDeviceSynchronize());
        const int64_t replays_timed = m.graph_stats().replays - replays_before;
        LT_CHECK(!setup.cuda_graphs || replays_timed == opt.steps,
                 "llama_bench: {} of the {} timed steps of {} at S={} replayed their CUDA graph{}", replays_timed,
                 opt.steps, label, S,
                 m.graph_stats().off_reason.empty() ? "" : " (graphs went off: " + m.graph_stats().off_reason + ")");
        double step_s = seconds_since(t0) / opt.steps;
        double fb_ms = 0.0, opt_ms = 0.0;
        for (int i = 0; i < opt.steps; ++i) {
          const size_t e = static_cast<size_t>(3 * i);
          fb_ms += events.ms(e, e + 1) / opt.steps;
          opt_ms += events.ms(e + 1, e + 2) / opt.steps;
        }
        double attn_ms = timed->elapsed_ms() / opt.steps;
        const double forwards_per_layer =
            static_cast<double>(timed->counters.forward_calls - forwards_timed_before) / (opt.steps * cfg.n_layers);
        const size_t free_after = free_bytes();
        // --profile: one more step, each op between a pair of events (which adds a few microseconds per
        // op, so this step is not the timed one); the regions' sum against the step says how much of it
        // is launch gaps and host work.
        json op_profile;
        if (opt.profile) {
          CudaEvents span(2);
          profile::enable(true);
          span.record(0);
          step(-1);
          span.record(1);
          const std::vector<profile::Entry> entries = profile::report();
          profile::enable(false);
          double in_ops = 0.0;
          json ops_json = json::array();
          for (const profile::Entry& en : entries) {
            ops_json.push_back({{"name", en.name}, {"ms", round3(en.ms)}, {"calls", en.calls}});
            // Regions that hold other regions: counted through what they hold.
            if (en.name != "optimizer") in_ops += en.ms;
          }
          const double span_ms = span.ms(0, 1);
          op_profile = {{"step_ms", round3(span_ms)}, {"in_ops_ms", round3(in_ops)},
                        {"outside_ops_ms", round3(span_ms - in_ops)}, {"ops", ops_json}};
          if (main_rank) {
            std::printf("profile of one step (S=%lld): %.1f ms, %.1f in ops, %.1f outside them\n", (long long)S, span_ms,
                        in_ops, span_ms - in_ops);
            for (const profile::Entry& en : entries)
              std::printf("  %-28s %9.2f ms %6lld calls %5.1f%%\n", en.name.c_str(), en.ms, (long long)en.calls,
                          100.0 * en.ms / span_ms);
          }
        }
        // The slowest rank's times, the largest rank's memory; the loss over the whole sequence.
        std::vector<double> maxes = {step_s, fb_ms, opt_ms, attn_ms, static_cast<double>(baseline_free - free_after),
                                     static_cast<double>(free_before - free_after), warm_s,
                                     static_cast<double>(allocation_stats(Device::cuda).peak)};
        reduce_host(group, maxes, parallel::ReduceOp::max);
        step_s = maxes[0];
        fb_ms = maxes[1];
        opt_ms = maxes[2];
        attn_ms = maxes[3];
        const double peak = maxes[4], model_bytes = maxes[5], tracked = maxes[7];
        const double loss = loss_sum / static_cast<double>(valid);

        const double tok_s = static_cast<double>(S) / step_s;
        // With documents the attention term counts the pairs computed (12·L·d per causal pair; the dense
        // window's S²/2 pairs give the anchor's 6·L·S·d per token).
        const double flops =
            docs.empty() ? anchor_flops_per_token(S) * static_cast<double>(S)
                         : 6.0 * n_matmul * static_cast<double>(S) +
                               12.0 * cfg.n_layers * cfg.dim * static_cast<double>(attn::document_pairs(docs, S, true));
        const double ours_flops = cfg.train_flops_per_token(S) * static_cast<double>(S);
        row["step_s"] = round3(step_s);
        row["tok_per_s"] = std::round(tok_s);
        row["tok_per_s_per_gpu"] = std::round(tok_s / P);
        row["model_tflops"] = round1(flops / step_s / 1e12);
        row["model_tflops_per_gpu"] = round1(flops / step_s / 1e12 / P);
        if (docs.empty()) row["model_tflops_longtrain_formula"] = round1(ours_flops / step_s / 1e12);
        row["mfu_989"] = round3(flops / step_s / 989e12 / P);
        row["peak_GiB"] = round1(peak / kGiB);
        row["peak_over_plan"] = round3(peak / static_cast<double>(plan.total()));
        row["allocated_peak_GiB"] = round3(tracked / kGiB);
        row["allocated_peak_over_plan"] = round3(tracked / static_cast<double>(plan.total()));
        row["model_GiB"] = round1(model_bytes / kGiB);
        row["loss"] = round3(loss);
        row["grad_norm"] = round3(grad_norm);
        row["first_steps_s"] = round3(maxes[6]);
        row["trial_steps"] = trial_steps;  // GEMM and attention trials (gemm_trial_steps until 2026-12-07)
        row["attention_forwards_per_layer"] = forwards_per_layer;
        if (!op_profile.is_null()) row["profile"] = op_profile;
        row["split_ms"] = {{"forward_backward", round1(fb_ms)},
                           {"attention_in_forward_backward", timed->timing() ? json(round1(attn_ms)) : json(nullptr)},
                           {"optimizer", round1(opt_ms)}};
        row["cuda_graphs"] = setup.cuda_graphs;
        if (setup.cuda_graphs) {
          const model::LlamaModel::GraphStats g = m.graph_stats();
          row["cuda_graph"] = {{"captures", g.captures}, {"replays_in_timed_steps", replays_timed},
                               {"dropped", g.dropped}, {"capture_warmup_steps", graph_steps}};
        }
        std::string line = fmt::format(
            "S={:7} {}GPU {:11}: {:8.3f} s/step, {:7.0f} tok/s, {:5.1f} TFLOP/s/GPU, MFU {:.3f}, peak {:5.1f} GiB "
            "(plan {:5.1f}); fwd+bwd {:.0f} ms (attention {:.0f}, {:.0f} fwd/layer), optimizer {:.0f} ms; loss {:.3f}",
            S, P, label, step_s, tok_s, flops / step_s / 1e12 / P,
            flops / step_s / 989e12 / P, peak / kGiB, plan.total() / kGiB, fb_ms, attn_ms, forwards_per_layer, opt_ms,
            loss);
        if (anchor_row != nullptr && anchor_row->is_object() && anchor_row->contains("tok_per_s")) {
          const double a_tok = (*anchor_row)["tok_per_s"].get<double>();
          row["anchor"] = *anchor_row;
          row["ratio_tok_per_s"] = round3(tok_s / a_tok);
          line += fmt::format("; anchor {:.0f} tok/s → {:.2f}x", a_tok, tok_s / a_tok);
        } else if (anchor_row != nullptr) {
          row["anchor"] = *anchor_row;
        }
        if (main_rank) std::printf("%s\n", line.c_str());
        summary.push_back(line);
      }
      std::fflush(stdout);
      rows.push_back(row);
      write_result(rows);  // after every configuration: a run stopped at its time limit keeps what it measured
    }
  }
  if (main_rank) {
    std::printf("\n");
    for (const std::string& l : summary) std::printf("%s\n", l.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  return report_failure("llama_bench", e);
}
