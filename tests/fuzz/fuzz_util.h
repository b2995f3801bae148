// Shared by the fuzz targets: a private scratch directory per process (the parsers under test read
// files), and the one rule every target follows: bad input may only end in longtrain::Error, the
// clear error a user sees. Any other exception, a crash, a leak or undefined behaviour (ASan, UBSan,
// LeakSanitizer) is a finding.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/error.h"

namespace longtrain::fuzz {

inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("longtrain-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline void write_bytes(const std::filesystem::path& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// Runs f on one input: a longtrain::Error is the expected answer to bad input; anything else aborts
// the process, which libFuzzer reports with the input that caused it.
template <class F>
void expect_clean(F&& f) {
  try {
    f();
  } catch (const Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an exception other than longtrain::Error escaped: %s\n", e.what());
    std::abort();
  }
}

}  // namespace longtrain::fuzz
