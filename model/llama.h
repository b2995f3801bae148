// LlamaModel: forward and backward of a Llama over one token shard, written out layer by layer (no
// autograd), with the activation checkpoint policy deciding which tensors each layer keeps.
//
// One layer on the shard x (T tokens × C):
//   h = x + Wo · Attn(RoPE(Wq·n1(x)), RoPE(Wk·n1(x)), Wv·n1(x))
//   y = h + Wdown · (silu(Wgate·n2(h)) ⊙ Wup·n2(h))            n1, n2: RMSNorm
// Head: final RMSNorm, then the LM head fused with cross-entropy, chunked over tokens.
//
// Checkpoint policies (what a layer keeps between forward and backward):
//   none         every activation below;
//   full         only the layer input x; backward re-runs the whole layer forward, attention and
//                its communication included;
//   remat_aware  x, the attention output O and its LSE (DistFlashAttn): backward recomputes
//                norm → QKV → RoPE and o_proj → MLP, and calls attention *backward* with the saved
//                O and LSE, so attention forward runs once per step.
// On CPU the three give bit-identical gradients (recomputation is deterministic).
//
// Attention is behind attn::SequenceAttention: a single rank uses LocalSequenceAttention; the
// distributed schedules plug in the same way. Positions are global ids, so RoPE is right for any
// sharding layout.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "attention/sequence_attention.h"
#include "kernels/ops.h"
#include "model/llama_config.h"
#include "model/offload.h"
#include "model/parameters.h"
#include "runtime/arena.h"

namespace longtrain::model {

class StepGraphs;  // model/step_graphs.h

enum class CheckpointPolicy { none, full, remat_aware };
CheckpointPolicy parse_checkpoint_policy(const std::string& name);  // error names model.checkpoint
const char* checkpoint_policy_name(CheckpointPolicy p);

// Whether the model lets its attention keep each layer's forward state for the backward
// (SequenceAttention::keep_forward): when the policy keeps O and LSE and does not run the attention
// forward again (none, remat_aware) and the checkpoints stay on the device (no offload, which would
// leave the attention's per-layer state on the device beside the offloaded ones).
bool attention_keeps_forward(CheckpointPolicy policy, Offload offload);

// Token tiling of the token-local work (model.mlp_chunk_tokens, model.loss_chunk_tokens). Everything
// after attention in a layer (o_proj, the residual add, the post-attention norm, the MLP) and the
// input norm feeding the QKV GEMM run over chunks of at most mlp_chunk_tokens tokens, forward and
// backward; the final norm, the LM head and the cross-entropy run over chunks of loss_chunk_tokens,
// forward and backward fused per chunk. Under a policy that recomputes (full, remat_aware) the MLP's
// [T, 2F] and [T, F] intermediates, the norms and the projections then exist one chunk at a time:
// only the residual stream, attention's own tensors (QKV, O, LSE, dO, dQKV) and the per-token losses
// scale with the shard. 0 = auto (resolve_tiling in model/memory_plan.h). The chunking is the same
// under every policy, so the policies stay bit-identical to each other on CPU.
// attention_head_groups (model.attention_head_groups): one rank's attention backward runs as that many
// calls, each over n_kv_heads / groups kv heads and their query heads, so the backward's f32
// workspace (cuDNN's workspace and dQ accumulator, 8 bytes per query element) is that many times
// smaller; heads are independent, so the results are the same. 0 = auto. The distributed schedules
// ignore it.
struct Tiling {
  int64_t mlp_chunk_tokens = 0;
  int64_t loss_chunk_tokens = 0;
  int64_t attention_head_groups = 0;
};

// Where and in which types the model lives. CPU: everything in one float type (f32 to train, f64 for
// gradient checks). CUDA: bf16 parameters and activations, f32 statistics, gradients in bf16 or f32.
struct Precision {
  Device device = Device::cpu;
  DType param = DType::f32;  // parameters (and their gradients unless f32_grads)
  DType act = DType::f32;    // activations and activation gradients
  DType stat = DType::f32;   // rstd, LSE, per-token losses
  // Gradients in f32 beside bf16 parameters (train.grad_dtype): every weight-gradient GEMM and
  // reduction adds into f32, so the token chunks and micro-batches of a step are summed without a
  // bf16 rounding in between. Costs 2 bytes a parameter more, and twice the gradient reduction traffic.
  bool f32_grads = false;

