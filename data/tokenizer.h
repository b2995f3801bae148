// The tokenizer: a SentencePiece model, trained by `longtrain tokenizer train` (BPE with byte
// fallback, as Llama's) or any SentencePiece .model (Llama 2's works as it is); or a Hugging Face
// tokenizer.json of a byte-level BPE model (Llama 3, GPT-2 and the like; hf_tokenizer.h).
//
// Our trained models are lossless: normalization is the identity, whitespace is kept as written and
// characters outside the vocabulary fall back to their UTF-8 bytes, so decode(encode(text)) == text
// for any UTF-8 text, newlines included (a newline is the byte piece <0x0A>, as in Llama 2).
// Special ids follow Llama: unk 0, bos 1, eos 2, no pad.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace longtrain::data {

class HfTokenizer;

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;  // .txt/.jsonl files or directories; every line is a sentence
  std::string model_prefix;         // writes PREFIX.model and PREFIX.vocab
  int vocab_size = 8000;
  std::string model_type = "bpe";   // bpe | unigram
  bool byte_fallback = true;
  double character_coverage = 0.9995;
  int64_t max_sentences = 0;        // sample at most this many lines (0: all)
  int threads = 0;                  // 0: all cores
  std::string text_key = "text";    // field of .jsonl records
  bool quiet = true;                // hide SentencePiece's training log
};

// Trains a SentencePiece model; errors (bad vocab size, no text, ...) name the inputs and option.
void train_tokenizer(const TokenizerTrainOptions& options);

// A tokenizer chosen by its file: a Hugging Face tokenizer.json (byte-level BPE, hf_tokenizer.h)
// or a SentencePiece .model; a directory means its own tokenizer (find_tokenizer_in).
class Tokenizer {
 public:
  // Loads a .model or tokenizer.json file, or a directory's tokenizer; a missing or invalid file is
  // an error naming it.
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Thread-safe: several threads may encode with one Tokenizer. No BOS/EOS are added.
  std::vector<int32_t> encode(std::string_view text) const;
  // Special tokens (SentencePiece's control pieces; tokenizer.json's special added tokens) are
  // dropped unless asked for. An id outside a .model's vocabulary is an error; a tokenizer.json
  // drops ids it has no token for (as HF tokenizers does: a model's padded embedding rows).
  std::string decode(std::span<const int32_t> ids, bool skip_special = true) const;
  std::vector<std::string> encode_pieces(std::string_view text) const;
  std::string piece(int32_t id) const;

  int32_t vocab_size() const;
  int32_t bos_id() const;  // -1 when the model has none
  int32_t eos_id() const;
  int32_t unk_id() const;
  int32_t pad_id() const;
  const std::string& path() const { return path_; }
  bool is_hf() const { return hf_ != nullptr; }
  // The file name a copy of it takes in a checkpoint: tokenizer.json or tokenizer.model.
  const char* file_name() const { return hf_ ? "tokenizer.json" : "tokenizer.model"; }

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::unique_ptr<HfTokenizer> hf_;
};

// The tokenizer of a model directory (a Hugging Face directory or one of our checkpoints):
// tokenizer.model when there is one (SentencePiece, the original of Llama 2-style models, which
// also ship a tokenizer.json), else tokenizer.json; "" when it has neither.
std::string find_tokenizer_in(const std::string& dir);

}  // namespace longtrain::data
