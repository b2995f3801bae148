// `longtrain tokenizer train|encode|decode`: train a SentencePiece model on our text inputs and
// inspect what it does to a text.
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "data/documents.h"
#include "data/tokenizer.h"
#include "runtime/error.h"
#include "tools/longtrain/commands.h"

namespace longtrain::cli {

namespace {

struct EncodeOptions {
  std::string model, text, input;
  bool pieces = false;
};

struct DecodeOptions {
  std::string model;
  std::vector<int32_t> ids;
};

std::string text_to_encode(const EncodeOptions& o) {
  LT_CHECK(o.text.empty() || o.input.empty(), "tokenizer encode: give --text or --input, not both");
  if (!o.input.empty()) return data::read_file(o.input);
  if (!o.text.empty()) return o.text;
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

void add_tokenizer_commands(CLI::App& app) {
  CLI::App* tok = app.add_subcommand("tokenizer", "Train a SentencePiece tokenizer, or encode/decode with one (or a tokenizer.json)");
  tok->require_subcommand(1);

  auto t = std::make_shared<data::TokenizerTrainOptions>();
  auto verbose = std::make_shared<bool>(false);
  CLI::App* train = tok->add_subcommand("train", "Train a SentencePiece model (BPE with byte fallback)");
  train->add_option("-i,--input", t->inputs, ".txt/.jsonl files or directories (every line is a sentence)")
      ->required();
  train->add_option("--vocab-size", t->vocab_size, "vocabulary size")->required();
  train->add_option("-o,--output", t->model_prefix, "writes PREFIX.model and PREFIX.vocab")->required();
  train->add_option("--model-type", t->model_type, "bpe or unigram")->capture_default_str();
  train->add_flag("--byte-fallback,!--no-byte-fallback", t->byte_fallback,
                  "unknown characters become UTF-8 byte pieces, lossless (default: yes)");
  train->add_option("--character-coverage", t->character_coverage, "share of characters kept as pieces")
      ->capture_default_str();
  train->add_option("--max-sentences", t->max_sentences, "sample at most this many lines (0: all)")
      ->capture_default_str();
  train->add_option("--threads", t->threads, "training threads (0: all cores)")->capture_default_str();
  train->add_option("--text-key", t->text_key, "field of .jsonl records")->capture_default_str();
  train->add_flag("-v,--verbose", *verbose, "show SentencePiece's training log");
  train->callback([t, verbose] {
    t->quiet = !*verbose;
    data::train_tokenizer(*t);
    const data::Tokenizer model(t->model_prefix + ".model");
    fmt::print("wrote {}.model and {}.vocab: {} pieces (unk {}, bos {}, eos {})\n", t->model_prefix,
               t->model_prefix, model.vocab_size(), model.unk_id(), model.bos_id(), model.eos_id());
  });

  auto e = std::make_shared<EncodeOptions>();
  CLI::App* encode = tok->add_subcommand("encode", "Print the token ids (or pieces) of a text");
  encode->add_option("-m,--model", e->model, "SentencePiece .model or Hugging Face tokenizer.json")->required();
  encode->add_option("-t,--text", e->text, "the text (default: standard input)");
  encode->add_option("-i,--input", e->input, "a file to encode");
  encode->add_flag("--pieces", e->pieces, "print pieces instead of ids");
  encode->callback([e] {
    const data::Tokenizer model(e->model);
    const std::string text = text_to_encode(*e);
    if (e->pieces) {
      const auto pieces = model.encode_pieces(text);
      fmt::print("{}\n", fmt::join(pieces, " "));
    } else {
      const auto ids = model.encode(text);
      fmt::print("{}\n", fmt::join(ids, " "));
    }
  });

  auto d = std::make_shared<DecodeOptions>();
  CLI::App* decode = tok->add_subcommand("decode", "Print the text of token ids (default: read ids from standard input)");
  decode->add_option("-m,--model", d->model, "SentencePiece .model or Hugging Face tokenizer.json")->required();
  decode->add_option("ids", d->ids, "token ids");
  decode->callback([d] {
    const data::Tokenizer model(d->model);
    std::vector<int32_t> ids = d->ids;
    if (ids.empty()) {
      std::string word;
      while (std::cin >> word) {
        try {
          ids.push_back(static_cast<int32_t>(std::stol(word)));
        } catch (const std::exception&) {
          LT_FAIL("tokenizer decode: '{}' on standard input is not a token id", word);
        }
      }
    }
    fmt::print("{}", model.decode(ids));
    std::fflush(stdout);
  });
}

}  // namespace longtrain::cli
