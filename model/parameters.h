// The parameter table: every tensor under its Hugging Face name, all in one arena (one flat
// buffer), so optimizer updates, all-reduce, norms and checkpoint I/O work on flat ranges while the
// layers read views. q/k/v and gate/up follow each other without padding so that each group is one
// GEMM operand: the fused QKV weight [(Hq + 2·Hkv)·D, C] and gate-up weight [2F, C] are views over
// the same memory, in the row order the GEMMs need (q rows, then k, then v; gate, then up).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "runtime/arena.h"

namespace longtrain::model {

// Views of one layer's parameters (or of their gradients: same table, other arena).
struct LayerParams {
  Tensor input_norm;  // [C]
  Tensor qkv;         // [(Hq + 2·Hkv)·D, C]   q_proj, k_proj, v_proj stacked
  Tensor o_proj;      // [C, Hq·D]
  Tensor post_norm;   // [C]
  Tensor gate_up;     // [2F, C]               gate_proj, up_proj stacked
  Tensor down_proj;   // [C, F]
};

struct ModelParams {
  Tensor embed;       // [V, C]  model.embed_tokens.weight
  std::vector<LayerParams> layers;
  Tensor final_norm;  // [C]     model.norm.weight
  Tensor lm_head;     // [V, C]  lm_head.weight, or the embedding when tied
};

// Hugging Face names, in the arena's order.
std::string layer_param_name(int64_t layer, const char* suffix);

// Adds every parameter of `config` to `arena` (not yet allocated) with `dtype`.
void add_parameter_entries(Arena& arena, const LlamaConfig& config, DType dtype);
// Views over an allocated arena filled by add_parameter_entries.
ModelParams parameter_views(const Arena& arena, const LlamaConfig& config);

// Initialisation, as Hugging Face's LlamaForCausalLM does it: every weight matrix (embedding,
// projections, LM head) ~ Normal(0, init_std) and every RMSNorm weight = 1. The normal draws come
// from a counter-based generator (splitmix64 + Box–Muller) keyed by (seed, parameter name,
// element index), so each tensor's values depend neither on the order of the table nor on the
// platform's <random>, and a sharded or resized model draws the same numbers for the same tensor.
// Values are drawn in double and rounded to the arena's dtype (bf16 with round-to-nearest-even).
void initialize_parameters(const Arena& arena, uint64_t seed, double init_std = 0.02);

}  // namespace longtrain::model
