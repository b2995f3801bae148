// data/hf_tokenizer.h: parity with Hugging Face tokenizers 0.23.2 on the committed fixture
// (tests/fixtures/hf_tokenizer: two byte-level BPE tokenizer.json files trained on the demo corpus,
// Llama 3's layout and GPT-2's; variants of the first with ignore_merges on and off over whole-word
// vocabulary entries, Qwen 2.5's layout (NFC) and the Unicode normalizers; cases.json with HF's ids,
// tokens and decodes of the demo texts, Unicode, emoji, code, whitespace runs, special tokens and
// text that normalization changes), the Tokenizer chosen by its file, and malformed tokenizer.json
// files refused naming the file and the field.
#include <gtest/gtest.h>

#include <algorithm>

#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"
#include "data_test_util.h"
#include "test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

const fs::path kFixture = LONGTRAIN_HF_TOKENIZER_FIXTURE;

std::vector<int32_t> ids_of(const nlohmann::json& j) { return j.get<std::vector<int32_t>>(); }

nlohmann::json fixture_cases() {
  return nlohmann::json::parse(::longtrain::test::read_file(kFixture / "cases.json"));
}

// Every case of one tokenizer of the fixture: our ids, tokens and decodes equal HF's. Returns the
// number of cases checked.
int expect_parity(const std::string& name, const nlohmann::json& t, int* special_cases = nullptr) {
  SCOPED_TRACE(name);
  const HfTokenizer tok((kFixture / name / "tokenizer.json").string());
  EXPECT_EQ(tok.vocab_size(), t.at("vocab_size").get<int32_t>());
  EXPECT_GE(t.at("cases").size(), 30u);
  int checked = 0;
  for (const nlohmann::json& c : t.at("cases")) {
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE(nlohmann::json(text).dump().substr(0, 80));
    const std::vector<int32_t> ids = ids_of(c.at("ids")), plain = ids_of(c.at("ids_no_special"));
    EXPECT_EQ(tok.encode(text, true), ids);
    EXPECT_EQ(tok.encode(text, false), plain);
    EXPECT_EQ(tok.encode_tokens(text), c.at("tokens_no_special").get<std::vector<std::string>>());
    EXPECT_EQ(tok.decode(ids, false), c.at("decode").get<std::string>());
    EXPECT_EQ(tok.decode(ids, true), c.at("decode_skip_special").get<std::string>());
    ++checked;
    if (special_cases && text.find("<|") != std::string::npos) ++*special_cases;
  }
  return checked;
}

TEST(HfTokenizer, SameIdsTokensAndDecodesAsHuggingFaceTokenizers) {
  const nlohmann::json cases = fixture_cases();
  int checked = 0, special_cases = 0;
  for (const char* name : {"llama3_style", "gpt2_style"}) {
    ASSERT_TRUE(cases.at("tokenizers").contains(name)) << name;
    checked += expect_parity(name, cases.at("tokenizers").at(name), &special_cases);
  }
  EXPECT_GE(checked, 76);
  EXPECT_GE(special_cases, 8);
  ::testing::Test::RecordProperty("cases", checked);
}

// The variants make_fixture.py derives from llama3_style, each with the tokenizer it must differ from.
const std::vector<std::pair<std::string, std::string>> kVariants = {
    {"whole_words", "whole_words_merged"},     // ignore_merges true / false over whole-word entries
    {"whole_words_merged", "whole_words"},
    {"qwen25_style", ""},                       // NFC; its twin is itself without the normalizer
    {"nfkc_lowercase", "llama3_style"},         // Sequence[NFKC, Lowercase], a normalized added token
    {"nfd_strip_accents", "llama3_style"},      // Sequence[NFD, StripAccents, Lowercase]
    {"nfkd_chain", "llama3_style"},             // Sequence[Strip, NFKD, Replace, Replace, Prepend]
};

