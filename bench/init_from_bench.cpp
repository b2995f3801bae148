// model.init_from load speed (issue 15): writes a Hugging Face directory of a given Llama shape in
// bf16 (random weights), then times init_from_hf_directory into an f32 host arena with 1, 2, ...
// threads, and prints one JSON line per run. The directory is read from the page cache after the
// first run, so the numbers are the conversion, not the disk.
//   init_from_bench [--dim 768] [--layers 12] [--vocab 32000] [--ffn 2048] [--dir /tmp/...] [--threads 1,2]
//
// Under longtrain-run (WORLD_SIZE > 1; Gloo on CPU ranks) it compares the two ways a job can load:
// every rank reading the directory itself (what the trainer does: memory-mapped, converted by all
// its threads), and rank 0 reading and broadcasting the parameter buffer. Rank 0 writes the
// directory; each way is timed from a barrier to the barrier after it (the slowest rank), --repeat
// times, and rank 0 prints one JSON line per way with the best time.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/hf_export.h"
#include "model/parameters.h"
#include "parallel/distributed.h"

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
  int repeat = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--repeat") {
      repeat = std::atoi(v.c_str());
      continue;
    }
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
  const parallel::WorldInfo w = parallel::world_from_env();
  if (w.world_size > 1) {
    try {
      parallel::DistributedOptions o;
      o.backend = parallel::Backend::gloo;
      parallel::Distributed dist(w, parallel::options_from_env(o));
      parallel::Communicator& world = dist.world();
      Arena params("parameters", Device::cpu);
      model::add_parameter_entries(params, c, DType::f32);
      params.allocate();
      if (w.rank == 0) {
        model::initialize_parameters(params, 1);
        model::HfLlamaConfig hf;
        hf.model = c;
        model::export_hf_directory(dir, hf, params, DType::bf16);
      }
      world.barrier();
      const double gib =
          static_cast<double>(std::filesystem::file_size(std::filesystem::path(dir) / "model.safetensors")) / 1073741824.0;
      model::init_from_hf_directory(dir, c, params, 0);  // warm the page cache on every rank
      auto timed = [&](const char* way, const std::function<void()>& load) {
        double best = 1e30;
        for (int r = 0; r < repeat; ++r) {
          world.barrier();
          const auto start = std::chrono::steady_clock::now();
          load();
          world.barrier();
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
        if (w.rank == 0)
          fmt::print("{{\"way\": \"{}\", \"ranks\": {}, \"parameters\": {}, \"file_gib\": {:.3f}, \"seconds\": {:.3f}, "
                     "\"gib_per_s\": {:.2f}}}\n",
                     way, w.world_size, c.num_parameters(), gib, best, gib / best);
      };
      // The f32 buffer a broadcast moves is twice the bf16 file; both ways end with every rank
      // holding the converted parameters.
      timed("every_rank_reads", [&] { model::init_from_hf_directory(dir, c, params, 0); });
      timed("rank0_reads_and_broadcasts", [&] {
        if (w.rank == 0) model::init_from_hf_directory(dir, c, params, 0);
        world.broadcast(params.flat(), 0);
      });
      world.barrier();
      if (w.rank == 0) std::filesystem::remove_all(dir);
    } catch (const Error& e) {
      std::fprintf(stderr, "init_from_bench (rank %d): %s\n", w.rank, e.what());
      return 1;
    }
    return 0;
  }
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
