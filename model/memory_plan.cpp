#include "model/memory_plan.h"

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#ifdef LONGTRAIN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "attention/distributed/ulysses_attention.h"
#include "attention/distributed/workspace.h"
#include "kernels/ops.h"
#include "model/parameters.h"
#include "parallel/process_group.h"

namespace longtrain::model {

bool keeps_activation(CheckpointPolicy policy, std::string_view kind) {
  if (policy == CheckpointPolicy::none) return true;
  if (policy == CheckpointPolicy::remat_aware) return kind == "o" || kind == "lse";
  return false;
}

Tiling resolve_tiling(const LlamaConfig& config, const Precision& precision, Tiling requested, int64_t max_tokens) {
  LT_CHECK(requested.mlp_chunk_tokens >= 0, "model.mlp_chunk_tokens is {}; expected a token count, or 0 for auto",
           requested.mlp_chunk_tokens);
  LT_CHECK(requested.loss_chunk_tokens >= 0, "model.loss_chunk_tokens is {}; expected a token count, or 0 for auto",
           requested.loss_chunk_tokens);
  const int64_t T = std::max<int64_t>(max_tokens, 1);
  Tiling t;
  t.mlp_chunk_tokens = std::min(T, requested.mlp_chunk_tokens > 0 ? requested.mlp_chunk_tokens : kAutoMlpChunkTokens);
  t.loss_chunk_tokens =
      std::min(T, requested.loss_chunk_tokens > 0 ? requested.loss_chunk_tokens : kAutoLossChunkTokens);
  const int64_t hkv = config.n_kv_heads;
  LT_CHECK(requested.attention_head_groups >= 0 &&
               (requested.attention_head_groups == 0 || hkv % requested.attention_head_groups == 0),
           "model.attention_head_groups is {}; expected a divisor of the {} kv heads (model.n_kv_heads), or 0 for auto",
           requested.attention_head_groups, hkv);
  t.attention_head_groups = requested.attention_head_groups;
  if (t.attention_head_groups == 0) {
    t.attention_head_groups = 1;
    if (precision.device == Device::cuda && T % kHeadGroupTokenMultiple == 0) {
      while (t.attention_head_groups < hkv &&
             (hkv % t.attention_head_groups != 0 ||
              attention_backward_workspace_bytes(T, config.n_heads / t.attention_head_groups, config.head_dim) >
                  kAutoAttentionWorkspaceBytes))
        ++t.attention_head_groups;
    }
  }
  return t;
}

namespace {
// The per-layer kinds computed token by token (a chunk at a time) rather than by attention.
bool token_local(std::string_view kind) { return kind != "qkv" && kind != "o" && kind != "lse"; }
}  // namespace

namespace {
struct Kind {
  const char* name;
  std::vector<int64_t> shape;  // without the token dimension
  DType dtype;
};
// The per-layer kinds; the token dimension is T for a kept kind and for attention's tensors, one MLP
// chunk for a token-local kind's scratch.
std::vector<Kind> layer_kinds(const LlamaConfig& config, const Precision& precision) {
  const int64_t C = config.dim, F = config.ffn_dim, Hq = config.n_heads;
  const DType act = precision.act, stat = precision.stat;
  return {
      {"n1", {C}, act},          {"rstd1", {}, stat},       {"qkv", {config.qkv_dim()}, act},
      {"o", {Hq, config.head_dim}, act}, {"lse", {Hq}, stat}, {"h", {C}, act},
      {"n2", {C}, act},          {"rstd2", {}, stat},       {"gate_up", {2 * F}, act},
      {"s", {F}, act},
  };
}
std::vector<int64_t> with_tokens(int64_t tokens, const std::vector<int64_t>& rest) {
  std::vector<int64_t> shape = {tokens};
  shape.insert(shape.end(), rest.begin(), rest.end());
  return shape;
}
}  // namespace

void add_offload_host_entries(Arena& host, const LlamaConfig& config, const Precision& precision,
                              CheckpointPolicy policy, int64_t max_tokens) {
  for (int64_t l = 0; l < config.n_layers; ++l) {
    host.add(fmt::format("residual.{}", l), {max_tokens, config.dim}, precision.act);
    for (const Kind& k : layer_kinds(config, precision))
      if (keeps_activation(policy, k.name))
        host.add(fmt::format("layers.{}.{}", l, k.name), with_tokens(max_tokens, k.shape), k.dtype);
  }
}

void add_activation_entries(Arena& acts, const LlamaConfig& config, const Precision& precision,
                            CheckpointPolicy policy, int64_t max_tokens, const Tiling& tiling, Offload offload) {
  const int64_t T = max_tokens, C = config.dim, F = config.ffn_dim, Hq = config.n_heads;
  LT_CHECK(tiling.mlp_chunk_tokens > 0 && tiling.mlp_chunk_tokens <= T && tiling.loss_chunk_tokens > 0 &&
               tiling.loss_chunk_tokens <= T,
           "token chunks {} / {} for {} tokens were not resolved (resolve_tiling)", tiling.mlp_chunk_tokens,
           tiling.loss_chunk_tokens, T);
  const int64_t M = tiling.mlp_chunk_tokens, Lc = tiling.loss_chunk_tokens;
  const DType act = precision.act, stat = precision.stat;
  const bool slots = offload == Offload::checkpoints;
  // Residual stream: x_0 .. x_L, the one tensor every policy keeps per layer (offloaded: its slots).
  for (int64_t l = 0; l < (slots ? kOffloadSlots : config.n_layers + 1); ++l)
    acts.add(slots ? fmt::format("residual_slot.{}", l) : fmt::format("residual.{}", l), {T, C}, act);
  // Per-layer tensors, kept per layer (or per slot) or as one scratch copy, by policy.
  for (const Kind& k : layer_kinds(config, precision)) {
    if (keeps_activation(policy, k.name)) {
      for (int64_t l = 0; l < (slots ? kOffloadSlots : config.n_layers); ++l)
        acts.add(slots ? fmt::format("slot.{}.{}", l, k.name) : fmt::format("layers.{}.{}", l, k.name),
                 with_tokens(T, k.shape), k.dtype);
    } else {
      acts.add(fmt::format("scratch.{}", k.name), with_tokens(token_local(k.name) ? M : T, k.shape), k.dtype);
    }
  }
  // Scratch of the forward (projection outputs) and of the backward (activation gradients): one chunk
  // for token-local work; the shard for the residual stream's gradient and attention's dO and dQKV.
  // RoPE's cos | sin per token, formed once per step (ops::rope_table): f32 as the CUDA kernels read
  // it, f64 on the CPU so the reference rotates exactly as rope_forward does.
  acts.add("rope_table", {T, config.head_dim}, precision.device == Device::cpu ? DType::f64 : DType::f32);
  acts.add("final_norm", {Lc, C}, act);
  acts.add("final_rstd", {Lc}, stat);
  acts.add("d_final_norm", {Lc, C}, act);
  acts.add("losses", {T}, stat);
  // forward_backward's gradient factor, read on the device (ops::CrossEntropyParams::grad_scale_from);
  // f64 on the CPU so the reference scales exactly as with the double it is given.
  acts.add("grad_scale", {1}, precision.device == Device::cpu ? DType::f64 : DType::f32);
  acts.add("d_residual", {T, C}, act);
  acts.add("d_norm", {M, C}, act);
  acts.add("d_s", {M, F}, act);
  acts.add("d_gate_up", {M, 2 * F}, act);
  acts.add("d_o", {T, Hq * config.head_dim}, act);
  acts.add("d_qkv", {T, config.qkv_dim()}, act);
}

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

// The CUDA ops' scratch buffers grow in whole MiB (kernels/cuda/cuda_common.cu).
size_t scratch_bytes(size_t bytes) { return (bytes + kMiB - 1) / kMiB * kMiB; }

size_t arena_bytes(const Arena& a) { return a.bytes(); }

std::string human(size_t bytes) {
  if (bytes >= kGiB) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / kGiB);
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / kMiB);
}

