#include "model/hf_export.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "model/parameters.h"
#include "runtime/error.h"

namespace longtrain::model {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

namespace {

// transformers' LlamaConfig defaults (configuration_llama.py), used for keys a config.json omits,
// so that we read the same model transformers would.
constexpr int64_t kHfVocab = 32000, kHfHidden = 4096, kHfIntermediate = 11008, kHfLayers = 32, kHfHeads = 32,
                  kHfMaxPositions = 2048;
constexpr double kHfRmsNormEps = 1e-6, kHfRopeTheta = 10000.0;

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "cannot open {} '{}'", what, path);
  std::ostringstream s;
  s << in.rdbuf();
  LT_CHECK(!in.bad(), "cannot read {} '{}'", what, path);
  return s.str();
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  LT_CHECK(out.good(), "cannot create '{}'", path);
  out << text;
  out.close();
  LT_CHECK(out.good(), "writing '{}' failed (disk full?)", path);
}

// Typed access to config.json keys, with errors naming the file and the key.
struct Keys {
  const json& j;
  const std::string& source;

  bool present(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  int64_t integer(const char* key, int64_t fallback) const {
    if (!present(key)) return fallback;
    const json& v = j.at(key);
    LT_CHECK(v.is_number_integer(), "{}: key '{}' must be an integer, got {}", source, key, v.dump());
    return v.get<int64_t>();
  }
  double number(const char* key, double fallback) const {
    if (!present(key)) return fallback;
    const json& v = j.at(key);
    LT_CHECK(v.is_number(), "{}: key '{}' must be a number, got {}", source, key, v.dump());
    return v.get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!present(key)) return fallback;
    const json& v = j.at(key);
    LT_CHECK(v.is_boolean(), "{}: key '{}' must be true or false, got {}", source, key, v.dump());
    return v.get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!present(key)) return fallback;
    const json& v = j.at(key);
    LT_CHECK(v.is_string(), "{}: key '{}' must be a string, got {}", source, key, v.dump());
    return v.get<std::string>();
  }
};

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// rope_scaling (transformers 4.x) or rope_parameters (5.x, which also carries rope_theta) into
// `scaling`, with transformers' read-time rules for what the object leaves out (see parse_hf_config).
// Returns rope_theta when the object carries one.
std::optional<double> read_rope_object(const json& rope, const char* key, const std::string& source,
                                       RopeScaling& scaling) {
  LT_CHECK(rope.is_object(), "{}: key '{}' must be an object or null, got {}", source, key, rope.dump());
  std::string type = "default";
  for (const char* type_key : {"rope_type", "type"})  // "type" is the legacy spelling
    if (rope.contains(type_key) && rope.at(type_key).is_string()) type = rope.at(type_key).get<std::string>();
  const auto& types = rope_scaling_types();
  LT_CHECK(std::find(types.begin(), types.end(), type) != types.end(),
           "{}: {} of type '{}' is not supported: longtrain computes RoPE scaling {}; remove or change it in "
           "config.json",
           source, key, type, fmt::join(types, ", "));
  scaling = RopeScaling{};
  scaling.type = type;
  std::optional<double> theta;
  for (auto it = rope.begin(); it != rope.end(); ++it) {
    const std::string& field = it.key();
    const json& v = it.value();
    if (field == "rope_type" || field == "type") continue;
    if (v.is_null()) continue;  // transformers reads null as "not given"
    auto number = [&]() {
      LT_CHECK(v.is_number(), "{}: {}.{} must be a number, got {}", source, key, field, v.dump());
      return v.get<double>();
    };
    if (field == "rope_theta") theta = number();
    else if (field == "factor") scaling.factor = number();
    else if (field == "original_max_position_embeddings") {
      LT_CHECK(v.is_number_integer(), "{}: {}.{} must be an integer, got {}", source, key, field, v.dump());
      scaling.original_max_position_embeddings = v.get<int64_t>();
    } else if (field == "low_freq_factor") scaling.low_freq_factor = number();
    else if (field == "high_freq_factor") scaling.high_freq_factor = number();
    else if (field == "beta_fast") scaling.beta_fast = number();
    else if (field == "beta_slow") scaling.beta_slow = number();
    else if (field == "attention_factor") scaling.attention_factor = number();
    else if (field == "mscale") scaling.mscale = number();
    else if (field == "mscale_all_dim") scaling.mscale_all_dim = number();
    else if (field == "truncate") {
      LT_CHECK(v.is_boolean(), "{}: {}.truncate must be true or false, got {}", source, key, v.dump());
      scaling.truncate = v.get<bool>();
    } else if (field == "partial_rotary_factor") {
      LT_CHECK(v.is_number() && v.get<double>() == 1.0,
               "{}: {}.partial_rotary_factor {} is not supported: longtrain rotates the whole head", source, key,
               v.dump());
    } else {
      LT_FAIL("{}: {}.{} is not a field longtrain knows for RoPE scaling {} (it would be ignored, and the model "
              "would compute something else); remove it",
              source, key, field, type);
    }
  }
  return theta;
}

}  // namespace

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
  }
  return "float32";
}

