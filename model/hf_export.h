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
// never silently dropped: rope_scaling other than null/"default", hidden_act other than "silu",
// attention_bias or mlp_bias true, a model_type other than "llama".
#pragma once

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

}  // namespace longtrain::model
