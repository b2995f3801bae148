// The Hugging Face parity fixtures (hf_parity_fixtures.h).
#include "hf_parity_fixtures.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "model/hf_export.h"
#include "model/llama.h"
#include "runtime/error.h"

namespace longtrain::model {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double uniform01(uint64_t& state) { return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53; }

bool is_norm_weight(const std::string& name) {
  return name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
}

}  // namespace

// The shapes the parity test must cover: GQA with an untied LM head, tied embeddings with MHA, and
// MQA with a rope_theta and norm_eps that differ from both libraries' defaults; then each RoPE
// scaling type run over 4x its original context (128 tokens against an original 32; dynamic's
// original is max_position_embeddings, written as 32), two of them with a head_dim (32) other than
// dim / n_heads (16). The first three keep head_dim = dim / n_heads, as when transformers 4.40 made
// their goldens.
std::vector<HfParityFixture> hf_parity_fixtures() {
  std::vector<HfParityFixture> f;
  {
    LlamaConfig c;
    c.vocab_size = 128, c.dim = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    c.ffn_dim = 128, c.rope_theta = 10000.0, c.norm_eps = 1e-5, c.tie_embeddings = false, c.max_seq_len = 256;
    f.push_back({"gqa_untied", c, 1401, 0.15, 48});
  }
  {
    LlamaConfig c;
    c.vocab_size = 128, c.dim = 48, c.n_layers = 2, c.n_heads = 3, c.n_kv_heads = 3, c.head_dim = 16;
    c.ffn_dim = 96, c.rope_theta = 10000.0, c.norm_eps = 1e-6, c.tie_embeddings = true, c.max_seq_len = 256;
    f.push_back({"tied_mha", c, 1402, 0.15, 40});
  }
  {
    LlamaConfig c;
    c.vocab_size = 96, c.dim = 64, c.n_layers = 3, c.n_heads = 4, c.n_kv_heads = 1, c.head_dim = 16;
    c.ffn_dim = 112, c.rope_theta = 500000.0, c.norm_eps = 1e-4, c.tie_embeddings = false, c.max_seq_len = 256;
    f.push_back({"mqa_theta_eps", c, 1403, 0.15, 56});
  }
  // RoPE scaling: the GQA shape, 128 tokens = 4x the original context of 32.
  auto scaled = [](int64_t head_dim, double theta, RopeScaling s) {
    LlamaConfig c;
    c.vocab_size = 128, c.dim = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = head_dim;
    c.ffn_dim = 128, c.rope_theta = theta, c.norm_eps = 1e-5, c.tie_embeddings = false, c.max_seq_len = 128;
    c.rope_scaling = s;
    return c;
  };
  {
    RopeScaling s;
    s.type = "linear", s.factor = 4.0;
    f.push_back({"rope_linear", scaled(16, 10000.0, s), 1404, 0.15, 128});
  }
  {
    RopeScaling s;
    s.type = "dynamic", s.factor = 4.0, s.original_max_position_embeddings = 32;
    f.push_back({"rope_dynamic", scaled(16, 10000.0, s), 1405, 0.15, 128});
  }
  {
    // Llama 3.1's low/high frequency factors at a small original context; theta 500000 as Llama 3's.
    RopeScaling s;
    s.type = "llama3", s.factor = 8.0, s.original_max_position_embeddings = 32;
    s.low_freq_factor = 1.0, s.high_freq_factor = 4.0;
    f.push_back({"rope_llama3", scaled(32, 500000.0, s), 1406, 0.15, 128});
  }
  {
    // yarn with its derived attention factor (0.1 ln 4 + 1), head_dim 32 so the ramp spans dims.
    RopeScaling s;
    s.type = "yarn", s.factor = 4.0, s.original_max_position_embeddings = 32;
    f.push_back({"rope_yarn", scaled(32, 10000.0, s), 1407, 0.15, 128});
  }
  return f;
}

void write_hf_parity_fixture(const std::filesystem::path& dir, const HfParityFixture& f) {
  LlamaModel model(f.config, Precision::cpu(DType::f32), CheckpointPolicy::none, 1);
  model.initialize(f.seed, f.init_std);
  // initialize() sets every RMSNorm weight to 1, as Hugging Face does; a test on such weights could not
  // see a norm weight that is skipped or applied to the wrong tensor, so spread them over [0.5, 1.5).
  uint64_t state = f.seed * 7919u;
  for (const ArenaEntry& e : model.params().table()) {
    if (!is_norm_weight(e.name)) continue;
    Tensor t = model.params().get(e.name);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = static_cast<float>(0.5 + uniform01(state));
  }
  HfLlamaConfig hf;
  hf.model = f.config;
  export_hf_directory(dir.string(), hf, model.params(), DType::f32);

  std::vector<int32_t> tokens;
  for (int64_t t = 0; t < f.tokens; ++t)
    tokens.push_back(static_cast<int32_t>(splitmix64(state) % static_cast<uint64_t>(f.config.vocab_size)));
  nlohmann::json j;
  j["tokens"] = tokens;
  const auto path = dir / "tokens.json";
  std::ofstream out(path);
  out << j.dump() << "\n";
  out.close();
  LT_CHECK(out.good(), "could not write {}", path.string());
}

}  // namespace longtrain::model