  DType grad() const { return f32_grads ? DType::f32 : param; }
  static Precision cpu(DType t) { return {Device::cpu, t, t, t}; }
  static Precision cuda_mixed(bool f32_grads = false) {
    return {Device::cuda, DType::bf16, DType::bf16, DType::f32, f32_grads};
  }
};

// One rank's share of a batch: its tokens, their labels (the next token of the global sequence, or
// ignore_index) and their positions for RoPE; all i32 [T] on the model's device. Without documents
// the positions are global ids in the sequence; with them (data.document_mask) they restart at 0 at
// each document start and `documents` holds the documents of the whole sequence in global token
// coordinates (attention/document_mask.h): attention then stays inside each document. The same
// documents on every rank of a sequence-parallel group.
struct TokenShard {
  Tensor tokens;
  Tensor labels;
  Tensor positions;
  attn::Documents documents = {};  // empty: no document mask
  // The labels that count (not ignore_index), when the ids were checked on the host as the batch was
  // made (check_token_ids): the model then reads nothing back from the device to check them or to
  // count them. -1: unchecked, the model checks on the device (a host read each).
  int64_t valid_labels = -1;
};

// Checks host token ids and labels against a vocabulary of `vocab` (ids in [0, vocab); labels there or
// ignore_index) and returns the count of labels that are not ignore_index: TokenShard::valid_labels.
// The errors name the token position and the id, as the device checks do.
int64_t check_token_ids(const Tensor& tokens, const Tensor& labels, int64_t vocab, int32_t ignore_index);

struct LossSum {
  double sum = 0.0;     // Σ per-token losses over valid labels of this shard
  int64_t count = 0;    // number of valid labels of this shard
};

// The q, k and v parts of a fused QKV buffer [T, (Hq + 2·Hkv)·D] (or of its gradient) as strided
// [T, H, D] views, read and written in place by RoPE and attention.
struct QkvViews {
  Tensor q, k, v;
  Tensor qk;  // Q and K as one [T, Hq + Hkv, D] view (their heads are adjacent): one RoPE pass rotates both
};
QkvViews split_qkv(const Tensor& qkv, const LlamaConfig& config);

class LlamaModel {
 public:
  // Allocates parameters, gradients and activations for shards of up to `max_tokens` tokens.
  // flat_shards > 1 pads the parameter and gradient arenas so their flat views split into that many
  // equal shards (ZeRO-1 over the ranks).
  // `tiling` picks the token chunks (0 = auto, resolved for max_tokens; tiling() says what was chosen).
  // `offload` = checkpoints keeps what the policy saves per layer in host memory (model/offload.h).
  LlamaModel(const LlamaConfig& config, Precision precision, CheckpointPolicy policy, int64_t max_tokens,
             std::unique_ptr<attn::SequenceAttention> attention = nullptr, int64_t flat_shards = 1,
             Tiling tiling = {}, Offload offload = Offload::none);
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const LlamaConfig& config() const { return config_; }
  CheckpointPolicy policy() const { return policy_; }
  const Tiling& tiling() const { return tiling_; }  // resolved: both chunk sizes > 0
  Offload offload() const { return offload_; }
  const Precision& precision() const { return precision_; }

  Arena& params() { return params_; }
  Arena& grads() { return grads_; }
  const ModelParams& param_views() const { return p_; }
  const ModelParams& grad_views() const { return g_; }
  attn::SequenceAttention& attention() { return *attention_; }