// The variant's cases, or a failure that says where they come from.
::testing::AssertionResult fixture_has(const nlohmann::json& cases, const std::string& name) {
  const fs::path file = kFixture / name / "tokenizer.json";
  if (cases.at("tokenizers").contains(name) && fs::is_regular_file(file)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "the fixture has no '" << name << "' tokenizer (" << file.string() << " and its cases in cases.json): "
         << "run tests/fixtures/hf_tokenizer/make_fixture.py where HF tokenizers is installed and commit what it "
            "writes (tests/fixtures/hf_tokenizer/README.txt)";
}

TEST(HfTokenizer, NormalizersAndIgnoreMergesGiveTheSameIdsAsHuggingFace) {
  const nlohmann::json cases = fixture_cases();
  int checked = 0;
  for (const auto& [name, twin] : kVariants) {
    ASSERT_TRUE(fixture_has(cases, name));
    checked += expect_parity(name, cases.at("tokenizers").at(name));
  }
  EXPECT_GE(checked, 6 * 55);
  ::testing::Test::RecordProperty("cases", checked);
}

// The fixture guards what it is for only where a variant's ids differ from its twin's: ignore_merges
// on or off, a normalizer or none. HF's ids say so for each; for NFC, our own encoder without the
// normalizer (parity-tested above) is the twin.
TEST(HfTokenizer, EachVariantOfTheFixtureChangesTheIdsOfSomeTexts) {
  const nlohmann::json cases = fixture_cases();
  for (const auto& [name, twin] : kVariants) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fixture_has(cases, name));
    const nlohmann::json& mine = cases.at("tokenizers").at(name).at("cases");
    std::vector<std::vector<int32_t>> other;
    if (twin.empty()) {
      TempDir dir;
      nlohmann::json j = nlohmann::json::parse(::longtrain::test::read_file(kFixture / name / "tokenizer.json"));
      ASSERT_FALSE(j.at("normalizer").is_null());
      j["normalizer"] = nullptr;
      test::write_file(dir / "tokenizer.json", j.dump());
      const HfTokenizer plain(dir / "tokenizer.json");
      for (const nlohmann::json& c : mine) other.push_back(plain.encode(c.at("text").get<std::string>(), true));
    } else {
      ASSERT_TRUE(fixture_has(cases, twin));
      for (const nlohmann::json& c : cases.at("tokenizers").at(twin).at("cases")) other.push_back(ids_of(c.at("ids")));
    }
    ASSERT_EQ(other.size(), mine.size());
    std::vector<std::string> differing;
    for (size_t i = 0; i < mine.size(); ++i)
      if (ids_of(mine[i].at("ids")) != other[i]) differing.push_back(mine[i].at("text").get<std::string>());
    EXPECT_GE(differing.size(), 3u) << "texts where " << name << " and its twin differ: "
                                    << nlohmann::json(differing).dump();
  }
  EXPECT_FALSE(cases.at("whole_words").empty());
}

TEST(HfTokenizer, SpecialIdsComeFromTheTemplateOrTheirNames) {
  const HfTokenizer llama((kFixture / "llama3_style/tokenizer.json").string());
  EXPECT_EQ(llama.bos_id(), llama.token_id("<|begin_of_text|>"));  // the template's
  EXPECT_EQ(llama.eos_id(), llama.token_id("<|end_of_text|>"));    // by name
  const HfTokenizer gpt2((kFixture / "gpt2_style/tokenizer.json").string());
  EXPECT_EQ(gpt2.bos_id(), -1);
  EXPECT_EQ(gpt2.eos_id(), gpt2.token_id("<|endoftext|>"));
  // tokenizer_config.json beside the file names them when the template does not.
  TempDir dir;
  fs::copy_file(kFixture / "gpt2_style/tokenizer.json", dir.path / "tokenizer.json");
  test::write_file(dir / "tokenizer_config.json", R"({"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}})");
  const HfTokenizer configured(dir / "tokenizer.json");
  EXPECT_EQ(configured.bos_id(), gpt2.token_id("<|endoftext|>"));
}

