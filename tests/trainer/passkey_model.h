// A model that knows one passkey: for the passkey tests, a one-layer Llama whose greedy next token is
// a chosen function of the current token only. Its embedding is the identity (dim = vocab), every
// projection of its layer is zero (so the residual stream is the embedding: attention and MLP add
// nothing), and LM head row f(t) is e_t, so after the final RMSNorm (weight 1) the logits of token t
// are a positive multiple of e_{f(t)} and the argmax is f(t); tokens without an f(t) give all-zero
// logits (argmax 0). With f mapping the prompt's last token to the first answer token and each answer
// token to the next, the model retrieves that key under teacher forcing, wherever its tokens sit,
// whatever the sharding: the test of a scorer's bookkeeping, not of attention.
#pragma once

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/llama.h"

namespace longtrain::trainer::test {

inline model::LlamaConfig key_mapping_config(int64_t vocab, int64_t max_seq_len) {
  model::LlamaConfig c;
  c.vocab_size = vocab;
  c.dim = vocab;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.ffn_dim = 16;
  c.max_seq_len = max_seq_len;
  return c;
}

// The mapping f for a prompt and its answer; false when it is not a function (a token would need
// two successors), which the caller avoids by choosing another key.
inline bool key_mapping(const std::vector<int32_t>& prompt, const std::vector<int32_t>& answer,
                        std::map<int32_t, int32_t>& f) {
  f.clear();
  int32_t prev = prompt.back();
  for (int32_t a : answer) {
    auto [it, inserted] = f.emplace(prev, a);
    if (!inserted && it->second != a) return false;
    prev = a;
  }
  return true;
}

// Sets `m`'s parameters (an f32 or f64 CPU model of key_mapping_config) to the model of `f`.
inline void set_key_mapping_weights(model::LlamaModel& m, const std::map<int32_t, int32_t>& f) {
  const int64_t V = m.config().vocab_size;
  for (const ArenaEntry& e : m.params().table()) {
    Tensor t = m.params().get(e.name);
    std::memset(t.data, 0, t.nbytes());
  }
  auto set = [&](const std::string& name, int64_t row, int64_t col, double v) {
    Tensor t = m.params().get(name);
    const int64_t cols = t.ndim == 2 ? t.size(1) : 1;
    if (t.dtype == DType::f64) t.ptr<double>()[row * cols + col] = v;
    else t.ptr<float>()[row * cols + col] = static_cast<float>(v);
  };
  for (int64_t v = 0; v < V; ++v) {
    set("model.embed_tokens.weight", v, v, 1.0);
    set("model.norm.weight", v, 0, 1.0);
  }
  for (auto [from, to] : f) set("lm_head.weight", to, from, 1.0);
}

}  // namespace longtrain::trainer::test
