// The Hugging Face Llama directory: config.json (LlamaForCausalLM) and model.safetensors, written
// so that `transformers.LlamaForCausalLM.from_pretrained(dir)` loads our model, and read so that a
// Hugging Face Llama checkpoint can be loaded for fine-tuning or context extension.
//
// Our parameter names are already Hugging Face's (model/parameters.h) and our RoPE pairs the two
// halves of each head like HF's rotate_half, so weights go both ways unchanged: no renaming, no q/k
// row permutation. The tokenizer files (tokenizer.model / tokenizer.json) are the caller's.
//
// Key mapping (LlamaConfig <-> config.json):
//   vocab_size <-> vocab_size            dim <-> hidden_size             ffn_dim <-> intermediate_size
//   n_layers <-> num_hidden_layers       n_heads <-> num_attention_heads n_kv_heads <-> num_key_value_heads
//   head_dim <-> head_dim                rope_theta <-> rope_theta       norm_eps <-> rms_norm_eps
//   tie_embeddings <-> tie_word_embeddings                               max_seq_len <-> max_position_embeddings
// Reading follows transformers' rules for absent keys: num_key_value_heads absent or null means
// n_heads (MHA), head_dim absent or null means hidden_size / num_attention_heads, and the other keys
// take LlamaConfig's defaults in transformers. What longtrain's model cannot represent is an error,
// never silently dropped: a rope_type other than default, linear, dynamic, yarn and llama3 (or a
// field longtrain does not know), hidden_act other than "silu", attention_bias or mlp_bias true, a
// model_type other than "llama".
//
// RoPE scaling: read from rope_parameters (transformers 5.x, rope_theta inside) or rope_scaling (4.x;
// "type" is its legacy spelling of rope_type), with transformers' read-time rules: dynamic's
// original length is max_position_embeddings; yarn's original length defaults to it, and a yarn
// without factor takes max_position_embeddings / original_max_position_embeddings. Written as 4.x's
// rope_scaling object (5.x reads it too) with the fields that are set, beside rope_theta; for dynamic,
// max_position_embeddings is written as the original length, because that is what transformers'
// dynamic rescales from. Caveat: transformers 4.46 to 4.5x compute yarn's factor as
// max_position_embeddings / original_max_position_embeddings whenever the latter is given, so an
// export with yarn computes the same in those versions only when max_seq_len = factor · original.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "model/safetensors.h"
#include "runtime/arena.h"

namespace longtrain::model {

struct HfLlamaConfig {
  LlamaConfig model;
  std::optional<int64_t> bos_token_id;  // written when known
  std::vector<int64_t> eos_token_ids;   // HF accepts one id or a list; written when known
  std::string torch_dtype = "float32";  // dtype of the weights in the directory ("bfloat16", ...)
};

// The fields that fix the weights' shapes, in the key mapping above: fn(our key, config.json's key,
// ours, theirs) for vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim and
// tie_embeddings, in that order. `ours` may be mutable (a config taking the directory's shape).
template <class Ours, class Theirs, class Fn>
void for_each_hf_shape_field(Ours& ours, const Theirs& theirs, Fn&& fn) {
  fn("vocab_size", "vocab_size", ours.vocab_size, theirs.vocab_size);
  fn("dim", "hidden_size", ours.dim, theirs.dim);
  fn("n_layers", "num_hidden_layers", ours.n_layers, theirs.n_layers);
  fn("n_heads", "num_attention_heads", ours.n_heads, theirs.n_heads);
  fn("n_kv_heads", "num_key_value_heads", ours.n_kv_heads, theirs.n_kv_heads);
  fn("head_dim", "head_dim", ours.head_dim, theirs.head_dim);
  fn("ffn_dim", "intermediate_size", ours.ffn_dim, theirs.ffn_dim);
  fn("tie_embeddings", "tie_word_embeddings", ours.tie_embeddings, theirs.tie_embeddings);
}

// "float32", "float64", "bfloat16", "int32": torch's names, as config.json's torch_dtype uses them.
const char* torch_dtype_name(DType dtype);

// config.json text for LlamaForCausalLM (pretty-printed, two-space indent).
std::string hf_config_json(const HfLlamaConfig& config);
void write_hf_config(const std::string& path, const HfLlamaConfig& config);

// Parses config.json text; `source` names it in errors. The LlamaConfig is validated.
HfLlamaConfig parse_hf_config(const std::string& text, const std::string& source);
HfLlamaConfig read_hf_config(const std::string& path);

// Writes `dir`/config.json and `dir`/model.safetensors from an allocated host parameter arena whose
// table is the one add_parameter_entries makes for config.model (checked: names and shapes).
// `dtype` is the stored dtype (f32 master weights as bf16: round to nearest even); unset keeps the
// arena's. config.torch_dtype is set from the stored dtype. Creates `dir` if needed.
void export_hf_directory(const std::string& dir, HfLlamaConfig config, const Arena& params,
                         std::optional<DType> dtype = std::nullopt);

// The weight files of a Hugging Face directory: model.safetensors when present (transformers looks
// for it first), else the files named by model.safetensors.index.json's weight_map. Throws naming
// the directory when there is neither, and naming the index when it is malformed or names a file
// that is absent or lacks a tensor the index puts in it.
std::vector<std::string> hf_weight_files(const std::string& dir);

// Loads an allocated host parameter arena from the directory's weight files. Extra tensors are
// ignored by default: HF checkpoints may carry buffers (rotary_emb.inv_freq) or an lm_head that is
// tied; they are listed in the report.
SafetensorsLoadReport load_hf_weights(const std::string& dir, const Arena& params,
                                      ExtraTensors extra = ExtraTensors::ignore,
                                      DTypeConversion conversion = DTypeConversion::exact);

// model.init_from: reads `dir`'s weights (f32, bf16 or f16, one file or the shards of
// model.safetensors.index.json) into an allocated host parameter arena of `config`'s model,
// converting to the arena's dtype (rounding to nearest even where it narrows), with `threads`
// threads and `progress` as load_safetensors takes them. `dir`'s config.json must describe the same
// shape as `config` (an error names the key and both values; max_seq_len, rope_theta and the RoPE
// scaling may differ). Every tensor the model needs must be there (the error names the missing
// ones and the directory); tensors it does not use (rotary_emb.inv_freq, a tied model's lm_head)
// are ignored and reported.
SafetensorsLoadReport init_from_hf_directory(const std::string& dir, const LlamaConfig& config, const Arena& params,
                                             int threads = 0,
                                             std::function<void(uint64_t, uint64_t)> progress = nullptr);

}  // namespace longtrain::model
