#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/memory_plan.h"
#include "runtime/device.h"

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

int64_t count_valid_labels(const Tensor& labels, int32_t ignore_index) {
  std::vector<int32_t> host(static_cast<size_t>(labels.numel()));
  copy(Tensor(host.data(), DType::i32, {labels.numel()}), labels);
  int64_t n = 0;
  for (int32_t v : host) n += v != ignore_index;
  return n;
}

}  // namespace

QkvViews split_qkv(const Tensor& qkv, const LlamaConfig& c) {
  const int64_t D = c.head_dim;
  auto heads = [&](int64_t first_head, int64_t n) {
    Tensor v = qkv.narrow(1, first_head * D, n * D);
    v.ndim = 3;
    v.shape = {qkv.shape[0], n, D, 0};
    v.stride = {qkv.stride[0], D, 1, 0};
    return v;
  };
  return {heads(0, c.n_heads), heads(c.n_heads, c.n_kv_heads), heads(c.n_heads + c.n_kv_heads, c.n_kv_heads)};
}

LlamaModel::LlamaModel(const LlamaConfig& config, Precision precision, CheckpointPolicy policy, int64_t max_tokens,
                       std::unique_ptr<attn::SequenceAttention> attention, int64_t flat_shards)
    : config_(config), precision_(precision), policy_(policy), max_tokens_(max_tokens),
      attention_(std::move(attention)), params_("parameters", precision.device),
      grads_("gradients", precision.device), acts_("activations", precision.device) {
  config_.validate();
  LT_CHECK(max_tokens > 0, "a model needs room for at least one token (max_tokens = {})", max_tokens);
  if (!attention_)
    attention_ = std::make_unique<attn::LocalSequenceAttention>(
        /*causal=*/true, 1.0 / std::sqrt(static_cast<double>(config_.head_dim)));

  set_rope_length(config_.max_seq_len);

  add_parameter_entries(params_, config_, precision_.param);
  add_parameter_entries(grads_, config_, precision_.param);
  LT_CHECK(flat_shards >= 1, "flat_shards must be at least 1 (got {})", flat_shards);
  params_.pad_to_multiple(static_cast<size_t>(flat_shards) * dtype_size(precision_.param));
  grads_.pad_to_multiple(static_cast<size_t>(flat_shards) * dtype_size(precision_.param));
  params_.allocate();
  grads_.allocate();
  p_ = parameter_views(params_, config_);
  g_ = parameter_views(grads_, config_);

  // The gradient-ready ranges follow the arena's order (model/parameters.cpp): embedding, layer 0 ..
  // L-1 (each starting at its input norm), final norm, LM head (untied), padding. A range runs to the
  // start of the next, so alignment gaps (always zero) ride along and the ranges cover the buffer.
  auto first_element = [&](const std::string& name) {
    const auto bytes = static_cast<char*>(grads_.get(name).data) - static_cast<char*>(grads_.base());
    return static_cast<int64_t>(bytes / static_cast<std::ptrdiff_t>(dtype_size(precision_.param)));
  };
  const int64_t L = config_.n_layers, total = grads_.flat().numel();
  std::vector<int64_t> layer_begin;
  for (int64_t l = 0; l < L; ++l) layer_begin.push_back(first_element(layer_param_name(l, "input_layernorm.weight")));
  const int64_t norm_begin = first_element("model.norm.weight");
  gradient_ranges_.push_back({norm_begin, total});
  for (int64_t l = L - 1; l >= 0; --l)
    gradient_ranges_.push_back({layer_begin[l], l + 1 < L ? layer_begin[l + 1] : norm_begin});
  gradient_ranges_.push_back({0, L > 0 ? layer_begin[0] : norm_begin});

  // The activation table (model/memory_plan.cpp), shared with the memory plan so that the plan is
  // exactly what is allocated here.
  add_activation_entries(acts_, config_, precision_, policy_, max_tokens);
  acts_.allocate();
}

void LlamaModel::zero_grads() { zero(grads_.flat()); }

void LlamaModel::set_rope_length(int64_t seq_len) {
  LT_CHECK(seq_len > 0, "the RoPE sequence length must be positive, got {}", seq_len);
  RopeTable table = config_.rope(seq_len);
  rope_ = ops::RopeParams{config_.rope_theta, std::move(table.inv_freq), table.attention_factor};
}

