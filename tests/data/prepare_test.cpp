// data/prepare.h: text -> shards. The shards hold exactly BOS? + encode(document) + EOS? for every
// document in input order, the validation split is whole documents, the output is the same for any
// thread count, and bad input is an error that leaves no shard set behind.
#include <gtest/gtest.h>

#include "data/documents.h"
#include "data/prepare.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;

using test::expect_error;
using test::TempDir;
using test::write_file;

// Writes 3 .txt files and a .jsonl of 9 records (one blank line) under dir/in; returns the
// documents in the order prepare reads them.
std::vector<std::string> make_inputs(const TempDir& dir) {
  std::vector<std::string> docs;
  for (int i = 0; i < 3; ++i) {
    docs.push_back(test::synthetic_text(20 + 7 * i, 100 + i));
    write_file(dir / fmt::format("in/a/{}.txt", i), docs.back());
  }
  std::string jsonl;
  for (int i = 0; i < 9; ++i) {
    docs.push_back(test::synthetic_text(3 + i, 200 + i));
    jsonl += nlohmann::json{{"id", i}, {"text", docs.back()}}.dump() + "\n";
    if (i == 4) jsonl += "   \n";
  }
  write_file(dir / "in/b.jsonl", jsonl);
  write_file(dir / "in/ignored.md", "not an input");
  return docs;
}

std::vector<int32_t> document_tokens(const TokenCorpus& c, int64_t d) {
  const int64_t begin = c.document_offset(d), end = c.document_offset(d + 1);
  std::vector<int32_t> out(static_cast<size_t>(end - begin));
  c.read(begin, out);
  return out;
}

TEST(Prepare, ShardsHoldEveryDocumentInOrder) {
  TempDir dir;
  const std::vector<std::string> docs = make_inputs(dir);
  const Tokenizer tok(test::small_tokenizer_path());
  PrepareOptions o;
  o.tokenizer = test::small_tokenizer_path();
  o.inputs = {dir / "in"};
  o.output = dir / "shards";
  o.val_fraction = 0.25;
  o.threads = 2;
  o.add_bos = true;
  o.shard_tokens = 500;  // several shards per split
  o.progress = false;
  const PrepareSummary s = prepare_corpus(o);
  EXPECT_EQ(s.documents, 12);

  // 12 documents, F = 0.25: 3 for validation, at (j + 1/2) * 12 / 3 = 2, 6, 10.
  const std::vector<int64_t> val_docs = validation_documents(12, 0.25);
  EXPECT_EQ(val_docs, (std::vector<int64_t>{2, 6, 10}));
  const TokenCorpus train(o.output, "train", tok.vocab_size()), val(o.output, "val", tok.vocab_size());
  EXPECT_EQ(train.num_documents(), 9);
  EXPECT_EQ(val.num_documents(), 3);
  EXPECT_EQ(train.num_tokens(), s.train_tokens);
  EXPECT_EQ(val.num_tokens(), s.val_tokens);
  EXPECT_GT(train.manifest()["splits"]["train"]["shards"].size(), 1u);
  int64_t t = 0, v = 0;
  for (int64_t d = 0; d < 12; ++d) {
    const bool is_val = std::find(val_docs.begin(), val_docs.end(), d) != val_docs.end();
    const std::vector<int32_t> got = is_val ? document_tokens(val, v++) : document_tokens(train, t++);
    std::vector<int32_t> want = {tok.bos_id()};
    for (int32_t id : tok.encode(docs[static_cast<size_t>(d)])) want.push_back(id);
    want.push_back(tok.eos_id());
    EXPECT_EQ(got, want) << "document " << d;
    EXPECT_EQ(tok.decode(std::span(got).subspan(1, got.size() - 2)), docs[static_cast<size_t>(d)]);
  }
  const nlohmann::json& m = train.manifest();
  EXPECT_EQ(m["tokenizer"]["add_bos"], true);
  EXPECT_EQ(m["tokenizer"]["eos_id"], 2);
  EXPECT_EQ(m["inputs"].size(), 4u);  // the .md file is not an input
  EXPECT_FALSE(fs::exists(o.output + fmt::format(".partial-{}", ::getpid())));
}