TEST(HfTokenizer, TheTokenizerIsChosenByItsFileAndADirectoryByWhatItHolds) {
  TempDir dir;
  const fs::path json_path = kFixture / "llama3_style/tokenizer.json";
  const Tokenizer by_file(json_path.string());
  EXPECT_TRUE(by_file.is_hf());
  EXPECT_STREQ(by_file.file_name(), "tokenizer.json");
  const std::string text = "It is a truth universally acknowledged, 👋🏽 <|eot_id|>";
  const HfTokenizer direct(json_path.string());
  EXPECT_EQ(by_file.encode(text), direct.encode(text, false));
  EXPECT_EQ(by_file.decode(by_file.encode(text)), "It is a truth universally acknowledged, 👋🏽 ");  // specials dropped
  EXPECT_EQ(by_file.decode(by_file.encode(text), false), text);
  // A .json of another name, and a file named otherwise whose content is JSON.
  fs::copy_file(json_path, dir.path / "other.json");
  EXPECT_TRUE(Tokenizer(dir / "other.json").is_hf());
  fs::copy_file(json_path, dir.path / "tok.bin");
  EXPECT_TRUE(Tokenizer(dir / "tok.bin").is_hf());
  // A directory: its tokenizer.model first, else its tokenizer.json.
  fs::create_directories(dir.path / "hf");
  fs::copy_file(json_path, dir.path / "hf/tokenizer.json");
  EXPECT_EQ(find_tokenizer_in(dir / "hf"), dir / "hf/tokenizer.json");
  EXPECT_TRUE(Tokenizer(dir / "hf").is_hf());
  fs::copy_file(test::small_tokenizer_path(), dir.path / "hf/tokenizer.model");
  EXPECT_EQ(find_tokenizer_in(dir / "hf"), dir / "hf/tokenizer.model");
  EXPECT_FALSE(Tokenizer(dir / "hf").is_hf());
  fs::create_directories(dir.path / "empty");
  EXPECT_EQ(find_tokenizer_in(dir / "empty"), "");
  expect_error([&] { Tokenizer t(dir / "empty"); }, {dir / "empty", "no tokenizer.model or tokenizer.json"});
}

TEST(HfTokenizer, IdsWithNoTokenDecodeToNothingAsInHf) {
  const HfTokenizer tok((kFixture / "gpt2_style/tokenizer.json").string());
  const std::vector<int32_t> ids = tok.encode("a truth");
  std::vector<int32_t> padded = {1000, 1023};
  padded.insert(padded.end(), ids.begin(), ids.end());
  padded.push_back(-1);
  EXPECT_EQ(tok.decode(padded), tok.decode(ids));
}

TEST(HfTokenizer, InvalidUtf8IsReadWithReplacementCharacters) {
  const HfTokenizer tok((kFixture / "gpt2_style/tokenizer.json").string());
  // "a\xff b\xe2\x82" is read as "a\ufffd b\ufffd" (one U+FFFD per maximal ill-formed part).
  EXPECT_EQ(tok.encode("a\xff b\xe2\x82"), tok.encode("a\xef\xbf\xbd b\xef\xbf\xbd"));
  EXPECT_EQ(tok.decode(tok.encode("a\xff b\xe2\x82")), " a\xef\xbf\xbd b\xef\xbf\xbd");
}

// The fixture's tokenizer.json with `edit` applied, written to dir/tokenizer.json.
std::string edited(const TempDir& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(test::read_bytes((kFixture / "llama3_style/tokenizer.json").string()));
  edit(j);
  const std::string path = dir / "tokenizer.json";
  test::write_file(path, j.dump());
  return path;
}