int cuda_sm_count() {
#ifdef LONGTRAIN_HAS_CUDA
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0)
    return sms;
#endif
  return 132;  // an H100/H200; only sizes rmsnorm_backward's few-MiB partial sums
}

}  // namespace

std::string tiling_summary(const Tiling& tiling, int sp_size) {
  return fmt::format("token chunks: MLP {}, loss {}{}", tiling.mlp_chunk_tokens, tiling.loss_chunk_tokens,
                     sp_size == 1 && tiling.attention_head_groups > 1
                         ? fmt::format("; attention backward in {} head groups", tiling.attention_head_groups)
                         : std::string());
}

size_t attention_backward_workspace_bytes(int64_t tokens, int64_t q_heads, int64_t head_dim) {
  // cudnn_sdpa.cpp's backward: cuDNN's own workspace (fp32, Hq·T·D, as measured with cuDNN 9.19), the
  // fp32 dQ accumulator it is given (same size) and rowsum(dO ⊙ O). Our Hopper backward
  // (hopper_attention_bwd.cu) takes the same two scratch buffers: its f32 dQ accumulator has T rounded
  // up to its 128-row query tiles (hopper::backward_dq_accum_bytes), and delta = rowsum(dO ⊙ O).
  const size_t q_elems = static_cast<size_t>(tokens * q_heads * head_dim);
  const size_t dq_accum_elems = static_cast<size_t>((tokens + 127) / 128 * 128 * q_heads * head_dim);
  return scratch_bytes(q_elems * 4 + 256) + scratch_bytes(dq_accum_elems * 4) +
         scratch_bytes(static_cast<size_t>(tokens * q_heads) * 4);
}

