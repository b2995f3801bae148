// Unicode text operations that tokenizer.json normalizers need, over UTF-8, with ICU's tables (Debian:
// libicu-dev). Each one means what Hugging Face tokenizers (Rust) means by it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace longtrain::data {

enum class UnicodeForm { nfc, nfd, nfkc, nfkd };

// `text` in normalization form `form` (UAX #15). Ill-formed UTF-8 is read with U+FFFD in its place.
std::string unicode_normalize(std::string_view text, UnicodeForm form);

// Every code point replaced by its full lowercase mapping, one code point at a time and without
// context, as Rust's char::to_lowercase (what HF's Lowercase normalizer applies): U+0130 'İ' becomes
// "i̇" (two code points), and 'Σ' is always 'σ', never the final form 'ς' that a context-aware
// string lowercasing (Rust's str::to_lowercase, ICU's u_strToLower) writes at the end of a word.
std::string lowercase_code_points(std::string_view text);

// `text` without its combining marks (General_Category M: Mn, Mc, Me), what HF's StripAccents
// removes (after NFD, that drops the accents of precomposed letters).
std::string remove_combining_marks(std::string_view text);

// Rust's char::is_whitespace: the Unicode White_Space property.
bool is_unicode_whitespace(uint32_t code_point);

// A word character as Rust's regex \w reads it (Unicode): Alphabetic, marks (M), decimal digits (Nd),
// connector punctuation (Pc) and Join_Control. HF's single_word added tokens look at it.
bool is_unicode_word_char(uint32_t code_point);

}  // namespace longtrain::data