// A Hugging Face tokenizer.json (the parity fixture's Llama 3-style one) prepares shards too: each
// document is BOS + its ids + EOS as HfTokenizer encodes it, and decodes back to the text.
TEST(Prepare, TokenizerJsonShardsHoldItsIds) {
  TempDir dir;
  const std::vector<std::string> docs = make_inputs(dir);
  const std::string json_path = std::string(LONGTRAIN_HF_TOKENIZER_FIXTURE) + "/llama3_style/tokenizer.json";
  const Tokenizer tok(json_path);
  ASSERT_TRUE(tok.is_hf());
  PrepareOptions o;
  o.tokenizer = json_path;
  o.inputs = {dir / "in"};
  o.output = dir / "shards";
  o.threads = 2;
  o.add_bos = true;
  o.progress = false;
  prepare_corpus(o);
  const TokenCorpus train(o.output, "train", tok.vocab_size());
  ASSERT_EQ(train.num_documents(), 12);
  EXPECT_EQ(train.manifest()["tokenizer"]["bos_id"], tok.bos_id());
  EXPECT_EQ(train.manifest()["tokenizer"]["eos_id"], tok.eos_id());
  for (int64_t d = 0; d < 12; ++d) {
    const std::vector<int32_t> got = document_tokens(train, d);
    std::vector<int32_t> want = {tok.bos_id()};
    for (int32_t id : tok.encode(docs[static_cast<size_t>(d)])) want.push_back(id);
    want.push_back(tok.eos_id());
    EXPECT_EQ(got, want) << "document " << d;
    EXPECT_EQ(tok.decode(got), docs[static_cast<size_t>(d)]);  // BOS/EOS are special: dropped
  }
}

TEST(Prepare, OutputIsTheSameForAnyThreadCount) {
  TempDir dir;
  make_inputs(dir);
  PrepareOptions o;
  o.tokenizer = test::small_tokenizer_path();
  o.inputs = {dir / "in/b.jsonl", dir / "in/a"};
  o.val_fraction = 0.1;
  o.shard_tokens = 700;
  o.progress = false;
  std::vector<std::string> outputs;
  for (int threads : {1, 3}) {
    o.threads = threads;
    o.output = dir / fmt::format("out{}", threads);
    prepare_corpus(o);
    outputs.push_back(o.output);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(outputs[0])) names.push_back(e.path().filename().string());
  EXPECT_GT(names.size(), 4u);
  for (const std::string& name : names)
    EXPECT_EQ(test::read_bytes(outputs[0] + "/" + name), test::read_bytes(outputs[1] + "/" + name)) << name;
}

TEST(Prepare, NoEosNoBos) {
  TempDir dir;
  write_file(dir / "one.txt", "the and of");
  write_file(dir / "two.txt", "ta ne ri");
  PrepareOptions o;
  o.tokenizer = test::small_tokenizer_path();
  o.inputs = {dir / "one.txt", dir / "two.txt"};
  o.output = dir / "shards/";  // a trailing slash names the same directory
  o.add_eos = false;
  o.progress = false;
  prepare_corpus(o);
  const Tokenizer tok(o.tokenizer);
  const TokenCorpus c(o.output, "train");
  EXPECT_EQ(document_tokens(c, 0), tok.encode("the and of"));
  EXPECT_EQ(document_tokens(c, 1), tok.encode("ta ne ri"));
  EXPECT_TRUE(fs::exists(dir / "shards/manifest.json"));
  // manifest, train .bin and .idx: the partial directory was beside it, not inside.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "shards"), fs::directory_iterator()), 3);
  expect_error([&] { TokenCorpus v(o.output, "val"); }, {"no \"val\" split", "--val-fraction"});
}

