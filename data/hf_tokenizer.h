// Hugging Face tokenizers' tokenizer.json, for byte-level BPE models (Llama 3, Qwen 2.5, GPT-2 and
// the like), encoded and decoded here in C++ with the same ids as HF tokenizers.
//
// What is read, in the order encode applies it:
//   added_tokens    leftmost-longest; those with normalized: false first, on the raw text, then those
//                   with normalized: true on each normalized piece between them (as the normalizer
//                   writes their content); single_word, lstrip and rstrip as HF defines them (Unicode
//                   words and whitespace: Rust's \w and \s). They are never split. As HF
//                   tokenizers 0.23: an added token's string (encode_tokens) is the text it matched,
//                   raw or normalized, with the whitespace lstrip/rstrip took; one with normalized:
//                   true decodes as its normalized content; decode(skip_special_tokens) drops an id
//                   whose decoded string is a `special` token's content (so a special normalized
//                   token that the normalizer changes is kept, as HF keeps it).
//   normalizer      applied to the text between added tokens: null, Sequence, NFC, NFD, NFKC, NFKD
//                   (ICU's tables), Lowercase (each code point's full lowercase mapping, without
//                   context, as HF: 'Σ' is always 'σ'), StripAccents (drops combining marks),
//                   Replace, Prepend, Strip (Unicode whitespace). Others (BertNormalizer,
//                   Precompiled, Nmt) are refused.
//   pre_tokenizer   null, Sequence, Split (a String or a Regex pattern, run by PCRE2 in UTF mode with
//                   Unicode properties; behaviors Removed, Isolated, MergedWithPrevious,
//                   MergedWithNext, Contiguous; invert), ByteLevel (add_prefix_space, use_regex with
//                   GPT-2's pattern; bytes mapped to GPT-2's printable characters), Digits.
//   model           BPE: vocab, merges (as "a b" strings or [a, b] pairs), ignore_merges, unk_token,
//                   fuse_unk, byte_fallback, continuing_subword_prefix, end_of_word_suffix; dropout
//                   must be null or 0 (encoding is deterministic).
//   post_processor  what encode(add_special_tokens = true) adds: TemplateProcessing's single
//                   template, RobertaProcessing/BertProcessing (cls ... sep), ByteLevel (no ids),
//                   Sequence of them, or null.
//   decoder         ByteLevel, ByteFallback, Fuse, Replace, Strip, Sequence, or null.
// Anything else is an error naming the file and the field. Text that is not valid UTF-8 is read
// with each invalid sequence replaced by U+FFFD (as Python's errors="replace" would decode it).
//
// BOS/EOS: the post-processor's template says which token comes before and after a sequence; when
// it says nothing, tokenizer_config.json beside the file (bos_token, eos_token) does; else none.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace longtrain::data {

class HfTokenizer {
 public:
  // Loads and validates tokenizer.json; errors name the file and the field.
  explicit HfTokenizer(const std::string& path);
  ~HfTokenizer();
  HfTokenizer(HfTokenizer&&) noexcept;
  HfTokenizer& operator=(HfTokenizer&&) noexcept;

  // Thread-safe. add_special_tokens applies the post-processor (e.g. the BOS of Llama 3's template).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  std::vector<std::string> encode_tokens(std::string_view text) const;  // the token strings, no specials
  // Ids with no token (beyond the vocabulary: a model's padded embedding rows) decode to nothing,
  // as in HF tokenizers.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // The string `id` decodes from (HF's id_to_token): its vocabulary entry, or its added token's
  // content, normalized when the token is matched normalized.
  std::string token(int32_t id) const;
  int32_t token_id(std::string_view token) const;  // -1 when not in the vocabulary

  int32_t vocab_size() const;  // 1 + the largest id of the vocabulary and the added tokens
  int32_t bos_id() const;      // -1 when there is none
  int32_t eos_id() const;
  int32_t unk_id() const;
  const std::string& path() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Whether `path` is a tokenizer.json (by name, or by content starting with '{').
bool is_hf_tokenizer_file(const std::string& path);

}  // namespace longtrain::data