  void initialize(uint64_t seed, double init_std = 0.02) { initialize_parameters(params_, seed, init_std); }
  // Sets every gradient to zero.
  void zero_grads();
  // The training loop's form of zero_grads (PyTorch's zero_grad(set_to_none=True)): the next
  // forward_backward overwrites each weight and norm gradient with its first contribution instead of
  // adding it to zeros, which spares a pass over the whole buffer and the GEMMs' read of it (the
  // embedding's, added to row by row, is zeroed). Until forward_backward reports a range
  // (set_gradients_ready) or returns, that range of grads() holds stale values; from then on
  // everything is as after zero_grads().
  void discard_grads();

  // Forward and backward over one shard. Gradients are ACCUMULATED into grads() (call zero_grads() or
  // discard_grads() between optimizer steps), scaled by grad_scale: pass 1 / (valid labels in the global batch) so
  // the loss is the global mean whatever the parallel layout. Returns this shard's loss sum/count.
  // With `loss_sum` (one f64 element on the model's device) the loss sum is added to it on the
  // device instead, and the returned sum is 0: no host read, for a step that reads its sums once at
  // its end (the trainer).
  LossSum forward_backward(const TokenShard& shard, double grad_scale, Tensor loss_sum = {});

  // CUDA graphs (train.cuda_graphs): forward_backward captured as one CUDA graph per distinct call and
  // replayed with one launch afterwards (model/step_graphs.h says when a call is the same, when graphs
  // are made and dropped). A call runs eagerly, as without graphs, unless it is on CUDA without
  // offload, documents, a gradients-ready hook or profiling, with `loss_sum` and host-checked labels
  // (TokenShard::valid_labels). Replays compute what the eager calls compute: the same kernels with the
  // same arguments. Returns why graphs cannot be used by this model at all ("" when they are on).
  std::string set_cuda_graphs(bool on);
  struct GraphStats {
    int64_t captures = 0, replays = 0, dropped = 0;
    std::string off_reason;  // non-empty once a capture failed or calls kept changing: graphs are off
  };
  GraphStats graph_stats() const;

  // Gradient-ready notification, for overlapping the data-parallel gradient reduction with
  // backward. When set, forward_backward calls hook(begin, end) each time the element range
  // [begin, end) of grads().flat() holds its final value for this call, in this order: the head
  // (final norm, the LM head and the arena's padding; with tied embeddings the LM head is the
  // embedding, so only the final norm and the padding), each layer from the last to the first
  // (its parameters and the alignment gaps after them), and last the embedding (tied: its lookup
  // and LM head gradients). The ranges partition grads().flat() (gradient_ranges()). "Final" is in
  // the compute stream's order: on CUDA the kernels writing the range are queued, not necessarily
  // done, so queue whatever reads it behind them (the communicators do). Nothing writes a range
  // again within the call after it was reported. Pass nullptr to remove the hook.
  using GradientsReady = std::function<void(int64_t begin, int64_t end)>;
  void set_gradients_ready(GradientsReady hook) { gradients_ready_ = std::move(hook); }
  struct FlatRange {
    int64_t begin, end;  // elements of grads().flat()
  };
  // The ranges forward_backward reports, in the order it reports them.
  const std::vector<FlatRange>& gradient_ranges() const { return gradient_ranges_; }

  // Forward only (evaluation): per-token losses [T] (stat dtype, 0 where the label is ignored) are
  // written to `losses` when it is non-empty; returns the shard's loss sum/count.
  LossSum forward(const TokenShard& shard, Tensor losses = {});

  // Forward only, to the full logits [T, vocab_size] (act dtype, contiguous, on the host): what the
  // fused, chunked head never materialises. Meant for short shards: it is how the model is compared
  // with other implementations (tests/model/hf_parity_test.cpp on the CPU and
  // tests/gpu/hf_parity_gpu_test.cpp on the GPU check it against Hugging Face transformers). The
  // layers are the ones forward() runs; the shard's tensors live on the model's device.
  void forward_logits(const TokenShard& shard, Tensor logits);

  // Forward only, then the greedy next token (the argmax of the logits) at the shard's local `rows`,
  // which alone pass through the final norm and the LM head. Under sequence parallelism every rank of
  // the group calls it for the same sequence (the layers are collective), each with its own rows,
  // possibly none. How passkey retrieval scores a whole prompt in one forward pass.
  std::vector<int32_t> argmax_at(const TokenShard& shard, const std::vector<int64_t>& rows);

