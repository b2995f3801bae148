// The Hugging Face parity fixtures: small, seeded longtrain models exported by longtrain's own
// Hugging Face writer (config.json, model.safetensors) and the token sequence each one is run on
// (tokens.json), under tests/fixtures/hf_parity/<name>/. make_hf_parity_fixtures writes them;
// tests/fixtures/hf_parity/make_goldens.py runs transformers on them; hf_parity_test compares
// longtrain's forward with those goldens and checks that the committed fixtures are what
// write_hf_parity_fixture writes today (so the recipe in README.md there still reproduces them).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "model/llama_config.h"

namespace longtrain::model {

struct HfParityFixture {
  std::string name;
  LlamaConfig config;
  uint64_t seed;
  double init_std;  // of every weight matrix: large enough that attention is far from uniform and the
                    // logits spread over several nats
  int64_t tokens;   // length of the token sequence
};

// Every fixture, in a fixed order.
std::vector<HfParityFixture> hf_parity_fixtures();

// Writes `dir`/config.json, model.safetensors and tokens.json for `f` (deterministic: the same
// bytes every time). Creates `dir` if needed.
void write_hf_parity_fixture(const std::filesystem::path& dir, const HfParityFixture& f);

}  // namespace longtrain::model
