// Writes the Hugging Face parity fixtures (hf_parity_fixtures.h) under OUT_DIR/<name>/:
//
//   make_hf_parity_fixtures OUT_DIR      (OUT_DIR is normally tests/fixtures/hf_parity)
//
// tests/fixtures/hf_parity/README.md says when to run it and how to remake the goldens afterwards.
#include <cstdio>
#include <exception>
#include <filesystem>

#include "hf_parity_fixtures.h"

using longtrain::model::HfParityFixture;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR   (normally tests/fixtures/hf_parity)\n", argv[0]);
    return 2;
  }
  try {
    for (const HfParityFixture& f : longtrain::model::hf_parity_fixtures()) {
      const std::filesystem::path dir = std::filesystem::path(argv[1]) / f.name;
      longtrain::model::write_hf_parity_fixture(dir, f);
      std::printf("%s: %lld parameters, %lld tokens\n", dir.string().c_str(),
                  static_cast<long long>(f.config.num_parameters()), static_cast<long long>(f.tokens));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_hf_parity_fixtures: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
