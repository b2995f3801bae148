// Memory plan: the bytes of every buffer a training run will allocate on one rank, computed before
// anything is allocated, from (model shape, precision, checkpoint policy, tokens per rank).
//
// The arenas are planned by building the very tables the model and the optimizer build (same entries,
// same 256-byte alignment), just never allocating them, so the plan and the real allocation cannot
// drift apart: LlamaModel's constructor fills its activation arena with add_activation_entries below.
// Workspaces outside the arenas (the LM head's logits chunk, the attention backward's buffers, the
// cuBLASLt workspace) are grow-only scratch of the CUDA ops; their sizes follow the ops' code
// (kernels/cuda/cross_entropy.cu, attention/cuda/local_attention.cu, attention/cuda/cudnn_sdpa.cpp).
//
//   MemoryPlan plan = plan_memory(config, Precision::cuda_mixed(), CheckpointPolicy::remat_aware, 65536);
//   fmt::print("{}", plan.table());
//   check_memory_fits(plan, device_memory(Device::cuda));   // a clear error when it does not fit
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <optional>
#include <string_view>

#include "attention/distributed/distributed_attention.h"
#include "model/llama.h"
#include "runtime/arena.h"

namespace longtrain::model {

// ---- the activation table, shared with LlamaModel ---------------------------------------------

// Whether a layer keeps the per-layer activation `kind` (n1, rstd1, qkv, o, lse, h, n2, rstd2,
// gate_up, s) between forward and backward under `policy`; a kind it does not keep lives in one
// scratch copy shared by all layers and is recomputed in backward. The layer input (the residual
// stream) is kept under every policy.
bool keeps_activation(CheckpointPolicy policy, std::string_view kind);

// The token chunks of a model with shards of up to `max_tokens` tokens: each requested size as given
// (a negative one is an error naming its key), 0 replaced by the automatic choice, and both clamped
// to max_tokens. The automatic choice keeps the chunks' buffers small beside attention's [T, ...]
// tensors at long shards while leaving short shards untiled (one chunk, the GEMMs as large as before):
// MLP chunks of kAutoMlpChunkTokens (at 16K tokens the 1.1B shape's four MLP chunk buffers take
// 1.1 GiB in bf16 against 14 GiB of attention tensors at 1M tokens), loss chunks of
// kAutoLossChunkTokens (f32 logits and their gradient, 0.75 GiB at a 32K vocabulary).
// attention_head_groups: a divisor of n_kv_heads (else an error naming the key); auto is 1 on CPU (no
// workspace) and on CUDA the fewest groups whose backward workspace (attention_backward_workspace_bytes)
// stays within kAutoAttentionWorkspaceBytes, at most n_kv_heads: for the 1.1B shape (32/4 heads, head
// dim 64) one group up to 256K tokens, 2 at 512K, 4 at 1M (4 GiB instead of 16).
constexpr int64_t kAutoMlpChunkTokens = 16384;
constexpr int64_t kAutoLossChunkTokens = 4096;
constexpr size_t kAutoAttentionWorkspaceBytes = size_t{5} << 30;
// Attention head groups on CUDA need tokens per rank in multiples of this: each group's slice of the
// head-major LSE (f32 [Hq, T]) must start 16-byte aligned for cuDNN. Auto keeps one group otherwise,
// and LlamaModel refuses an explicit count.
constexpr int64_t kHeadGroupTokenMultiple = 4;
Tiling resolve_tiling(const LlamaConfig& config, const Precision& precision, Tiling requested, int64_t max_tokens);
// The CUDA attention backward's scratch for one call over `tokens` queries and `q_heads` heads.
size_t attention_backward_workspace_bytes(int64_t tokens, int64_t q_heads, int64_t head_dim);
// "token chunks: MLP M, loss L" and, where one rank's attention runs its backward in head groups
// (sp_size 1), "; attention backward in N head groups": the plan's table and the train log say it alike.
std::string tiling_summary(const Tiling& tiling, int sp_size);

// Adds every activation entry of a model with shards of up to `max_tokens` tokens to `acts`, with the
// (resolved) token chunks `tiling`: residual.0 .. residual.L [T, C]; layers.<l>.<kind> for kept kinds,
// scratch.<kind> otherwise (a token-local kind's scratch holds one MLP chunk); the forward and backward
// scratch: proj, d_norm, d_s, d_gate_up (one MLP chunk), final_norm, final_rstd, d_final_norm (one loss
// chunk), losses, d_residual, d_o, d_qkv (the shard).
// With offload = checkpoints, the per-layer entries become kOffloadSlots device slots
// (residual_slot.<s>, slot.<s>.<kind>) and the layers' own copies live on the host
// (add_offload_host_entries).
void add_activation_entries(Arena& acts, const LlamaConfig& config, const Precision& precision,
                            CheckpointPolicy policy, int64_t max_tokens, const Tiling& tiling,
                            Offload offload = Offload::none);
// The host table of offloaded checkpoints: residual.<l> (layer l's input) and layers.<l>.<kind> for
// the kept kinds, l = 0 .. L-1.
void add_offload_host_entries(Arena& host, const LlamaConfig& config, const Precision& precision,
                              CheckpointPolicy policy, int64_t max_tokens);

// ---- the plan ---------------------------------------------------------------------------------

// The sequence parallelism a plan is for: sp_size ranks share one sequence through `schedule`
// (attention/distributed); nodes > 1 is burst's double ring. sp_size 1: the local attention.
struct SequenceParallelPlan {
  int sp_size = 1;
  attn::Schedule schedule = attn::Schedule::zigzag;
  bool causal = true;
  int nodes = 1;
  int ulysses_size = 1;  // parallel.ulysses_size: the 2D hybrid when 1 < it < sp_size
};

struct MemoryPlan {
  LlamaConfig config;
  Precision precision;
  CheckpointPolicy policy = CheckpointPolicy::remat_aware;
  int64_t tokens = 0;  // per rank (sequence length / sp_size × micro-batch)
  Tiling tiling;       // resolved token chunks
  Offload offload = Offload::none;