MemoryPlan plan_memory(const LlamaConfig& config, const Precision& precision, CheckpointPolicy policy,
                       int64_t tokens_per_rank, int64_t optimizer_shards, const SequenceParallelPlan& sp,
                       const Tiling& tiling, Offload offload) {
  config.validate();
  LT_CHECK(tokens_per_rank > 0, "a memory plan needs at least one token per rank (got {})", tokens_per_rank);
  LT_CHECK(optimizer_shards >= 1, "a memory plan needs at least one optimizer shard (got {})", optimizer_shards);
  LT_CHECK(sp.sp_size >= 1 && sp.nodes >= 1, "a memory plan needs sp_size >= 1 and nodes >= 1 (got {}, {})",
           sp.sp_size, sp.nodes);
  MemoryPlan plan;
  plan.config = config;
  plan.precision = precision;
  plan.policy = policy;
  plan.tokens = tokens_per_rank;
  plan.tiling = resolve_tiling(config, precision, tiling, tokens_per_rank);
  plan.optimizer_shards = optimizer_shards;
  plan.sp = sp;
  plan.offload = offload;
  const Device dev = precision.device;

  // Parameters and gradients: LlamaModel's tables, padded as it pads them for flat shards.
  Arena params("parameters", dev);
  add_parameter_entries(params, config, precision.param);
  params.pad_to_multiple(static_cast<size_t>(optimizer_shards) * dtype_size(precision.param));
  plan.parameters = arena_bytes(params);
  Arena grads("gradients", dev);  // the same element layout, in the gradients' dtype
  grads.add_mirror(params, precision.grad());
  plan.gradients = arena_bytes(grads);

  // Optimizer state as trainer::AdamW builds it: flat arenas over this rank's shard of the parameters'
  // flat view (padding between tensors included), moments in f32 (f64 for an f64 model), and a master
  // copy in that dtype when the parameters are stored in another (bf16).
  const DType state = precision.param == DType::f64 ? DType::f64 : DType::f32;
  const int64_t flat = static_cast<int64_t>(plan.parameters / dtype_size(precision.param));
  const int64_t shard = std::max<int64_t>(flat / optimizer_shards, 1);
  plan.adam_m = plan.adam_v = static_cast<size_t>(shard) * dtype_size(state);
  plan.master_weights = precision.param != state ? plan.adam_m : 0;

  // Activations: the model's own table, split into what layers keep and what is scratch.
  Arena acts("activations", dev);
  add_activation_entries(acts, config, precision, policy, tokens_per_rank, plan.tiling, offload);
  plan.activations = arena_bytes(acts);
  const std::vector<ArenaEntry>& table = acts.table();
  for (size_t i = 0; i < table.size(); ++i) {
    const ArenaEntry& e = table[i];
    // An entry's footprint runs to the next entry's offset (alignment padding included).
    const size_t end = i + 1 < table.size() ? table[i + 1].offset : acts.bytes();
    const size_t footprint = end - e.offset;
    auto starts = [&](const char* prefix) { return e.name.rfind(prefix, 0) == 0; };
    // Offloaded, the saved part on the device is the slots, one of which holds what one layer keeps.
    if (starts("residual.") || starts("layers.") || starts("residual_slot.") || starts("slot.")) plan.saved += footprint;
    if (e.name == "residual.0" || starts("layers.0.") || e.name == "residual_slot.0" || starts("slot.0."))
      plan.saved_per_layer += footprint;
  }
  if (offload == Offload::checkpoints) {
    Arena host("offloaded checkpoints", Device::cpu);
    add_offload_host_entries(host, config, precision, policy, tokens_per_rank);
    plan.host_offload = host.allocation_bytes();
  }
  plan.activation_scratch = plan.activations - plan.saved;
  std::vector<std::string_view> kept = {"x"};
  for (const char* kind : {"n1", "rstd1", "qkv", "o", "lse", "h", "n2", "rstd2", "gate_up", "s"})
    if (keeps_activation(policy, kind)) kept.push_back(kind);
  plan.saved_kinds = fmt::format("{}", fmt::join(kept, ", "));

  // Workspaces outside the arenas.
  const int64_t T = tokens_per_rank, V = config.vocab_size, C = config.dim, Hq = config.n_heads,
                Hkv = config.n_kv_heads, D = config.head_dim;
  const int64_t chunk = plan.tiling.loss_chunk_tokens;  // head() calls the op once per loss chunk
  const size_t act = dtype_size(precision.act);
  const size_t q_elems = static_cast<size_t>(T * Hq * D), kv_elems = static_cast<size_t>(T * Hkv * D);
  if (dev == Device::cuda) {
    // cross_entropy.cu: f32 logits and act-dtype d(logits) of one chunk.
    plan.lm_head_workspace = scratch_bytes(static_cast<size_t>(chunk * V) * 4) +
                             scratch_bytes(static_cast<size_t>(chunk * V) * act);
    // One rank's backward hands cuDNN the model's O and lets it write dQ/dK/dV straight into the fused
    // dQKV buffer (no more scratch), in attention_head_groups calls of Hq / groups query heads each.
    const int64_t groups = sp.sp_size > 1 ? 1 : plan.tiling.attention_head_groups;
    plan.attention_workspace = attention_backward_workspace_bytes(T, Hq / groups, D);
    if (sp.sp_size > 1) {
      // local_attention.cu under a distributed schedule: the block's bf16 dQ/dK/dV before they are added
      // into the schedule's f32 accumulators; burst (visiting query rows) and distflash with helpers
      // (P >= 3) rebuild a bf16 O stand-in from D for the rows whose O is not on this rank.
      plan.attention_workspace += scratch_bytes(q_elems * 2) + 2 * scratch_bytes(kv_elems * 2);
      if (sp.schedule == attn::Schedule::burst || (sp.schedule == attn::Schedule::distflash && sp.causal && sp.sp_size >= 3))
        plan.attention_workspace += scratch_bytes(q_elems * 2);
    }
    // linear.cu's cuBLASLt workspace (32 MiB), rmsnorm_backward's partial sums, embedding_backward's
    // sort, the bad-index flag, sum_squares' result.
    const int64_t norm_blocks = std::min<int64_t>(T, 4LL * cuda_sm_count());
    plan.gemm_workspace = scratch_bytes(32 * kMiB) + scratch_bytes(static_cast<size_t>(norm_blocks * C) * 4) +
                          scratch_bytes(ops::embedding_backward_scratch_bytes(Device::cuda, T, V)) + scratch_bytes(4) +
                          scratch_bytes(8);
  } else {
    // kernels/cpu/cross_entropy.cpp: one chunk of logits (then their gradient) in the model's dtype.
    plan.lm_head_workspace = static_cast<size_t>(chunk * V) * act;
  }
  // trainer.cpp's token staging arena (train) and evaluate()'s staging and losses arenas, each an
  // Arena allocation rounded to 256 bytes.
  auto arena_allocation = [&](const std::vector<std::pair<int64_t, DType>>& entries) {
    Arena a("tokens", dev);
    int i = 0;
    for (const auto& [n, dtype] : entries) a.add(fmt::format("e{}", i++), {n}, dtype);
    return a.allocation_bytes();
  };
  const size_t staging = arena_allocation({{T, DType::i32}, {T, DType::i32}, {T, DType::i32}});
  // ... and the training step's device sums (loss, squared gradient norm, stop flag).
  plan.token_buffers = 2 * staging + arena_allocation({{T, precision.stat}}) + arena_allocation({{3, DType::f64}});
  if (sp.sp_size > 1) {
    attn::ScheduleWorkspaceShape shape;
    shape.tokens = T;
    shape.q_heads = Hq;
    shape.kv_heads = Hkv;
    shape.head_dim = D;
    shape.dtype = precision.act;
    shape.stat = precision.stat;
    shape.device = dev;
    const int U = sp.ulysses_size;
    const bool hybrid = U > 1 && U < sp.sp_size && sp.schedule != attn::Schedule::ulysses;
    const int head_split = sp.schedule == attn::Schedule::ulysses ? sp.sp_size : hybrid ? U : 1;
    if (head_split > 1 && attention_keeps_forward(policy, offload)) {
      shape.ulysses_keeps_forward = true;
      plan.attention_kept = static_cast<size_t>(config.n_layers) *
                            attn::ulysses_kept_bytes(head_split, T, Hq, Hkv, D, precision.act, precision.stat, dev);
    }
    if (hybrid) {
      // The 2D hybrid: Ulysses' buffers over U ranks, and the ring schedule over sp_size / U ranks on the
      // gathered U·T tokens of this rank's heads (attention/distributed/ulysses_attention.h); burst's
      // ring across the groups is a double ring when it spans nodes that hold whole groups alike.
      attn::ScheduleWorkspaceShape across = shape;
      across.tokens = U * T;
      across.q_heads = Hq / U;
      across.kv_heads = std::max<int64_t>(Hkv / U, 1);
      const int R = sp.sp_size / U;
      const parallel::ParallelShape group{sp.sp_size, sp.sp_size / sp.nodes, sp.sp_size, U};
      const int across_nodes = sp.schedule == attn::Schedule::burst ? parallel::ulysses_ring_nodes(group) : 1;
      plan.schedule_workspace = attn::schedule_workspace_bytes(attn::Schedule::ulysses, sp.causal, U, 1, shape) +
                                attn::schedule_workspace_bytes(sp.schedule, sp.causal, R, across_nodes, across);
    } else {
      plan.schedule_workspace = attn::schedule_workspace_bytes(sp.schedule, sp.causal, sp.sp_size, sp.nodes, shape);
    }
  }
  return plan;
}

