#include "model/parameters.h"

#include <cmath>
#include <numbers>
#include <vector>

#include <fmt/format.h>

#include "runtime/device.h"

namespace longtrain::model {

std::string layer_param_name(int64_t layer, const char* suffix) {
  return fmt::format("model.layers.{}.{}", layer, suffix);
}

void add_parameter_entries(Arena& arena, const LlamaConfig& c, DType dtype) {
  const int64_t C = c.dim, D = c.head_dim, F = c.ffn_dim;
  arena.add("model.embed_tokens.weight", {c.vocab_size, C}, dtype);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    arena.add(layer_param_name(l, "input_layernorm.weight"), {C}, dtype);
    arena.add(layer_param_name(l, "self_attn.q_proj.weight"), {c.n_heads * D, C}, dtype);
    arena.add(layer_param_name(l, "self_attn.k_proj.weight"), {c.n_kv_heads * D, C}, dtype, /*align=*/false);
    arena.add(layer_param_name(l, "self_attn.v_proj.weight"), {c.n_kv_heads * D, C}, dtype, /*align=*/false);
    arena.add(layer_param_name(l, "self_attn.o_proj.weight"), {C, c.n_heads * D}, dtype);
    arena.add(layer_param_name(l, "post_attention_layernorm.weight"), {C}, dtype);
    arena.add(layer_param_name(l, "mlp.gate_proj.weight"), {F, C}, dtype);
    arena.add(layer_param_name(l, "mlp.up_proj.weight"), {F, C}, dtype, /*align=*/false);
    arena.add(layer_param_name(l, "mlp.down_proj.weight"), {C, F}, dtype);
  }
  arena.add("model.norm.weight", {C}, dtype);
  if (!c.tie_embeddings) arena.add("lm_head.weight", {c.vocab_size, C}, dtype);
}

ModelParams parameter_views(const Arena& arena, const LlamaConfig& c) {
  const int64_t C = c.dim, F = c.ffn_dim;
  ModelParams p;
  p.embed = arena.get("model.embed_tokens.weight");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    LayerParams lp;
    lp.input_norm = arena.get(layer_param_name(l, "input_layernorm.weight"));
    Tensor q = arena.get(layer_param_name(l, "self_attn.q_proj.weight"));
    lp.qkv = Tensor(q.data, q.dtype, {c.qkv_dim(), C}, q.device);
    lp.o_proj = arena.get(layer_param_name(l, "self_attn.o_proj.weight"));
    lp.post_norm = arena.get(layer_param_name(l, "post_attention_layernorm.weight"));
    Tensor gate = arena.get(layer_param_name(l, "mlp.gate_proj.weight"));
    lp.gate_up = Tensor(gate.data, gate.dtype, {2 * F, C}, gate.device);
    lp.down_proj = arena.get(layer_param_name(l, "mlp.down_proj.weight"));
    p.layers.push_back(lp);
  }
  p.final_norm = arena.get("model.norm.weight");
  p.lm_head = c.tie_embeddings ? p.embed : arena.get("lm_head.weight");
  return p;
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t hash_name(const std::string& name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// Uniform in (0, 1): 53 random bits, never exactly 0.
double uniform_open(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; }

// Standard normal number i of the stream `key` (Box–Muller, one value per index).
double normal_at(uint64_t key, uint64_t i) {
  double u1 = uniform_open(splitmix64(key ^ splitmix64(2 * i)));
  double u2 = uniform_open(splitmix64(key ^ splitmix64(2 * i + 1)));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

bool is_norm_weight(const std::string& name) { return name.find("norm.weight") != std::string::npos; }

}  // namespace

void initialize_parameters(const Arena& arena, uint64_t seed, double init_std) {
  // Fill a host image of the whole arena (padding stays zero), then copy it over once.
  const int64_t words = static_cast<int64_t>((arena.bytes() + 3) / 4);
  std::vector<int32_t> image(static_cast<size_t>(words), 0);
  char* base = reinterpret_cast<char*>(image.data());
  for (const ArenaEntry& e : arena.table()) {
    const uint64_t key = splitmix64(seed ^ hash_name(e.name));
    char* dst = base + e.offset;
    for (int64_t j = 0; j < e.numel; ++j) {
      double v = is_norm_weight(e.name) ? 1.0 : init_std * normal_at(key, static_cast<uint64_t>(j));
      switch (e.dtype) {
        case DType::f32: reinterpret_cast<float*>(dst)[j] = static_cast<float>(v); break;
        case DType::f64: reinterpret_cast<double*>(dst)[j] = v; break;
        case DType::bf16: reinterpret_cast<bf16*>(dst)[j] = bf16(static_cast<float>(v)); break;
        default: LT_FAIL("parameter '{}' has dtype {}; parameters are floating point", e.name, dtype_name(e.dtype));
      }
    }
  }
  copy(Tensor(arena.base(), DType::i32, {words}, arena.device()), Tensor(image.data(), DType::i32, {words}));
}

}  // namespace longtrain::model
