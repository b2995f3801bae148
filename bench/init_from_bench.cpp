// model.init_from load speed (issue 15): writes a Hugging Face directory of a given Llama shape in
// bf16 (random weights), then times init_from_hf_directory into an f32 host arena with 1, 2, ...
// threads, and prints one JSON line per run. The directory is read from the page cache after the
// first run, so the numbers are the conversion, not the disk.
//   init_from_bench [--dim 768] [--layers 12] [--vocab 32000] [--ffn 2048] [--dir /tmp/...] [--threads 1,2]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/hf_export.h"
#include "model/parameters.h"

using namespace longtrain;

int main(int argc, char** argv) {
  model::LlamaConfig c;
  c.vocab_size = 32000;
  c.dim = 768;
  c.n_layers = 12;
  c.n_heads = 12;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.ffn_dim = 2048;
  std::string dir = (std::filesystem::temp_directory_path() / "longtrain-init-from-bench").string();
  std::vector<int> threads = {1, 2};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dim") c.dim = std::atoll(v.c_str()), c.n_heads = c.dim / 64;
    else if (k == "--layers") c.n_layers = std::atoll(v.c_str());
    else if (k == "--vocab") c.vocab_size = std::atoll(v.c_str());
    else if (k == "--ffn") c.ffn_dim = std::atoll(v.c_str());
    else if (k == "--dir") dir = v;
    else if (k == "--threads") {
      threads.clear();
      for (size_t p = 0; p < v.size();) {
        size_t q = v.find(',', p);
        threads.push_back(std::atoi(v.substr(p, q - p).c_str()));
        p = q == std::string::npos ? v.size() : q + 1;
      }
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  c.n_kv_heads = std::max<int64_t>(1, c.n_heads / 3);
  c.validate();
  try {
    Arena params("parameters", Device::cpu);
    model::add_parameter_entries(params, c, DType::f32);
    params.allocate();
    model::initialize_parameters(params, 1);
    model::HfLlamaConfig hf;
    hf.model = c;
    model::export_hf_directory(dir, hf, params, DType::bf16);
    const double gib = static_cast<double>(std::filesystem::file_size(std::filesystem::path(dir) / "model.safetensors")) /
                       1073741824.0;
    model::init_from_hf_directory(dir, c, params, 0);  // warm the page cache
    for (int t : threads) {
      const auto start = std::chrono::steady_clock::now();
      model::init_from_hf_directory(dir, c, params, t);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print("{{\"parameters\": {}, \"file_gib\": {:.3f}, \"threads\": {}, \"seconds\": {:.3f}, \"gib_per_s\": {:.2f}}}\n",
                 c.num_parameters(), gib, t, s, gib / s);
    }
    std::filesystem::remove_all(dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "init_from_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