std::string hf_config_json(const HfLlamaConfig& config) {
  const LlamaConfig& m = config.model;
  ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.dim;
  j["intermediate_size"] = m.ffn_dim;
  j["num_hidden_layers"] = m.n_layers;
  j["num_attention_heads"] = m.n_heads;
  j["num_key_value_heads"] = m.n_kv_heads;
  j["head_dim"] = m.head_dim;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.max_seq_len;
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  if (m.rope_scaling.is_default()) {
    j["rope_scaling"] = nullptr;
  } else {
    // transformers 4.x's form, which 5.x also reads. Only the fields given are written, so transformers
    // applies the same defaults we did.
    const RopeScaling& r = m.rope_scaling;
    ordered_json rs;
    rs["rope_type"] = r.type;
    rs["factor"] = r.factor;
    if (r.original_max_position_embeddings) rs["original_max_position_embeddings"] = r.original_max_position_embeddings;
    if (r.low_freq_factor != 0.0) rs["low_freq_factor"] = r.low_freq_factor;
    if (r.high_freq_factor != 0.0) rs["high_freq_factor"] = r.high_freq_factor;
    if (r.beta_fast != 0.0) rs["beta_fast"] = r.beta_fast;
    if (r.beta_slow != 0.0) rs["beta_slow"] = r.beta_slow;
    if (r.attention_factor != 0.0) rs["attention_factor"] = r.attention_factor;
    if (r.mscale != 0.0) rs["mscale"] = r.mscale;
    if (r.mscale_all_dim != 0.0) rs["mscale_all_dim"] = r.mscale_all_dim;
    if (r.type == "yarn" && !r.truncate) rs["truncate"] = false;
    j["rope_scaling"] = rs;
    // transformers' dynamic reads its original length from max_position_embeddings.
    if (r.type == "dynamic") j["max_position_embeddings"] = r.original_max_position_embeddings;
  }
  j["tie_word_embeddings"] = m.tie_embeddings;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["initializer_range"] = 0.02;
  j["pretraining_tp"] = 1;
  j["use_cache"] = true;
  j["torch_dtype"] = config.torch_dtype;
  if (config.bos_token_id) j["bos_token_id"] = *config.bos_token_id;
  if (config.eos_token_ids.size() == 1) j["eos_token_id"] = config.eos_token_ids[0];
  if (config.eos_token_ids.size() > 1) j["eos_token_id"] = config.eos_token_ids;
  return j.dump(2) + "\n";
}

void write_hf_config(const std::string& path, const HfLlamaConfig& config) {
  write_text_file(path, hf_config_json(config));
}