std::string MemoryPlan::table() const {
  const Precision& p = precision;
  std::string out = fmt::format(
      "memory plan: {} parameters, {} layers, dim {}, vocab {}; {} (parameters {}, activations {}, statistics {}); "
      "checkpoint {}, offload {}; {} tokens per rank{}; {}\n",
      config.num_parameters(), config.n_layers, config.dim, config.vocab_size, p.device == Device::cuda ? "cuda" : "cpu",
      dtype_name(p.param), dtype_name(p.act), dtype_name(p.stat), checkpoint_policy_name(policy), offload_name(offload), tokens,
      sp.sp_size > 1 ? fmt::format(" ({} sequence-parallel ranks, {} schedule)", sp.sp_size,
                                   attn::schedule_name(sp.schedule))
                     : std::string(),
      tiling_summary(tiling, sp.sp_size));
  auto row = [&](const std::string& what, size_t bytes, const std::string& detail) {
    out += fmt::format("  {:<22} {:>11}   {}\n", what, human(bytes), detail);
  };
  const DType state = p.param == DType::f64 ? DType::f64 : DType::f32;
  row("parameters", parameters, fmt::format("{} × {}", config.num_parameters(), dtype_name(p.param)));
  row("gradients", gradients, fmt::format("{} × {}", config.num_parameters(), dtype_name(p.grad())));
  if (master_weights > 0) row("master weights", master_weights, fmt::format("AdamW, {}", dtype_name(state)));
  row("adam m", adam_m, fmt::format("AdamW, {}", dtype_name(state)));
  row("adam v", adam_v, fmt::format("AdamW, {}", dtype_name(state)));
  if (optimizer_shards > 1) out += fmt::format("  (optimizer state: one of {} ZeRO-1 shards)\n", optimizer_shards);
  if (offload == Offload::checkpoints) {
    row("activations, saved", saved,
        fmt::format("{} device slots of {} ({}); the {} layers' copies are in host memory", kOffloadSlots,
                    human(saved_per_layer), saved_kinds, config.n_layers));
  } else {
    const size_t final_residual = saved - saved_per_layer * static_cast<size_t>(config.n_layers);
    row("activations, saved", saved,
        fmt::format("{} per layer ({}) × {} layers + {} final residual", human(saved_per_layer), saved_kinds,
                    config.n_layers, human(final_residual)));
  }
  row("activations, scratch", activation_scratch,
      "once for all layers: recomputed tensors, projections, backward gradients");
  row("LM head workspace", lm_head_workspace,
      fmt::format("{} tokens × {} vocab of logits at a time", tiling.loss_chunk_tokens, config.vocab_size));
  row("attention workspace", attention_workspace,
      p.device == Device::cuda ? (sp.sp_size > 1 ? "cuDNN workspace, fp32 dQ accumulator, bf16 block dQ/dK/dV"
                                                 : "cuDNN workspace and fp32 dQ accumulator")
                               : "none");
  if (attention_kept > 0)
    row("ulysses, kept", attention_kept,
        fmt::format("head-layout Q, K, V, O, LSE of all {} layers (backward sends only dO)", config.n_layers));
  if (schedule_workspace > 0)
    row("schedule buffers", schedule_workspace,
        sp.schedule == attn::Schedule::ulysses
            ? std::string("ulysses: all-to-all send and receive slots, gathered head-layout tensors")
            : fmt::format("{}: K/V (or Q-side) rotation slots, f32 O and dQ/dK/dV accumulators, block partials",
                          attn::schedule_name(sp.schedule)));
  row("token buffers", token_buffers, "tokens, labels, positions of a step (and of an eval batch, with its losses)");
  if (gemm_workspace > 0) row("GEMM/op workspace", gemm_workspace, "cuBLASLt workspace, norm partials, index plan");
  row("total", total(), p.device == Device::cuda ? "GPU memory" : "");
  if (host_offload > 0)
    row("host (pinned)", host_offload,
        fmt::format("model.offload: checkpoints, {} per layer × {} layers", human(saved_per_layer), config.n_layers));
  return out;
}

