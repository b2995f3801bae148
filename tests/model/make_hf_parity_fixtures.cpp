// Writes the Hugging Face parity fixtures: small, seeded longtrain models exported by longtrain's own
// Hugging Face writer (config.json, model.safetensors) and the token sequence each one is run on
// (tokens.json). tests/fixtures/hf_parity/make_goldens.py runs transformers on them to make the
// goldens that hf_parity_test.cpp compares longtrain's forward with (README.md there says how).
//
//   make_hf_parity_fixtures OUT_DIR      (OUT_DIR is normally tests/fixtures/hf_parity)
//
// The output is deterministic: the same binary writes the same bytes, so regenerating the fixtures
// without changing this file leaves the committed goldens valid.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/hf_export.h"
#include "model/llama.h"
#include "runtime/error.h"

namespace {

using namespace longtrain;
using namespace longtrain::model;

struct Fixture {
  const char* name;
  LlamaConfig config;
  uint64_t seed;
  double init_std;  // of every weight matrix; large enough that attention is far from uniform and the
                    // logits spread over several nats
  int64_t tokens;
};

// The shapes the parity test must cover: GQA with an untied LM head, tied embeddings with MHA, and
// MQA with a rope_theta and norm_eps that differ from both libraries' defaults. head_dim is
// dim / n_heads in all of them: transformers 4.40 (the newest release that runs on Debian's
// torch 1.13 without the tokenizers package) has no separate head_dim.
std::vector<Fixture> fixtures() {
  std::vector<Fixture> f;
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
  return f;
}

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

void write_fixture(const std::filesystem::path& dir, const Fixture& f) {
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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR   (normally tests/fixtures/hf_parity)\n", argv[0]);
    return 2;
  }
  try {
    for (const Fixture& f : fixtures()) {
      const std::filesystem::path dir = std::filesystem::path(argv[1]) / f.name;
      write_fixture(dir, f);
      std::printf("%s: %lld parameters, %lld tokens\n", dir.string().c_str(),
                  static_cast<long long>(f.config.num_parameters()), static_cast<long long>(f.tokens));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_hf_parity_fixtures: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
