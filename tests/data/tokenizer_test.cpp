// data/tokenizer.h: our SentencePiece models are lossless, and bad models or options are errors.
#include <gtest/gtest.h>

#include "data/tokenizer.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

using test::expect_error;
using test::small_tokenizer_path;

TEST(Tokenizer, SpecialIdsAndVocabulary) {
  const Tokenizer tok(small_tokenizer_path());
  EXPECT_EQ(tok.vocab_size(), 320);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.pad_id(), -1);
  EXPECT_EQ(tok.piece(3), "<0x00>");  // byte fallback pieces follow the special ones
}

TEST(Tokenizer, DecodeOfEncodeIsExact) {
  const Tokenizer tok(small_tokenizer_path());
  const std::vector<std::string> texts = {
      "the tanering of the sokula.",
      "  leading spaces, trailing spaces   ",
      "lines\n\nwith\r\nbreaks\n",
      "\ttabs\tand  double  spaces",
      "unseen: Caf\xc3\xa9, na\xc3\xafve, \xe6\x97\xa5\xe6\x9c\xac, \xf0\x9f\x98\x80, 1234567890",
      " ",
      "\n",
      "",
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, tok.vocab_size());
      EXPECT_NE(id, tok.unk_id()) << "byte fallback should leave nothing unknown";
    }
    EXPECT_EQ(tok.decode(ids), text);
  }
  // Learned merges: a frequent word of the training text is a single piece or a few.
  EXPECT_LT(tok.encode("the").size(), 3u);
}

TEST(Tokenizer, BadModelAndOptions) {
  test::TempDir dir;
  expect_error([&] { Tokenizer t(dir / "nope.model"); }, {"nope.model", "does not exist"});
  test::write_file(dir / "junk.model", "not a protobuf");
  expect_error([&] { Tokenizer t(dir / "junk.model"); }, {"junk.model", "cannot load"});
  const Tokenizer tok(small_tokenizer_path());
  const std::vector<int32_t> bad = {5, 320};
  expect_error([&] { tok.decode(bad); }, {"id 320", "outside the vocabulary"});

  TokenizerTrainOptions o;
  o.inputs = {dir / "missing.txt"};
  o.model_prefix = dir / "m";
  expect_error([&] { train_tokenizer(o); }, {"missing.txt", "does not exist"});
  test::write_file(dir / "empty.txt", "");
  o.inputs = {dir / "empty.txt"};
  expect_error([&] { train_tokenizer(o); }, {"empty.txt", "empty"});
  test::write_file(dir / "bad.jsonl", "{\"text\": \"the and of\"}\n{\"body\": 1}\n");
  o.inputs = {dir / "bad.jsonl"};
  expect_error([&] { train_tokenizer(o); }, {"bad.jsonl", "line 2", "\"text\""});
  o.vocab_size = 100;
  expect_error([&] { train_tokenizer(o); }, {"vocab size 100", "too small"});
}

}  // namespace
}  // namespace longtrain::data