TEST(HfTokenizer, MalformedFilesAreRefusedNamingTheFileAndField) {
  TempDir dir;
  const std::string path = dir / "tokenizer.json";
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit, std::initializer_list<std::string> parts) {
    const std::string p = edited(dir, edit);
    std::vector<std::string> all(parts);
    all.push_back(p);
    try {
      HfTokenizer t(p);
      ADD_FAILURE() << "expected an error mentioning '" << all[0] << "'";
    } catch (const Error& e) {
      for (const std::string& part : all) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(HfTokenizer(edited(dir, [](nlohmann::json&) {})));
  test::write_file(path, "{\"model\": ");
  expect_error([&] { HfTokenizer t(path); }, {path, "not valid JSON"});
  expect_error([&] { HfTokenizer t(dir / "missing.json"); }, {dir / "missing.json", "does not exist"});
  refused([](nlohmann::json& j) { j.erase("model"); }, {"has no \"model\""});
  refused([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, {"model type \"WordPiece\""});
  refused([](nlohmann::json& j) { j["model"]["merges"][3] = nlohmann::json::array({"h", "nowhere"}); },
          {"model.merges[3]", "\"nowhere\""});
  refused([](nlohmann::json& j) { j["model"]["merges"][5] = "three tokens here"; }, {"model.merges[5]"});
  refused([](nlohmann::json& j) { j["model"]["vocab"]["Ġthe"] = "x"; }, {"model.vocab[\"Ġthe\"]"});
  refused([](nlohmann::json& j) { j["model"]["vocab"]["zzzz-duplicate"] = 7; }, {"id 7 is given to two tokens"});
  refused([](nlohmann::json& j) { j["model"]["dropout"] = 0.1; }, {"model.dropout"});
  refused([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
          {"pre_tokenizer.pretokenizers[0].pattern", "does not compile"});
  refused([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][1]["type"] = "Metaspace"; },
          {"pre_tokenizer.pretokenizers[1]", "\"Metaspace\" is not supported"});
  refused([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; },
          {"pre_tokenizer.pretokenizers[0].behavior"});
  refused([](nlohmann::json& j) { j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}}; },
          {"normalizer", "\"Precompiled\" is not supported"});
  refused([](nlohmann::json& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}},
                                                                                            {{"type", "Nmt"}}}}}; },
          {"normalizer.normalizers[1]", "\"Nmt\" is not supported"});
  refused([](nlohmann::json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, {"decoder", "\"WordPiece\""});
  refused([](nlohmann::json& j) { j["post_processor"]["processors"][1]["single"][0]["SpecialToken"]["id"] = "<x>"; },
          {"post_processor.processors[1]", "\"<x>\" is not in special_tokens"});
  refused([](nlohmann::json& j) { j["added_tokens"][0].erase("content"); }, {"added_tokens[0]"});
  refused([](nlohmann::json& j) { j["added_tokens"][1]["id"] = 300; }, {"added token \"<|end_of_text|>\" has id 300"});
  refused([](nlohmann::json& j) { j["model"]["unk_token"] = "<unk>"; }, {"model.unk_token \"<unk>\""});
}

