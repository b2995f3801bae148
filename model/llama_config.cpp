#include "model/llama_config.h"

#include "runtime/error.h"

namespace longtrain::model {

void LlamaConfig::validate() const {
  auto positive = [](int64_t v, const char* key) {
    LT_CHECK(v > 0, "model.{} must be positive (got {})", key, v);
  };
  positive(vocab_size, "vocab_size");
  positive(dim, "dim");
  positive(n_layers, "n_layers");
  positive(n_heads, "n_heads");
  positive(n_kv_heads, "n_kv_heads");
  positive(head_dim, "head_dim");
  positive(ffn_dim, "ffn_dim");
  positive(max_seq_len, "max_seq_len");
  LT_CHECK(n_heads % n_kv_heads == 0,
           "model.n_heads ({}) must be a multiple of model.n_kv_heads ({}): each KV head serves a whole group of "
           "query heads",
           n_heads, n_kv_heads);
  LT_CHECK(head_dim % 2 == 0, "model.head_dim ({}) must be even: RoPE rotates pairs of dimensions", head_dim);
  LT_CHECK(rope_theta > 0.0, "model.rope_theta must be positive (got {})", rope_theta);
  LT_CHECK(norm_eps > 0.0, "model.norm_eps must be positive (got {})", norm_eps);
  validate_rope_scaling(rope_scaling);
}

LlamaConfig tinyllama_1b_shape() {
  LlamaConfig c;
  c.vocab_size = 32000;
  c.dim = 2048;
  c.n_layers = 22;
  c.n_heads = 32;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.ffn_dim = 5632;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5;
  c.max_seq_len = 2048;
  return c;
}

int64_t LlamaConfig::num_parameters() const {
  int64_t per_layer = 2 * dim                            // input and post-attention norms
                      + qkv_dim() * dim                  // q, k, v projections
                      + dim * n_heads * head_dim         // o projection
                      + 3 * ffn_dim * dim;               // gate, up, down
  int64_t n = vocab_size * dim + n_layers * per_layer + dim;
  if (!tie_embeddings) n += vocab_size * dim;
  return n;
}

double LlamaConfig::train_flops_per_token(int64_t seq_len) const {
  double matmul_params = static_cast<double>(n_layers) *
                             static_cast<double>(qkv_dim() * dim + dim * n_heads * head_dim + 3 * ffn_dim * dim) +
                         static_cast<double>(vocab_size * dim);
  // Causal attention: QKᵀ and PV are 2·2·S·D per head per token in forward, half of it masked out,
  // times 3 for forward + backward.
  double attention = 6.0 * static_cast<double>(n_layers) * static_cast<double>(seq_len) *
                     static_cast<double>(n_heads * head_dim);
  return 6.0 * matmul_params + attention;
}

}  // namespace longtrain::model