TEST(Prepare, BadInputIsAClearErrorAndLeavesNoShardSet) {
  TempDir dir;
  PrepareOptions o;
  o.tokenizer = test::small_tokenizer_path();
  o.output = dir / "shards";
  o.progress = false;
  const auto run = [&](std::vector<std::string> inputs) {
    o.inputs = std::move(inputs);
    prepare_corpus(o);
  };
  write_file(dir / "ok.txt", "the and of");
  expect_error([&] { run({dir / "ok.txt", dir / "missing.txt"}); }, {"missing.txt", "does not exist"});
  write_file(dir / "empty.txt", "");
  expect_error([&] { run({dir / "ok.txt", dir / "empty.txt"}); }, {"empty.txt", "is empty"});
  write_file(dir / "blank.jsonl", "\n  \n");
  expect_error([&] { run({dir / "blank.jsonl"}); }, {"blank.jsonl", "is empty"});
  write_file(dir / "notes.md", "x");
  expect_error([&] { run({dir / "notes.md"}); }, {"notes.md", "neither .txt nor .jsonl"});
  fs::create_directories(dir / "nothing");
  expect_error([&] { run({dir / "nothing"}); }, {"nothing", "no .txt or .jsonl"});
  expect_error([&] { run({}); }, {"no input"});
  // Errors found while tokenizing (after work has started) remove the partial output too.
  std::string jsonl;
  for (int i = 0; i < 3000; ++i) jsonl += nlohmann::json{{"text", test::synthetic_text(2, i)}}.dump() + "\n";
  write_file(dir / "late.jsonl", jsonl + "{\"text\": \"fine\"}\n{\"body\": \"no text field\"}\n");
  expect_error([&] { run({dir / "ok.txt", dir / "late.jsonl"}); }, {"late.jsonl", "line 3002", "\"text\""});
  write_file(dir / "broken.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"unterminated\n");
  expect_error([&] { run({dir / "broken.jsonl"}); }, {"broken.jsonl", "line 2", "not valid JSON"});
  write_file(dir / "number.jsonl", "{\"text\": 5}\n");
  expect_error([&] { run({dir / "number.jsonl"}); }, {"number.jsonl", "line 1", "not a string"});
  // Nothing that looks like a shard set, and no partial directory, is left behind.
  EXPECT_FALSE(fs::exists(o.output));
  for (const auto& e : fs::directory_iterator(dir.path))
    EXPECT_EQ(e.path().filename().string().find("shards"), std::string::npos) << e.path();

  o.val_fraction = 0.5;
  expect_error([&] { run({dir / "ok.txt"}); }, {"needs at least 2 documents"});
  o.val_fraction = 1.0;
  expect_error([&] { run({dir / "ok.txt"}); }, {"--val-fraction 1", "[0, 1)"});
  o.val_fraction = 0.0;
  o.tokenizer = dir / "none.model";
  expect_error([&] { run({dir / "ok.txt"}); }, {"none.model", "does not exist"});
  o.tokenizer = test::small_tokenizer_path();

  run({dir / "ok.txt"});
  expect_error([&] { run({dir / "ok.txt"}); }, {"already exists", "--overwrite"});
  o.overwrite = true;
  write_file(dir / "two.txt", "ta ne ri so");
  run({dir / "ok.txt", dir / "two.txt"});
  EXPECT_EQ(TokenCorpus(o.output, "train").num_documents(), 2);
}

TEST(Prepare, ValidationDocumentsAreSpreadAndBounded) {
  EXPECT_TRUE(validation_documents(10, 0.0).empty());
  EXPECT_EQ(validation_documents(6, 0.1), (std::vector<int64_t>{3}));  // at least one
  EXPECT_EQ(validation_documents(2, 0.9), (std::vector<int64_t>{1}));  // at most D - 1
  const auto v = validation_documents(1000, 0.05);
  EXPECT_EQ(v.size(), 50u);
  EXPECT_EQ(v.front(), 10);
  EXPECT_EQ(v.back(), 990);
}

}  // namespace
}  // namespace longtrain::data