DeviceMemory device_memory(Device device) {
  DeviceMemory m;
  if (device == Device::cuda) {
#ifdef LONGTRAIN_HAS_CUDA
    cudaError_t err = cudaMemGetInfo(&m.free, &m.total);
    LT_CHECK(err == cudaSuccess, "cudaMemGetInfo failed: {} (is a GPU visible? CUDA_VISIBLE_DEVICES)",
             cudaGetErrorString(err));
    return m;
#else
    LT_FAIL("GPU memory asked for, but longtrain was built without CUDA (-DLONGTRAIN_CUDA=ON)");
#endif
  }
  std::ifstream in("/proc/meminfo");
  std::string key;
  size_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit) {
    if (key == "MemTotal:") m.total = value * 1024;
    if (key == "MemAvailable:") m.free = value * 1024;
  }
  return m;
}

size_t memory_headroom(const DeviceMemory& memory) { return std::max<size_t>(kGiB, memory.total / 50); }

void check_memory_fits(const MemoryPlan& plan, const DeviceMemory& memory, const DeviceMemory* host_memory) {
  const bool on_host = plan.precision.device == Device::cpu;
  if (plan.host_offload > 0 && !on_host) {
    const DeviceMemory host = host_memory ? *host_memory : device_memory(Device::cpu);
    const size_t host_need = plan.host_offload + memory_headroom(host);
    if (host_need > host.free) {
      std::string knobs;
      if (plan.policy != CheckpointPolicy::full) {
        MemoryPlan full = plan_memory(plan.config, plan.precision, CheckpointPolicy::full, plan.tokens,
                                      plan.optimizer_shards, plan.sp, plan.tiling, plan.offload);
        knobs = fmt::format("model.checkpoint: full would offload {}; ", human(full.host_offload));
      }
      LT_FAIL("not enough host memory for model.offload: checkpoints: the offloaded checkpoints need {} of pinned "
              "host memory ({} per layer ({}) × {} layers for {} tokens per rank) plus {} headroom, but only {} of "
              "{} are available (MemAvailable in /proc/meminfo). {}model.offload: none keeps them on the GPU; fewer "
              "tokens per rank (data.seq_len, or a larger parallel.sp_size) shrink them",
              human(plan.host_offload), human(plan.saved_per_layer), plan.saved_kinds, plan.config.n_layers,
              plan.tokens, human(memory_headroom(host)), human(host.free), human(host.total), knobs);
    }
  }
  // On a CPU run the host is the device: the offloaded copies come out of the same memory.
  const size_t need = plan.total() + (on_host ? plan.host_offload : 0) + memory_headroom(memory);
  if (need <= memory.free) return;
  const char* where = plan.precision.device == Device::cuda ? "GPU" : "host";
  std::string knobs;
  if (plan.policy != CheckpointPolicy::full) {
    MemoryPlan full = plan_memory(plan.config, plan.precision, CheckpointPolicy::full, plan.tokens,
                                  plan.optimizer_shards, plan.sp, plan.tiling, plan.offload);
    knobs += fmt::format("model.checkpoint: full would need {} in all; ", human(full.total()));
  }
  if (plan.offload == Offload::none && !on_host) {
    MemoryPlan off = plan_memory(plan.config, plan.precision, plan.policy, plan.tokens, plan.optimizer_shards,
                                 plan.sp, plan.tiling, Offload::checkpoints);
    knobs += fmt::format("model.offload: checkpoints would need {} (and {} of host memory); ", human(off.total()),
                         human(off.host_offload));
  }
  if (plan.tokens > 1) {
    MemoryPlan half =
        plan_memory(plan.config, plan.precision, plan.policy, (plan.tokens + 1) / 2, plan.optimizer_shards, plan.sp,
                    plan.tiling, plan.offload);
    knobs += fmt::format("halving the tokens per rank (data.seq_len, or doubling parallel.sp_size) would need {}",
                         human(half.total()));
  }
  LT_FAIL("not enough {} memory: training needs {} (parameters {}, gradients {}, optimizer state {}, activations {} "
          "under checkpoint policy {} with offload {} for {} tokens per rank, workspace {}{}) plus {} headroom, but "
          "only {} of {} are free. {}",
          where, human(plan.total()), human(plan.parameters), human(plan.gradients), human(plan.optimizer()),
          human(plan.activations), checkpoint_policy_name(plan.policy), offload_name(plan.offload), plan.tokens,
          human(plan.workspace()),
          on_host && plan.host_offload > 0 ? fmt::format(", offloaded checkpoints {}", human(plan.host_offload)) : "",
          human(memory_headroom(memory)), human(memory.free), human(memory.total), knobs);
}

