// `longtrain prepare`: text (.txt/.jsonl files or directories) -> token shards (shards.h).
//
// Documents are read in input order, tokenized on several threads, and written in input order, so
// the output is byte-identical whatever the thread count. The validation split takes whole
// documents: k = round(F * D) of the D documents (at least 1 when F > 0, at most D - 1), spread
// evenly through the corpus (document floor((j + 1/2) * D / k) for j < k), so it samples every part
// of the input rather than its tail.
//
// The set is written into "<output>.partial-<pid>" and renamed to <output> only when complete
// (manifest.json included), so an interrupted run never leaves a set that looks complete.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace longtrain::data {

struct PrepareOptions {
  std::string tokenizer;            // SentencePiece .model
  std::vector<std::string> inputs;  // .txt/.jsonl files or directories
  std::string output;               // the shard directory
  double val_fraction = 0.0;        // share of documents held out as the "val" split
  int threads = 0;                  // tokenizer threads; 0: all cores
  bool add_bos = false;             // the tokenizer's BOS before each document
  bool add_eos = true;              // the tokenizer's EOS after each document
  std::string text_key = "text";    // field of .jsonl records
  int64_t shard_tokens = int64_t{1} << 28;  // at most this many tokens per .bin (1 GiB)
  bool overwrite = false;           // replace an existing output directory
  bool progress = true;             // draw a progress bar on a terminal
};

struct PrepareSummary {
  int64_t input_bytes = 0;
  int64_t documents = 0;  // documents read (empty ones included)
  int64_t train_documents = 0, train_tokens = 0;
  int64_t val_documents = 0, val_tokens = 0;
  int64_t vocab_size = 0;
  int threads = 0;
  double seconds = 0.0;
};

PrepareSummary prepare_corpus(const PrepareOptions& options);

// Which of D documents go to the validation split for fraction F (sorted indices).
std::vector<int64_t> validation_documents(int64_t documents, double val_fraction);

}  // namespace longtrain::data