  // RoPE for runs over sequences of `seq_len` tokens (the whole sequence, before sequence-parallel
  // sharding). Only rope_scaling dynamic depends on it (model/rope_scaling.h says why it is fixed
  // per run); the model starts at config().max_seq_len. The trainer sets data.seq_len, eval its
  // --seq-len.
  void set_rope_length(int64_t seq_len);
  const ops::RopeParams& rope() const { return rope_; }

  // Bytes of each arena, for the memory plan.
  size_t activation_bytes() const { return acts_.bytes(); }
  size_t offload_host_bytes() const { return offloader_ ? offloader_->host_bytes() : 0; }  // pinned host memory

  static constexpr int32_t kIgnoreIndex = -100;

 private:
  struct LayerActs;  // views of one layer's activations (saved or scratch, per policy)
  LayerActs layer_acts(int64_t layer, int64_t T) const;
  Tensor residual(int64_t l, int64_t T) const;  // x_l, the input of layer l (x_L: the last layer's output)
  std::vector<CheckpointOffloader::Copy> offload_copies(int64_t layer, int64_t T, bool to_host) const;
  Tensor forward_layers(const TokenShard& shard);  // embedding and every layer; returns the last residual
  void layer_forward(int64_t layer, const LayerActs& a, Tensor x_in, Tensor x_out);
  void qkv_forward(int64_t layer, const LayerActs& a, Tensor x_in);
  void layer_backward(int64_t layer, const LayerActs& a, Tensor x_in, Tensor d_residual);
  void attention_forward(int64_t l, const LayerActs& a, const QkvViews& qkv);
  // True inside forward_backward, whose layers' backward follows their forward (the attention may keep
  // state for it); false in forward-only passes.
  bool training_forward_ = false;
  Tensor rope_table(int64_t T) const;  // this step's RoPE table (ops::rope_table), T rows
  // forward_backward's work, queued (or captured) without the shard check or graphs.
  LossSum run_forward_backward(const TokenShard& shard, Tensor loss_sum);
  // forward_backward through a graph (captured now, or replayed), or eagerly until one is made.
  LossSum forward_backward_graphed(const TokenShard& shard, Tensor loss_sum);
  bool graph_eligible(const TokenShard& shard, const Tensor& loss_sum) const;
  // with_grad: the factor is the one forward_backward wrote into the activations' "grad_scale".
  LossSum head(const TokenShard& shard, Tensor x_final, Tensor losses, bool with_grad, int64_t T,
               Tensor loss_sum = {});
  void check_shard(const TokenShard& shard) const;
  // Reports r after zeroing the gradients in it that discard_grads() left and nothing has written since.
  void gradients_ready(const FlatRange& r);
  // How the next write into grad (a view of g_) is made: overwrite for the first after
  // discard_grads(), accumulate otherwise.
  ops::GradWrite first_write(const Tensor& grad);

  LlamaConfig config_;
  Precision precision_;
  CheckpointPolicy policy_;
  int64_t max_tokens_;
  Tiling tiling_;
  Offload offload_;
  std::unique_ptr<CheckpointOffloader> offloader_;
  std::unique_ptr<attn::SequenceAttention> attention_;
  ops::RopeParams rope_;
  Arena params_, grads_, acts_;
  ModelParams p_, g_;
  // gradient_ranges_: [0] the head, [1 + L - 1 - l] layer l, [L + 1] the embedding.
  std::vector<FlatRange> gradient_ranges_;
  GradientsReady gradients_ready_;
  // The gradients discard_grads() can leave for their first write (every layer's, the final norm's,
  // the LM head's), with their first element in grads().flat(); `discarded` until written.
  struct Discardable {
    Tensor grad;
    int64_t begin;
    bool discarded = false;
  };
  std::vector<Discardable> discardable_;
  std::unique_ptr<StepGraphs> graphs_;  // null: graphs off (set_cuda_graphs)
};

}  // namespace longtrain::model