HfLlamaConfig parse_hf_config(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    LT_FAIL("{}: not valid JSON: {}", source, e.what());
  }
  LT_CHECK(j.is_object(), "{}: must be a JSON object, got {}", source, j.type_name());
  Keys k{j, source};

  std::string model_type = k.string("model_type", "");
  bool llama_architecture = false;
  if (j.contains("architectures") && j.at("architectures").is_array())
    for (const json& a : j.at("architectures"))
      llama_architecture = llama_architecture || (a.is_string() && a.get<std::string>() == "LlamaForCausalLM");
  LT_CHECK(model_type == "llama" || (model_type.empty() && llama_architecture),
           "{}: model_type is '{}'; longtrain reads Llama configs (model_type \"llama\")", source, model_type);
  std::string act = k.string("hidden_act", "silu");
  LT_CHECK(act == "silu", "{}: hidden_act '{}' is not supported; longtrain's MLP is SwiGLU (\"silu\")", source, act);
  LT_CHECK(!k.boolean("attention_bias", false),
           "{}: attention_bias is true; longtrain's attention projections have no bias", source);
  LT_CHECK(!k.boolean("mlp_bias", false), "{}: mlp_bias is true; longtrain's MLP projections have no bias", source);

  HfLlamaConfig out;
  LlamaConfig& m = out.model;
  m.vocab_size = k.integer("vocab_size", kHfVocab);
  m.dim = k.integer("hidden_size", kHfHidden);
  m.ffn_dim = k.integer("intermediate_size", kHfIntermediate);
  m.n_layers = k.integer("num_hidden_layers", kHfLayers);
  m.n_heads = k.integer("num_attention_heads", kHfHeads);
  m.n_kv_heads = k.integer("num_key_value_heads", m.n_heads);
  if (k.present("head_dim")) {
    m.head_dim = k.integer("head_dim", 0);
  } else {
    LT_CHECK(m.n_heads > 0 && m.dim % m.n_heads == 0,
             "{}: head_dim is absent and hidden_size {} is not a multiple of num_attention_heads {}", source, m.dim,
             m.n_heads);
    m.head_dim = m.dim / m.n_heads;
  }
  m.norm_eps = k.number("rms_norm_eps", kHfRmsNormEps);
  m.rope_theta = k.number("rope_theta", kHfRopeTheta);
  m.tie_embeddings = k.boolean("tie_word_embeddings", false);
  m.max_seq_len = k.integer("max_position_embeddings", kHfMaxPositions);
  // 5.x's rope_parameters wins over a legacy rope_scaling left beside it, as in transformers.
  const char* rope_key = k.present("rope_parameters") ? "rope_parameters" : k.present("rope_scaling") ? "rope_scaling" : nullptr;
  if (rope_key) {
    std::optional<double> theta = read_rope_object(j.at(rope_key), rope_key, source, m.rope_scaling);
    if (theta) m.rope_theta = *theta;
    RopeScaling& r = m.rope_scaling;
    // What transformers fills in at read time: dynamic's original length is always
    // max_position_embeddings; yarn's defaults to it, and yarn without a factor takes the ratio.
    if (r.type == "dynamic") r.original_max_position_embeddings = m.max_seq_len;
    if (r.type == "yarn" && r.original_max_position_embeddings == 0) r.original_max_position_embeddings = m.max_seq_len;
    if (r.type == "yarn" && r.factor == 0.0 && r.original_max_position_embeddings > 0)
      r.factor = static_cast<double>(m.max_seq_len) / static_cast<double>(r.original_max_position_embeddings);
    LT_CHECK(r.type != "llama3" || r.original_max_position_embeddings > 0,
             "{}: {} llama3 needs original_max_position_embeddings (Llama 3.1: 8192)", source, rope_key);
  }

  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  out.torch_dtype = k.string("dtype", k.string("torch_dtype", "float32"));
  if (k.present("bos_token_id")) out.bos_token_id = k.integer("bos_token_id", 0);
  if (k.present("eos_token_id")) {
    const json& eos = j.at("eos_token_id");
    if (eos.is_array()) {
      for (const json& e : eos) {
        LT_CHECK(e.is_number_integer(), "{}: eos_token_id entries must be integers, got {}", source, e.dump());
        out.eos_token_ids.push_back(e.get<int64_t>());
      }
    } else {
      out.eos_token_ids.push_back(k.integer("eos_token_id", 0));
    }
  }

  try {
    m.validate();
  } catch (const Error& e) {
    LT_FAIL("{}: describes a model longtrain cannot build: {}", source, e.what());
  }
  return out;
}

HfLlamaConfig read_hf_config(const std::string& path) {
  return parse_hf_config(read_text_file(path, "Hugging Face config"), fmt::format("config file '{}'", path));
}

