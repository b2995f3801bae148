#include "data/tokenizer.h"

#include <exception>
#include <filesystem>
#include <thread>
#include <unordered_map>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include "data/documents.h"
#include "data/hf_tokenizer.h"
#include "runtime/error.h"

namespace longtrain::data {

namespace {

// Feeds SentencePiece's trainer one line of our documents at a time, so .jsonl inputs and paths
// with commas work, and read errors are ours (naming the file) rather than the trainer's.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  LineIterator(std::vector<InputFile> inputs, std::string text_key, int64_t max_bytes)
      : reader_(std::move(inputs), std::move(text_key)), max_bytes_(max_bytes) {
    Next();
  }
  bool done() const override { return done_; }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override {
    if (!error_) return {};
    return sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal, "input error");
  }
  // Our read errors stop the iteration here and are rethrown after Train returns, rather than
  // unwinding through SentencePiece.
  void Next() override {
    try {
      next_line();
    } catch (...) {
      error_ = std::current_exception();
      done_ = true;
    }
  }
  void rethrow_if_failed() const {
    if (error_) std::rethrow_exception(error_);
  }
  int64_t lines() const { return lines_; }

 private:
  void next_line() {
    while (true) {
      if (pos_ >= doc_.size()) {
        if (!reader_.next(doc_)) {
          done_ = true;
          return;
        }
        pos_ = 0;
      }
      size_t end = doc_.find('\n', pos_);
      if (end == std::string::npos) end = doc_.size();
      line_.assign(doc_, pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      // The trainer skips sentences longer than max_sentence_length; cut them rather than lose them.
      if (static_cast<int64_t>(line_.size()) > max_bytes_) line_.resize(static_cast<size_t>(max_bytes_));
      if (line_.find_first_not_of(' ') != std::string::npos) {
        ++lines_;
        return;
      }
    }
  }
  DocumentReader reader_;
  int64_t max_bytes_;
  std::string doc_, line_;
  size_t pos_ = 0;
  bool done_ = false;
  int64_t lines_ = 0;
  std::exception_ptr error_;
};

}  // namespace

void train_tokenizer(const TokenizerTrainOptions& o) {
  LT_CHECK(!o.model_prefix.empty(), "tokenizer train: --output PREFIX is required");
  LT_CHECK(o.model_type == "bpe" || o.model_type == "unigram",
           "tokenizer train: model type '{}' is not supported: use bpe or unigram", o.model_type);
  // Byte fallback needs the 256 byte pieces plus unk/bos/eos before any learned piece.
  const int minimum = o.byte_fallback ? 256 + 3 + 1 : 3 + 1;
  LT_CHECK(o.vocab_size >= minimum, "tokenizer train: vocab size {} is too small: at least {} with{} byte "
           "fallback", o.vocab_size, minimum, o.byte_fallback ? "" : "out");
  std::vector<InputFile> inputs = list_inputs(o.inputs);
  count_documents(inputs);
  const std::filesystem::path parent = std::filesystem::path(o.model_prefix).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);

  constexpr int64_t kMaxSentenceBytes = 16384;
  const int threads = o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  std::unordered_map<std::string, std::string> args = {
      {"model_prefix", o.model_prefix},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      {"byte_fallback", o.byte_fallback ? "true" : "false"},
      {"character_coverage", fmt::format("{}", o.character_coverage)},
      // Lossless: no NFKC, keep every space as written (decode(encode(x)) == x).
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"max_sentence_length", std::to_string(kMaxSentenceBytes)},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", std::to_string(threads)},
      {"minloglevel", o.quiet ? "2" : "0"},
  };
  if (o.max_sentences > 0) {
    args["input_sentence_size"] = std::to_string(o.max_sentences);
    args["shuffle_input_sentence"] = "true";
  }
  LineIterator lines(inputs, o.text_key, kMaxSentenceBytes);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines);
  lines.rethrow_if_failed();
  LT_CHECK(status.ok(), "tokenizer train on {} input file(s) ({} lines): SentencePiece failed: {}",
           inputs.size(), lines.lines(), status.ToString());
}

std::string find_tokenizer_in(const std::string& dir) {
  std::error_code ec;
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    const std::filesystem::path p = std::filesystem::path(dir) / name;
    if (std::filesystem::is_regular_file(p, ec)) return p.string();
  }
  return "";
}

Tokenizer::Tokenizer(const std::string& model_path) : path_(model_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec)) {
    path_ = find_tokenizer_in(model_path);
    LT_CHECK(!path_.empty(), "tokenizer directory '{}' has no tokenizer.model or tokenizer.json", model_path);
  }
  LT_CHECK(std::filesystem::exists(path_),
           "tokenizer model '{}' does not exist (train one with `longtrain tokenizer train`, or give a Hugging Face "
           "tokenizer.json)", path_);
  if (is_hf_tokenizer_file(path_)) {
    hf_ = std::make_unique<HfTokenizer>(path_);
    return;
  }
  sp_ = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = sp_->Load(path_);
  LT_CHECK(status.ok(), "cannot load tokenizer model '{}': {}", path_, status.ToString());
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  if (hf_) return hf_->encode(text, false);
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  LT_CHECK(status.ok(), "tokenizer '{}': encode failed: {}", path_, status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  if (hf_) return hf_->decode(ids, skip_special);
  const int32_t n = vocab_size();
  for (int32_t id : ids) LT_CHECK(id >= 0 && id < n, "tokenizer '{}': id {} is outside the vocabulary [0, {})",
                                  path_, id, n);
  std::vector<int> v(ids.begin(), ids.end());
  std::string text;
  // SentencePiece always drops its control pieces (unk/bos/eos).
  const auto status = sp_->Decode(v, &text);
  LT_CHECK(status.ok(), "tokenizer '{}': decode failed: {}", path_, status.ToString());
  return text;
}

std::vector<std::string> Tokenizer::encode_pieces(std::string_view text) const {
  if (hf_) return hf_->encode_tokens(text);
  std::vector<std::string> pieces;
  const auto status = sp_->Encode(text, &pieces);
  LT_CHECK(status.ok(), "tokenizer '{}': encode failed: {}", path_, status.ToString());
  return pieces;
}

std::string Tokenizer::piece(int32_t id) const {
  LT_CHECK(id >= 0 && id < vocab_size(), "tokenizer '{}': id {} is outside the vocabulary [0, {})", path_,
           id, vocab_size());
  if (hf_) return hf_->token(id);
  return sp_->IdToPiece(id);
}

int32_t Tokenizer::vocab_size() const { return hf_ ? hf_->vocab_size() : sp_->GetPieceSize(); }
int32_t Tokenizer::bos_id() const { return hf_ ? hf_->bos_id() : sp_->bos_id(); }
int32_t Tokenizer::eos_id() const { return hf_ ? hf_->eos_id() : sp_->eos_id(); }
int32_t Tokenizer::unk_id() const { return hf_ ? hf_->unk_id() : sp_->unk_id(); }
int32_t Tokenizer::pad_id() const { return hf_ ? -1 : sp_->pad_id(); }

}  // namespace longtrain::data