  int64_t optimizer_shards = 1;
  SequenceParallelPlan sp;

  // Arenas (LlamaModel and trainer::AdamW), bytes as Arena::bytes() reports them.
  size_t parameters = 0;
  size_t gradients = 0;
  size_t master_weights = 0;  // 0 when the parameters are the master copy (f32/f64 on CPU)
  size_t adam_m = 0;
  size_t adam_v = 0;
  size_t activations = 0;     // the whole activation arena = saved + scratch

  // The activation arena split by kind.
  size_t saved_per_layer = 0;     // what one layer keeps: its input x plus the kinds the policy keeps
  size_t saved = 0;               // saved_per_layer × n_layers + the final residual
  size_t activation_scratch = 0;  // one copy for all layers (recomputed kinds, projections, gradients)
  std::string saved_kinds;        // e.g. "x, o, lse"

  // model.offload: checkpoints: the pinned host buffer holding every layer's saved tensors (not in
  // total(), which is device memory; check_memory_fits checks it against the host's).
  size_t host_offload = 0;

  // Grow-only workspaces outside the arenas.
  size_t lm_head_workspace = 0;    // one chunk of f32 logits and of their gradient
  size_t attention_workspace = 0;  // cuDNN's workspace and fp32 dQ accumulator; with sp_size > 1 the block's bf16 dQ/dK/dV
  size_t schedule_workspace = 0;   // sp_size > 1: the schedule's message slots and accumulators
  // Ulysses under attention_keeps_forward: every layer's head-layout Q, K, V, O, LSE (its backward then
  // sends only dO; attention/distributed/ulysses_attention.h). Persistent, not a workspace: in total().
  size_t attention_kept = 0;
  size_t gemm_workspace = 0;       // cuBLASLt workspace, norm partial sums, embedding index plan

  // The trainer's token buffers: the step's tokens, labels and positions (i32 [T] each), and during
  // evaluation another such set with the per-token losses.
  size_t token_buffers = 0;

  size_t optimizer() const { return master_weights + adam_m + adam_v; }
  size_t workspace() const { return lm_head_workspace + attention_workspace + schedule_workspace + gemm_workspace; }
  size_t total() const {
    return parameters + gradients + optimizer() + activations + attention_kept + workspace() + token_buffers;
  }

