// Helpers for the data tests: scratch directories, files, synthetic shard sets and a small
// tokenizer trained once per test process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "data/shards.h"
#include "parallel/layout.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "test_util.h"

namespace longtrain {
// Readable parameter names in gtest output.
inline void PrintTo(SeqLayout layout, std::ostream* os) { *os << layout_name(layout); }
}  // namespace longtrain

namespace longtrain::data::test {

namespace fs = std::filesystem;
using longtrain::test::expect_error;

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = fmt::format("longtrain-{}-{}-{}-{}", info ? info->test_suite_name() : "x",
                                   info ? info->name() : "x", ::getpid(), counter++);
    std::replace(name.begin(), name.end(), '/', '_');  // parametrized names hold slashes
    path = fs::temp_directory_path() / name;
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Writes a shard set by hand (the format of shards.h): each split's documents through ShardWriter
// and a manifest listing them. Returns nothing; the set is in `dir`.
inline void write_shard_set(const std::string& dir, int64_t vocab_size,
                            const std::vector<std::pair<std::string, std::vector<std::vector<uint32_t>>>>& splits,
                            int64_t shard_tokens = int64_t{1} << 30) {
  fs::create_directories(dir);
  nlohmann::json manifest = {{"format", "longtrain-shards"}, {"version", kManifestVersion},
                             {"vocab_size", vocab_size},     {"dtype", "uint32"}};
  manifest["splits"] = nlohmann::json::object();
  for (const auto& [name, docs] : splits) {
    ShardWriter w(dir, name, vocab_size, shard_tokens);
    for (const auto& d : docs) w.add_document(d);
    nlohmann::json list = nlohmann::json::array();
    for (const ShardInfo& s : w.finish())
      list.push_back({{"bin", s.bin}, {"idx", s.idx}, {"documents", s.documents}, {"tokens", s.tokens}});
    manifest["splits"][name] = {{"documents", w.documents()}, {"tokens", w.tokens()}, {"shards", list}};
  }
  std::ofstream(fs::path(dir) / kManifestName) << manifest.dump(2);
}

// Documents of random lengths in [min_len, max_len] whose tokens are their stream positions modulo
// the vocabulary, so any token says where it came from.
inline std::vector<std::vector<uint32_t>> positional_documents(int count, int min_len, int max_len,
                                                               uint32_t vocab, uint64_t seed,
                                                               uint64_t first_position = 0) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint32_t>> docs;
  uint64_t pos = first_position;
  for (int d = 0; d < count; ++d) {
    const int len = min_len + static_cast<int>(rng() % static_cast<uint64_t>(max_len - min_len + 1));
    std::vector<uint32_t> doc;
    for (int i = 0; i < len; ++i) doc.push_back(static_cast<uint32_t>(pos++ % vocab));
    docs.push_back(doc);
  }
  return docs;
}

// Words made of a small alphabet, in sentences, for training a small tokenizer quickly.
inline std::string synthetic_text(int lines, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<std::string> syllables = {"ta", "ne", "ri", "so", "ku", "la", "me", "do", "vi", "an",
                                              "the", "and", "of", "ing", "er", "on"};
  std::string text;
  for (int l = 0; l < lines; ++l) {
    const int words = 3 + static_cast<int>(rng() % 12);
    for (int w = 0; w < words; ++w) {
      const int syl = 1 + static_cast<int>(rng() % 3);
      for (int s = 0; s < syl; ++s) text += syllables[rng() % syllables.size()];
      text += (w + 1 < words) ? (rng() % 9 == 0 ? ", " : " ") : ".\n";
    }
  }
  return text;
}

// A BPE tokenizer (vocabulary 320, byte fallback) trained once per process on synthetic text.
inline const std::string& small_tokenizer_path() {
  static const std::string path = [] {
    const fs::path dir = fs::temp_directory_path() / fmt::format("longtrain-tok-{}", ::getpid());
    fs::create_directories(dir);
    const std::string text_path = (dir / "train.txt").string();
    std::ofstream(text_path) << synthetic_text(3000, 7);
    TokenizerTrainOptions o;
    o.inputs = {text_path};
    o.model_prefix = (dir / "small").string();
    o.vocab_size = 320;
    o.threads = 1;
    train_tokenizer(o);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(fs::temp_directory_path() / fmt::format("longtrain-tok-{}", ::getpid()), ec);
    });
    return o.model_prefix + ".model";
  }();
  return path;
}

}  // namespace longtrain::data::test