void export_hf_directory(const std::string& dir, HfLlamaConfig config, const Arena& params, std::optional<DType> dtype) {
  config.model.validate();
  LT_CHECK(params.allocated() && params.device() == Device::cpu,
           "exporting '{}': arena '{}' must be an allocated host arena (copy GPU parameters to the host first)", dir,
           params.kind());
  // The arena must hold exactly this config's parameters, or the directory would describe another model.
  Arena expected("expected parameters", Device::cpu);
  add_parameter_entries(expected, config.model, params.table().empty() ? DType::f32 : params.table()[0].dtype);
  LT_CHECK(expected.table().size() == params.table().size(),
           "exporting '{}': arena '{}' has {} tensors but the config's model has {}", dir, params.kind(),
           params.table().size(), expected.table().size());
  for (size_t i = 0; i < expected.table().size(); ++i) {
    const ArenaEntry& want = expected.table()[i];
    const ArenaEntry& have = params.table()[i];
    LT_CHECK(want.name == have.name && want.shape == have.shape,
             "exporting '{}': arena '{}' entry {} is '{}' {} but the config's model has '{}' {}", dir, params.kind(), i,
             have.name, shape_string(have.shape), want.name, shape_string(want.shape));
    LT_CHECK(have.dtype != DType::i32, "exporting '{}': parameter '{}' is i32", dir, have.name);
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  LT_CHECK(!ec, "exporting: cannot create directory '{}': {}", dir, ec.message());
  DType stored = dtype ? *dtype : (params.table().empty() ? DType::f32 : params.table()[0].dtype);
  config.torch_dtype = torch_dtype_name(stored);
  SafetensorsSaveOptions options;
  options.dtype = stored;
  save_safetensors((fs::path(dir) / "model.safetensors").string(), params, options);
  write_hf_config((fs::path(dir) / "config.json").string(), config);
}

std::vector<std::string> hf_weight_files(const std::string& dir) {
  const fs::path root(dir);
  if (fs::is_regular_file(root / "model.safetensors")) return {(root / "model.safetensors").string()};
  const fs::path index_path = root / "model.safetensors.index.json";
  LT_CHECK(fs::is_regular_file(index_path),
           "'{}' holds neither model.safetensors nor model.safetensors.index.json: not a Hugging Face safetensors "
           "checkpoint (PyTorch .bin checkpoints are not read; convert them to safetensors)",
           dir);
  const std::string source = fmt::format("index '{}'", index_path.string());
  json index;
  try {
    index = json::parse(read_text_file(index_path.string(), "safetensors index"));
  } catch (const json::exception& e) {
    LT_FAIL("{}: not valid JSON: {}", source, e.what());
  }
  LT_CHECK(index.is_object() && index.contains("weight_map") && index.at("weight_map").is_object(),
           "{}: has no \"weight_map\" object", source);
  std::map<std::string, std::vector<std::string>> by_file;  // file -> tensor names the index puts there
  for (auto it = index.at("weight_map").begin(); it != index.at("weight_map").end(); ++it) {
    LT_CHECK(it.value().is_string(), "{}: weight_map entry '{}' must be a file name", source, it.key());
    std::string file = it.value().get<std::string>();
    // Shards live in the directory itself; a path elsewhere is a malformed (or hostile) index.
    LT_CHECK(!file.empty() && fs::path(file).filename() == fs::path(file) && file != "." && file != "..",
             "{}: weight_map puts '{}' in '{}', which is not a file name inside the directory", source, it.key(), file);
    by_file[file].push_back(it.key());
  }
  LT_CHECK(!by_file.empty(), "{}: weight_map is empty", source);
  std::vector<std::string> files;
  for (const auto& [file, names] : by_file) {
    const fs::path path = root / file;
    LT_CHECK(fs::is_regular_file(path), "{}: names shard '{}', which does not exist", source, path.string());
    SafetensorsFile shard(path.string());  // validates it; only the header is read
    for (const std::string& name : names)
      LT_CHECK(shard.find(name) != nullptr, "{}: puts tensor '{}' in '{}', which does not hold it", source, name,
               path.string());
    files.push_back(path.string());
  }
  return files;
}

SafetensorsLoadReport load_hf_weights(const std::string& dir, const Arena& params, ExtraTensors extra,
                                      DTypeConversion conversion) {
  return load_safetensors(hf_weight_files(dir), params, extra, conversion);
}

}  // namespace longtrain::model

namespace longtrain::model {

SafetensorsLoadReport init_from_hf_directory(const std::string& dir, const LlamaConfig& config, const Arena& params,
                                             int threads, std::function<void(uint64_t, uint64_t)> progress) {
  const std::string json_path = (fs::path(dir) / "config.json").string();
  const LlamaConfig hf = read_hf_config(json_path).model;
  auto same = [&](const char* key, const char* hf_key, auto ours, auto theirs) {
    LT_CHECK(ours == theirs,
             "model.init_from '{}': model.{} is {} but config.json has {} = {}; the weights cannot be loaded into "
             "another shape",
             dir, key, ours, hf_key, theirs);
  };
  for_each_hf_shape_field(config, hf, same);
  SafetensorsLoadOptions options;
  options.extra = ExtraTensors::ignore;
  options.conversion = DTypeConversion::rounding;
  options.threads = threads;
  options.progress = std::move(progress);
  try {
    return load_safetensors(hf_weight_files(dir), params, options);
  } catch (const Error& e) {
    // The inner message's own source location would only repeat ours.
    std::string inner = e.what();
    if (size_t colon = inner.find(": "); colon != std::string::npos && inner.find(".cpp:") < colon)
      inner = inner.substr(colon + 2);
    LT_FAIL("model.init_from '{}': {}", dir, inner);
  }
}

}  // namespace longtrain::model
