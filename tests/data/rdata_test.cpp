// data/rdata.h: R serializations of character vectors inside zlib records of an .rdb, built here
// byte by byte from R's format description.
#include <optional>

#include <gtest/gtest.h>
#include <zlib.h>

#include "data/rdata.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

using test::expect_error;
using test::TempDir;
using test::write_file;

void put32(std::string& s, int32_t v) {
  const uint32_t u = static_cast<uint32_t>(v);
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((u >> shift) & 0xFF));
}

struct RString {
  std::optional<std::string> bytes;  // nullopt: NA
  int levels = 64;                   // ASCII by default; 8 UTF-8, 4 Latin-1
};

// R's XDR serialization (version 2 or 3) of a character vector.
std::string serialize(const std::vector<RString>& v, int version = 3, int32_t type = 16,
                      bool long_length = false, int32_t extra_flags = 0) {
  std::string s = "X\n";
  put32(s, version);
  put32(s, 0x00040201);  // written by R 4.2.1
  put32(s, 0x00030500);  // readable by R >= 3.5.0
  if (version == 3) {
    put32(s, 5);
    s += "UTF-8";
  }
  put32(s, type | extra_flags);
  if (long_length) {
    put32(s, -1);
    put32(s, 0);
    put32(s, static_cast<int32_t>(v.size()));
  } else {
    put32(s, static_cast<int32_t>(v.size()));
  }
  for (const RString& e : v) {
    put32(s, 9 | (e.levels << 12));
    if (!e.bytes) {
      put32(s, -1);
    } else {
      put32(s, static_cast<int32_t>(e.bytes->size()));
      s += *e.bytes;
    }
  }
  return s;
}

// One .rdb record: 4-byte big-endian uncompressed length, then the zlib stream.
std::string rdb_record(const std::string& payload) {
  uLongf n = compressBound(payload.size());
  std::string z(n, '\0');
  EXPECT_EQ(compress(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(payload.data()),
                     payload.size()), Z_OK);
  z.resize(n);
  std::string rec;
  put32(rec, static_cast<int32_t>(payload.size()));
  return rec + z;
}

TEST(Rdata, ParsesStringsNaAndEncodings) {
  const std::vector<RString> v = {
      {"EMMA"}, {""}, {std::nullopt}, {"caf\xc3\xa9", 8}, {"na\xefve", 4}, {"By Jane Austen"}};
  for (int version : {2, 3}) {
    const auto out = unserialize_character_vector(serialize(v, version), "test");
    ASSERT_EQ(out.size(), 6u);
    EXPECT_EQ(out[0], "EMMA");
    EXPECT_EQ(out[1], "");
    EXPECT_FALSE(out[2].has_value());
    EXPECT_EQ(out[3], "caf\xc3\xa9");
    EXPECT_EQ(out[4], "na\xc3\xafve");  // Latin-1 0xEF became UTF-8
    EXPECT_EQ(out[5], "By Jane Austen");
  }
  const auto long_form = unserialize_character_vector(serialize(v, 3, 16, true), "test");
  EXPECT_EQ(long_form.size(), 6u);
  EXPECT_EQ(long_form[5], "By Jane Austen");
}

TEST(Rdata, ReadsEveryRecordOfAnRdbAsText) {
  TempDir dir;
  const std::string path = dir / "Rdata.rdb";
  write_file(path, rdb_record(serialize({{""}, {"PRIDE AND PREJUDICE"}, {"It is a truth"}, {std::nullopt}})) +
                       rdb_record(serialize({{"  "}, {"Persuasion!"}, {"Sir Walter"}}, 2)) +
                       rdb_record(serialize({{"..."}})));
  const std::vector<RdbText> texts = read_rdb_texts(path);
  ASSERT_EQ(texts.size(), 3u);
  EXPECT_EQ(texts[0].text, "\nPRIDE AND PREJUDICE\nIt is a truth\n\n");
  EXPECT_EQ(texts[0].title, "PRIDE AND PREJUDICE");
  EXPECT_EQ(texts[0].slug, "pride-and-prejudice");
  EXPECT_EQ(texts[0].lines, 4);
  EXPECT_EQ(texts[0].na_lines, 1);
  EXPECT_EQ(texts[1].text, "  \nPersuasion!\nSir Walter\n");
  EXPECT_EQ(texts[1].slug, "persuasion");
  EXPECT_EQ(texts[2].slug, "record-02");  // nothing alphanumeric in the title
}

TEST(Rdata, BadInputNamesTheFileAndTheProblem) {
  TempDir dir;
  expect_error([&] { read_rdb_records(dir / "missing.rdb"); }, {"missing.rdb", "cannot open"});

  const std::string good = rdb_record(serialize({{"a"}, {"b"}}));
  const std::string truncated = dir / "truncated.rdb";
  write_file(truncated, good + good.substr(0, good.size() - 5));
  expect_error([&] { read_rdb_records(truncated); }, {"truncated.rdb", "record 1", "truncated or corrupt"});

  std::string wrong_length = good;
  wrong_length[3] = static_cast<char>(wrong_length[3] + 1);  // header claims one byte more
  write_file(dir / "length.rdb", wrong_length);
  expect_error([&] { read_rdb_records(dir / "length.rdb"); }, {"length.rdb", "record 0"});

  write_file(dir / "bzip.rdb", std::string("\0\0\0\x10" "2BZh9", 9));
  expect_error([&] { read_rdb_records(dir / "bzip.rdb"); }, {"bzip.rdb", "not a zlib stream"});

  expect_error([] { unserialize_character_vector(serialize({{"x"}}, 3, 13), "rec 4"); },
               {"rec 4", "type 13", "not a character vector"});
  expect_error([] { unserialize_character_vector(serialize({{"x"}}, 3, 16, false, 1 << 9), "rec 5"); },
               {"rec 5", "attributes"});
  expect_error([] { unserialize_character_vector(serialize({{"x"}}, 4), "rec 6"); }, {"rec 6", "version 4"});
  expect_error([] { unserialize_character_vector("A\n" + serialize({{"x"}}).substr(2), "rec 7"); },
               {"rec 7", "not XDR"});
  const std::string full = serialize({{"hello"}});
  expect_error([&] { unserialize_character_vector(full.substr(0, full.size() - 2), "rec 8"); },
               {"rec 8", "truncated"});
}

TEST(Rdata, Slugify) {
  EXPECT_EQ(slugify("SENSE AND SENSIBILITY"), "sense-and-sensibility");
  EXPECT_EQ(slugify("  Pride & Prejudice!  "), "pride-prejudice");
  EXPECT_EQ(slugify("***"), "");
}

}  // namespace
}  // namespace longtrain::data