bool memory_fits(const MemoryPlan& plan, const DeviceMemory& device, const DeviceMemory& host, std::string* why) {
  const bool on_host = plan.precision.device == Device::cpu;
  const size_t need = plan.total() + (on_host ? plan.host_offload : 0) + memory_headroom(device);
  if (need > device.free) {
    if (why)
      *why = fmt::format("needs {} > {} free", human(plan.total() + (on_host ? plan.host_offload : 0)),
                         human(device.free > memory_headroom(device) ? device.free - memory_headroom(device) : 0));
    return false;
  }
  if (!on_host && plan.host_offload > 0 && plan.host_offload + memory_headroom(host) > host.free) {
    if (why)
      *why = fmt::format("needs {} of host memory > {} available", human(plan.host_offload),
                         human(host.free > memory_headroom(host) ? host.free - memory_headroom(host) : 0));
    return false;
  }
  return true;
}

MemoryChoice choose_memory(const LlamaConfig& config, const Precision& precision,
                           std::optional<CheckpointPolicy> policy, std::optional<Offload> offload,
                           int64_t tokens_per_rank, int64_t optimizer_shards, const SequenceParallelPlan& sp,
                           const Tiling& tiling, const DeviceMemory& device, const DeviceMemory& host) {
  auto describe = [](CheckpointPolicy p, Offload o) {
    return fmt::format("{} {}", checkpoint_policy_name(p), o == Offload::none ? "without offload" : "with offload");
  };
  MemoryChoice choice;
  if (policy && offload) {  // nothing to choose
    choice.policy = *policy;
    choice.offload = *offload;
    choice.plan = plan_memory(config, precision, *policy, tokens_per_rank, optimizer_shards, sp, tiling, *offload);
    choice.fits = memory_fits(choice.plan, device, host, nullptr);
    choice.reason = fmt::format("{} (as configured)", describe(*policy, *offload));
    return choice;
  }
  std::vector<std::string> rejected;
  std::optional<MemoryChoice> smallest;
  for (const AutoCandidate& c : kAutoOrder) {
    if (policy && c.policy != *policy) continue;
    if (offload && c.offload != *offload) continue;
    if (!offload && c.offload == Offload::checkpoints && precision.device == Device::cpu) continue;
    MemoryChoice m;
    m.policy = c.policy;
    m.offload = c.offload;
    m.plan = plan_memory(config, precision, c.policy, tokens_per_rank, optimizer_shards, sp, tiling, c.offload);
    std::string why;
    m.fits = memory_fits(m.plan, device, host, &why);
    if (m.fits) {
      m.reason = fmt::format("auto: {}{}", describe(c.policy, c.offload),
                             rejected.empty() ? std::string(" (the fastest; it fits)")
                                              : fmt::format(" ({})", fmt::join(rejected, "; ")));
      return m;
    }
    rejected.push_back(fmt::format("{} {}", describe(c.policy, c.offload), why));
    if (!smallest || m.plan.total() < smallest->plan.total()) smallest = std::move(m);
  }
  LT_CHECK(smallest.has_value(), "model.checkpoint: auto with model.offload {} has no candidate on {}",
           offload ? offload_name(*offload) : "auto", precision.device == Device::cuda ? "cuda" : "cpu");
  smallest->reason = fmt::format("auto: nothing fits ({}); {} needs the least", fmt::join(rejected, "; "),
                                 describe(smallest->policy, smallest->offload));
  return *smallest;
}

}  // namespace longtrain::model
