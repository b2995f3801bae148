// LlamaConfig: the shape of a Llama-family model, with the checks that make a bad shape an error
// naming the config key before any memory is touched.
#pragma once

#include <cstdint>
#include <string>

#include "model/rope_scaling.h"

namespace longtrain::model {

struct LlamaConfig {
  int64_t vocab_size = 4096;
  int64_t dim = 256;         // hidden size C
  int64_t n_layers = 4;
  int64_t n_heads = 8;       // query heads Hq
  int64_t n_kv_heads = 4;    // key/value heads Hkv (GQA: Hq % Hkv == 0; MQA: Hkv = 1)
  int64_t head_dim = 32;     // D; usually dim / n_heads
  int64_t ffn_dim = 688;     // F, the SwiGLU hidden size
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // transformers' rope_scaling / rope_parameters (model/rope_scaling.h)
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  int64_t max_seq_len = 4096;

  // Throws longtrain::Error naming the `model.<key>` that is wrong and why.
  void validate() const;

  // RoPE's inverse frequencies and attention factor for a run over sequences of `seq_len` tokens
  // (only rope_scaling dynamic depends on it).
  RopeTable rope(int64_t seq_len) const { return rope_table(rope_scaling, rope_theta, head_dim, seq_len); }

  int64_t qkv_dim() const { return (n_heads + 2 * n_kv_heads) * head_dim; }
  int64_t num_parameters() const;
  // Matmul FLOPs of forward + backward per token at sequence length `seq_len` with causal
  // attention (6·N_matmul + causal attention 6·L·S·Hq·D), the usual MFU numerator.
  double train_flops_per_token(int64_t seq_len) const;
};

// TinyLlama-1.1B's shape (vocab 32000, dim 2048, 22 layers, 32 query and 4 KV heads of 64, ffn 5632;
// RoPE theta 10000, norm eps 1e-5, TinyLlama's 2048 positions): the benchmark's (llama_bench --shape
// tinyllama) and the tests' that plan memory at that scale.
LlamaConfig tinyllama_1b_shape();

}  // namespace longtrain::model
