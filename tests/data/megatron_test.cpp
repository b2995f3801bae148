// Megatron-LM / NeMo indexed datasets (MMIDIDX, data/shards.h) read as they are: the committed
// fixture (tests/fixtures/megatron, written by make_fixtures.py from Megatron's documented layout)
// in every integer dtype, through TokenCorpus and the loader; and malformed copies of it refused
// with errors naming the file.
#include <cstring>
#include <functional>

#include <gtest/gtest.h>

#include "data/loader.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

const fs::path kFixtures = LONGTRAIN_MEGATRON_FIXTURES;

nlohmann::json expected() {
  return nlohmann::json::parse(test::read_bytes((kFixtures / "expected.json").string()));
}

TEST(Megatron, EveryIntegerDtypeReadsTheTokensAndDocumentsTheScriptWrote) {
  const nlohmann::json want = expected();
  ASSERT_EQ(want.size(), 6u);  // uint8, int8, int16, int32, int64, uint16
  for (const auto& [name, e] : want.items()) {
    SCOPED_TRACE(name);
    const std::string prefix = (kFixtures / name).string();
    std::vector<int64_t> stream, starts;
    for (const auto& doc : e["documents"]) {
      if (doc.empty()) continue;  // an empty document has no start of its own
      starts.push_back(static_cast<int64_t>(stream.size()));
      for (int64_t t : doc) stream.push_back(t);
    }
    // The prefix, the .bin or the .idx: one dataset.
    for (const std::string& path : {prefix, prefix + ".bin", prefix + ".idx"}) {
      EXPECT_EQ(megatron_prefix(path), prefix);
      const TokenCorpus c(path, "train");
      EXPECT_TRUE(c.is_megatron());
      ASSERT_EQ(c.num_tokens(), static_cast<int64_t>(stream.size()));
      ASSERT_EQ(c.num_documents(), static_cast<int64_t>(starts.size()));
      std::vector<int32_t> got(stream.size());
      c.read(0, got);
      for (size_t i = 0; i < stream.size(); ++i) EXPECT_EQ(got[i], stream[i]) << "token " << i;
      EXPECT_EQ(c.document_starts(0, c.num_tokens()), starts);
      for (size_t d = 0; d < starts.size(); ++d) EXPECT_EQ(c.document_offset(static_cast<int64_t>(d)), starts[d]);
      EXPECT_EQ(c.document_offset(c.num_documents()), c.num_tokens());
    }
  }
}

TEST(Megatron, LoaderPacksWindowsWithDocumentStartsAndChecksTheModelVocabulary) {
  const std::string prefix = (kFixtures / "tiny_uint16").string();
  LoaderOptions o;
  o.shard_dir = prefix;
  o.seq_len = 4;
  o.shuffle = false;
  o.prefetch = 0;
  o.vocab_size = 65536;
  Loader loader(o);
  const TokenCorpus& c = loader.corpus();
  EXPECT_EQ(loader.num_windows(), (c.num_tokens() - 1) / 4);
  for (int64_t w = 0; w < loader.num_windows(); ++w) {
    const Batch b = loader.next();
    ASSERT_EQ(b.window, w);
    std::vector<int32_t> window(5);
    c.read(w * 4, window);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(b.tokens[static_cast<size_t>(i)], window[static_cast<size_t>(i)]);
      EXPECT_EQ(b.labels[static_cast<size_t>(i)], window[static_cast<size_t>(i) + 1]);
    }
    std::vector<int32_t> starts;
    for (int64_t s : c.document_starts(w * 4, w * 4 + 5)) starts.push_back(static_cast<int32_t>(s - w * 4));
    EXPECT_EQ(b.doc_starts, starts);
  }
  // The last document holds 65535: a model vocabulary of 1000 must refuse it, naming the file.
  o.vocab_size = 1000;
  Loader small(o);
  expect_error([&] { for (int64_t w = 0; w < small.num_windows(); ++w) small.next(); },
               {prefix + ".bin", "65535", "outside the vocabulary [0, 1000)"});
}

