#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "attention/local_attention.h"
#include "model/memory_plan.h"
#include "model/step_graphs.h"
#include "runtime/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/profile.h"

namespace longtrain::model {

CheckpointPolicy parse_checkpoint_policy(const std::string& name) {
  if (name == "none") return CheckpointPolicy::none;
  if (name == "full") return CheckpointPolicy::full;
  if (name == "remat_aware") return CheckpointPolicy::remat_aware;
  LT_FAIL("model.checkpoint is '{}'; expected one of none, full, remat_aware", name);
}

const char* checkpoint_policy_name(CheckpointPolicy p) {
  switch (p) {
    case CheckpointPolicy::none: return "none";
    case CheckpointPolicy::full: return "full";
    case CheckpointPolicy::remat_aware: return "remat_aware";
  }
  return "?";
}

bool attention_keeps_forward(CheckpointPolicy policy, Offload offload) {
  return policy != CheckpointPolicy::full && offload == Offload::none;
}

// One layer's activations. Under a policy that does not keep a tensor, its view points into
// scratch shared by all layers and is recomputed in backward.
struct LlamaModel::LayerActs {
  Tensor n1, rstd1;  // input RMSNorm output [T, C] and its rstd [T]
  Tensor qkv;        // [T, (Hq + 2·Hkv)·D], RoPE applied to the q and k parts
  Tensor o, lse;     // attention output [T, Hq, D] and LSE [T, Hq]
  Tensor h;          // residual after attention [T, C]
  Tensor n2, rstd2;  // post-attention RMSNorm [T, C], [T]
  Tensor gate_up;    // [T, 2F]
  Tensor s;          // swiglu output [T, F]
};

namespace {


// Σ of a [T] tensor on any device, in double on the host.
double sum_to_host(const Tensor& t) {
  if (t.dtype == DType::f64 && t.device == Device::cpu) {
    double s = 0.0;
    for (int64_t i = 0; i < t.numel(); ++i) s += t.ptr<double>()[i];
    return s;
  }
  LT_CHECK(t.dtype == DType::f32, "loss tensor of dtype {}; expected f32 or f64", dtype_name(t.dtype));
  std::vector<float> host(static_cast<size_t>(t.numel()));
  copy(Tensor(host.data(), DType::f32, {t.numel()}), t);
  double s = 0.0;
  for (float v : host) s += v;
  return s;
}

// The labels that count, after checking every one is ignore_index or inside the vocabulary.
int64_t count_valid_labels(const Tensor& labels, int32_t ignore_index, int64_t vocab) {
  std::vector<int32_t> host(static_cast<size_t>(labels.numel()));
  copy(Tensor(host.data(), DType::i32, {labels.numel()}), labels);
  int64_t n = 0;
  for (size_t t = 0; t < host.size(); ++t) {
    const int32_t v = host[t];
    LT_CHECK(v == ignore_index || (v >= 0 && v < vocab),
             "label {} at token index {} is outside the vocabulary [0, {}) of the LM head and is not ignore_index "
             "({}); the data was tokenized for another vocabulary (check model.vocab_size)",
             v, t, vocab, ignore_index);
    n += v != ignore_index;
  }
  return n;
}

}  // namespace

int64_t check_token_ids(const Tensor& tokens, const Tensor& labels, int64_t vocab, int32_t ignore_index) {
  LT_CHECK(tokens.device == Device::cpu && labels.device == Device::cpu && tokens.dtype == DType::i32 &&
               labels.dtype == DType::i32 && tokens.numel() == labels.numel() && tokens.is_contiguous() &&
               labels.is_contiguous(),
           "check_token_ids needs host i32 tokens and labels of one length; got {} and {}", tokens.describe(),
           labels.describe());
  const int32_t* ids = tokens.ptr<int32_t>();
  for (int64_t t = 0; t < tokens.numel(); ++t)
    LT_CHECK(ids[t] >= 0 && ids[t] < vocab,
             "embedding_forward: token id {} at position {} is outside the vocabulary [0, {}); check the tokenizer "
             "and model.vocab_size",
             ids[t], t, vocab);
  return count_valid_labels(labels, ignore_index, vocab);
}

QkvViews split_qkv(const Tensor& qkv, const LlamaConfig& c) {
  const int64_t D = c.head_dim;
  auto heads = [&](int64_t first_head, int64_t n) {
    Tensor v = qkv.narrow(1, first_head * D, n * D);
    v.ndim = 3;
    v.shape = {qkv.shape[0], n, D, 0};
    v.stride = {qkv.stride[0], D, 1, 0};
    return v;
  };
  return {heads(0, c.n_heads), heads(c.n_heads, c.n_kv_heads), heads(c.n_heads + c.n_kv_heads, c.n_kv_heads),
          heads(0, c.n_heads + c.n_kv_heads)};
}

LlamaModel::LlamaModel(const LlamaConfig& config, Precision precision, CheckpointPolicy policy, int64_t max_tokens,
                       std::unique_ptr<attn::SequenceAttention> attention, int64_t flat_shards, Tiling tiling,
                       Offload offload)
    : config_(config), precision_(precision), policy_(policy), max_tokens_(max_tokens), offload_(offload),
      attention_(std::move(attention)), params_("parameters", precision.device),
      grads_("gradients", precision.device), acts_("activations", precision.device) {
  config_.validate();
  LT_CHECK(max_tokens > 0, "a model needs room for at least one token (max_tokens = {})", max_tokens);
  if (!attention_)
    attention_ = std::make_unique<attn::LocalSequenceAttention>(
        /*causal=*/true, 1.0 / std::sqrt(static_cast<double>(config_.head_dim)));

  if (attention_keeps_forward(policy_, offload_)) attention_->keep_forward(config_.n_layers);
  set_rope_length(config_.max_seq_len);

  LT_CHECK(!precision_.f32_grads || precision_.param == DType::bf16,
           "f32 gradients are for bf16 parameters (train.grad_dtype f32 with train.dtype bf16); {} parameters keep "
           "gradients of their own dtype",
           dtype_name(precision_.param));
  add_parameter_entries(params_, config_, precision_.param);
  LT_CHECK(flat_shards >= 1, "flat_shards must be at least 1 (got {})", flat_shards);
  params_.pad_to_multiple(static_cast<size_t>(flat_shards) * dtype_size(precision_.param));
  // The same element layout in the gradients' dtype: a flat range is the same tensors in both.
  grads_.add_mirror(params_, precision_.grad());
  params_.allocate();
  grads_.allocate();
  p_ = parameter_views(params_, config_);
  g_ = parameter_views(grads_, config_);

  // The gradient-ready ranges follow the arena's order (model/parameters.cpp): embedding, layer 0 ..
  // L-1 (each starting at its input norm), final norm, LM head (untied), padding. A range runs to the
  // start of the next, so alignment gaps (always zero) ride along and the ranges cover the buffer.
  auto element_of = [&](const Tensor& g) {  // g's first element in grads_.flat()
    const auto bytes = static_cast<char*>(g.data) - static_cast<char*>(grads_.base());
    return static_cast<int64_t>(bytes / static_cast<std::ptrdiff_t>(dtype_size(precision_.grad())));
  };
  auto first_element = [&](const std::string& name) { return element_of(grads_.get(name)); };
  const int64_t L = config_.n_layers, total = grads_.flat().numel();
  std::vector<int64_t> layer_begin;
  for (int64_t l = 0; l < L; ++l) layer_begin.push_back(first_element(layer_param_name(l, "input_layernorm.weight")));
  const int64_t norm_begin = first_element("model.norm.weight");
  gradient_ranges_.push_back({norm_begin, total});
  for (int64_t l = L - 1; l >= 0; --l)
    gradient_ranges_.push_back({layer_begin[l], l + 1 < L ? layer_begin[l + 1] : norm_begin});
  gradient_ranges_.push_back({0, L > 0 ? layer_begin[0] : norm_begin});
  auto discardable = [&](const Tensor& g) { discardable_.push_back({g, element_of(g)}); };
  for (const LayerParams& g : g_.layers) {
    for (const Tensor* t : {&g.input_norm, &g.qkv, &g.o_proj, &g.post_norm, &g.gate_up, &g.down_proj}) discardable(*t);
  }
  discardable(g_.final_norm);
  discardable(g_.lm_head);

  // The activation table (model/memory_plan.cpp), shared with the memory plan so that the plan is
  // exactly what is allocated here.
  tiling_ = resolve_tiling(config_, precision_, tiling, max_tokens);
  // A head group's slice of the head-major LSE ([Hq, max_tokens] storage) starts g·(Hq/groups)·max_tokens
  // floats in (memory_plan.h: kHeadGroupTokenMultiple).
  LT_CHECK(tiling_.attention_head_groups == 1 || precision_.device != Device::cuda || !attention_->head_major_lse() ||
               max_tokens % kHeadGroupTokenMultiple == 0,
           "model.attention_head_groups {} needs a multiple of {} tokens per rank on CUDA (the head-major LSE of each "
           "group must start 16-byte aligned), got {}: set data.seq_len to a multiple of {} or the key to 1",
           tiling_.attention_head_groups, kHeadGroupTokenMultiple, max_tokens, kHeadGroupTokenMultiple);
  attention_->set_backward_head_groups(tiling_.attention_head_groups);
  add_activation_entries(acts_, config_, precision_, policy_, max_tokens, tiling_, offload_);
  acts_.allocate();
  if (offload_ == Offload::checkpoints) {
    Arena host("offloaded checkpoints", Device::cpu);
    add_offload_host_entries(host, config_, precision_, policy_, max_tokens);
    offloader_ = std::make_unique<CheckpointOffloader>(host, precision_.device, config_.n_layers);
  }
}

LlamaModel::~LlamaModel() = default;

std::string LlamaModel::set_cuda_graphs(bool on) {
  graphs_.reset();
  if (!on) return {};
  if (precision_.device != Device::cuda) return "the model is not on CUDA";
  if (offloader_) return "checkpoints are offloaded (model.offload): their copies run on a stream of their own";
  if (!attention_->graph_capturable())
    return "the attention cannot be captured (a distributed schedule: its transfers run on streams of their own)";
  graphs_ = std::make_unique<StepGraphs>();
  return {};
}

LlamaModel::GraphStats LlamaModel::graph_stats() const {
  if (!graphs_) return {};
  const StepGraphs::Stats& s = graphs_->stats();
  return {s.captures, s.replays, s.dropped, s.off_reason};
}

void LlamaModel::zero_grads() {
  const profile::Region region("zero_grads", precision_.device);
  zero(grads_.flat());
  for (Discardable& d : discardable_) d.discarded = false;
}

void LlamaModel::discard_grads() {
  const profile::Region region("discard_grads", precision_.device);
  // The alignment gaps and padding are never written (zero since allocation); the embedding is
  // scattered into, so it is zeroed, unless it is the (tied) LM head, which the head writes first.
  if (!config_.tie_embeddings) zero(g_.embed);
  for (Discardable& d : discardable_) d.discarded = true;
}

ops::GradWrite LlamaModel::first_write(const Tensor& grad) {
  for (Discardable& d : discardable_) {
    if (d.grad.data == grad.data) {
      const bool first = d.discarded;
      d.discarded = false;
      return first ? ops::GradWrite::overwrite : ops::GradWrite::accumulate;
    }
  }
  return ops::GradWrite::accumulate;
}

void LlamaModel::gradients_ready(const FlatRange& r) {
  for (Discardable& d : discardable_) {
    if (d.discarded && d.begin >= r.begin && d.begin < r.end) {
      zero(d.grad);  // nothing wrote it in this call: its gradient is zero
      d.discarded = false;
    }
  }
  if (gradients_ready_) gradients_ready_(r.begin, r.end);
}

void LlamaModel::set_rope_length(int64_t seq_len) {
  LT_CHECK(seq_len > 0, "the RoPE sequence length must be positive, got {}", seq_len);
  RopeTable table = config_.rope(seq_len);
  rope_ = ops::RopeParams{config_.rope_theta, std::move(table.inv_freq), table.attention_factor};
  if (graphs_) graphs_->drop_all();  // the frequencies are the RoPE table kernel's arguments
}

Tensor LlamaModel::residual(int64_t l, int64_t T) const {
  return (offloader_ ? acts_.get(fmt::format("residual_slot.{}", l % kOffloadSlots))
                     : acts_.get(fmt::format("residual.{}", l)))
      .narrow(0, T);
}

LlamaModel::LayerActs LlamaModel::layer_acts(int64_t l, int64_t T) const {
  auto buffer = [&](const char* name) {
    return !keeps_activation(policy_, name) ? acts_.get(fmt::format("scratch.{}", name))
           : offloader_                     ? acts_.get(fmt::format("slot.{}.{}", l % kOffloadSlots, name))
                                            : acts_.get(fmt::format("layers.{}.{}", l, name));
  };
  // The first T tokens of a buffer sized for max_tokens, or the whole of a chunk-sized scratch.
  auto get = [&](const char* name) {
    const Tensor t = buffer(name);
    return t.narrow(0, std::min(T, t.size(0)));
  };
  // The LSE as the attention wants it (SequenceAttention::head_major_lse): on CUDA maybe head-major,
  // the same max_tokens·Hq floats seen as [T, Hq] with strides (1, max_tokens).
  Tensor lse = get("lse");
  if (precision_.device == Device::cuda && attention_->head_major_lse()) {
    lse = buffer("lse");
    lse.shape = {T, config_.n_heads, 0, 0};
    lse.stride = {1, max_tokens_, 0, 0};
  }
  return {get("n1"), get("rstd1"), get("qkv"), get("o"), lse, get("h"), get("n2"), get("rstd2"), get("gate_up"),
          get("s")};
}

// What layer l keeps, between its device slot and its host copy: its input x_l and the kept kinds.
std::vector<CheckpointOffloader::Copy> LlamaModel::offload_copies(int64_t l, int64_t T, bool to_host) const {
  std::vector<CheckpointOffloader::Copy> copies;
  auto add = [&](const Tensor& device, const std::string& host_name, int64_t rows) {
    const Tensor host = offloader_->host(host_name).narrow(0, rows);
    copies.push_back(to_host ? CheckpointOffloader::Copy{host, device} : CheckpointOffloader::Copy{device, host});
  };
  add(residual(l, T), fmt::format("residual.{}", l), T);
  for (const char* kind : {"n1", "rstd1", "qkv", "o", "lse", "h", "n2", "rstd2", "gate_up", "s"}) {
    if (!keeps_activation(policy_, kind)) continue;
    // The LSE goes whole: head-major on CUDA (layer_acts), a shard shorter than max_tokens spreads its
    // values over the whole buffer. It is 4·Hq bytes a token.
    const Tensor slot = acts_.get(fmt::format("slot.{}.{}", l % kOffloadSlots, kind));
    const int64_t n_rows = std::string_view(kind) == "lse" ? slot.size(0) : T;
    add(slot.narrow(0, n_rows), fmt::format("layers.{}.{}", l, kind), n_rows);
  }
  return copies;
}

namespace {

// Rows [t0, t0 + n) of a token-local activation: of the tensor itself when it spans the shard (a
// kept per-layer tensor), else the first n rows of a chunk-sized scratch copy.
Tensor rows(const Tensor& t, int64_t T, int64_t t0, int64_t n) { return t.size(0) == T ? t.narrow(t0, n) : t.narrow(0, n); }

// Calls fn(t0, n) for consecutive chunks of at most `chunk` tokens covering [0, T).
template <class Fn>
void for_chunks(int64_t T, int64_t chunk, Fn&& fn) {
  for (int64_t t0 = 0; t0 < T; t0 += chunk) fn(t0, std::min(chunk, T - t0));
}

}  // namespace

void LlamaModel::check_shard(const TokenShard& s) const {
  const int64_t T = s.tokens.numel();
  LT_CHECK(T > 0 && T <= max_tokens_, "a shard of {} tokens; this model was sized for 1..{}", T, max_tokens_);
  for (const Tensor* t : {&s.tokens, &s.labels, &s.positions}) {
    LT_CHECK(t->dtype == DType::i32 && t->numel() == T && t->device == precision_.device,
             "shard tensors must be i32 [{}] on the model's device; got {}", T, t->describe());
  }
}

// n1 = RMSNorm(x) and qkv = Wqkv·n1 chunk by chunk, then RoPE on the q and k parts: attention's input.
void LlamaModel::qkv_forward(int64_t l, const LayerActs& a, Tensor x_in) {
  const LayerParams& p = p_.layers[l];
  const int64_t T = x_in.size(0);
  for_chunks(T, tiling_.mlp_chunk_tokens, [&](int64_t t0, int64_t n) {
    const Tensor n1 = rows(a.n1, T, t0, n);
    ops::rmsnorm_forward(n1, rows(a.rstd1, T, t0, n), x_in.narrow(t0, n), p.input_norm, config_.norm_eps);
    ops::linear_forward(a.qkv.narrow(t0, n), n1, p.qkv);
  });
  ops::rope_apply(split_qkv(a.qkv, config_).qk, rope_table(T), /*inverse=*/false);
}

// Runs layer `l` forward from x_in into x_out, filling `a` (what the policy keeps of it).
void LlamaModel::layer_forward(int64_t l, const LayerActs& a, Tensor x_in, Tensor x_out) {
  const LayerParams& p = p_.layers[l];
  const int64_t T = x_in.size(0), D = config_.head_dim, Hq = config_.n_heads;
  qkv_forward(l, a, x_in);
  const QkvViews qkv = split_qkv(a.qkv, config_);
  attention_forward(l, a, qkv);

  // Everything after attention is token-local: o_proj with the residual add in its epilogue, the
  // post-attention norm and the MLP, one chunk of tokens at a time.
  const Tensor o = a.o.reshape({T, Hq * D});
  for_chunks(T, tiling_.mlp_chunk_tokens, [&](int64_t t0, int64_t n) {
    const Tensor h = rows(a.h, T, t0, n), n2 = rows(a.n2, T, t0, n), gate_up = rows(a.gate_up, T, t0, n),
                 s = rows(a.s, T, t0, n);
    ops::linear_residual_forward(h, o.narrow(t0, n), p.o_proj, x_in.narrow(t0, n));
    ops::rmsnorm_forward(n2, rows(a.rstd2, T, t0, n), h, p.post_norm, config_.norm_eps);
    ops::linear_forward(gate_up, n2, p.gate_up);
    ops::swiglu_forward(s, gate_up);
    ops::linear_residual_forward(x_out.narrow(t0, n), s, p.down_proj, h);
  });
}

Tensor LlamaModel::rope_table(int64_t T) const { return acts_.get("rope_table").narrow(0, T); }

void LlamaModel::attention_forward(int64_t l, const LayerActs& a, const QkvViews& qkv) {
  const profile::Region region("attention_forward", precision_.device);
  // A forward with no backward after it (evaluation, forward_logits) keeps nothing in the attention.
  attention_->set_layer(training_forward_ ? l : attn::SequenceAttention::kNoLayer);
  attention_->forward(a.o, a.lse, qkv.q, qkv.k, qkv.v);
}

// d_residual holds dL/d(layer output) on entry and dL/d(layer input) on return. Under a policy that
// dropped activations, they are recomputed here: QKV for the whole shard (attention's input; under
// full attention forward as well; not when the attention kept its own copy of them,
// SequenceAttention::keeps_forward), the token-local tensors one chunk at a time right before the
// chunk's backward uses them.
void LlamaModel::layer_backward(int64_t l, const LayerActs& a, Tensor x_in, Tensor d_residual) {
  const LayerParams& p = p_.layers[l];
  const LayerParams& g = g_.layers[l];
  const int64_t T = x_in.size(0), D = config_.head_dim, Hq = config_.n_heads;
  const bool recompute = policy_ != CheckpointPolicy::none;
  // Ulysses keeps the layer's head-layout Q, K, V and reads none of ours: the QKV GEMM and RoPE need
  // not run again, only the input norm that the QKV weight gradient reads (below, per chunk).
  const bool qkv_recompute = recompute && !attention_->keeps_forward();
  Tensor d_o = acts_.get("d_o").narrow(0, T), d_qkv = acts_.get("d_qkv").narrow(0, T);
  const QkvViews qkv = split_qkv(a.qkv, config_);
  if (qkv_recompute) {
    qkv_forward(l, a, x_in);
    if (policy_ == CheckpointPolicy::full) attention_forward(l, a, qkv);
  }

  // Per chunk: y = h + Wdown·swiglu(Wgu·n2(h)), h = x + Wo·O, back to dL/dh and dO.
  const Tensor o = a.o.reshape({T, Hq * D});
  for_chunks(T, tiling_.mlp_chunk_tokens, [&](int64_t t0, int64_t n) {
    const Tensor h = rows(a.h, T, t0, n), n2 = rows(a.n2, T, t0, n), rstd2 = rows(a.rstd2, T, t0, n),
                 gate_up = rows(a.gate_up, T, t0, n), s = rows(a.s, T, t0, n), d = d_residual.narrow(t0, n);
    const Tensor d_norm = acts_.get("d_norm").narrow(0, n), d_s = acts_.get("d_s").narrow(0, n),
                 d_gate_up = acts_.get("d_gate_up").narrow(0, n);
    if (recompute) {
      ops::linear_residual_forward(h, o.narrow(t0, n), p.o_proj, x_in.narrow(t0, n));
      ops::rmsnorm_forward(n2, rstd2, h, p.post_norm, config_.norm_eps);
      ops::linear_forward(gate_up, n2, p.gate_up);
    }
    // down_proj's input and weight gradients run apart: under a recomputing policy s = swiglu(gate_up)
    // is written by swiglu_backward from the reads it makes anyway, and only the weight gradient, after
    // it, reads s.
    ops::linear_backward(d_s, Tensor{}, d, s, p.down_proj);
    ops::swiglu_backward(d_gate_up, d_s, gate_up, recompute ? s : Tensor{});
    ops::linear_backward(Tensor{}, g.down_proj, d, s, p.down_proj, first_write(g.down_proj));
    ops::linear_backward(d_norm, g.gate_up, d_gate_up, n2, p.gate_up, first_write(g.gate_up));
    ops::rmsnorm_backward(d, g.post_norm, d_norm, h, p.post_norm, rstd2, first_write(g.post_norm));  // now dL/dh
    ops::linear_backward(d_o.narrow(t0, n), g.o_proj, d, o.narrow(t0, n), p.o_proj, first_write(g.o_proj));
  });

  // Attention: h = x + Wo·Attn(q, k, v). SequenceAttention::backward overwrites dQ/dK/dV (one rank:
  // cuDNN writes straight into d_qkv).
  const QkvViews grad = split_qkv(d_qkv, config_);
  {
    const profile::Region region("attention_backward", precision_.device);
    attention_->set_layer(l);
    attention_->backward(grad.q, grad.k, grad.v, qkv.q, qkv.k, qkv.v, a.o, a.lse, d_o.reshape({T, Hq, D}));
  }
  ops::rope_apply(grad.qk, rope_table(T), /*inverse=*/true);

  // Per chunk: qkv = Wqkv·n1(x), back to dL/dx. A chunk-sized n1 holds the last chunk only, so the
  // others are recomputed (bit-identical to what qkv_forward made); all of it when qkv_forward did not
  // run in this backward but the policy recomputes n1.
  const bool n1_recompute = a.n1.size(0) < T || (recompute && !qkv_recompute);
  for_chunks(T, tiling_.mlp_chunk_tokens, [&](int64_t t0, int64_t n) {
    const Tensor n1 = rows(a.n1, T, t0, n), rstd1 = rows(a.rstd1, T, t0, n), x = x_in.narrow(t0, n),
                 d_norm = acts_.get("d_norm").narrow(0, n);
    if (n1_recompute) ops::rmsnorm_forward(n1, rstd1, x, p.input_norm, config_.norm_eps);
    ops::linear_backward(d_norm, g.qkv, d_qkv.narrow(t0, n), n1, p.qkv, first_write(g.qkv));
    ops::rmsnorm_backward(d_residual.narrow(t0, n), g.input_norm, d_norm, x, p.input_norm, rstd1,
                          first_write(g.input_norm));  // now dL/dx
  });
}

// Final norm, LM head and cross-entropy, forward and backward fused one chunk of loss_chunk_tokens
// at a time: neither the [T, V] logits nor a [T, C] normed copy of the last residual ever exist.
LossSum LlamaModel::head(const TokenShard& shard, Tensor x_final, Tensor losses, bool with_grad, int64_t T,
                         Tensor loss_sum) {
  // Every label is checked before any gradient is touched, so a bad batch leaves them as they were.
  const int64_t valid =
      shard.valid_labels >= 0 ? shard.valid_labels : count_valid_labels(shard.labels, kIgnoreIndex, config_.vocab_size);
  Tensor d_residual = acts_.get("d_residual").narrow(0, T);
  if (with_grad) zero(d_residual);
  ops::CrossEntropyParams ce;
  ce.ignore_index = kIgnoreIndex;
  // The factor forward_backward wrote on the device: read by the kernels, never their argument, so a
  // replayed graph scales by this call's factor (a step's label count changes under masked labels).
  if (with_grad) ce.grad_scale_from = acts_.get("grad_scale");
  ce.labels_checked = true;
  for_chunks(T, tiling_.loss_chunk_tokens, [&](int64_t t0, int64_t n) {
    const Tensor normed = acts_.get("final_norm").narrow(0, n), rstd = acts_.get("final_rstd").narrow(0, n),
                 d_normed = acts_.get("d_final_norm").narrow(0, n), x = x_final.narrow(t0, n);
    ops::rmsnorm_forward(normed, rstd, x, p_.final_norm, config_.norm_eps);
    ce.chunk_tokens = n;
    ce.dw_write = with_grad ? first_write(g_.lm_head) : ops::GradWrite::accumulate;
    ops::lm_head_cross_entropy(losses.narrow(t0, n), with_grad ? d_normed : Tensor{}, with_grad ? g_.lm_head : Tensor{},
                               normed, p_.lm_head, shard.labels.narrow(t0, n), ce);
    if (with_grad) {
      ops::rmsnorm_backward(d_residual.narrow(t0, n), g_.final_norm, d_normed, x, p_.final_norm, rstd,
                            first_write(g_.final_norm));
    }
  });
  if (!loss_sum.empty()) {
    ops::sum_into(loss_sum, losses, ops::SumOf::values, /*accumulate=*/true);
    return {0.0, valid};
  }
  return {sum_to_host(losses), valid};
}

LossSum LlamaModel::forward_backward(const TokenShard& shard, double grad_scale, Tensor loss_sum) {
  check_shard(shard);
  LT_CHECK(std::isfinite(grad_scale),
           "forward_backward: grad_scale {} is not finite (pass 1 / the valid labels of the global batch)", grad_scale);
  // Queued outside any graph (ops::fill takes the value as its argument): the head reads it.
  ops::fill(acts_.get("grad_scale"), grad_scale);
  if (graph_eligible(shard, loss_sum)) return forward_backward_graphed(shard, loss_sum);
  return run_forward_backward(shard, loss_sum);
}

bool LlamaModel::graph_eligible(const TokenShard& shard, const Tensor& loss_sum) const {
  // What a graph cannot hold: host reads (the loss without loss_sum, labels checked on the device),
  // host callbacks between kernels (the gradients-ready hook, profiling's events) and work that
  // depends on the data on the host (the document mask's block pairs).
  return graphs_ && !graphs_->off() && !loss_sum.empty() && shard.valid_labels >= 0 && shard.documents.empty() &&
         !gradients_ready_ && !profile::enabled();
}

LossSum LlamaModel::forward_backward_graphed(const TokenShard& shard, Tensor loss_sum) {
  // Everything the captured kernels take from the host (model/step_graphs.h).
  StepGraphKey key;
  key.tokens = shard.tokens.numel();
  key.ids = shard.tokens.data;
  key.labels = shard.labels.data;
  key.positions = shard.positions.data;
  key.ids_stride = shard.tokens.stride[0];
  key.labels_stride = shard.labels.stride[0];
  key.positions_stride = shard.positions.stride[0];
  key.loss_sum = loss_sum.data;
  for (const Discardable& d : discardable_) key.discarded.push_back(d.discarded);
  key.attention_kernel_policy = static_cast<int>(attn::kernel_policy());
  key.gemm_algo_policy = static_cast<int>(ops::gemm_algo_policy());

  attention_->set_documents(shard.documents);
  attn::AttentionCounters& counters = attention_->counters;
  auto discarded_now = [&] {
    std::vector<bool> v;
    for (const Discardable& d : discardable_) v.push_back(d.discarded);
    return v;
  };
  auto replay = [&](const StepGraphs::Entry& e) {
    e.graph.launch();
    for (size_t i = 0; i < discardable_.size(); ++i) discardable_[i].discarded = e.effects.discarded_after[i];
    counters.forward_calls += e.effects.attention_forward_calls;
    counters.backward_calls += e.effects.attention_backward_calls;
    counters.bytes_sent += e.effects.attention_bytes_sent;
    counters.pairs += e.effects.attention_pairs;
  };

  if (const StepGraphs::Entry* e = graphs_->find(key, allocation_stats(Device::cuda).frees)) {
    replay(*e);
    graphs_->count_replay();
    return {0.0, shard.valid_labels};
  }
  // A key's first call runs eagerly, and so does every call until one ran no kernel or GEMM trial call.
  if (!graphs_->ready_to_capture(key)) {
    const int64_t trial_calls = attn::kernel_trial_calls() + ops::gemm_trial_calls();
    const LossSum r = run_forward_backward(shard, loss_sum);
    graphs_->record_eager_call(key, attn::kernel_trial_calls() + ops::gemm_trial_calls() == trial_calls);
    return r;
  }

  const std::vector<bool> discarded_before = key.discarded;
  const attn::AttentionCounters counters_before = counters;
  // Nothing ran on the device during a capture that failed: undo the host state the captured call
  // changed.
  auto restore = [&] {
    for (size_t i = 0; i < discardable_.size(); ++i) discardable_[i].discarded = discarded_before[i];
    counters = counters_before;
  };
  CudaGraph graph;
  try {
    graph = CudaGraph::capture([&] { run_forward_backward(shard, loss_sum); });
  } catch (const Error& e) {
    // Run the call eagerly and leave graphs off for this model, with the reason.
    restore();
    graphs_->turn_off(e.what());
    return run_forward_backward(shard, loss_sum);
  } catch (...) {
    restore();
    throw;
  }
  StepGraphEffects effects;
  effects.discarded_after = discarded_now();
  effects.attention_forward_calls = counters.forward_calls - counters_before.forward_calls;
  effects.attention_backward_calls = counters.backward_calls - counters_before.backward_calls;
  effects.attention_bytes_sent = counters.bytes_sent - counters_before.bytes_sent;
  effects.attention_pairs = counters.pairs - counters_before.pairs;
  // The capture ran the host side of the call, not its kernels: launch them now, from the state before.
  for (size_t i = 0; i < discardable_.size(); ++i) discardable_[i].discarded = discarded_before[i];
  counters = counters_before;
  const StepGraphs::Entry& entry =
      graphs_->add(std::move(key), std::move(graph), std::move(effects), allocation_stats(Device::cuda).frees);
  replay(entry);
  return {0.0, shard.valid_labels};
}

LossSum LlamaModel::run_forward_backward(const TokenShard& shard, Tensor loss_sum) {
  attention_->set_documents(shard.documents);  // every layer's attention, forward and backward
  const int64_t T = shard.tokens.numel(), L = config_.n_layers;
  CheckpointOffloader* off = offloader_.get();

  ops::rope_table(rope_table(T), shard.positions, rope_);  // every layer's RoPE, forward and backward

  // Forward. Offloaded: layer l writes x_{l+1} into the slot that held x_{l-2} and its kept tensors
  // into the one that held layer l-3's, so it waits for layer l-2's copy to the host (in stream
  // order after l-3's); its own slot goes to the host while layer l+1 computes.
  ops::embedding_forward(residual(0, T), shard.tokens, p_.embed, /*ids_checked=*/shard.valid_labels >= 0);
  training_forward_ = true;
  struct EndTrainingForward {
    bool& flag;
    ~EndTrainingForward() { flag = false; }
  } end_training_forward{training_forward_};
  for (int64_t l = 0; l < L; ++l) {
    if (off && l >= 2) off->wait_out(l - 2);
    layer_forward(l, layer_acts(l, T), residual(l, T), residual(l + 1, T));
    if (off) off->out(l, offload_copies(l, T, /*to_host=*/true));
  }

  LossSum loss =
      head(shard, residual(L, T), acts_.get("losses").narrow(0, T), /*with_grad=*/true, T, loss_sum);
  gradients_ready(gradient_ranges_[0]);  // final norm, LM head (tied: it is the embedding, reported last)

  // Backward. Offloaded: the last layers are still in their slots (x_l's slot was last written by
  // layer l-1 for l >= L-2; layer l's kept tensors for l >= L-3); every other layer is brought back a
  // layer ahead, into the slot layer l+2 used, while layer l computes.
  auto resident = [&](int64_t l) { return l >= L - 2; };
  Tensor d_residual = acts_.get("d_residual").narrow(0, T);
  for (int64_t l = L - 1; l >= 0; --l) {
    if (off && !resident(l)) off->wait_in(l);
    if (off && l >= 1 && !resident(l - 1)) off->in(l - 1, offload_copies(l - 1, T, /*to_host=*/false));
    layer_backward(l, layer_acts(l, T), residual(l, T), d_residual);
    gradients_ready(gradient_ranges_[static_cast<size_t>(L - l)]);
  }
  // Tied, the embedding is the LM head, which the head wrote first; were it still discarded, the rows
  // below would be added to stale values.
  if (first_write(g_.embed) == ops::GradWrite::overwrite) zero(g_.embed);
  ops::embedding_backward(g_.embed, shard.tokens, d_residual);
  if (off) off->wait_all();  // nothing of this step stays in flight on the copy stream
  gradients_ready(gradient_ranges_.back());
  return loss;
}

Tensor LlamaModel::forward_layers(const TokenShard& shard) {
  check_shard(shard);
  attention_->set_documents(shard.documents);  // every layer's attention, forward and backward
  const int64_t T = shard.tokens.numel(), L = config_.n_layers;
  // Forward only: nothing goes to the host, the slots (offloaded) are simply reused in turn.
  ops::rope_table(rope_table(T), shard.positions, rope_);
  ops::embedding_forward(residual(0, T), shard.tokens, p_.embed, /*ids_checked=*/shard.valid_labels >= 0);
  for (int64_t l = 0; l < L; ++l) layer_forward(l, layer_acts(l, T), residual(l, T), residual(l + 1, T));
  return residual(L, T);
}

LossSum LlamaModel::forward(const TokenShard& shard, Tensor losses) {
  Tensor x_final = forward_layers(shard);
  const int64_t T = shard.tokens.numel();
  Tensor out = losses.empty() ? acts_.get("losses").narrow(0, T) : losses;
  return head(shard, x_final, out, /*with_grad=*/false, T);
}

void LlamaModel::forward_logits(const TokenShard& shard, Tensor logits) {
  const int64_t T = shard.tokens.numel();
  LT_CHECK(logits.device == Device::cpu && logits.dtype == precision_.act && logits.ndim == 2 &&
               logits.size(0) == T && logits.size(1) == config_.vocab_size && logits.is_contiguous(),
           "forward_logits needs contiguous host logits {} [{}, {}]; got {}", dtype_name(precision_.act), T,
           config_.vocab_size, logits.describe());
  Tensor x_final = forward_layers(shard);
  // Buffers of its own: the activation arena holds the final norm one loss chunk at a time, and no
  // [T, V] tensor at all (training never materialises the logits); on the GPU the logits are copied
  // to the host afterwards.
  Arena out("logits", precision_.device);
  out.add("normed", {T, config_.dim}, precision_.act);
  out.add("rstd", {T}, precision_.stat);
  if (precision_.device != Device::cpu) out.add("logits", {T, config_.vocab_size}, precision_.act);
  out.allocate();
  Tensor normed = out.get("normed");
  ops::rmsnorm_forward(normed, out.get("rstd"), x_final, p_.final_norm, config_.norm_eps);
  if (precision_.device == Device::cpu) {
    ops::linear_forward(logits, normed, p_.lm_head);
    return;
  }
  ops::linear_forward(out.get("logits"), normed, p_.lm_head);
  copy(logits, out.get("logits"));
}

std::vector<int32_t> LlamaModel::argmax_at(const TokenShard& shard, const std::vector<int64_t>& rows) {
  const int64_t T = shard.tokens.numel(), C = config_.dim, V = config_.vocab_size;
  for (int64_t r : rows) LT_CHECK(r >= 0 && r < T, "argmax_at: row {} is outside the shard's {} tokens", r, T);
  Tensor x_final = forward_layers(shard);  // collective under sequence parallelism: every rank calls it
  std::vector<int32_t> out;
  if (rows.empty()) return out;
  const auto n = static_cast<int64_t>(rows.size());
  // Only the asked rows go through the final norm and the LM head: at long lengths the full logits
  // would be T x V, far more than the model's own activations.
  Arena a("argmax rows", precision_.device);
  a.add("x", {n, C}, precision_.act);
  a.add("normed", {n, C}, precision_.act);
  a.add("rstd", {n}, precision_.stat);
  a.add("logits", {n, V}, precision_.act);
  a.allocate();
  for (int64_t i = 0; i < n; ++i) copy(a.get("x").narrow(i, 1), x_final.narrow(rows[static_cast<size_t>(i)], 1));
  ops::rmsnorm_forward(a.get("normed"), a.get("rstd"), a.get("x"), p_.final_norm, config_.norm_eps);
  ops::linear_forward(a.get("logits"), a.get("normed"), p_.lm_head);
  std::vector<double> logits(static_cast<size_t>(n * V));
  {
    const Tensor src = a.get("logits");
    if (precision_.act == DType::f64) {
      copy(Tensor(logits.data(), DType::f64, {n * V}), src.reshape({n * V}));
    } else if (precision_.act == DType::f32) {
      std::vector<float> h(logits.size());
      copy(Tensor(h.data(), DType::f32, {n * V}), src.reshape({n * V}));
      std::copy(h.begin(), h.end(), logits.begin());
    } else {
      std::vector<bf16> h(logits.size());
      copy(Tensor(h.data(), DType::bf16, {n * V}), src.reshape({n * V}));
      std::transform(h.begin(), h.end(), logits.begin(), [](bf16 b) { return static_cast<double>(static_cast<float>(b)); });
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const double* row = logits.data() + i * V;
    for (int64_t v = 0; v < V; ++v) LT_CHECK(std::isfinite(row[v]), "the model's logits are not finite (row {})", rows[i]);
    out.push_back(static_cast<int32_t>(std::max_element(row, row + V) - row));
  }
  return out;
}

}  // namespace longtrain::model