// The normalizers on llama3_style's vocabulary, by properties checked by hand against the Unicode
// tables (HF's own ids for them are the fixture's variants above): a normalized text encodes as
// the text written in its normal form does.
TEST(HfTokenizer, NormalizersEncodeTextAsItsNormalFormEncodes) {
  TempDir dir;
  const HfTokenizer plain((kFixture / "llama3_style/tokenizer.json").string());
  const auto with = [&](const nlohmann::json& normalizer) {
    return HfTokenizer(edited(dir, [&](nlohmann::json& j) { j["normalizer"] = normalizer; }));
  };
  const HfTokenizer nfc = with({{"type", "NFC"}});
  EXPECT_EQ(nfc.encode("cafe\u0301 A\u030angstro\u0308m \u212b"), plain.encode("caf\u00e9 \u00c5ngstr\u00f6m \u00c5"));
  EXPECT_NE(plain.encode("cafe\u0301"), plain.encode("caf\u00e9"));  // so the line above says something
  const HfTokenizer nfkc_lower = with({{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}, {{"type", "Lowercase"}}}}});
  EXPECT_EQ(nfkc_lower.encode("\uff26\uff35\uff2c\uff2c \ufb01ne \u039f\u0394\u03a5\u03a3\u03a3\u0395\u03a5\u03a3 \u0130"),
            plain.encode("full fine \u03bf\u03b4\u03c5\u03c3\u03c3\u03b5\u03c5\u03c3 i\u0307"));
  const HfTokenizer strip_accents = with(
      {{"type", "Sequence"}, {"normalizers", {{{"type", "NFD"}}, {{"type", "StripAccents"}}}}});
  EXPECT_EQ(strip_accents.encode("caf\u00e9 na\u00efve"), plain.encode("cafe naive"));
  const HfTokenizer nfkd = with({{"type", "NFKD"}});
  EXPECT_EQ(nfkd.encode("\ufb01 \u00e9"), plain.encode("fi e\u0301"));
  // Strip removes Unicode whitespace (Rust's char::is_whitespace), not only ASCII's.
  const HfTokenizer strip = with({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}});
  EXPECT_EQ(strip.encode("\u3000 \u00a0hi there\u2003\n"), plain.encode("hi there"));
  EXPECT_EQ(strip.encode("\u200bhi"), plain.encode("\u200bhi"));  // ZERO WIDTH SPACE is not whitespace
}

// Qwen 2.5's tokenizer.json, as it ships (its fields around llama3_style's vocabulary): NFC, Qwen's
// Split regex, ByteLevel without its regex, a ByteLevel post-processor, empty (not null) subword
// prefix and suffix. It used to be refused for its NFC; it loads, and NFC does its work.
TEST(HfTokenizer, QwenTwoPointFiveLayoutLoads) {
  TempDir dir;
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                                     {"use_regex", false}};
  const HfTokenizer qwen(edited(dir, [&](nlohmann::json& j) {
    j["version"] = "1.0";
    j["truncation"] = nullptr;
    j["padding"] = nullptr;
    j["normalizer"] = {{"type", "NFC"}};
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern", {{"Regex", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
                                   "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          byte_level}}};
    j["post_processor"] = byte_level;
    j["decoder"] = byte_level;
    j["model"]["continuing_subword_prefix"] = "";
    j["model"]["end_of_word_suffix"] = "";
    j["model"]["ignore_merges"] = false;
  }));
  const HfTokenizer plain((kFixture / "llama3_style/tokenizer.json").string());
  EXPECT_EQ(qwen.encode("cafe\u0301 ok", true), qwen.encode("caf\u00e9 ok", true));  // no BOS, NFC
  EXPECT_EQ(qwen.decode(qwen.encode("cafe\u0301 2026")), "caf\u00e9 2026");
  EXPECT_EQ(qwen.encode("2026").size(), 4u);  // Qwen splits digits one by one
  EXPECT_EQ(qwen.encode("It is a truth"), plain.encode("It is a truth"));
}