LlamaModel::LayerActs LlamaModel::layer_acts(int64_t l, int64_t T) const {
  auto buffer = [&](const char* name) {
    return keeps_activation(policy_, name) ? acts_.get(fmt::format("layers.{}.{}", l, name))
                                           : acts_.get(fmt::format("scratch.{}", name));
  };
  auto get = [&](const char* name) { return buffer(name).narrow(0, T); };  // the first T tokens
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

void LlamaModel::check_shard(const TokenShard& s) const {
  const int64_t T = s.tokens.numel();
  LT_CHECK(T > 0 && T <= max_tokens_, "a shard of {} tokens; this model was sized for 1..{}", T, max_tokens_);
  for (const Tensor* t : {&s.tokens, &s.labels, &s.positions}) {
    LT_CHECK(t->dtype == DType::i32 && t->numel() == T && t->device == precision_.device,
             "shard tensors must be i32 [{}] on the model's device; got {}", T, t->describe());
  }
}

// Runs layer `l` forward from x_in, filling `a`. x_out (when non-empty) receives the layer output.
// run_attention = false reuses the O and LSE already in `a` (remat_aware recomputation).
void LlamaModel::layer_forward(int64_t l, const LayerActs& a, Tensor x_in, Tensor x_out, Tensor positions,
                               bool run_attention) {
  const LayerParams& p = p_.layers[l];
  const int64_t T = x_in.size(0), D = config_.head_dim, Hq = config_.n_heads;
  const ops::RopeParams& rope = rope_;
  Tensor proj = acts_.get("proj").narrow(0, T);

  ops::rmsnorm_forward(a.n1, a.rstd1, x_in, p.input_norm, config_.norm_eps);
  ops::linear_forward(a.qkv, a.n1, p.qkv);
  const QkvViews qkv = split_qkv(a.qkv, config_);
  ops::rope_forward(qkv.q, positions, rope);
  ops::rope_forward(qkv.k, positions, rope);
  if (run_attention) attention_->forward(a.o, a.lse, qkv.q, qkv.k, qkv.v);

  ops::linear_forward(proj, a.o.reshape({T, Hq * D}), p.o_proj);
  copy(a.h, x_in);
  ops::add_inplace(a.h, proj);

  ops::rmsnorm_forward(a.n2, a.rstd2, a.h, p.post_norm, config_.norm_eps);
  ops::linear_forward(a.gate_up, a.n2, p.gate_up);
  ops::swiglu_forward(a.s, a.gate_up);
  if (!x_out.empty()) {
    ops::linear_forward(proj, a.s, p.down_proj);
    copy(x_out, a.h);
    ops::add_inplace(x_out, proj);
  }
}

// d_residual holds dL/d(layer output) on entry and dL/d(layer input) on return.
void LlamaModel::layer_backward(int64_t l, const LayerActs& a, Tensor x_in, Tensor d_residual, Tensor positions) {
  const LayerParams& p = p_.layers[l];
  const LayerParams& g = g_.layers[l];
  const int64_t T = x_in.size(0), D = config_.head_dim, Hq = config_.n_heads;
  const ops::RopeParams& rope = rope_;
  Tensor d_norm = acts_.get("d_norm").narrow(0, T), d_s = acts_.get("d_s").narrow(0, T),
         d_gate_up = acts_.get("d_gate_up").narrow(0, T), d_o = acts_.get("d_o").narrow(0, T),
         d_qkv = acts_.get("d_qkv").narrow(0, T);

  // MLP: y = h + Wdown·swiglu(Wgu·n2(h)).
  ops::linear_backward(d_s, g.down_proj, d_residual, a.s, p.down_proj);
  ops::swiglu_backward(d_gate_up, d_s, a.gate_up);
  ops::linear_backward(d_norm, g.gate_up, d_gate_up, a.n2, p.gate_up);
  ops::rmsnorm_backward(d_residual, g.post_norm, d_norm, a.h, p.post_norm, a.rstd2);  // now dL/dh

  // Attention: h = x + Wo·Attn(q, k, v).
  ops::linear_backward(d_o, g.o_proj, d_residual, a.o.reshape({T, Hq * D}), p.o_proj);
  // SequenceAttention::backward overwrites dQ/dK/dV (one rank: cuDNN writes straight into d_qkv).
  const QkvViews grad = split_qkv(d_qkv, config_), qkv = split_qkv(a.qkv, config_);
  attention_->backward(grad.q, grad.k, grad.v, qkv.q, qkv.k, qkv.v, a.o, a.lse, d_o.reshape({T, Hq, D}));
  ops::rope_backward(grad.q, positions, rope);
  ops::rope_backward(grad.k, positions, rope);
  ops::linear_backward(d_norm, g.qkv, d_qkv, a.n1, p.qkv);
  ops::rmsnorm_backward(d_residual, g.input_norm, d_norm, x_in, p.input_norm, a.rstd1);  // now dL/dx
}

LossSum LlamaModel::head(const TokenShard& shard, Tensor x_final, Tensor losses, bool with_grad, double grad_scale,
                         int64_t T) {
  Tensor normed = acts_.get("final_norm").narrow(0, T), rstd = acts_.get("final_rstd").narrow(0, T);
  Tensor d_norm = acts_.get("d_norm").narrow(0, T);
  ops::rmsnorm_forward(normed, rstd, x_final, p_.final_norm, config_.norm_eps);
  ops::CrossEntropyParams ce;
  ce.ignore_index = kIgnoreIndex;
  ce.grad_scale = grad_scale;
  ops::lm_head_cross_entropy(losses, with_grad ? d_norm : Tensor{}, with_grad ? g_.lm_head : Tensor{}, normed,
                             p_.lm_head, shard.labels, ce);
  if (with_grad) {
    Tensor d_residual = acts_.get("d_residual").narrow(0, T);
    zero(d_residual);
    ops::rmsnorm_backward(d_residual, g_.final_norm, d_norm, x_final, p_.final_norm, rstd);
  }
  return {sum_to_host(losses), count_valid_labels(shard.labels, kIgnoreIndex)};
}

LossSum LlamaModel::forward_backward(const TokenShard& shard, double grad_scale) {
  check_shard(shard);
  attention_->set_documents(shard.documents);  // every layer's attention, forward and backward
  const int64_t T = shard.tokens.numel(), L = config_.n_layers;
  auto residual = [&](int64_t l) { return acts_.get(fmt::format("residual.{}", l)).narrow(0, T); };

  ops::embedding_forward(residual(0), shard.tokens, p_.embed);
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, layer_acts(l, T), residual(l), residual(l + 1), shard.positions, /*run_attention=*/true);

  LossSum loss = head(shard, residual(L), acts_.get("losses").narrow(0, T), /*with_grad=*/true, grad_scale, T);
  gradients_ready(gradient_ranges_[0]);  // final norm, LM head (tied: it is the embedding, reported last)

  Tensor d_residual = acts_.get("d_residual").narrow(0, T);
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerActs a = layer_acts(l, T);
    if (policy_ != CheckpointPolicy::none)  // bring back what the policy dropped
      layer_forward(l, a, residual(l), Tensor{}, shard.positions,
                    /*run_attention=*/policy_ == CheckpointPolicy::full);
    layer_backward(l, a, residual(l), d_residual, shard.positions);
    gradients_ready(gradient_ranges_[static_cast<size_t>(L - l)]);
  }
  ops::embedding_backward(g_.embed, shard.tokens, d_residual);
  gradients_ready(gradient_ranges_.back());
  return loss;
}

