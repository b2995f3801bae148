// RoPE scaling with transformers' definitions (src/transformers/modeling_rope_utils.py), which a
// Hugging Face checkpoint's config.json assumes. Notation: D = head_dim, i = 0 .. D/2-1,
// base = rope_theta, inv_i = base^(-2i/D), L0 = original_max_position_embeddings, f = factor.
//
//   default  inv_i                                                    attention factor 1
//   linear   inv_i / f                                                1
//   dynamic  base' = base·(f·L/L0 - (f-1))^(D/(D-2)) when the sequence length L > L0, else inv_i
//   yarn     ramp between inv_i (fast dims) and inv_i/f (slow dims)   attention_factor, or
//            over [low, high] from beta_fast/beta_slow                  0.1·ln f + 1, or m(mscale)/m(mscale_all_dim)
//   llama3   inv_i/f for wavelengths > L0/low_freq_factor, inv_i below L0/high_freq_factor,
//            a smooth blend between                                   1
// The attention factor multiplies both cos and sin, so q·k logits scale by its square.
//
// `dynamic` at a fixed length. transformers recomputes dynamic's table from the current sequence
// length (the largest position + 1) on every forward, with L0 = config.max_position_embeddings.
// longtrain computes the table once per run for the length the run processes: data.seq_len in
// training, --seq-len in eval, prompt + new tokens in generate. So training at L <= L0 is plain RoPE
// (identity), and at L > L0 it is a fixed rescale of theta for that L, exactly what transformers
// computes for one forward pass over a sequence of L tokens.
//
// Fields a type does not use must be left unset (an error names them), and every field a type needs
// must be given: factor for all but default; original_max_position_embeddings for dynamic, yarn and
// llama3; low_freq_factor and high_freq_factor for llama3. Zero means "not given" for every number,
// as in transformers, where None and 0 fall back to the same defaults (beta_fast 32, beta_slow 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace longtrain::model {

struct RopeScaling {
  std::string type = "default";  // rope_type: default, linear, dynamic, yarn, llama3
  double factor = 0.0;
  int64_t original_max_position_embeddings = 0;
  double low_freq_factor = 0.0, high_freq_factor = 0.0;  // llama3
  double beta_fast = 0.0, beta_slow = 0.0;               // yarn; 0 = 32 and 1
  double attention_factor = 0.0;                         // yarn; 0 = derived from factor (and mscale)
  double mscale = 0.0, mscale_all_dim = 0.0;             // yarn
  bool truncate = true;                                  // yarn: floor/ceil the correction range

  bool is_default() const { return type == "default"; }
  bool operator==(const RopeScaling&) const = default;
};

// The rope_type names longtrain reads, in the order the schema lists them.
const std::vector<std::string>& rope_scaling_types();

// Throws longtrain::Error naming model.rope_scaling / model.rope_<field> when the type is unknown,
// a field it needs is missing, a field it does not use is set, or a value is out of range.
void validate_rope_scaling(const RopeScaling& s);

struct RopeTable {
  std::vector<double> inv_freq;  // D/2 entries
  double attention_factor = 1.0;
};

// The inverse frequencies and attention factor for head_dim D at sequence length `seq_len` (used by
// dynamic only), in double.
RopeTable rope_table(const RopeScaling& s, double theta, int64_t head_dim, int64_t seq_len);

}  // namespace longtrain::model