  // A printable table (one line per item, GiB/MiB, what each holds), ending with the total.
  std::string table() const;
};

// The plan for a model of `config` in `precision` under `policy` with shards of `tokens_per_rank`
// tokens, trained with trainer::AdamW (f32 moments; f32 master weights when the parameters are bf16).
// optimizer_shards > 1 plans ZeRO-1: the parameter and gradient arenas padded as
// LlamaModel(..., flat_shards) pads them, and the optimizer state of one of that many equal shards.
// sp.sp_size > 1 adds the distributed attention's buffers (attention/distributed/workspace.h).
// `tiling` as LlamaModel takes it (0 = auto).
MemoryPlan plan_memory(const LlamaConfig& config, const Precision& precision, CheckpointPolicy policy,
                       int64_t tokens_per_rank, int64_t optimizer_shards = 1, const SequenceParallelPlan& sp = {},
                       const Tiling& tiling = {}, Offload offload = Offload::none);

struct DeviceMemory {
  size_t free = 0;
  size_t total = 0;
};

// Free and total memory of the current CUDA device (cudaMemGetInfo), or of the host (MemAvailable,
// MemTotal of /proc/meminfo) for Device::cpu.
DeviceMemory device_memory(Device device);

// Headroom kept free beyond the plan: CUDA context, cuBLAS/cuDNN handles and the kernels they load,
// allocator rounding. 1 GiB or 2% of the device, the larger.
size_t memory_headroom(const DeviceMemory& memory);

// Throws longtrain::Error when plan.total() + memory_headroom() exceeds memory.free. The message
// says what needs how much, what is free, and which knob to turn (model.checkpoint, data.seq_len,
// parallel.sp_size), with the totals those knobs would give.
// With plan.host_offload > 0 on a GPU, the pinned host buffer is checked against `host` (default: this
// host's /proc/meminfo), the error naming model.offload; on a CPU run it adds to the one memory.
void check_memory_fits(const MemoryPlan& plan, const DeviceMemory& memory, const DeviceMemory* host = nullptr);

}  // namespace longtrain::model

namespace longtrain::model {

// ---- model.checkpoint: auto ---------------------------------------------------------------------

// The combinations of checkpoint policy and offload that `auto` considers, fastest first. The order
// is the measured step speed on one H200 (1.1B shape; bench/results/llama-h200-*.json, llama_bench),
// relative to remat_aware without offload; entries marked "not measured" carry the target
// instead and are to be replaced by measurements (llama_bench --policies ... --offload ...). This
// table is the one place the order lives: reorder or re-weigh it here after measuring.
// none with offload is left out: it would copy every activation of every layer over PCIe.
struct AutoCandidate {
  CheckpointPolicy policy;
  Offload offload;
  double relative_speed;  // tokens/s over remat_aware without offload
  const char* basis;      // where the number comes from
};
inline constexpr AutoCandidate kAutoOrder[] = {
    {CheckpointPolicy::none, Offload::none, 1.050,
     "measured: 16640 vs 15843 tok/s at 64K, 1.1B shape (bench/results/million-tokens-h200-2026-12-02.json; 1.174 "
     "at 8K)"},
    {CheckpointPolicy::remat_aware, Offload::none, 1.0, "the reference"},
    {CheckpointPolicy::remat_aware, Offload::checkpoints, 0.997,
     "measured: 15796 vs 15843 tok/s at 64K, 9019 vs 9006 at 128K (bench/results/million-tokens-h200-2026-12-02.json)"},
    {CheckpointPolicy::full, Offload::none, 0.828,
     "measured: 13118 vs 15843 tok/s at 64K (bench/results/million-tokens-h200-2026-12-02.json)"},
    {CheckpointPolicy::full, Offload::checkpoints, 0.828,
     "measured: 13130 tok/s at 64K, level with full without offload; listed after it, so a tie keeps the host "
     "memory free (bench/results/million-tokens-h200-2026-12-02.json)"},
};

// Whether `plan` fits `device` (and, offloaded on a GPU, `host`) with the headroom check_memory_fits
// keeps; when not, *why says what needs how much, e.g. "needs 180.2 GiB > 139.0 GiB free".
bool memory_fits(const MemoryPlan& plan, const DeviceMemory& device, const DeviceMemory& host, std::string* why);

// The policy and offload a run uses. `policy` / `offload` empty = auto (model.checkpoint: auto,
// model.offload: auto): the first entry of kAutoOrder that agrees with what is fixed and whose plan
// fits; offload is never chosen on a CPU run (the host is the device). When nothing fits, the entry
// needing the least device memory is returned with fits = false (check_memory_fits then says why).
// `reason` names the choice and why, e.g. "auto: remat_aware without offload (none needs 180.2 GiB
// > 139.0 GiB free)".
struct MemoryChoice {
  CheckpointPolicy policy = CheckpointPolicy::remat_aware;
  Offload offload = Offload::none;
  MemoryPlan plan;
  bool fits = true;
  std::string reason;
};
MemoryChoice choose_memory(const LlamaConfig& config, const Precision& precision,
                           std::optional<CheckpointPolicy> policy, std::optional<Offload> offload,
                           int64_t tokens_per_rank, int64_t optimizer_shards, const SequenceParallelPlan& sp,
                           const Tiling& tiling, const DeviceMemory& device, const DeviceMemory& host);

}  // namespace longtrain::model