Tensor LlamaModel::forward_layers(const TokenShard& shard) {
  check_shard(shard);
  attention_->set_documents(shard.documents);  // every layer's attention, forward and backward
  const int64_t T = shard.tokens.numel(), L = config_.n_layers;
  auto residual = [&](int64_t l) { return acts_.get(fmt::format("residual.{}", l)).narrow(0, T); };
  ops::embedding_forward(residual(0), shard.tokens, p_.embed);
  for (int64_t l = 0; l < L; ++l)
    layer_forward(l, layer_acts(l, T), residual(l), residual(l + 1), shard.positions, /*run_attention=*/true);
  return residual(L);
}

LossSum LlamaModel::forward(const TokenShard& shard, Tensor losses) {
  Tensor x_final = forward_layers(shard);
  const int64_t T = shard.tokens.numel();
  Tensor out = losses.empty() ? acts_.get("losses").narrow(0, T) : losses;
  return head(shard, x_final, out, /*with_grad=*/false, 1.0, T);
}

void LlamaModel::forward_logits(const TokenShard& shard, Tensor logits) {
  const int64_t T = shard.tokens.numel();
  LT_CHECK(logits.device == Device::cpu && logits.dtype == precision_.act && logits.ndim == 2 &&
               logits.size(0) == T && logits.size(1) == config_.vocab_size && logits.is_contiguous(),
           "forward_logits needs contiguous host logits {} [{}, {}]; got {}", dtype_name(precision_.act), T,
           config_.vocab_size, logits.describe());
  Tensor x_final = forward_layers(shard);
  Tensor normed = acts_.get("final_norm").narrow(0, T), rstd = acts_.get("final_rstd").narrow(0, T);
  ops::rmsnorm_forward(normed, rstd, x_final, p_.final_norm, config_.norm_eps);
  if (precision_.device == Device::cpu) {
    ops::linear_forward(logits, normed, p_.lm_head);
    return;
  }
  // On the GPU the head writes a device buffer of its own (the activation arena has no [T, V] tensor:
  // training never materialises the logits), copied to the host afterwards.
  Arena out("logits", precision_.device);
  out.add("logits", {T, config_.vocab_size}, precision_.act);
  out.allocate();
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
