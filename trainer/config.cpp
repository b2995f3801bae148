// The config table and everything it drives: parsing (yaml-cpp, with line numbers from node marks),
// --set overrides, defaults, validation, the schema text, the resolved YAML and the config hash.
//
// Reading order: value helpers and enum names; the key table (the one place defaults live); the
// did-you-mean search; the loader (file -> overrides -> defaults resolved -> checks); the writers.
#include "trainer/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
// GCC 12 reports false "dangling pointer" warnings inside yaml-cpp's node headers. Clang (the fuzz
// build) has no such warning group and would warn about the pragma itself.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdangling-pointer"
#endif
#include <yaml-cpp/yaml.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "data/mixture.h"
#include "data/tokenizer.h"
#include "model/hf_export.h"
#include "runtime/error.h"
#include "runtime/text.h"

namespace longtrain::trainer {

// ---------------------------------------------------------------------------------------------------
// Enum names. Our own enums are named here by index; the model's checkpoint policy and the sequence
// layout keep their names where they are defined.

namespace {
constexpr std::array<std::string_view, 3> kDeviceNames = {"auto", "cpu", "cuda"};
constexpr std::array<std::string_view, 4> kDTypeNames = {"auto", "f32", "f64", "bf16"};
constexpr std::array<std::string_view, 2> kNonFiniteNames = {"skip", "stop"};
constexpr std::array<std::string_view, 3> kLrScheduleNames = {"cosine", "linear", "constant"};
constexpr std::array<std::string_view, 5> kAttentionNames = {"ring", "zigzag", "distflash", "burst", "ulysses"};
constexpr std::array<std::string_view, 3> kCudaGraphsNames = {"false", "true", "auto"};
constexpr std::array<std::string_view, 3> kOnResumeNames = {"refused", "allowed", "elastic"};
}  // namespace

std::string_view enum_name(DeviceChoice v) { return kDeviceNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(DTypeChoice v) { return kDTypeNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(NonFinitePolicy v) { return kNonFiniteNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(LrSchedule v) { return kLrScheduleNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(AttentionSchedule v) { return kAttentionNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(CudaGraphsChoice v) { return kCudaGraphsNames.at(static_cast<size_t>(v)); }
std::string_view enum_name(OnResume v) { return kOnResumeNames.at(static_cast<size_t>(v)); }

namespace {

// A key's value while parsing, printing and comparing. Enum keys travel as their names.
using Value = std::variant<int64_t, double, bool, std::string, std::vector<std::string>>;

enum class Type { integer, number, boolean, string, choice, string_list };

template <size_t N>
std::vector<std::string_view> name_list(const std::array<std::string_view, N>& names) {
  return {names.begin(), names.end()};
}

// choices_of(field): the allowed names of an enum field; empty for every other type.
template <class T>
std::vector<std::string_view> choices_of(const T&) { return {}; }
std::vector<std::string_view> choices_of(DeviceChoice) { return name_list(kDeviceNames); }
std::vector<std::string_view> choices_of(DTypeChoice) { return name_list(kDTypeNames); }
std::vector<std::string_view> choices_of(NonFinitePolicy) { return name_list(kNonFiniteNames); }
std::vector<std::string_view> choices_of(LrSchedule) { return name_list(kLrScheduleNames); }
std::vector<std::string_view> choices_of(AttentionSchedule) { return name_list(kAttentionNames); }
std::vector<std::string_view> choices_of(CudaGraphsChoice) { return name_list(kCudaGraphsNames); }
std::vector<std::string_view> choices_of(attn::KernelPolicy) {
  using K = attn::KernelPolicy;
  return {attn::kernel_policy_name(K::autotune), attn::kernel_policy_name(K::cudnn), attn::kernel_policy_name(K::hopper)};
}
std::vector<std::string_view> choices_of(ops::GemmAlgoPolicy) {
  using G = ops::GemmAlgoPolicy;
  return {ops::gemm_algo_policy_name(G::autotune), ops::gemm_algo_policy_name(G::heuristic)};
}
std::vector<std::string_view> choices_of(std::optional<model::CheckpointPolicy>) {
  using P = model::CheckpointPolicy;
  return {"auto", model::checkpoint_policy_name(P::none), model::checkpoint_policy_name(P::full),
          model::checkpoint_policy_name(P::remat_aware)};
}
std::vector<std::string_view> choices_of(std::optional<model::Offload>) {
  return {"auto", model::offload_name(model::Offload::none), model::offload_name(model::Offload::checkpoints)};
}
std::vector<std::string_view> choices_of(SeqLayout) {
  return {layout_name(SeqLayout::contiguous), layout_name(SeqLayout::zigzag)};
}

Value to_value(int64_t v) { return v; }
Value to_value(double v) { return v; }
Value to_value(bool v) { return v; }
Value to_value(const std::string& v) { return v; }
Value to_value(const std::vector<std::string>& v) { return v; }
Value to_value(DeviceChoice v) { return std::string(enum_name(v)); }
Value to_value(DTypeChoice v) { return std::string(enum_name(v)); }
Value to_value(NonFinitePolicy v) { return std::string(enum_name(v)); }
Value to_value(LrSchedule v) { return std::string(enum_name(v)); }
Value to_value(AttentionSchedule v) { return std::string(enum_name(v)); }
Value to_value(CudaGraphsChoice v) { return std::string(enum_name(v)); }
Value to_value(attn::KernelPolicy v) { return std::string(attn::kernel_policy_name(v)); }
Value to_value(ops::GemmAlgoPolicy v) { return std::string(ops::gemm_algo_policy_name(v)); }
Value to_value(std::optional<model::CheckpointPolicy> v) {
  return std::string(v ? model::checkpoint_policy_name(*v) : "auto");
}
Value to_value(std::optional<model::Offload> v) { return std::string(v ? model::offload_name(*v) : "auto"); }
Value to_value(SeqLayout v) { return std::string(layout_name(v)); }

// Our enums list their names in declaration order, so the name's index is the value.
template <class E, size_t N>
E by_index(const std::array<std::string_view, N>& names, const std::string& name) {
  auto it = std::find(names.begin(), names.end(), name);
  LT_CHECK(it != names.end(), "'{}' is not a checked choice (config table bug)", name);
  return static_cast<E>(it - names.begin());
}

// Why train.grad_dtype cannot go with train.dtype (and device), or "" when it can (or either is auto):
// gradients have the parameters' dtype, or f32 beside bf16 parameters.
std::string grad_dtype_problem(DTypeChoice grad, DTypeChoice param, DeviceChoice device) {
  if (grad == DTypeChoice::auto_select) return {};
  if (grad == DTypeChoice::bf16 && device == DeviceChoice::cpu)
    return "train.grad_dtype bf16 needs train.device cuda (bf16 parameters); on the CPU gradients have train.dtype";
  if (param == DTypeChoice::auto_select || grad == param) return {};
  if (grad == DTypeChoice::f32 && param == DTypeChoice::bf16) return {};
  return fmt::format("train.grad_dtype {} cannot go with train.dtype {}: gradients have the parameters' dtype, or f32 "
                     "beside bf16 parameters (set train.grad_dtype auto)",
                     enum_name(grad), enum_name(param));
}

// The value was converted and checked against the key's type and choices before it gets here.
void from_value(const Value& v, int64_t& out) { out = std::get<int64_t>(v); }
void from_value(const Value& v, double& out) { out = std::get<double>(v); }
void from_value(const Value& v, bool& out) { out = std::get<bool>(v); }
void from_value(const Value& v, std::string& out) { out = std::get<std::string>(v); }
void from_value(const Value& v, std::vector<std::string>& out) { out = std::get<std::vector<std::string>>(v); }
void from_value(const Value& v, DeviceChoice& out) { out = by_index<DeviceChoice>(kDeviceNames, std::get<std::string>(v)); }
void from_value(const Value& v, DTypeChoice& out) { out = by_index<DTypeChoice>(kDTypeNames, std::get<std::string>(v)); }
void from_value(const Value& v, NonFinitePolicy& out) {
  out = by_index<NonFinitePolicy>(kNonFiniteNames, std::get<std::string>(v));
}
void from_value(const Value& v, LrSchedule& out) { out = by_index<LrSchedule>(kLrScheduleNames, std::get<std::string>(v)); }
void from_value(const Value& v, CudaGraphsChoice& out) {
  out = by_index<CudaGraphsChoice>(kCudaGraphsNames, std::get<std::string>(v));
}
void from_value(const Value& v, attn::KernelPolicy& out) {
  out = attn::parse_kernel_policy(std::get<std::string>(v), "attention.kernel");
}
void from_value(const Value& v, ops::GemmAlgoPolicy& out) {
  out = ops::parse_gemm_algo_policy(std::get<std::string>(v), "train.gemm_algorithm");
}
void from_value(const Value& v, AttentionSchedule& out) {
  out = by_index<AttentionSchedule>(kAttentionNames, std::get<std::string>(v));
}
void from_value(const Value& v, std::optional<model::CheckpointPolicy>& out) {
  const std::string& name = std::get<std::string>(v);
  out = name == "auto" ? std::nullopt : std::optional(model::parse_checkpoint_policy(name));
}
void from_value(const Value& v, std::optional<model::Offload>& out) {
  const std::string& name = std::get<std::string>(v);
  out = name == "auto" ? std::nullopt : std::optional(model::parse_offload(name));
}
void from_value(const Value& v, SeqLayout& out) { out = parse_layout(std::get<std::string>(v)); }

// How the table reaches a field of TrainConfig.
struct Binding {
  Value (*get)(const TrainConfig&);
  void (*set)(TrainConfig&, const Value&);
  std::vector<std::string_view> (*choices)();
};

#define LT_CONFIG_FIELD(path)                                               \
  Binding {                                                                 \
    [](const TrainConfig& c) { return to_value(c.path); },                  \
    [](TrainConfig& c, const Value& v) { from_value(v, c.path); },          \
    []() { return choices_of(decltype(TrainConfig{}.path){}); }             \
  }

constexpr double kInf = std::numeric_limits<double>::infinity();

// Allowed values of an int or float key: lo (or lo_open: above lo) up to hi (hi_open: below hi).
struct Range {
  double lo = -kInf, hi = kInf;
  bool lo_open = false, hi_open = false;

  bool contains(double v) const {
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  bool unbounded() const { return lo == -kInf && hi == kInf; }
  std::string text() const {
    if (hi == kInf) return fmt::format("{} {}", lo_open ? ">" : ">=", lo);
    return fmt::format("in {}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
};
Range at_least(double lo) { return {lo, kInf, false, false}; }
Range above(double lo) { return {lo, kInf, true, false}; }
Range unit_interval_open() { return {0.0, 1.0, false, true}; }  // [0, 1)

// OnResume without a default constructor, so that leaving .resume out of a table entry is a
// compile error, not a silent default (GCC: "could not convert '{{"model", "vocab_size", ...}}' from
// '<brace-enclosed initializer list>' to 'const std::vector<KeySpec>'": look for the entry that
// lacks .resume).
struct ResumeRule {
  constexpr ResumeRule(OnResume v) : value(v) {}  // NOLINT: implicit, so entries read .resume = OnResume::x
  OnResume value;
};

struct KeySpec {
  std::string_view section;
  std::string_view key;
  Value default_value;  // the one place this default is written; also fixes the key's type
  std::string_view meaning;
  Binding bind;
  Range range = {};
  std::string_view default_note = {};          // shown instead of default_value when that is resolved later
  std::vector<std::string_view> aliases = {};  // what other trainers call it, for did-you-mean
  bool hashed = true;                          // part of config_hash (see config.h for why not)
  bool required = false;                       // no default: the file or --set must give it
  bool path = false;                           // a file or directory: compared on resume as a path
  bool sources = false;                        // a path or a mixture list of {path, weight} (data/mixture.h)
  // What a resumed run may do with this key (config.h, OnResume). It has no default on purpose: a
  // key added to the table without saying whether a resume may change it does not compile.
  ResumeRule resume;

  std::string name() const { return fmt::format("{}.{}", section, key); }
  Type type() const {
    switch (default_value.index()) {
      case 0: return Type::integer;
      case 1: return Type::number;
      case 2: return Type::boolean;
      case 3: return bind.choices().empty() ? Type::string : Type::choice;
      default: return Type::string_list;
    }
  }
};

struct SectionSpec {
  std::string_view name;
  std::string_view meaning;
  std::vector<std::string_view> aliases;
};

const std::vector<SectionSpec>& section_table() {
  static const std::vector<SectionSpec> sections = {
      {"model", "the Llama model: shape, activation checkpointing, initialization", {"model_config", "arch"}},
      {"data", "prepared token shards, tokenizer and sequence length", {"dataset", "datasets", "loader"}},
      {"train", "the run: device, precision, steps, batch, seed, non-finite losses",
       {"training", "trainer", "run"}},
      {"optim", "AdamW and the learning-rate schedule", {"optimizer", "optimiser", "opt", "lr_scheduler", "scheduler"}},
      {"parallel", "sequence parallelism: ranks per sequence and how tokens are split",
       {"parallelism", "distributed", "dist"}},
      {"attention", "the attention schedule over the sequence-parallel group", {"attn"}},
      {"checkpoint", "when and where training state is saved", {"checkpoints", "checkpointing", "ckpt", "save"}},
      {"eval", "validation loss during training", {"evaluation", "validation", "val"}},
      {"logging", "run directory, console and metrics", {"log", "logs", "metrics", "wandb"}},
  };
  return sections;
}

// Every key. Model shape defaults are LlamaConfig's own, so they are not written twice.
const std::vector<KeySpec>& key_table() {
  static const model::LlamaConfig m{};
  static const std::vector<KeySpec> keys = {
      // model
      {.section = "model", .key = "vocab_size", .default_value = m.vocab_size,
       .meaning = "tokens in the vocabulary (must cover the tokenizer's)", .bind = LT_CONFIG_FIELD(model.vocab_size),
       .range = at_least(1), .aliases = {"n_vocab", "vocab", "padded_vocab_size"}, .resume = OnResume::refused},
      {.section = "model", .key = "dim", .default_value = m.dim, .meaning = "hidden size C",
       .bind = LT_CONFIG_FIELD(model.dim), .range = at_least(1),
       .aliases = {"hidden_size", "d_model", "n_embd", "hidden_dim", "embed_dim", "model_dim"},
       .resume = OnResume::refused},
      {.section = "model", .key = "n_layers", .default_value = m.n_layers, .meaning = "transformer layers",
       .bind = LT_CONFIG_FIELD(model.n_layers), .range = at_least(1),
       .aliases = {"num_layers", "num_hidden_layers", "n_layer", "layers", "depth"}, .resume = OnResume::refused},
      {.section = "model", .key = "n_heads", .default_value = m.n_heads, .meaning = "query heads",
       .bind = LT_CONFIG_FIELD(model.n_heads), .range = at_least(1),
       .aliases = {"num_heads", "num_attention_heads", "n_head", "heads"}, .resume = OnResume::refused},
      {.section = "model", .key = "n_kv_heads", .default_value = m.n_kv_heads,
       .meaning = "key/value heads (GQA; 1 = MQA); must divide n_heads", .bind = LT_CONFIG_FIELD(model.n_kv_heads),
       .range = at_least(1),
       .aliases = {"num_key_value_heads", "num_kv_heads", "n_kv_head", "kv_heads", "num_query_groups"},
       .resume = OnResume::refused},
      {.section = "model", .key = "head_dim", .default_value = int64_t{0},
       .meaning = "size of one head; 0 = dim / n_heads (resolved when loading)", .bind = LT_CONFIG_FIELD(model.head_dim),
       .range = at_least(0), .aliases = {"kv_channels", "head_size", "d_head"}, .resume = OnResume::refused},
      {.section = "model", .key = "ffn_dim", .default_value = m.ffn_dim, .meaning = "SwiGLU hidden size F",
       .bind = LT_CONFIG_FIELD(model.ffn_dim), .range = at_least(1),
       .aliases = {"intermediate_size", "ffn_hidden_size", "hidden_dim_ffn", "mlp_dim", "d_ff"},
       .resume = OnResume::refused},
      {.section = "model", .key = "rope_theta", .default_value = m.rope_theta, .meaning = "RoPE base frequency",
       .bind = LT_CONFIG_FIELD(model.rope_theta), .range = above(0), .aliases = {"rotary_base", "rope_base", "theta"},
       .resume = OnResume::refused},
      {.section = "model", .key = "rope_scaling", .default_value = m.rope_scaling.type,
       .meaning = "RoPE scaling, transformers' rope_type; its fields are the rope_* keys (or write rope_scaling: "
                  "{rope_type: yarn, factor: 8, ...} as in config.json)",
       .bind = Binding{[](const TrainConfig& c) { return to_value(c.model.rope_scaling.type); },
                       [](TrainConfig& c, const Value& v) { from_value(v, c.model.rope_scaling.type); },
                       []() {
                         std::vector<std::string_view> names;
                         for (const std::string& t : model::rope_scaling_types()) names.push_back(t);
                         return names;
                       }},
       .aliases = {"rope_type", "rope_scaling_type", "position_interpolation"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_factor", .default_value = m.rope_scaling.factor,
       .meaning = "RoPE scaling factor (context extension ratio, >= 1); 0 = not given",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.factor), .range = at_least(0), .aliases = {"rope_scaling_factor"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_original_max_position_embeddings",
       .default_value = m.rope_scaling.original_max_position_embeddings,
       .meaning = "context length the model was pretrained at (dynamic, yarn, llama3); 0 = not given",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.original_max_position_embeddings), .range = at_least(0),
       .aliases = {"original_max_position_embeddings", "rope_original_max_seq_len"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_low_freq_factor", .default_value = m.rope_scaling.low_freq_factor,
       .meaning = "llama3: wavelengths above original / this are divided by factor (Llama 3.1: 1)",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.low_freq_factor), .range = at_least(0),
       .aliases = {"low_freq_factor"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_high_freq_factor", .default_value = m.rope_scaling.high_freq_factor,
       .meaning = "llama3: wavelengths below original / this are kept (Llama 3.1: 4)",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.high_freq_factor), .range = at_least(0),
       .aliases = {"high_freq_factor"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_beta_fast", .default_value = m.rope_scaling.beta_fast,
       .meaning = "yarn: rotations that end the extrapolated band; 0 = 32", .bind = LT_CONFIG_FIELD(model.rope_scaling.beta_fast),
       .range = at_least(0), .aliases = {"beta_fast"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_beta_slow", .default_value = m.rope_scaling.beta_slow,
       .meaning = "yarn: rotations that start the interpolated band; 0 = 1", .bind = LT_CONFIG_FIELD(model.rope_scaling.beta_slow),
       .range = at_least(0), .aliases = {"beta_slow"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_attention_factor", .default_value = m.rope_scaling.attention_factor,
       .meaning = "yarn: scale of cos and sin; 0 = 0.1 ln(factor) + 1 (or from mscale)",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.attention_factor), .range = at_least(0),
       .aliases = {"attention_factor", "mscale_factor"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_mscale", .default_value = m.rope_scaling.mscale,
       .meaning = "yarn: with rope_mscale_all_dim, attention factor m(mscale) / m(mscale_all_dim); 0 = not given",
       .bind = LT_CONFIG_FIELD(model.rope_scaling.mscale), .range = at_least(0), .aliases = {"mscale"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_mscale_all_dim", .default_value = m.rope_scaling.mscale_all_dim,
       .meaning = "yarn: see rope_mscale; 0 = not given", .bind = LT_CONFIG_FIELD(model.rope_scaling.mscale_all_dim),
       .range = at_least(0), .aliases = {"mscale_all_dim"}, .resume = OnResume::refused},
      {.section = "model", .key = "rope_truncate", .default_value = m.rope_scaling.truncate,
       .meaning = "yarn: round the band edges to whole dimensions", .bind = LT_CONFIG_FIELD(model.rope_scaling.truncate),
       .aliases = {"truncate"}, .resume = OnResume::refused},
      {.section = "model", .key = "norm_eps", .default_value = m.norm_eps, .meaning = "RMSNorm epsilon",
       .bind = LT_CONFIG_FIELD(model.norm_eps), .range = above(0),
       .aliases = {"rms_norm_eps", "layernorm_epsilon", "eps", "norm_epsilon"}, .resume = OnResume::refused},
      {.section = "model", .key = "tie_embeddings", .default_value = m.tie_embeddings,
       .meaning = "LM head shares the token embedding matrix", .bind = LT_CONFIG_FIELD(model.tie_embeddings),
       .aliases = {"tie_word_embeddings", "tied_embeddings", "share_embeddings"}, .resume = OnResume::refused},
      {.section = "model", .key = "max_seq_len", .default_value = m.max_seq_len,
       .meaning = "longest sequence the model is meant for; data.seq_len must not exceed it",
       .bind = LT_CONFIG_FIELD(model.max_seq_len), .range = at_least(1),
       .aliases = {"max_position_embeddings", "n_positions", "max_seq_length", "context_length"},
       .resume = OnResume::refused},
      // Allowed on resume, like the keys below: they change what is kept and where, not the function
      // trained (on CPU the gradients are bit-identical; chunk sizes change only the summation order).
      {.section = "model", .key = "checkpoint", .default_value = std::string("auto"),
       .meaning = "activation checkpointing per layer: none, full (recompute all), remat_aware (keep attention "
                  "output), auto (the fastest policy, with model.offload, whose memory plan fits; --plan says which)",
       .bind = LT_CONFIG_FIELD(model.checkpoint),
       .aliases = {"activation_checkpointing", "recompute", "gradient_checkpointing", "recompute_granularity", "ac"},
       .resume = OnResume::allowed},
      {.section = "model", .key = "offload", .default_value = std::string("auto"),
       .meaning = "where the checkpoints the policy keeps per layer live: none (device), checkpoints (pinned host "
                  "memory, copied out during forward and back a layer ahead in backward), auto (offload only when "
                  "nothing faster fits; never on CPU)",
       .bind = LT_CONFIG_FIELD(model.offload),
       .aliases = {"offload_checkpoints", "cpu_offload", "activation_offload", "offload_activations"},
       .resume = OnResume::allowed},
      {.section = "model", .key = "mlp_chunk_tokens", .default_value = int64_t{0},
       .meaning = "tokens per chunk of the token-local layer work (norms, o_proj, MLP), so its intermediates exist one "
                  "chunk at a time; 0 = auto (16384)",
       .bind = LT_CONFIG_FIELD(model.tiling.mlp_chunk_tokens), .range = at_least(0),
       .aliases = {"tiled_mlp_chunk", "mlp_chunk", "mlp_tile_tokens"}, .resume = OnResume::allowed},
      {.section = "model", .key = "loss_chunk_tokens", .default_value = int64_t{0},
       .meaning = "tokens per chunk of the final norm, LM head and cross-entropy (forward and backward fused per "
                  "chunk; the [T, vocab] logits never exist); 0 = auto (4096)",
       .bind = LT_CONFIG_FIELD(model.tiling.loss_chunk_tokens), .range = at_least(0),
       .aliases = {"logits_chunk", "loss_chunk", "ce_chunk_tokens", "tiled_loss_chunk"}, .resume = OnResume::allowed},
      {.section = "model", .key = "attention_head_groups", .default_value = int64_t{0},
       .meaning = "calls one rank's attention backward is split into by kv heads, each over n_kv_heads / groups kv "
                  "heads and their query heads, so its f32 workspace (cuDNN's workspace and dQ accumulator) is that "
                  "many times smaller; a divisor of n_kv_heads; 0 = auto (on CUDA the fewest groups keeping it "
                  "within 5 GiB)",
       .bind = LT_CONFIG_FIELD(model.tiling.attention_head_groups), .range = at_least(0),
       .aliases = {"attention_backward_head_groups", "attn_head_groups", "head_groups"}, .resume = OnResume::allowed},
      {.section = "model", .key = "init_std", .default_value = 0.02,
       .meaning = "standard deviation of the normal init of weight matrices", .bind = LT_CONFIG_FIELD(model.init_std),
       .range = above(0), .aliases = {"initializer_range", "init_method_std", "std"}, .resume = OnResume::refused},
      {.section = "model", .key = "init_from", .default_value = std::string(),
       .meaning = "Hugging Face Llama directory (config.json, safetensors) whose weights start the run; its config.json "
                  "gives the shape; empty = random init",
       .bind = LT_CONFIG_FIELD(model.init_from),
       .aliases = {"pretrained", "from_pretrained", "model_name_or_path", "load", "init_checkpoint", "hf_model"},
       // Read only when a run starts fresh: a resume takes the weights from its checkpoint.
       .resume = OnResume::allowed},

      // data
      {.section = "data", .key = "train", .default_value = std::string(),
       .meaning = "token shards written by `longtrain prepare`, a Megatron-LM/NeMo indexed dataset (PREFIX of "
                  "PREFIX.bin/.idx), or a weighted mixture of them: [{path: a, weight: 0.3}, {path: b, weight: 0.7}]",
       .bind = LT_CONFIG_FIELD(data.train),
       .default_note = "(required)", .aliases = {"train_dir", "train_data", "path", "data_path", "dataset", "train_path",
                                                 "data_mixture", "mixture", "blend", "train_blend"},
       .required = true, .path = true, .sources = true, .resume = OnResume::allowed},
      {.section = "data", .key = "val", .default_value = std::string(),
       .meaning = "validation shard directory or Megatron dataset; empty = data.train's validation split (a shard "
                  "set's; a Megatron dataset or a mixture needs data.val)",
       .bind = LT_CONFIG_FIELD(data.val), .aliases = {"val_dir", "valid", "validation", "val_data", "eval_data"},
       .hashed = false, .path = true, .resume = OnResume::allowed},
      {.section = "data", .key = "tokenizer", .default_value = std::string(),
       .meaning = "SentencePiece .model or Hugging Face tokenizer.json (byte-level BPE: Llama 3, Qwen 2.5, GPT-2; "
                  "for generate and passkey eval); empty = none "
                  "(model.init_from's own tokenizer when it has one)",
       .bind = LT_CONFIG_FIELD(data.tokenizer), .aliases = {"tokenizer_path", "tokenizer_model", "spm"},
       .hashed = false, .path = true, .resume = OnResume::refused},
      {.section = "data", .key = "seq_len", .default_value = int64_t{1024},
       .meaning = "tokens per sequence, split over parallel.sp_size ranks", .bind = LT_CONFIG_FIELD(data.seq_len),
       .range = at_least(1),
       .aliases = {"seq_length", "sequence_length", "block_size", "context_len", "max_seq_len", "seqlen"},
       .resume = OnResume::refused},
      {.section = "data", .key = "prefetch", .default_value = int64_t{2},
       .meaning = "batches the loader thread prepares ahead; 0 = load on demand", .bind = LT_CONFIG_FIELD(data.prefetch),
       .range = at_least(0), .aliases = {"prefetch_factor", "num_workers"}, .hashed = false,
       .resume = OnResume::allowed},
      // Refused on resume: it changes the function trained (attention, positions and which labels
      // count), so a resumed run with the other value is not the continuation of the saved one.
      {.section = "data", .key = "document_mask", .default_value = false,
       .meaning = "packed documents stay apart: a token attends only to earlier tokens of its own document, "
                  "positions restart at 0 at each document start, and the label from a document's last token to "
                  "the next document's first is ignored (training and eval); false = windows attend across "
                  "documents with positions 0..seq_len-1. On cuda, one cuDNN call over the documents' ragged rows",
       .bind = LT_CONFIG_FIELD(data.document_mask),
       .aliases = {"doc_mask", "document_masking", "reset_attention_mask", "reset_position_ids",
                   "varlen", "packed_documents", "intra_document"},
       .resume = OnResume::refused},

      // train
      {.section = "train", .key = "device", .default_value = std::string("auto"),
       .meaning = "auto = cuda when a GPU is present (and dtype allows), else cpu",
       .bind = LT_CONFIG_FIELD(train.device),
       .resume = OnResume::refused},
      {.section = "train", .key = "dtype", .default_value = std::string("auto"),
       .meaning = "f32 or f64 on cpu; bf16 mixed precision on cuda; auto = bf16 on cuda, f32 on cpu",
       .bind = LT_CONFIG_FIELD(train.dtype), .aliases = {"precision", "mixed_precision", "dtype_param"},
       .resume = OnResume::refused},
      {.section = "train", .key = "steps", .default_value = int64_t{1000},
       .meaning = "optimizer steps of the whole run (the lr schedule ends here)", .bind = LT_CONFIG_FIELD(train.steps),
       .range = at_least(1), .aliases = {"max_steps", "train_iters", "num_steps", "total_steps", "iters", "max_iters"},
       .resume = OnResume::allowed},
      {.section = "train", .key = "batch_size", .default_value = int64_t{1},
       .meaning = "sequences per data-parallel rank per micro-step", .bind = LT_CONFIG_FIELD(train.batch_size),
       .range = at_least(1),
       .aliases = {"micro_batch_size", "local_batch_size", "batch", "per_device_train_batch_size"},
       .resume = OnResume::elastic},
      {.section = "train", .key = "grad_accum", .default_value = int64_t{1},
       .meaning = "micro-steps whose gradients are summed per optimizer step", .bind = LT_CONFIG_FIELD(train.grad_accum),
       .range = at_least(1), .aliases = {"gradient_accumulation_steps", "grad_accum_steps", "accumulation_steps"},
       .resume = OnResume::elastic},
      {.section = "train", .key = "grad_dtype", .default_value = std::string("auto"),
       .meaning = "dtype of the gradients: f32 beside bf16 parameters sums token chunks and micro-batches without "
                  "bf16 rounding (2 bytes a parameter more, twice the gradient reduction); bf16 on cuda; on cpu the "
                  "train.dtype; auto = f32 on cuda when grad_accum > 1, else train.dtype",
       .bind = LT_CONFIG_FIELD(train.grad_dtype),
       .aliases = {"grad_precision", "accumulate_allreduce_grads_in_fp32", "main_grads_dtype", "gradient_dtype"},
       .resume = OnResume::allowed},
      {.section = "train", .key = "seed", .default_value = int64_t{1234},
       .meaning = "seed of initialization and data order", .bind = LT_CONFIG_FIELD(train.seed), .range = at_least(0),
       .aliases = {"random_seed", "rng_seed"}, .resume = OnResume::refused},
      {.section = "train", .key = "on_nonfinite", .default_value = std::string("skip"),
       .meaning = "a step with a NaN/Inf loss or gradient: skip its update, or stop the run",
       .bind = LT_CONFIG_FIELD(train.on_nonfinite), .aliases = {"nan_policy", "on_nan"}, .hashed = false,
       .resume = OnResume::allowed},
      {.section = "train", .key = "max_nonfinite_skips", .default_value = int64_t{3},
       .meaning = "non-finite steps skipped in a row before the run stops anyway",
       .bind = LT_CONFIG_FIELD(train.max_nonfinite_skips), .range = at_least(1), .aliases = {"max_skips", "max_nan_skips"},
       .hashed = false, .resume = OnResume::allowed},
      {.section = "train", .key = "threads", .default_value = int64_t{0}, .meaning = "CPU threads; 0 = all cores",
       .bind = LT_CONFIG_FIELD(train.threads), .range = at_least(0), .aliases = {"num_threads", "omp_num_threads"},
       .hashed = false, .resume = OnResume::allowed},
      {.section = "train", .key = "gemm_algorithm", .default_value = std::string("auto"),
       .meaning = "cuBLASLt's algorithm for each GEMM shape on cuda: heuristic (its heuristic's first, as PyTorch "
                  "runs) or auto (its first 6 timed on the shape's first calls, the fastest kept; results then "
                  "differ from heuristic's by rounding); LONGTRAIN_GEMM_ALGO overrides it",
       .bind = LT_CONFIG_FIELD(train.gemm_algorithm), .aliases = {"matmul_algorithm", "cublas_algorithm"},
       .hashed = false, .resume = OnResume::allowed},
      {.section = "train", .key = "cuda_graphs", .default_value = std::string("auto"),
       .meaning = "each micro-batch's forward and backward captured once as a CUDA graph and replayed with one "
                  "launch (the same kernels, fewer host calls), on cuda with one rank: auto (wherever they can "
                  "run), true (the same, and the log says why where they cannot), false; calls with offloaded "
                  "checkpoints and runs with data.document_mask run eagerly",
       .bind = LT_CONFIG_FIELD(train.cuda_graphs), .aliases = {"cuda_graph", "use_cuda_graphs", "enable_cuda_graph"},
       .hashed = false, .resume = OnResume::allowed},

      // optim
      {.section = "optim", .key = "lr", .default_value = 3e-4, .meaning = "peak learning rate, reached at the end of warmup",
       .bind = LT_CONFIG_FIELD(optim.lr), .range = at_least(0),
       .aliases = {"learning_rate", "max_lr", "peak_lr", "lr_max", "base_lr"}, .resume = OnResume::allowed},
      {.section = "optim", .key = "min_lr", .default_value = 0.0,
       .meaning = "learning rate at train.steps (cosine and linear decay to it); <= lr", .bind = LT_CONFIG_FIELD(optim.min_lr),
       .range = at_least(0), .aliases = {"lr_min", "final_lr", "end_lr", "min_learning_rate"},
       .resume = OnResume::allowed},
      {.section = "optim", .key = "weight_decay", .default_value = 0.1,
       .meaning = "decoupled (AdamW) weight decay, applied as lr * weight_decay * w",
       .bind = LT_CONFIG_FIELD(optim.weight_decay), .range = at_least(0), .aliases = {"wd", "decay"},
       .resume = OnResume::refused},
      {.section = "optim", .key = "beta1", .default_value = 0.9, .meaning = "Adam first-moment decay",
       .bind = LT_CONFIG_FIELD(optim.beta1), .range = unit_interval_open(), .aliases = {"adam_beta1", "b1", "momentum"},
       .resume = OnResume::refused},
      {.section = "optim", .key = "beta2", .default_value = 0.95, .meaning = "Adam second-moment decay",
       .bind = LT_CONFIG_FIELD(optim.beta2), .range = unit_interval_open(), .aliases = {"adam_beta2", "b2"},
       .resume = OnResume::refused},
      {.section = "optim", .key = "eps", .default_value = 1e-8, .meaning = "Adam denominator epsilon",
       .bind = LT_CONFIG_FIELD(optim.eps), .range = above(0), .aliases = {"adam_eps", "epsilon", "adam_epsilon"},
       .resume = OnResume::refused},
      {.section = "optim", .key = "warmup_steps", .default_value = int64_t{100},
       .meaning = "steps of linear warmup from 0 to lr; <= train.steps", .bind = LT_CONFIG_FIELD(optim.warmup_steps),
       .range = at_least(0), .aliases = {"warmup", "lr_warmup_steps", "warmup_iters", "num_warmup_steps"},
       .resume = OnResume::allowed},
      {.section = "optim", .key = "schedule", .default_value = std::string("cosine"),
       .meaning = "learning-rate decay after warmup, down to min_lr at train.steps", .bind = LT_CONFIG_FIELD(optim.schedule),
       .aliases = {"lr_schedule", "lr_scheduler", "scheduler", "lr_decay_style", "decay_style"},
       .resume = OnResume::allowed},
      {.section = "optim", .key = "grad_clip", .default_value = 1.0,
       .meaning = "clip the global gradient norm to this; 0 = no clipping", .bind = LT_CONFIG_FIELD(optim.grad_clip),
       .range = at_least(0),
       .aliases = {"max_grad_norm", "clip_grad", "gradient_clipping", "max_norm", "clip_grad_norm"},
       .resume = OnResume::refused},
      {.section = "optim", .key = "no_decay", .default_value = std::vector<std::string>{"norm", "embed_tokens"},
       .meaning = "parameters whose Hugging Face name contains one of these get no weight decay",
       .bind = LT_CONFIG_FIELD(optim.no_decay), .aliases = {"no_weight_decay", "exclude_from_weight_decay"},
       .resume = OnResume::refused},

      // parallel
      {.section = "parallel", .key = "sp_size", .default_value = int64_t{1},
       .meaning = "ranks that share one sequence (sequence/context parallelism); must divide the world size",
       .bind = LT_CONFIG_FIELD(parallel.sp_size), .range = at_least(1),
       .aliases = {"context_parallel_size", "cp_size", "cp", "sp", "sequence_parallel_size", "context_parallel_degree"},
       .resume = OnResume::elastic},
      {.section = "parallel", .key = "ulysses_size", .default_value = int64_t{1},
       .meaning = "2D sequence parallelism: Ulysses (all-to-all to head shards) inside groups of this many consecutive "
                  "ranks, attention.schedule's ring across the sp_size / ulysses_size groups; must divide sp_size and "
                  "model.n_heads; 1 = no Ulysses (schedule ulysses: Ulysses over the whole SP group)",
       .bind = LT_CONFIG_FIELD(parallel.ulysses_size), .range = at_least(1),
       .aliases = {"ulysses_degree", "ulysses", "head_parallel_size", "a2a_size"}, .resume = OnResume::allowed},
      {.section = "parallel", .key = "layout", .default_value = std::string("zigzag"),
       .meaning = "token split: contiguous (rank r: chunk r) or zigzag (rank r: chunks r and 2P-1-r)",
       .bind = LT_CONFIG_FIELD(parallel.layout), .aliases = {"sharding", "seq_layout", "load_balance"},
       .resume = OnResume::elastic},
      {.section = "parallel", .key = "timeout_s", .default_value = 600.0,
       .meaning = "seconds a collective may block before the run fails naming it", .bind = LT_CONFIG_FIELD(parallel.timeout_s),
       .range = above(0), .aliases = {"timeout", "nccl_timeout", "comm_timeout"}, .hashed = false,
       .resume = OnResume::allowed},
      {.section = "parallel", .key = "store_timeout_s", .default_value = 30.0,
       .meaning = "seconds the rendezvous store (served by global rank 0) may stay silent before every rank fails "
                  "naming it: its host died, hung or is unreachable",
       .bind = LT_CONFIG_FIELD(parallel.store_timeout_s), .range = above(0),
       .aliases = {"store_timeout", "rendezvous_timeout"}, .hashed = false, .resume = OnResume::allowed},

      // attention
      {.section = "attention", .key = "schedule", .default_value = std::string("zigzag"),
       .meaning = "ring (contiguous baseline), zigzag (needs layout zigzag), distflash (needs contiguous), burst, "
                  "ulysses (all-to-all to head shards over the SP group; sp_size must divide model.n_heads)",
       .bind = LT_CONFIG_FIELD(attention.schedule), .aliases = {"algorithm", "impl", "cp_algorithm", "rotate_method"},
       .resume = OnResume::allowed},
      {.section = "attention", .key = "causal", .default_value = true, .meaning = "causal mask (language modelling)",
       .bind = LT_CONFIG_FIELD(attention.causal), .aliases = {"is_causal", "mask"}, .resume = OnResume::refused},
      {.section = "attention", .key = "kernel", .default_value = std::string("auto"),
       .meaning = "which kernel runs attention's block calls on cuda: cudnn (cuDNN's fused SDPA), hopper (ours, "
                  "sm_90 only; cuDNN where it does not apply), auto (each call shape timed both ways after its "
                  "first 48 calls, which run cuDNN; the faster kept); LONGTRAIN_ATTENTION_KERNEL overrides it",
       .bind = LT_CONFIG_FIELD(attention.kernel), .aliases = {"attn_implementation", "attn_impl", "backend", "sdpa_backend"},
       .hashed = false, .resume = OnResume::allowed},

      // checkpoint
      {.section = "checkpoint", .key = "every", .default_value = int64_t{500},
       .meaning = "steps between checkpoints; 0 = only at the end", .bind = LT_CONFIG_FIELD(checkpoint.every),
       .range = at_least(0), .aliases = {"interval", "save_every", "save_interval", "save_steps", "checkpoint_every"},
       .hashed = false, .resume = OnResume::allowed},
      {.section = "checkpoint", .key = "keep_last", .default_value = int64_t{3},
       .meaning = "newest complete checkpoints kept; 0 = keep all", .bind = LT_CONFIG_FIELD(checkpoint.keep_last),
       .range = at_least(0), .aliases = {"keep", "keep_latest_k", "save_total_limit", "max_to_keep"}, .hashed = false,
       .resume = OnResume::allowed},
      {.section = "checkpoint", .key = "dir", .default_value = std::string(),
       .meaning = "where step_N/ directories go; empty = <logging.run_dir>/checkpoints",
       .bind = LT_CONFIG_FIELD(checkpoint.dir), .default_note = "<run_dir>/checkpoints",
       .aliases = {"path", "folder", "save_dir", "output_dir", "checkpoint_dir"}, .hashed = false,
       .path = true, .resume = OnResume::allowed},

      // eval
      {.section = "eval", .key = "every", .default_value = int64_t{200},
       .meaning = "steps between evaluations; 0 = only at the end", .bind = LT_CONFIG_FIELD(eval.every),
       .range = at_least(0), .aliases = {"interval", "eval_every", "eval_interval", "eval_steps", "val_every"},
       .hashed = false, .resume = OnResume::allowed},
      {.section = "eval", .key = "batches", .default_value = int64_t{16},
       .meaning = "validation batches per evaluation; 0 = no evaluation", .bind = LT_CONFIG_FIELD(eval.batches),
       .range = at_least(0), .aliases = {"eval_iters", "eval_batches", "steps", "val_batches"}, .hashed = false,
       .resume = OnResume::allowed},
      {.section = "eval", .key = "position_buckets", .default_value = int64_t{8},
       .meaning = "validation loss is also reported per bucket of token positions; <= data.seq_len",
       .bind = LT_CONFIG_FIELD(eval.position_buckets), .range = at_least(1), .aliases = {"buckets", "position_bins"},
       .hashed = false, .resume = OnResume::allowed},

      // logging
      {.section = "logging", .key = "run_dir", .default_value = std::string(),
       .meaning = "run directory (config, metrics.jsonl, plots); empty = runs/<config file stem>",
       .bind = LT_CONFIG_FIELD(logging.run_dir), .default_note = "runs/<config file stem>",
       .aliases = {"output_dir", "out_dir", "dir", "log_dir", "run_name"}, .hashed = false,
       .path = true, .resume = OnResume::allowed},
      {.section = "logging", .key = "log_every", .default_value = int64_t{10},
       .meaning = "steps between console lines and metrics.jsonl records", .bind = LT_CONFIG_FIELD(logging.log_every),
       .range = at_least(1), .aliases = {"log_interval", "logging_steps", "every", "print_every"}, .hashed = false,
       .resume = OnResume::allowed},
      {.section = "logging", .key = "plot", .default_value = true,
       .meaning = "keep a loss-curve SVG in the run directory up to date", .bind = LT_CONFIG_FIELD(logging.plot),
       .aliases = {"plots", "loss_plot", "svg"}, .hashed = false, .resume = OnResume::allowed},
  };
  return keys;
}

#undef LT_CONFIG_FIELD

const KeySpec* find_key(std::string_view section, std::string_view key) {
  for (const KeySpec& s : key_table())
    if (s.section == section && s.key == key) return &s;
  return nullptr;
}

bool is_section(std::string_view name) {
  for (const SectionSpec& s : section_table())
    if (s.name == name) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------------
// Did-you-mean, in order of confidence: a name other trainers use for a key of the same section
// (optim.learning_rate -> optim.lr), the same key in another section (train.lr -> optim.lr), another
// section's alias (optim.max_steps -> train.steps), spelling (edit distance, a transposition counts
// once; same section first), then a prefix (optim.warmup -> optim.warmup_steps).

std::string normalized(std::string_view s) {
  std::string out;
  for (char c : s)
    if (c != '_' && c != '-' && c != ' ') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  // Optimal string alignment distance over three rows.
  std::vector<size_t> prev2(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) cur[j] = std::min(cur[j], prev2[j - 2] + 1);
    }
    prev2 = prev;
    prev = cur;
  }
  return prev[b.size()];
}

size_t typo_budget(std::string_view word) { return word.size() <= 3 ? 1 : word.size() <= 7 ? 2 : 3; }

// The closest of `names` to `word` by spelling, or "" when none is close.
std::string closest(std::string_view word, const std::vector<std::string_view>& names) {
  std::string best;
  size_t best_d = typo_budget(word) + 1;
  for (std::string_view n : names) {
    size_t d = edit_distance(normalized(word), normalized(n));
    if (d < best_d) best_d = d, best = std::string(n);
  }
  return best;
}

// A suggestion "section.key" for an unknown `key` written in `section`, or "". Candidates rank by
// (kind of match, spelling distance); the first key in table order wins a tie.
std::string suggest_key(std::string_view section, std::string_view key) {
  const std::string nk = normalized(key);
  std::pair<int, size_t> best = {std::numeric_limits<int>::max(), 0};
  const KeySpec* found = nullptr;
  for (const KeySpec& s : key_table()) {
    const bool here = s.section == section;
    const std::string ns = normalized(s.key);
    const bool alias = std::any_of(s.aliases.begin(), s.aliases.end(), [&](auto a) { return normalized(a) == nk; });
    const size_t d = edit_distance(nk, ns);
    std::pair<int, size_t> rank;
    if (alias && here) rank = {0, 0};                              // learning_rate in optim
    else if (ns == nk && !here) rank = {1, 0};                     // train.lr: lr lives in optim
    else if (alias) rank = {2, 0};                                 // optim.max_steps: train.steps
    else if (d <= typo_budget(key)) rank = {here ? 3 : 4, d};      // spelling
    else if (nk.size() >= 4 && ns.starts_with(nk)) rank = {here ? 5 : 6, 0};  // warmup -> warmup_steps
    else continue;
    if (rank < best) best = rank, found = &s;
  }
  return found ? found->name() : std::string();
}

std::string unknown_section_message(std::string_view name) {
  std::vector<std::string_view> names;
  for (const SectionSpec& s : section_table()) names.push_back(s.name);
  std::string list = fmt::format("{}", fmt::join(names, ", "));
  // "optim.lr: 1e-3" at the top level: a whole key where a section belongs.
  if (auto dot = name.find('.'); dot != std::string_view::npos) {
    if (find_key(name.substr(0, dot), name.substr(dot + 1)))
      return fmt::format("unknown section {} (write it inside its section: {}: {{{}: ...}})", name,
                         name.substr(0, dot), name.substr(dot + 1));
  }
  for (const SectionSpec& s : section_table())
    for (std::string_view a : s.aliases)
      if (normalized(a) == normalized(name))
        return fmt::format("unknown section {} (did you mean {}?); sections are {}", name, s.name, list);
  if (std::string c = closest(name, names); !c.empty())
    return fmt::format("unknown section {} (did you mean {}?); sections are {}", name, c, list);
  // "lr: 1e-3" at the top level: a key without its section.
  for (const KeySpec& s : key_table())
    if (normalized(s.key) == normalized(name))
      return fmt::format("unknown section {} (did you mean {}? keys go inside their section); sections are {}", name,
                         s.name(), list);
  return fmt::format("unknown section {}; sections are {}", name, list);
}

std::string unknown_key_message(std::string_view section, std::string_view key) {
  std::string suggestion = suggest_key(section, key);
  if (!suggestion.empty()) return fmt::format("unknown key {}.{} (did you mean {}?)", section, key, suggestion);
  std::vector<std::string_view> keys;
  for (const KeySpec& s : key_table())
    if (s.section == section) keys.push_back(s.key);
  return fmt::format("unknown key {}.{}; the keys of {} are {}", section, key, section, fmt::join(keys, ", "));
}

// ---------------------------------------------------------------------------------------------------
// Values: YAML node -> Value (type checks), Value -> YAML text.

std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Scalar: return fmt::format("'{}'", n.Scalar());
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a mapping";
    default: return "no value";
  }
}

bool parse_bool(std::string_view text, bool& out) {
  std::string s;
  for (char c : trimmed(text)) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "true" || s == "yes" || s == "on") return out = true, true;
  if (s == "false" || s == "no" || s == "off") return out = false, true;
  return false;
}

// A mixture written as a YAML list of {path, weight} -> its canonical text (data/mixture.h).
std::string mixture_spec(const KeySpec& spec, const YAML::Node& n, const std::string& where) {
  std::vector<data::DataSource> sources;
  if (n.size() == 0) throw Error(fmt::format("{}: {}: a mixture must list at least one {{path, weight}}", where,
                                             spec.name()));
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node item = n[i];
    const std::string at = fmt::format("{}: {}[{}]", where, spec.name(), i);
    if (!item.IsMap()) throw Error(fmt::format("{}: expected {{path: ..., weight: ...}}, got {}", at, describe(item)));
    data::DataSource src;
    bool has_path = false, has_weight = false;
    for (auto kv = item.begin(); kv != item.end(); ++kv) {
      const std::string field = kv->first.IsScalar() ? kv->first.Scalar() : std::string();
      if (field == "path") {
        if (!kv->second.IsScalar() || trimmed(kv->second.Scalar()).empty())
          throw Error(fmt::format("{}: path must be a non-empty string, got {}", at, describe(kv->second)));
        src.path = kv->second.Scalar();
        has_path = true;
      } else if (field == "weight") {
        if (!kv->second.IsScalar() || !parse_double(kv->second.Scalar(), src.weight))
          throw Error(fmt::format("{}: weight must be a number, got {}", at, describe(kv->second)));
        has_weight = true;
      } else {
        throw Error(fmt::format("{}: unknown field '{}' (a source has path and weight)", at, field));
      }
    }
    if (!has_path) throw Error(fmt::format("{}: path is missing (a shard directory or a Megatron dataset prefix)", at));
    if (!has_weight) throw Error(fmt::format("{} ({}): weight is missing (the source's share of the windows)", at,
                                             src.path));
    if (!std::isfinite(src.weight) || src.weight <= 0)
      throw Error(fmt::format("{} ({}): weight {} must be positive and finite", at, src.path, src.weight));
    sources.push_back(std::move(src));
  }
  return data::data_sources_text(sources);
}

// Converts a node to the key's type. `where` starts the message: "file:line" or "--set k=v".
Value convert(const KeySpec& spec, const YAML::Node& n, const std::string& where) {
  auto bad = [&](std::string_view expected) {
    return Error(fmt::format("{}: {}: expected {}, got {}", where, spec.name(), expected, describe(n)));
  };
  switch (spec.type()) {
    case Type::integer: {
      int64_t v = 0;
      if (!n.IsScalar() || !parse_int(n.Scalar(), v)) throw bad("an integer");
      return v;
    }
    case Type::number: {
      double v = 0.0;
      if (!n.IsScalar() || !parse_double(n.Scalar(), v)) throw bad("a number");
      return v;
    }
    case Type::boolean: {
      bool v = false;
      if (!n.IsScalar() || !parse_bool(n.Scalar(), v)) throw bad("true or false");
      return v;
    }
    case Type::string:
      if (n.IsNull()) return std::string();
      if (spec.sources && n.IsSequence()) return mixture_spec(spec, n, where);
      if (!n.IsScalar()) throw bad(spec.sources ? "a path or a list of {path, weight}" : "a string");
      return n.Scalar();
    case Type::choice: {
      auto choices = spec.bind.choices();
      std::string expected = fmt::format("one of {}", fmt::join(choices, ", "));
      if (!n.IsScalar()) throw bad(expected);
      std::string v = trimmed(n.Scalar());
      if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
      // A choice between true, false and more (train.cuda_graphs) takes every spelling a boolean key does.
      bool flag = false;
      const bool has_bools = std::find(choices.begin(), choices.end(), "true") != choices.end() &&
                             std::find(choices.begin(), choices.end(), "false") != choices.end();
      if (has_bools && parse_bool(v, flag)) return std::string(flag ? "true" : "false");
      std::string near = closest(v, choices);
      throw Error(fmt::format("{}: {}: expected {}, got '{}'{}", where, spec.name(), expected, v,
                              near.empty() ? "" : fmt::format(" (did you mean {}?)", near)));
    }
    case Type::string_list: {
      if (!n.IsSequence()) throw bad("a list of strings like [a, b]");
      std::vector<std::string> v;
      for (const YAML::Node& item : n) {
        if (!item.IsScalar() || trimmed(item.Scalar()).empty())
          throw Error(fmt::format("{}: {}: list items must be non-empty strings, got {}", where, spec.name(),
                                  describe(item)));
        v.push_back(item.Scalar());
      }
      return v;
    }
  }
  LT_FAIL("unhandled config key type");
}

std::string format_number(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos &&
      s.find("nan") == std::string::npos)
    s += ".0";
  return s;
}

// A JSON string is a valid YAML double-quoted scalar: the safe way to write any path back.
std::string quoted(const std::string& s) { return nlohmann::json(s).dump(); }

std::string yaml_text(const KeySpec& spec, const Value& v) {
  switch (v.index()) {
    case 0: return fmt::format("{}", std::get<int64_t>(v));
    case 1: return format_number(std::get<double>(v));
    case 2: return std::get<bool>(v) ? "true" : "false";
    case 3:
      if (spec.type() == Type::choice) return std::get<std::string>(v);
      // A mixture's canonical text is JSON, which is YAML: written as the list itself.
      if (spec.sources && data::is_mixture_spec(std::get<std::string>(v))) return std::get<std::string>(v);
      return quoted(std::get<std::string>(v));
    default: {
      std::vector<std::string> items;
      for (const std::string& s : std::get<std::vector<std::string>>(v)) items.push_back(quoted(s));
      return fmt::format("[{}]", fmt::join(items, ", "));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The loader: where each key's value came from, so every message can point at it.

struct Origin {
  enum Kind { from_default, from_file, from_override } kind = from_default;
  int line = 0;          // 1-based, from_file
  std::string override;  // the --set text, from_override
};

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) { config_.source = source_; }

  void apply_document(const std::string& text);
  void apply_override(const std::string& text);
  TrainConfig finish();

 private:
  std::string location(const Origin& o) const {
    switch (o.kind) {
      case Origin::from_file: return fmt::format("{}:{}", source_, o.line);
      case Origin::from_override: return fmt::format("--set {}", o.override);
      default: return source_;
    }
  }
  std::string note(const Origin& o) const {
    switch (o.kind) {
      case Origin::from_file: return fmt::format("line {}", o.line);
      case Origin::from_override: return fmt::format("--set {}", o.override);
      default: return "default";
    }
  }
  const Origin& origin(std::string_view key) const {
    static const Origin none;
    auto it = origins_.find(std::string(key));
    return it == origins_.end() ? none : it->second;
  }
  // Throws `message` located at the first of `keys` that the user set (a --set before a file line),
  // noting where the other keys' values came from.
  [[noreturn]] void fail(const std::vector<std::string>& keys, const std::string& message) const;
  void apply_rope_mapping(const YAML::Node& body, int line);
  void apply_init_from();
  void check_ranges() const;
  void resolve_derived();
  void check_model() const;
  void check_combinations() const;

  std::string source_;
  TrainConfig config_;
  std::map<std::string, Origin> origins_;  // keys the file or --set gave
  std::map<std::string, Value> given_;     // their converted values, applied over the defaults
};

void Loader::fail(const std::vector<std::string>& keys, const std::string& message) const {
  const std::string* primary = nullptr;
  for (auto kind : {Origin::from_override, Origin::from_file})
    for (const std::string& k : keys)
      if (!primary && origin(k).kind == kind) primary = &k;
  std::vector<std::string> notes;
  for (const std::string& k : keys)
    if (&k != primary) notes.push_back(fmt::format("{}: {}", k, note(origin(k))));
  std::string where = primary ? location(origin(*primary)) : source_;
  std::string tail = keys.size() > 1 ? fmt::format(" ({})", fmt::join(notes, "; ")) : "";
  throw Error(fmt::format("{}: {}{}", where, message, tail));
}

void Loader::apply_document(const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}:{}: malformed YAML (column {}): {}", source_, e.mark.line + 1, e.mark.column + 1,
                            e.msg));
  }
  if (root.IsNull()) return;
  if (!root.IsMap())
    throw Error(fmt::format("{}:{}: expected a mapping of sections (model:, data:, train:, ...), got {}", source_,
                            root.Mark().line + 1, describe(root)));
  std::map<std::string, int> section_lines;
  for (auto it = root.begin(); it != root.end(); ++it) {
    // Copies, not references: yaml-cpp's operator-> returns a temporary proxy, and a reference to its
    // members dangles once the statement ends (found by the config fuzz target under ASan).
    const YAML::Node name_node = it->first;
    const YAML::Node body = it->second;
    const int line = name_node.Mark().line + 1;
    if (!name_node.IsScalar())
      throw Error(fmt::format("{}:{}: expected a section name, got {}", source_, line, describe(name_node)));
    const std::string section = name_node.Scalar();
    if (!is_section(section)) throw Error(fmt::format("{}:{}: {}", source_, line, unknown_section_message(section)));
    if (auto [seen, fresh] = section_lines.emplace(section, line); !fresh)
      throw Error(fmt::format("{}:{}: section {} appears twice (first at line {})", source_, line, section,
                              seen->second));
    if (body.IsNull()) continue;
    if (!body.IsMap())
      throw Error(fmt::format("{}:{}: section {} must be a mapping of key: value lines, got {}", source_, line, section,
                              describe(body)));
    for (auto kv = body.begin(); kv != body.end(); ++kv) {
      const int key_line = kv->first.Mark().line + 1;
      if (!kv->first.IsScalar())
        throw Error(fmt::format("{}:{}: expected a key name in section {}, got {}", source_, key_line, section,
                                describe(kv->first)));
      const std::string key = kv->first.Scalar();
      if (section == "model" && key == "rope_scaling" && kv->second.IsMap()) {
        apply_rope_mapping(kv->second, key_line);
        continue;
      }
      const KeySpec* spec = find_key(section, key);
      if (!spec) throw Error(fmt::format("{}:{}: {}", source_, key_line, unknown_key_message(section, key)));
      if (auto seen = origins_.find(spec->name()); seen != origins_.end())
        throw Error(fmt::format("{}:{}: {} is given twice (first at line {})", source_, key_line, spec->name(),
                                seen->second.line));
      given_[spec->name()] = convert(*spec, kv->second, fmt::format("{}:{}", source_, key_line));
      origins_[spec->name()] = Origin{Origin::from_file, key_line, {}};
    }
  }
}

// rope_scaling written as in config.json, {rope_type: yarn, factor: 8, ...}: each field is the key
// model.rope_<field> (rope_type, or its legacy spelling type, is model.rope_scaling itself).
void Loader::apply_rope_mapping(const YAML::Node& body, int line) {
  for (auto kv = body.begin(); kv != body.end(); ++kv) {
    const int field_line = kv->first.Mark().line + 1 > 0 ? kv->first.Mark().line + 1 : line;
    const std::string field = kv->first.IsScalar() ? kv->first.Scalar() : std::string();
    const std::string key = field == "rope_type" || field == "type" ? "rope_scaling" : "rope_" + field;
    const KeySpec* spec = field.empty() ? nullptr : find_key("model", key);
    if (!spec || key == "rope_theta")
      throw Error(fmt::format("{}:{}: model.rope_scaling has no field '{}'; its fields are rope_type, factor, "
                              "original_max_position_embeddings, low_freq_factor, high_freq_factor, beta_fast, "
                              "beta_slow, attention_factor, mscale, mscale_all_dim, truncate (rope_theta is "
                              "model.rope_theta)",
                              source_, field_line, field));
    if (auto seen = origins_.find(spec->name()); seen != origins_.end())
      throw Error(fmt::format("{}:{}: {} is given twice (first at line {})", source_, field_line, spec->name(),
                              seen->second.line));
    given_[spec->name()] = convert(*spec, kv->second, fmt::format("{}:{}", source_, field_line));
    origins_[spec->name()] = Origin{Origin::from_file, field_line, {}};
  }
}

void Loader::apply_override(const std::string& text) {
  const std::string where = fmt::format("--set {}", text);
  const size_t eq = text.find('=');
  const std::string path = trimmed(text.substr(0, eq));
  const size_t dot = path.find('.');
  if (eq == std::string::npos || dot == std::string::npos || path.find('.', dot + 1) != std::string::npos)
    throw Error(fmt::format("{}: expected section.key=value, e.g. --set optim.lr=3e-4", where));
  const std::string section = path.substr(0, dot), key = path.substr(dot + 1);
  if (!is_section(section)) throw Error(fmt::format("{}: {}", where, unknown_section_message(section)));
  const KeySpec* spec = find_key(section, key);
  if (!spec) throw Error(fmt::format("{}: {}", where, unknown_key_message(section, key)));
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("{}: {}: malformed value: {}", where, spec->name(), e.msg));
  }
  given_[spec->name()] = convert(*spec, value, where);  // a later --set of the same key wins
  origins_[spec->name()] = Origin{Origin::from_override, 0, text};
}

void Loader::check_ranges() const {
  for (const KeySpec& s : key_table()) {
    const Value v = s.bind.get(config_);
    if (s.required && std::get<std::string>(v).empty()) {
      fail({s.name()}, fmt::format("{} is required: {}", s.name(), s.meaning));
    }
    if (s.sources && !std::get<std::string>(v).empty()) {
      try {
        data::parse_data_sources(std::get<std::string>(v), s.name());
      } catch (const Error& e) {
        fail({s.name()}, e.what());
      }
    }
    if (s.range.unbounded()) continue;
    double x = v.index() == 0 ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    if (!s.range.contains(x))
      fail({s.name()}, fmt::format("{} must be {}, got {}", s.name(), s.range.text(), yaml_text(s, v)));
  }
}

void Loader::resolve_derived() {
  ModelSection& m = config_.model;
  if (m.head_dim == 0) {
    if (m.dim % m.n_heads != 0)
      fail({"model.head_dim", "model.dim", "model.n_heads"},
           fmt::format("model.head_dim is 0 (= dim / n_heads) but model.dim ({}) is not a multiple of model.n_heads "
                       "({}): set model.head_dim explicitly or change dim or n_heads",
                       m.dim, m.n_heads));
    m.head_dim = m.dim / m.n_heads;
  }
  if (config_.logging.run_dir.empty()) {
    // runs/<stem>, keeping only characters that are safe in a directory name.
    std::string stem;
    for (char c : std::filesystem::path(source_).stem().string())
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') stem += c;
    config_.logging.run_dir = (std::filesystem::path("runs") / (stem.empty() ? "run" : stem)).string();
  }
  if (config_.checkpoint.dir.empty())
    config_.checkpoint.dir = (std::filesystem::path(config_.logging.run_dir) / "checkpoints").string();
}

void Loader::check_model() const {
  try {
    static_cast<const model::LlamaConfig&>(config_.model).validate();
  } catch (const Error& e) {
    // LlamaConfig's message names model.<key>: locate it at that key in the config.
    const std::string message = e.what();
    std::vector<std::string> keys;
    static const std::regex model_key("model\\.[a-z_]+");
    for (std::sregex_iterator it(message.begin(), message.end(), model_key), end; it != end; ++it)
      if (std::find(keys.begin(), keys.end(), it->str()) == keys.end()) keys.push_back(it->str());
    if (keys.empty()) keys.push_back("model.dim");
    fail(keys, message);
  }
}

void Loader::check_combinations() const {
  const TrainConfig& c = config_;
  const int64_t S = c.data.seq_len, P = c.parallel.sp_size;

  if (S > c.model.max_seq_len)
    fail({"data.seq_len", "model.max_seq_len"},
         fmt::format("data.seq_len ({}) exceeds model.max_seq_len ({}): raise model.max_seq_len or shorten the sequences",
                     S, c.model.max_seq_len));

  const int64_t chunks = c.parallel.layout == SeqLayout::zigzag ? 2 * P : P;
  if (S % chunks != 0)
    fail({"data.seq_len", "parallel.sp_size", "parallel.layout"},
         c.parallel.layout == SeqLayout::zigzag
             ? fmt::format("data.seq_len ({}) must be a multiple of 2*parallel.sp_size = {} with parallel.layout "
                           "zigzag: each rank holds two chunks of seq_len / (2*sp_size) tokens",
                           S, chunks)
             : fmt::format("data.seq_len ({}) must be a multiple of parallel.sp_size = {} with parallel.layout "
                           "contiguous: each rank holds seq_len / sp_size tokens",
                           S, chunks));

  const AttentionSchedule sched = c.attention.schedule;
  if (sched == AttentionSchedule::zigzag && c.parallel.layout != SeqLayout::zigzag)
    fail({"attention.schedule", "parallel.layout"},
         "attention.schedule zigzag needs parallel.layout zigzag (it balances causal work through that layout); "
         "use schedule ring or distflash with the contiguous layout");
  if (sched == AttentionSchedule::distflash && c.parallel.layout != SeqLayout::contiguous)
    fail({"attention.schedule", "parallel.layout"},
         "attention.schedule distflash needs parallel.layout contiguous (it balances causal work by moving queries "
         "between ranks); use schedule zigzag or burst with the zigzag layout");

  const int64_t U = c.parallel.ulysses_size;
  if (P % U != 0)
    fail({"parallel.ulysses_size", "parallel.sp_size"},
         fmt::format("parallel.ulysses_size ({}) must divide parallel.sp_size ({}): the SP group is ulysses_size ranks "
                     "of Ulysses times sp_size / ulysses_size ranks of ring",
                     U, P));
  if (sched == AttentionSchedule::ulysses && U != 1 && U != P)
    fail({"attention.schedule", "parallel.ulysses_size"},
         fmt::format("attention.schedule ulysses runs Ulysses over the whole SP group (parallel.ulysses_size 1 or "
                     "{}), but parallel.ulysses_size is {}: for Ulysses inside groups of {} with a ring across them, "
                     "set attention.schedule to ring, zigzag, distflash or burst",
                     P, U, U));
  // The ranks that split heads: the whole SP group (schedule ulysses) or the Ulysses groups.
  const int64_t head_split = sched == AttentionSchedule::ulysses ? P : U;
  if (head_split > 1) {
    const std::string key = sched == AttentionSchedule::ulysses ? "parallel.sp_size" : "parallel.ulysses_size";
    const int64_t hq = c.model.n_heads, hkv = c.model.n_kv_heads;
    if (hq % head_split != 0)
      fail({"model.n_heads", key},
           fmt::format("Ulysses splits the heads over {} = {} ranks, but model.n_heads ({}) is not a multiple of {}",
                       key, head_split, hq, head_split));
    if (hkv > 0 && hkv % head_split != 0 && head_split % hkv != 0)
      fail({"model.n_kv_heads", key},
           fmt::format("Ulysses over {} = {} ranks needs model.n_kv_heads ({}) to be a multiple of {} (K/V heads "
                       "split) or a divisor of it (each K/V head sent to the ranks that read it)",
                       key, head_split, hkv, head_split));
  }

  const DeviceChoice dev = c.train.device;
  const DTypeChoice dt = c.train.dtype;
  if (dev == DeviceChoice::cuda && (dt == DTypeChoice::f32 || dt == DTypeChoice::f64))
    fail({"train.dtype", "train.device"},
         fmt::format("train.dtype {} runs on the CPU only; on cuda the model trains in bf16 mixed precision "
                     "(train.dtype bf16 or auto), or set train.device cpu",
                     enum_name(dt)));
  if (dev == DeviceChoice::cpu && dt == DTypeChoice::bf16)
    fail({"train.dtype", "train.device"},
         "train.dtype bf16 needs train.device cuda; on the CPU use f32 (or f64 for gradient checks)");
  const std::string grad_why = grad_dtype_problem(c.train.grad_dtype, dt, dev);
  if (!grad_why.empty()) fail({"train.grad_dtype", "train.dtype"}, grad_why);

  if (c.optim.min_lr > c.optim.lr)
    fail({"optim.min_lr", "optim.lr"},
         fmt::format("optim.min_lr ({}) is above optim.lr ({}): the schedule decays from lr down to min_lr",
                     format_number(c.optim.min_lr), format_number(c.optim.lr)));
  if (c.optim.warmup_steps > c.train.steps)
    fail({"optim.warmup_steps", "train.steps"},
         fmt::format("optim.warmup_steps ({}) exceeds train.steps ({}): the run would end before warmup does",
                     c.optim.warmup_steps, c.train.steps));
  if (c.eval.position_buckets > S)
    fail({"eval.position_buckets", "data.seq_len"},
         fmt::format("eval.position_buckets ({}) exceeds data.seq_len ({}): a bucket needs at least one position",
                     c.eval.position_buckets, S));
}

// model.init_from: the shape comes from the directory's config.json. A shape key the config gives
// must agree with it; max_seq_len, rope_theta and the RoPE scaling are what a user changes to extend
// the context, so the config's win (and the directory's are taken when the config gives none).
void Loader::apply_init_from() {
  ModelSection& m = config_.model;
  if (m.init_from.empty()) return;
  namespace fs = std::filesystem;
  const fs::path dir(m.init_from);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail({"model.init_from"}, fmt::format("model.init_from '{}' is not a directory; it must be a Hugging Face Llama "
                                          "directory (config.json and model.safetensors or its shards)",
                                          m.init_from));
  const fs::path json_path = dir / "config.json";
  if (!fs::is_regular_file(json_path, ec))
    fail({"model.init_from"},
         fmt::format("model.init_from '{}' has no config.json: it must be a Hugging Face Llama directory", m.init_from));
  model::HfLlamaConfig hf;
  try {
    hf = model::read_hf_config(json_path.string());
  } catch (const Error& e) {
    fail({"model.init_from"},
         fmt::format("model.init_from: {}", std::regex_replace(std::string(e.what()), std::regex("^\\S+:[0-9]+: "), "")));
  }
  const model::LlamaConfig& h = hf.model;
  const std::string file = json_path.string();
  auto given = [&](const std::string& key) { return origins_.count(key) > 0; };
  auto shape = [&](const char* key, const char* hf_key, auto& ours, auto theirs) {
    const std::string name = fmt::format("model.{}", key);
    const bool zero_head_dim = std::string_view(key) == "head_dim" && ours == std::remove_reference_t<decltype(ours)>{};
    if (given(name) && !zero_head_dim && ours != theirs)
      fail({name, "model.init_from"},
           fmt::format("{} is {} but model.init_from's {} has {} = {}: the model's shape comes from the Hugging Face "
                       "directory; remove {} from the config or make it match",
                       name, ours, file, hf_key, theirs, name));
    ours = theirs;
  };
  model::for_each_hf_shape_field(m, h, shape);
  shape("norm_eps", "rms_norm_eps", m.norm_eps, h.norm_eps);  // not a shape, but the directory's to set
  if (!given("model.max_seq_len")) m.max_seq_len = h.max_seq_len;
  if (!given("model.rope_theta")) m.rope_theta = h.rope_theta;
  bool rope_given = false;
  for (const KeySpec& spec : key_table())
    rope_given = rope_given || (spec.section == "model" && spec.key.starts_with("rope_") && spec.key != "rope_theta" &&
                                given(spec.name()));
  if (!rope_given) m.rope_scaling = h.rope_scaling;
  if (!given("data.tokenizer")) config_.data.tokenizer = data::find_tokenizer_in(dir.string());
}

TrainConfig Loader::finish() {
  for (const KeySpec& s : key_table()) {
    auto it = given_.find(s.name());
    s.bind.set(config_, it != given_.end() ? it->second : s.default_value);
  }
  apply_init_from();
  check_ranges();
  resolve_derived();
  check_model();
  check_combinations();
  return config_;
}

std::string read_config_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(fmt::format("{}: is a directory; expected a YAML config file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot read the config file: {}", path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Public API.

namespace {

// The byte offset of the first byte that is not part of a well-formed UTF-8 sequence (or is a control
// character), or npos. YAML
// is UTF-8 text; yaml-cpp passes other bytes through, and the config's JSON forms (its hash, the
// resolved copy) cannot hold them.
size_t invalid_utf8_at(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    // YAML text is printable: control characters other than tab and line breaks are not allowed
    // (yaml-cpp would let a NUL through and turn what follows into bytes that are not UTF-8).
    if ((c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c == 0x7f) return i;
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size() || (n == 2 && c < 0xc2)) return i;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return i;
    const auto c1 = n > 1 ? static_cast<unsigned char>(s[i + 1]) : 0;
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    if ((n == 3 && c == 0xe0 && c1 < 0xa0) || (n == 3 && c == 0xed && c1 >= 0xa0) ||
        (n == 4 && c == 0xf0 && c1 < 0x90) || (n == 4 && (c > 0xf4 || (c == 0xf4 && c1 >= 0x90))))
      return i;
    i += n;
  }
  return std::string_view::npos;
}

// `where` is the file (the line is added) or the --set override.
void check_utf8(std::string_view text, const std::string& where, bool is_file) {
  const size_t at = invalid_utf8_at(text);
  if (at == std::string_view::npos) return;
  const int64_t line = 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n');
  throw Error(fmt::format("{}{}: byte 0x{:02x} is not printable UTF-8 text (a config holds UTF-8 without control "
                          "characters; paths with other bytes cannot be given here)",
                          where, is_file ? fmt::format(":{}", line) : std::string(),
                          static_cast<unsigned char>(text[at])));
}

}  // namespace

TrainConfig config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides,
                                    const std::string& source_name) {
  check_utf8(yaml, source_name, true);
  for (const std::string& o : overrides) check_utf8(o, "--set " + o.substr(0, o.find('=')), false);
  Loader loader(source_name);
  loader.apply_document(yaml);
  for (const std::string& o : overrides) loader.apply_override(o);
  return loader.finish();
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return config_from_yaml_string(read_config_file(path), overrides, path);
}

void resolve_device(TrainConfig& c, bool cuda_available) {
  TrainSection& t = c.train;
  if (t.device == DeviceChoice::auto_select) {
    const bool cpu_only_dtype = t.dtype == DTypeChoice::f32 || t.dtype == DTypeChoice::f64;
    t.device = cuda_available && !cpu_only_dtype ? DeviceChoice::cuda : DeviceChoice::cpu;
  }
  if (t.device == DeviceChoice::cuda && !cuda_available)
    throw Error(fmt::format("{}: train.device is cuda but no CUDA device is usable here (no GPU found, or this build "
                            "has no CUDA backend): set train.device cpu or auto",
                            c.source));
  if (t.dtype == DTypeChoice::auto_select) t.dtype = t.device == DeviceChoice::cuda ? DTypeChoice::bf16 : DTypeChoice::f32;
  if (t.device == DeviceChoice::cpu && t.dtype == DTypeChoice::bf16)
    throw Error(fmt::format("{}: train.dtype bf16 needs a CUDA device and none is usable here: set train.dtype f32 "
                            "(or auto) to train on the CPU",
                            c.source));
  if (t.grad_dtype == DTypeChoice::auto_select)
    t.grad_dtype = t.device == DeviceChoice::cuda && t.grad_accum > 1 ? DTypeChoice::f32 : t.dtype;
  const std::string grad_why = grad_dtype_problem(t.grad_dtype, t.dtype, t.device);
  if (!grad_why.empty()) throw Error(fmt::format("{}: {}", c.source, grad_why));
}

std::string resolved_yaml(const TrainConfig& c) {
  std::string out = fmt::format(
      "# longtrain config, resolved: every key with its final value.\n# source: {}\n# config_hash: {}\n", c.source,
      config_hash(c));
  for (const SectionSpec& sec : section_table()) {
    out += fmt::format("\n{}:  # {}\n", sec.name, sec.meaning);
    for (const KeySpec& s : key_table()) {
      if (s.section != sec.name) continue;
      std::string line = fmt::format("  {}: {}", s.key, yaml_text(s, s.bind.get(c)));
      out += fmt::format("{:<44} # {}\n", line, s.meaning);
    }
  }
  return out;
}

std::string config_hash(const TrainConfig& c) {
  std::string text = "longtrain-config-v1\n";
  for (const KeySpec& s : key_table())
    if (s.hashed) text += fmt::format("{}={}\n", s.name(), yaml_text(s, s.bind.get(c)));
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

std::string ConfigChange::text() const { return fmt::format("{}: {} -> {}", key, before, after); }

namespace {
namespace fs = std::filesystem;

// "runs/x", "./runs/x/" and its absolute form are one directory; "" stays "" (unset).
std::string path_identity(const std::string& p) {
  if (p.empty()) return p;
  std::error_code ec;
  fs::path abs = fs::weakly_canonical(fs::absolute(p), ec);
  if (ec) return fs::path(p).lexically_normal().string();
  std::string s = abs.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}
// Paths, or mixtures whose sources are the same paths with the same weights in the same order.
bool same_paths(const KeySpec& s, const std::string& a, const std::string& b) {
  if (!s.sources || (!data::is_mixture_spec(a) && !data::is_mixture_spec(b)))
    return path_identity(a) == path_identity(b);
  try {
    const std::vector<data::DataSource> x = data::parse_data_sources(a), y = data::parse_data_sources(b);
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (x[i].weight != y[i].weight || path_identity(x[i].path) != path_identity(y[i].path)) return false;
    return true;
  } catch (const Error&) {
    return false;
  }
}
}  // namespace

std::vector<ConfigChange> config_changes(const TrainConfig& before, const TrainConfig& after) {
  std::vector<ConfigChange> out;
  for (const KeySpec& s : key_table()) {
    const Value a = s.bind.get(before), b = s.bind.get(after);
    std::string ta = yaml_text(s, a), tb = yaml_text(s, b);
    if (ta == tb) continue;
    if (s.path && same_paths(s, std::get<std::string>(a), std::get<std::string>(b))) continue;
    out.push_back({s.name(), std::move(ta), std::move(tb), s.resume.value});
  }
  return out;
}

OnResume on_resume(std::string_view key) {
  for (const KeySpec& s : key_table())
    if (s.name() == key) return s.resume.value;
  throw Error(fmt::format("unknown config key {} (see `longtrain schema`)", key));
}

std::string schema_text() {
  struct Row {
    std::string key, type, def;
    std::string_view resume, meaning;
  };
  std::map<std::string_view, std::vector<Row>> rows;
  size_t wk = 0, wt = 0, wd = 0;
  for (const KeySpec& s : key_table()) {
    std::string type;
    switch (s.type()) {
      case Type::integer: type = "int"; break;
      case Type::number: type = "float"; break;
      case Type::boolean: type = "bool"; break;
      case Type::string: type = "string"; break;
      case Type::choice: type = fmt::format("{}", fmt::join(s.bind.choices(), "|")); break;
      case Type::string_list: type = "list of strings"; break;
    }
    if (!s.range.unbounded()) type += " " + s.range.text();
    std::string def = s.default_note.empty() ? yaml_text(s, s.default_value) : std::string(s.default_note);
    rows[s.section].push_back({std::string(s.key), type, def, enum_name(s.resume.value), s.meaning});
    wk = std::max(wk, s.key.size());
    wt = std::max(wt, type.size());
    wd = std::max(wd, def.size());
  }
  std::string out =
      "longtrain config keys. In the YAML file each key goes inside its section:\n"
      "  optim:\n    lr: 3e-4\n"
      "On the command line: --set optim.lr=3e-4 (repeatable; values are YAML, lists as [a, b]).\n"
      "The resume column says whether `--resume` may continue a checkpoint with another value (see the end).\n";
  out += fmt::format("\n  {:<{}}  {:<{}}  {:<{}}  {:<7}  {}\n", "key", wk, "type", wt, "default", wd, "resume",
                     "meaning");
  for (const SectionSpec& sec : section_table()) {
    out += fmt::format("\n{}: {}\n", sec.name, sec.meaning);
    for (const Row& r : rows[sec.name])
      out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:<7}  {}\n", r.key, wk, r.type, wt, r.def, wd, r.resume,
                         r.meaning);
  }
  out +=
      "\nChanging keys on resume (--resume auto|DIR with another config or --set):\n"
      "  refused  the key is part of what the checkpoint means (model shape, tokenizer, sequence length, seed,\n"
      "           optimizer hyperparameters): the resume is an error that names each such key with its old and\n"
      "           new value. Start a new run directory instead.\n"
      "  allowed  the resume goes on with the new value and the log names each change (old -> new).\n"
      "  elastic  the parallel layout and the batch split (parallel.sp_size, parallel.layout, train.batch_size,\n"
      "           train.grad_accum) may change, and so may the number of ranks (longtrain-run --nnodes,\n"
      "           --nproc-per-node), when the global batch train.batch_size x train.grad_accum x data-parallel\n"
      "           ranks stays the same: the ZeRO-1 optimizer shards are re-sharded and the loader continues at\n"
      "           the same window; the log names the old and new world. Another global batch is an error that\n"
      "           names the grad_accum that keeps it.\n"
      "  The learning-rate schedule, when train.steps, optim.lr, optim.min_lr, optim.warmup_steps or\n"
      "  optim.schedule changed: it is re-shaped from the resume step R (optimizer steps taken) and the lr\n"
      "  L the old schedule gave step R, so step R+1 continues from L without a jump:\n"
      "    while R < warmup_steps: linear from L at R to lr at warmup_steps, then the decay below from lr;\n"
      "    decay (cosine/linear) from L at R to min_lr at train.steps: lr(s) = min_lr + (L - min_lr)*f(p),\n"
      "      p = (s - R)/(train.steps - R), f = (1 + cos(pi*p))/2 (cosine) or 1 - p (linear);\n"
      "    constant: linear from L at R to lr at train.steps (constant when lr did not change).\n"
      "  So more steps after a finished cosine run go on at min_lr; lower optim.min_lr to decay further.\n"
      "  optim.lr only matters while warmup remains (or under constant). The re-shaped schedule is kept in\n"
      "  each later checkpoint, so resuming again without changes follows it exactly.\n"
      "  New data (data.train changed): the loader starts the new data from its beginning (epoch 0) with the\n"
      "  run's train.seed; the position reached in the old data is not used. train.steps must be at least\n"
      "  the checkpoint's step.\n";
  return out;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  for (const KeySpec& s : key_table()) out.push_back(s.name());
  return out;
}

}  // namespace longtrain::trainer