// Added tokens: those with normalized: false are matched on the raw text, before normalization;
// those with normalized: true on the normalized text, as the normalizer writes their content. As HF
// tokenizers 0.23 (AddedVocabulary::split_with_indices, simple_id_to_token): such a token is named by
// the normalized text it matched, and decodes as its normalized content; decode(skip_special_tokens)
// drops what decodes as a special token's content, so a special token that normalization changes
// stays.
TEST(HfTokenizer, AddedTokensAreMatchedOnRawOrNormalizedText) {
  TempDir dir;
  const HfTokenizer plain((kFixture / "llama3_style/tokenizer.json").string());
  const int32_t darcy = plain.token_id("Mr. Darcy");
  ASSERT_GE(darcy, 0);
  const HfTokenizer tok(edited(dir, [&](nlohmann::json& j) {
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFKC"}}, {{"type", "Lowercase"}}}}};
    j["added_tokens"].push_back({{"id", darcy + 1}, {"content", "Miss Bennet"}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", false}});
    j["added_tokens"].push_back({{"id", darcy + 2}, {"content", "<SEP>"}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", true}});
    j["added_tokens"].push_back({{"id", darcy + 3}, {"content", "<cls>"}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", true}, {"special", true}});
  }));
  const int32_t bennet = darcy + 1, sep = darcy + 2, cls = darcy + 3;
  EXPECT_EQ(tok.encode("Mr. Darcy"), std::vector<int32_t>{darcy});
  EXPECT_EQ(tok.encode("MR. DARCY"), plain.encode("mr. darcy"));  // raw match only
  for (const char* text : {"Miss Bennet", "MISS BENNET", "miss bennet", "\uff2d\uff29\uff33\uff33 BENNET"})
    EXPECT_EQ(tok.encode(text), std::vector<int32_t>{bennet}) << text;
  std::vector<int32_t> expected = plain.encode("dear ");
  expected.push_back(bennet);
  for (int32_t id : plain.encode("!")) expected.push_back(id);
  EXPECT_EQ(tok.encode("Dear MISS BENNET!"), expected);
  EXPECT_EQ(tok.decode(tok.encode("Dear MISS BENNET!")), "dear miss bennet!");  // the normalized content
  EXPECT_EQ(tok.token(bennet), "miss bennet");
  EXPECT_EQ(tok.token(darcy), "Mr. Darcy");  // normalized: false, its content as written
  const std::vector<std::string> names = tok.encode_tokens("Dear \uff2d\uff29\uff33\uff33 BENNET!");
  ASSERT_FALSE(names.empty());
  EXPECT_NE(std::find(names.begin(), names.end(), "miss bennet"), names.end());
  // "<SEP>" normalizes to "<sep>": decoded as that, which no special token is, so skipping keeps it;
  // "<cls>" is unchanged by the normalizer and skipped.
  EXPECT_EQ(tok.encode("<sep><CLS>"), (std::vector<int32_t>{sep, cls}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{sep, cls}, false), "<sep><cls>");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{sep, cls}, true), "<sep>");
}

// single_word, lstrip and rstrip read words and spaces as HF does, by Unicode (Rust's regex \w and
// \s): an em dash ends a word, a letter with an accent or a combining mark does not; an ideographic
// space is stripped like an ASCII one.
TEST(HfTokenizer, AddedTokensSingleWordAndStripReadUnicode) {
  TempDir dir;
  const HfTokenizer plain((kFixture / "llama3_style/tokenizer.json").string());
  const int32_t mask = plain.vocab_size(), word = mask + 1;
  const HfTokenizer tok(edited(dir, [&](nlohmann::json& j) {
    j["added_tokens"].push_back({{"id", mask}, {"content", "<mask>"}, {"lstrip", true}, {"rstrip", true},
                                 {"special", true}, {"normalized", false}});
    j["added_tokens"].push_back({{"id", word}, {"content", "Zorblax"}, {"single_word", true}, {"special", false},
                                 {"normalized", false}});
  }));
  const auto cat = [](std::initializer_list<std::vector<int32_t>> parts) {
    std::vector<int32_t> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  };
  EXPECT_EQ(tok.encode("a\u3000 <mask>\u00a0\u2003b"), cat({plain.encode("a"), {mask}, plain.encode("b")}));
  // As HF, the token is named by the span it took, the stripped whitespace with it.
  EXPECT_EQ(tok.encode_tokens("a\u3000 <mask>\u00a0\u2003b"),
            (std::vector<std::string>{"a", "\u3000 <mask>\u00a0\u2003", "b"}));
  EXPECT_EQ(tok.encode("\u2014Zorblax\u2014"), cat({plain.encode("\u2014"), {word}, plain.encode("\u2014")}));
  EXPECT_EQ(tok.encode("Zorblax's"), cat({{word}, plain.encode("'s")}));
  for (const char* glued : {"\u00e9Zorblax", "Zorblax\u0301", "Zorblax_", "Zorblax2", "\u65e5Zorblax"})
    EXPECT_EQ(tok.encode(glued), plain.encode(glued)) << glued;
}

// ignore_merges emits a pre-token whole when the model's vocabulary has it; an added token of the
// same spelling is not the model's vocabulary (HF's BPE looks only there).
TEST(HfTokenizer, IgnoreMergesLooksInTheModelsVocabularyOnly) {
  TempDir dir;
  const HfTokenizer plain((kFixture / "llama3_style/tokenizer.json").string());
  ASSERT_EQ(plain.token_id("\u0120Zyxwvut"), -1);
  const int32_t next = plain.vocab_size();
  const auto make = [&](bool ignore_merges, bool in_model) {
    return HfTokenizer(edited(dir, [&](nlohmann::json& j) {
      j["model"]["ignore_merges"] = ignore_merges;
      if (in_model) j["model"]["vocab"]["\u0120Zyxwvut"] = next;
      else j["added_tokens"].push_back({{"id", next}, {"content", "\u0120Zyxwvut"}, {"special", false},
                                        {"normalized", false}});
    }));
  };
  const std::vector<int32_t> merged = plain.encode(" Zyxwvut");
  ASSERT_GT(merged.size(), 1u);
  EXPECT_EQ(make(true, true).encode(" Zyxwvut"), std::vector<int32_t>{next});
  EXPECT_EQ(make(false, true).encode(" Zyxwvut"), merged);
  EXPECT_EQ(make(true, false).encode(" Zyxwvut"), merged);
  EXPECT_EQ(make(true, false).encode("\u0120Zyxwvut"), std::vector<int32_t>{next});  // matched as added text
}

// The BPE knobs the fixture does not exercise, on a hand-made vocabulary: byte fallback, unk with
// fuse_unk, a continuing-subword prefix, and the Llama 2-style normalizer and decoder chain.
TEST(HfTokenizer, ByteFallbackUnkAndTheMetaspaceStyleChain) {
  TempDir dir;
  nlohmann::json vocab = {{"<unk>", 0}, {"▁", 1}, {"a", 2}, {"b", 3}, {"▁a", 4}, {"ab", 5}, {"▁ab", 6}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 7 + b;
  nlohmann::json j = {
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", "▁"}},
                                                              {{"type", "Replace"}, {"pattern", {{"String", " "}}},
                                                               {"content", "▁"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor", nullptr},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                                        {{"type", "ByteFallback"}},
                                                        {{"type", "Fuse"}},
                                                        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true},
                 {"vocab", vocab}, {"merges", {"▁ a", "a b", "▁a b"}}}}};
  test::write_file(dir / "tokenizer.json", j.dump());
  const HfTokenizer tok(dir / "tokenizer.json");
  // "ab ab" -> "▁ab▁ab": merges (▁ a) rank 0, then (a b)... leftmost lowest rank first.
  EXPECT_EQ(tok.encode("ab ab"), (std::vector<int32_t>{6, 6}));
  // "é" is not in the vocabulary: its two UTF-8 bytes, as byte tokens.
  EXPECT_EQ(tok.encode("aé"), (std::vector<int32_t>{4, 7 + 0xC3, 7 + 0xA9}));
  EXPECT_EQ(tok.decode(tok.encode("ab aé b")), "ab aé b");
  // Without byte fallback, unknown characters are unk, consecutive ones fused.
  j["model"]["byte_fallback"] = false;
  test::write_file(dir / "tokenizer.json", j.dump());
  const HfTokenizer unk(dir / "tokenizer.json");
  EXPECT_EQ(unk.encode("aéé"), (std::vector<int32_t>{4, 0}));
}

}  // namespace
}  // namespace longtrain::data