// A copy of the uint16 fixture in `dir`, with `patch` applied to its .idx and .bin bytes.
std::string patched(const TempDir& dir, const std::function<void(std::string& idx, std::string& bin)>& patch) {
  std::string idx = test::read_bytes((kFixtures / "tiny_uint16.idx").string());
  std::string bin = test::read_bytes((kFixtures / "tiny_uint16.bin").string());
  patch(idx, bin);
  const std::string prefix = dir / "broken";
  test::write_file(prefix + ".idx", idx);
  test::write_file(prefix + ".bin", bin);
  return prefix;
}

template <class T> void put(std::string& bytes, size_t at, T v) { std::memcpy(bytes.data() + at, &v, sizeof v); }

TEST(Megatron, MalformedFilesAreRefusedNamingTheFile) {
  TempDir dir;
  const auto refused = [&](const std::function<void(std::string&, std::string&)>& patch,
                           std::initializer_list<std::string> parts) {
    const std::string prefix = patched(dir, patch);
    expect_error([&] { TokenCorpus c(prefix, "train"); }, parts);
  };
  const std::string idx = dir / "broken.idx", bin = dir / "broken.bin";
  // The fixture as it is opens (so each failure below is the patch's doing).
  EXPECT_NO_THROW(TokenCorpus(patched(dir, [](std::string&, std::string&) {}), "train"));
  refused([](std::string& i, std::string&) { i[0] = 'X'; }, {idx, "Megatron magic"});
  refused([](std::string& i, std::string&) { put<uint64_t>(i, 9, 2); }, {idx, "version 2"});
  refused([](std::string& i, std::string&) { i[17] = 7; }, {idx, "dtype code 7 (float32)"});
  refused([](std::string& i, std::string&) { i[17] = 9; }, {idx, "dtype code 9"});
  refused([](std::string& i, std::string&) { i.resize(20); }, {idx, "truncated"});
  refused([](std::string& i, std::string&) { i.resize(i.size() - 8); }, {idx, "truncated"});
  refused([](std::string& i, std::string&) { put<uint64_t>(i, 18, uint64_t{1} << 40); }, {idx, "truncated or damaged"});
  refused([](std::string& i, std::string&) { i += std::string(7, '\0'); }, {idx, "multimodal"});
  // The fixture has N = 6 sequences and a document index of M = 7 entries: lengths at 34, pointers
  // at 34 + 4N, the document index at 34 + 12N.
  // Sequence 1's pointer moved by one token: sizes and pointers disagree.
  refused([](std::string& i, std::string&) { put<int64_t>(i, 34 + 4 * 6 + 8, 10); }, {idx, "inconsistent"});
  // A sequence length that runs past the .bin, and a .bin cut short or grown.
  refused([](std::string& i, std::string&) { put<int32_t>(i, 34 + 4 * 5, 4); }, {bin, "truncated"});
  refused([](std::string&, std::string& b) { b.resize(b.size() - 2); }, {bin, "truncated"});
  refused([](std::string&, std::string& b) { b += "xx"; }, {bin, "bytes but its index"});
  // Document index not rising from 0 to N.
  refused([](std::string& i, std::string&) { put<int64_t>(i, 34 + 12 * 6 + 8 * 2, 0); }, {idx, "document index"});
  refused([](std::string& i, std::string&) { put<int64_t>(i, i.size() - 8, 5); }, {idx, "document index"});
  refused([](std::string& i, std::string&) { put<int32_t>(i, 34, -1); }, {idx, "negative length"});
  // An int64 id that does not fit the trainer's int32 ids.
  {
    std::string i64idx = test::read_bytes((kFixtures / "tiny_int64.idx").string());
    std::string i64bin = test::read_bytes((kFixtures / "tiny_int64.bin").string());
    put<int64_t>(i64bin, 0, int64_t{1} << 40);
    test::write_file(dir / "wide.idx", i64idx);
    test::write_file(dir / "wide.bin", i64bin);
    const TokenCorpus wide(dir / "wide", "train");
    std::vector<int32_t> got(4);
    expect_error([&] { wide.read(0, got); }, {dir / "wide.bin", "1099511627776", "outside the vocabulary"});
  }
  // One file of the pair missing.
  fs::remove(bin);
  expect_error([&] { TokenCorpus c(dir / "broken", "train"); }, {bin, "missing"});
}

}  // namespace
}  // namespace longtrain::data
