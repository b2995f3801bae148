#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <atomic>
#include <filesystem>
#include <functional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "data/documents.h"
#include "data/unicode.h"
#include "runtime/error.h"

namespace longtrain::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---------------------------------------------------------------------------------------------
// UTF-8

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The length of the well-formed UTF-8 sequence at s[i], or 0 with `bad` set to the length of the
// maximal ill-formed prefix there (Unicode's "maximal subpart", what Rust's from_utf8_lossy and
// Python's errors="replace" replace by one U+FFFD each).
size_t utf8_sequence(std::string_view s, size_t i, size_t& bad) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) need = 2, lo = 0xA0;
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
  else if (c == 0xED) need = 2, hi = 0x9F;
  else if (c == 0xF0) need = 3, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else if (c == 0xF4) need = 3, hi = 0x8F;
  else {
    bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    const unsigned char first_lo = k == 1 ? lo : 0x80, first_hi = k == 1 ? hi : 0xBF;
    if (i + k >= s.size() || b(k) < first_lo || b(k) > first_hi) {
      bad = k;
      return 0;
    }
  }
  return need + 1;
}

// `s` with every ill-formed sequence replaced by U+FFFD.
std::string lossy_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    const size_t n = utf8_sequence(s, i, bad);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t bad = 0;
    const size_t n = utf8_sequence(s, i, bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

size_t utf8_char_len(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xF0) return 4;
  if (c >= 0xE0) return 3;
  return 2;
}

// The code point of the n-byte UTF-8 sequence at s[i] (well-formed).
uint32_t code_point_at(std::string_view s, size_t i, size_t n) {
  const unsigned char c0 = static_cast<unsigned char>(s[i]);
  uint32_t cp = n == 1 ? c0 : n == 2 ? (c0 & 0x1F) : n == 3 ? (c0 & 0x0F) : (c0 & 0x07);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// ---------------------------------------------------------------------------------------------
// GPT-2's byte-level alphabet: bytes 33-126, 161-172 and 174-255 stand for themselves; the other
// 68 bytes take code points 256, 257, ... in byte order, so every byte is a printable character.

struct ByteLevelAlphabet {
  std::string byte_text[256];
  std::unordered_map<uint32_t, uint8_t> byte_of;
  ByteLevelAlphabet() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool self = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = self ? b : next++;
      append_utf8(byte_text[b], cp);
      byte_of[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// GPT-2's pre-tokenization pattern, which ByteLevel(use_regex = true) splits with.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// A PCRE2 pattern (UTF, Unicode properties for \s \w \d and POSIX classes, JIT when available).

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                          &error, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      LT_FAIL("{}: the regex {} does not compile (PCRE2, at offset {}): {}", where, json(pattern).dump(), offset,
              reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // an interpreter fallback when JIT is unavailable
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [start, end) of `s`, left to right; empty matches are skipped (the
  // search goes on one character later), as Rust's find_iter yields them and HF drops them.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    LT_CHECK(md, "out of memory for a regex match");
    size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, PCRE2_NO_UTF_CHECK,
                                 md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof message);
        LT_FAIL("regex match failed: {}", reinterpret_cast<const char*>(message));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t start = ov[0], end = ov[1];
      if (end == start) {
        if (start >= s.size()) break;
        at = start + utf8_char_len(static_cast<unsigned char>(s[start]));
        continue;
      }
      out.emplace_back(start, end);
      at = end;
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// A pattern: a literal string or a regex ({"String": ...} or {"Regex": ...} in tokenizer.json).
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    if (regex) return regex->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal.empty()) return out;
    for (size_t at = s.find(literal); at != std::string_view::npos; at = s.find(literal, at + literal.size()))
      out.emplace_back(at, at + literal.size());
    return out;
  }
};

Pattern parse_pattern(const json& j, const std::string& where) {
  LT_CHECK(j.is_object() && j.size() == 1 && (j.contains("String") || j.contains("Regex")),
           "{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, got {}", where, j.dump());
  Pattern p;
  if (j.contains("String")) {
    LT_CHECK(j["String"].is_string(), "{}: pattern String must be a string", where);
    p.literal = j["String"].get<std::string>();
  } else {
    LT_CHECK(j["Regex"].is_string(), "{}: pattern Regex must be a string", where);
    p.regex = std::make_shared<Regex>(j["Regex"].get<std::string>(), where);
  }
  return p;
}

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// HF's split with a delimiter behavior: `matches` cut `s` into spans (matched or not), which the
// behavior keeps, drops or merges; empty spans are dropped.
std::vector<std::string> split_by(std::string_view s, const std::vector<std::pair<size_t, size_t>>& matches,
                                  Behavior behavior, bool invert) {
  struct Span {
    size_t start, end;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (const auto& [a, b] : matches) {
    if (a > prev) spans.push_back({prev, a, invert});
    spans.push_back({a, b, !invert});
    prev = b;
  }
  if (prev < s.size()) spans.push_back({prev, s.size(), invert});

  std::vector<Span> kept;
  switch (behavior) {
    case Behavior::removed:
      for (const Span& sp : spans)
        if (!sp.match) kept.push_back(sp);
      break;
    case Behavior::isolated:
      kept = spans;
      break;
    case Behavior::merged_with_previous: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.match && !previous_match && !kept.empty()) kept.back().end = sp.end;
        else kept.push_back(sp);
        previous_match = sp.match;
      }
      break;
    }
    case Behavior::merged_with_next: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !kept.empty()) kept.back().start = it->start;
        else kept.push_back(*it);
        previous_match = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
    case Behavior::contiguous: {
      bool previous_match = false;
      bool first = true;
      for (const Span& sp : spans) {
        if (!first && sp.match == previous_match) kept.back().end = sp.end;
        else kept.push_back(sp);
        previous_match = sp.match;
        first = false;
      }
      break;
    }
  }
  std::vector<std::string> out;
  for (const Span& sp : kept)
    if (sp.end > sp.start) out.emplace_back(s.substr(sp.start, sp.end - sp.start));
  return out;
}

// A Replace normalizer's or decoder's step: every match of the pattern becomes the content.
struct Replace {
  Pattern pattern;
  std::string content;
  void apply(std::string& s) const {
    std::string out;
    size_t prev = 0;
    for (const auto& [a, b] : pattern.find_all(s)) {
      out.append(s, prev, a - prev);
      out += content;
      prev = b;
    }
    out.append(s, prev, std::string::npos);
    s = std::move(out);
  }
};

Replace parse_replace(const json& j, const std::string& where) {
  LT_CHECK(j.contains("pattern") && j.contains("content") && j["content"].is_string(),
           "{}: Replace needs \"pattern\" and \"content\"", where);
  return {parse_pattern(j["pattern"], where + ".pattern"), j["content"].get<std::string>()};
}

Behavior parse_behavior(const json& j, const std::string& where) {
  const std::string b = j.is_string() ? j.get<std::string>() : std::string();
  if (b == "Removed") return Behavior::removed;
  if (b == "Isolated") return Behavior::isolated;
  if (b == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (b == "MergedWithNext") return Behavior::merged_with_next;
  if (b == "Contiguous") return Behavior::contiguous;
  LT_FAIL("{}: behavior {} is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous", where,
          j.dump());
}

// Components nest (Sequence of Sequence ...): a bound on the depth keeps a hostile file from
// exhausting the stack.
struct NestingGuard {
  static inline thread_local int depth = 0;
  explicit NestingGuard(const std::string& where) {
    LT_CHECK(++depth <= 32, "{}: components nested more than 32 deep", where);
  }
  ~NestingGuard() { --depth; }
  NestingGuard(const NestingGuard&) = delete;
  NestingGuard& operator=(const NestingGuard&) = delete;
};

std::string type_of(const json& j, const std::string& where) {
  LT_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), "{}: expected an object with a \"type\", got {}",
           where, j.dump().substr(0, 200));
  return j["type"].get<std::string>();
}

bool flag(const json& j, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  LT_CHECK(j[key].is_boolean(), "\"{}\" must be true or false, got {}", key, j[key].dump());
  return j[key].get<bool>();
}

using Normalizer = std::function<void(std::string&)>;
using PreTokenizer = std::function<void(std::vector<std::string>&)>;
using Decoder = std::function<void(std::vector<std::string>&)>;

// Applies f to every piece, replacing it by the pieces f returns.
template <class F> void each_piece(std::vector<std::string>& pieces, F&& f) {
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (const std::string& p : pieces)
    for (std::string& q : f(p)) out.push_back(std::move(q));
  pieces = std::move(out);
}

Normalizer parse_normalizer(const json& j, const std::string& where) {
  const NestingGuard guard(where);
  if (j.is_null()) return {};
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    LT_CHECK(j.contains("normalizers") && j["normalizers"].is_array(), "{}: Sequence needs a \"normalizers\" list",
             where);
    std::vector<Normalizer> steps;
    for (size_t i = 0; i < j["normalizers"].size(); ++i)
      if (Normalizer n = parse_normalizer(j["normalizers"][i], fmt::format("{}.normalizers[{}]", where, i))) steps.push_back(n);
    return [steps](std::string& s) {
      for (const Normalizer& n : steps) n(s);
    };
  }
  if (type == "Replace") {
    return [r = parse_replace(j, where)](std::string& s) { r.apply(s); };
  }
  if (type == "Prepend") {
    LT_CHECK(j.contains("prepend") && j["prepend"].is_string(), "{}: Prepend needs \"prepend\"", where);
    const std::string prepend = j["prepend"].get<std::string>();
    return [prepend](std::string& s) {
      if (!s.empty()) s = prepend + s;
    };
  }
  if (type == "Strip") {
    // HF strips what Rust's char::is_whitespace calls whitespace: all of Unicode's White_Space.
    const bool left = flag(j, "strip_left", true), right = flag(j, "strip_right", true);
    return [left, right](std::string& s) {
      size_t a = 0, b = s.size();
      while (left && a < b) {
        const size_t n = std::min(utf8_char_len(static_cast<unsigned char>(s[a])), b - a);
        if (!is_unicode_whitespace(code_point_at(s, a, n))) break;
        a += n;
      }
      while (right && b > a) {
        size_t start = b - 1;
        while (start > a && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        if (!is_unicode_whitespace(code_point_at(s, start, b - start))) break;
        b = start;
      }
      s = s.substr(a, b - a);
    };
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    const UnicodeForm form = type == "NFC"    ? UnicodeForm::nfc
                             : type == "NFD"  ? UnicodeForm::nfd
                             : type == "NFKC" ? UnicodeForm::nfkc
                                              : UnicodeForm::nfkd;
    return [form](std::string& s) { s = unicode_normalize(s, form); };
  }
  if (type == "Lowercase") return [](std::string& s) { s = lowercase_code_points(s); };
  if (type == "StripAccents") return [](std::string& s) { s = remove_combining_marks(s); };
  LT_FAIL("{}: normalizer type \"{}\" is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, "
          "StripAccents, Replace, Prepend, Strip)", where, type);
}

PreTokenizer byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex) {
  std::shared_ptr<Regex> gpt2 = use_regex ? std::make_shared<Regex>(kGpt2Pattern, "ByteLevel") : nullptr;
  return [add_prefix_space, gpt2](std::vector<std::string>& pieces) {
    const ByteLevelAlphabet& alphabet = byte_level();
    each_piece(pieces, [&](const std::string& p) {
      std::string s = p;
      if (add_prefix_space && !s.empty() && s[0] != ' ') s.insert(s.begin(), ' ');
      std::vector<std::string> parts =
          gpt2 ? split_by(s, gpt2->find_all(s), Behavior::isolated, false) : std::vector<std::string>{s};
      for (std::string& part : parts) {
        std::string mapped;
        mapped.reserve(part.size() * 2);
        for (unsigned char c : part) mapped += alphabet.byte_text[c];
        part = std::move(mapped);
      }
      return parts;
    });
  };
}

PreTokenizer parse_pre_tokenizer(const json& j, const std::string& where) {
  const NestingGuard guard(where);
  if (j.is_null()) return {};
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    LT_CHECK(j.contains("pretokenizers") && j["pretokenizers"].is_array(),
             "{}: Sequence needs a \"pretokenizers\" list", where);
    std::vector<PreTokenizer> steps;
    for (size_t i = 0; i < j["pretokenizers"].size(); ++i)
      if (PreTokenizer p = parse_pre_tokenizer(j["pretokenizers"][i], fmt::format("{}.pretokenizers[{}]", where, i)))
        steps.push_back(p);
    return [steps](std::vector<std::string>& pieces) {
      for (const PreTokenizer& p : steps) p(pieces);
    };
  }
  if (type == "Split") {
    LT_CHECK(j.contains("pattern") && j.contains("behavior"), "{}: Split needs \"pattern\" and \"behavior\"", where);
    const Pattern p = parse_pattern(j["pattern"], where + ".pattern");
    const Behavior behavior = parse_behavior(j["behavior"], where + ".behavior");
    const bool invert = flag(j, "invert", false);
    return [p, behavior, invert](std::vector<std::string>& pieces) {
      each_piece(pieces, [&](const std::string& s) { return split_by(s, p.find_all(s), behavior, invert); });
    };
  }
  if (type == "ByteLevel") return byte_level_pre_tokenizer(flag(j, "add_prefix_space", true), flag(j, "use_regex", true));
  if (type == "Digits") {
    const bool individual = flag(j, "individual_digits", false);
    auto digits = std::make_shared<Regex>(R"(\p{N})", where);
    return [digits, individual](std::vector<std::string>& pieces) {
      each_piece(pieces, [&](const std::string& s) {
        return split_by(s, digits->find_all(s), individual ? Behavior::isolated : Behavior::contiguous, false);
      });
    };
  }
  LT_FAIL("{}: pre-tokenizer type \"{}\" is not supported (supported: Sequence, Split, ByteLevel, Digits)", where,
          type);
}

Decoder parse_decoder(const json& j, const std::string& where) {
  const NestingGuard guard(where);
  if (j.is_null()) return {};
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    LT_CHECK(j.contains("decoders") && j["decoders"].is_array(), "{}: Sequence needs a \"decoders\" list", where);
    std::vector<Decoder> steps;
    for (size_t i = 0; i < j["decoders"].size(); ++i)
      if (Decoder d = parse_decoder(j["decoders"][i], fmt::format("{}.decoders[{}]", where, i))) steps.push_back(d);
    return [steps](std::vector<std::string>& tokens) {
      for (const Decoder& d : steps) d(tokens);
    };
  }
  if (type == "ByteLevel") {
    // Each token whose characters are all in the byte-level alphabet becomes its bytes; any other
    // token (an added token written as text) its own UTF-8; the whole is read as lossy UTF-8.
    return [](std::vector<std::string>& tokens) {
      const ByteLevelAlphabet& alphabet = byte_level();
      std::string bytes;
      for (const std::string& t : tokens) {
        std::string mine;
        bool all = true;
        for (size_t i = 0; i < t.size() && all;) {
          size_t bad = 0;
          const size_t n = utf8_sequence(t, i, bad);
          uint32_t cp = 0;
          if (n == 0) {
            all = false;
            break;
          }
          const unsigned char c0 = static_cast<unsigned char>(t[i]);
          cp = n == 1 ? c0 : n == 2 ? (c0 & 0x1F) : n == 3 ? (c0 & 0x0F) : (c0 & 0x07);
          for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(t[i + k]) & 0x3F);
          auto it = alphabet.byte_of.find(cp);
          if (it == alphabet.byte_of.end()) all = false;
          else mine += static_cast<char>(it->second);
          i += n;
        }
        bytes += all ? mine : t;
      }
      tokens.assign(1, lossy_utf8(bytes));
    };
  }
  if (type == "Replace") {
    return [r = parse_replace(j, where)](std::vector<std::string>& tokens) {
      for (std::string& s : tokens) r.apply(s);
    };
  }
  if (type == "ByteFallback") {
    // Runs of <0xXX> tokens become their bytes when those are UTF-8, else one U+FFFD per byte.
    return [](std::vector<std::string>& tokens) {
      std::vector<std::string> out;
      std::string run;
      size_t run_tokens = 0;
      auto flush = [&] {
        if (run_tokens == 0) return;
        if (valid_utf8(run)) out.push_back(run);
        else
          for (size_t i = 0; i < run_tokens; ++i) out.push_back("\xEF\xBF\xBD");
        run.clear();
        run_tokens = 0;
      };
      for (const std::string& t : tokens) {
        unsigned value = 0;
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
            std::sscanf(t.c_str() + 3, "%2x", &value) == 1 && std::isxdigit(static_cast<unsigned char>(t[3])) &&
            std::isxdigit(static_cast<unsigned char>(t[4]))) {
          run += static_cast<char>(value);
          ++run_tokens;
        } else {
          flush();
          out.push_back(t);
        }
      }
      flush();
      tokens = std::move(out);
    };
  }
  if (type == "Fuse") {
    return [](std::vector<std::string>& tokens) {
      std::string all;
      for (const std::string& t : tokens) all += t;
      tokens.assign(1, all);
    };
  }
  if (type == "Strip") {
    LT_CHECK(j.contains("content") && j["content"].is_string(), "{}: Strip needs \"content\"", where);
    const std::string content = j["content"].get<std::string>();
    const int64_t start = j.value("start", 0), stop = j.value("stop", 0);
    return [content, start, stop](std::vector<std::string>& tokens) {
      for (std::string& t : tokens) {
        int64_t a = 0, b = 0;
        while (a < start && t.compare(0, content.size(), content) == 0) t.erase(0, content.size()), ++a;
        while (b < stop && t.size() >= content.size() && !content.empty() &&
               t.compare(t.size() - content.size(), content.size(), content) == 0)
          t.erase(t.size() - content.size()), ++b;
      }
    };
  }
  LT_FAIL("{}: decoder type \"{}\" is not supported (supported: Sequence, ByteLevel, Replace, ByteFallback, Fuse, "
          "Strip)", where, type);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct HfTokenizer::Impl {
  struct AddedToken {
    int32_t id = 0;
    std::string content;
    bool single_word = false, lstrip = false, rstrip = false, special = false;
    bool normalized = false;  // matched on the normalized text (after the raw-matched ones)
    std::string pattern;      // what is matched: content, normalized when `normalized`
  };

  std::string path;
  uint64_t instance = 0;  // keys the per-thread word cache
  // Model (BPE).
  std::unordered_map<std::string, int32_t> vocab;        // the model's (BPE looks only here)
  std::unordered_map<std::string, int32_t> added_ids;    // the added tokens'
  // As HF's Tokenizer::id_to_token (what decode reads): an added token's content, normalized when it
  // is matched normalized (HF's AddedVocabulary::simple_id_to_token), else the vocabulary entry.
  std::vector<std::string> id_to_token;
  std::vector<std::string> model_token;  // the model's vocabulary entry, what BPE's tokens are named
  // Whether decode(skip_special_tokens) drops the id: as HF, whether the string it decodes from is
  // the content of a special token (so a special token that normalization changes is kept).
  std::vector<char> skipped_as_special;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged id)
  int32_t unk = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::string prefix, suffix;
  // Pipeline.
  std::vector<AddedToken> added;
  // Indices into `added` by the first byte of their pattern, longest first: those matched on the raw
  // text, and those matched on the normalized text (HF's two passes).
  using AddedIndex = std::vector<std::vector<size_t>>;
  AddedIndex raw_added = AddedIndex(256), normalized_added = AddedIndex(256);
  bool any_normalized_added = false;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  Decoder decoder;
  std::vector<int32_t> before, after;  // the post-processor's tokens around a single sequence
  int32_t bos = -1, eos = -1;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  int32_t model_lookup(const std::string& s) const {
    auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  }
  // As HF's token_to_id: the added tokens first, then the model's vocabulary.
  int32_t lookup(const std::string& s) const {
    auto it = added_ids.find(s);
    return it != added_ids.end() ? it->second : model_lookup(s);
  }

  void load(const json& root);
  void parse_post_processor(const json& j, const std::string& where);
  void encode_word(const std::string& word, std::vector<int32_t>& out) const;
  void encode_word_cached(const std::string& word, std::vector<int32_t>& out) const;
  // The text split around added tokens: (text, -1) segments, and (span, id) ones: the added token's
  // match with the whitespace its lstrip/rstrip took.
  std::vector<std::pair<std::string_view, int32_t>> split_added(std::string_view text, const AddedIndex& index) const;
  // Pre-tokenizer and BPE; `tokens`, when given, gets each new id's token string.
  void encode_pieces(std::string text, std::vector<int32_t>& ids, std::vector<std::string>* tokens) const;
  void encode_text(std::string_view text, std::vector<int32_t>& ids, std::vector<std::string>* tokens) const;
};

void HfTokenizer::Impl::parse_post_processor(const json& j, const std::string& where) {
  const NestingGuard guard(where);
  if (j.is_null()) return;
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    LT_CHECK(j.contains("processors") && j["processors"].is_array(), "{}: Sequence needs a \"processors\" list",
             where);
    for (size_t i = 0; i < j["processors"].size(); ++i)
      parse_post_processor(j["processors"][i], fmt::format("{}.processors[{}]", where, i));
    return;
  }
  if (type == "ByteLevel") return;  // offsets only
  if (type == "TemplateProcessing") {
    LT_CHECK(j.contains("single") && j["single"].is_array() && j.contains("special_tokens") &&
                 j["special_tokens"].is_object(),
             "{}: TemplateProcessing needs \"single\" and \"special_tokens\"", where);
    const json& specials = j["special_tokens"];
    bool seen_sequence = false;
    for (const json& piece : j["single"]) {
      if (piece.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      LT_CHECK(piece.contains("SpecialToken") && piece["SpecialToken"].contains("id"),
               "{}: a template piece must be a Sequence or a SpecialToken, got {}", where, piece.dump());
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      LT_CHECK(specials.contains(name) && specials[name].contains("ids") && specials[name]["ids"].is_array(),
               "{}: the template's special token \"{}\" is not in special_tokens", where, name);
      for (const json& id : specials[name]["ids"]) {
        LT_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                     id.get<int64_t>() < static_cast<int64_t>(id_to_token.size()),
                 "{}: special token \"{}\" has id {}, outside the vocabulary", where, name, id.dump());
        (seen_sequence ? after : before).push_back(id.get<int32_t>());
      }
    }
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto id_of = [&](const char* key) {
      LT_CHECK(j.contains(key) && j[key].is_array() && j[key].size() == 2 && j[key][1].is_number_integer(),
               "{}: {} needs \"{}\": [token, id]", where, type, key);
      return j[key][1].get<int32_t>();
    };
    before.push_back(id_of("cls"));
    after.push_back(id_of("sep"));
    return;
  }
  LT_FAIL("{}: post-processor type \"{}\" is not supported (supported: TemplateProcessing, RobertaProcessing, "
          "BertProcessing, ByteLevel, Sequence)", where, type);
}

void HfTokenizer::Impl::load(const json& root) {
  LT_CHECK(root.is_object(), "tokenizer '{}' is not a tokenizer.json: the top level must be an object", path);
  LT_CHECK(root.contains("model") && root["model"].is_object(), "tokenizer '{}' has no \"model\"", path);
  const json& model = root["model"];
  const std::string type = model.value("type", std::string("BPE"));
  LT_CHECK(type == "BPE", "tokenizer '{}': model type \"{}\" is not supported (byte-level BPE tokenizers only; a "
           "SentencePiece .model is read as such)", path, type);
  LT_CHECK(model.contains("vocab") && model["vocab"].is_object(), "tokenizer '{}': model.vocab must be an object of "
           "token: id", path);
  LT_CHECK(model.contains("merges") && model["merges"].is_array(), "tokenizer '{}': model.merges must be a list",
           path);
  if (model.contains("dropout") && !model["dropout"].is_null())
    LT_CHECK(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0,
             "tokenizer '{}': model.dropout {} would make encoding random; set it to null", path,
             model["dropout"].dump());

  int64_t max_id = -1;
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    LT_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 &&
                 it.value().get<int64_t>() < (int64_t{1} << 31) - 1,
             "tokenizer '{}': model.vocab[{}] = {} is not a token id", path, json(it.key()).dump(), it.value().dump());
    vocab.emplace(it.key(), it.value().get<int32_t>());
    max_id = std::max<int64_t>(max_id, it.value().get<int64_t>());
  }
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    LT_CHECK(root["added_tokens"].is_array(), "tokenizer '{}': added_tokens must be a list", path);
    for (size_t i = 0; i < root["added_tokens"].size(); ++i) {
      const json& t = root["added_tokens"][i];
      LT_CHECK(t.is_object() && t.contains("id") && t["id"].is_number_integer() && t["id"].get<int64_t>() >= 0 &&
                   t["id"].get<int64_t>() < (int64_t{1} << 31) - 1 && t.contains("content") && t["content"].is_string() &&
                   !t["content"].get<std::string>().empty(),
               "tokenizer '{}': added_tokens[{}] needs an integer \"id\" and a non-empty \"content\"", path, i);
      AddedToken a;
      a.id = t["id"].get<int32_t>();
      a.content = t["content"].get<std::string>();
      a.single_word = flag(t, "single_word", false);
      a.lstrip = flag(t, "lstrip", false);
      a.rstrip = flag(t, "rstrip", false);
      a.special = flag(t, "special", false);
      a.normalized = flag(t, "normalized", false);
      max_id = std::max<int64_t>(max_id, a.id);
      added.push_back(a);
    }
  }
  LT_CHECK(max_id >= 0, "tokenizer '{}' has an empty vocabulary", path);
  id_to_token.assign(static_cast<size_t>(max_id) + 1, std::string());
  std::vector<char> has(id_to_token.size(), 0);
  for (const auto& [token, id] : vocab) {
    LT_CHECK(!has[static_cast<size_t>(id)], "tokenizer '{}': id {} is given to two tokens ({} and {})", path, id,
             json(id_to_token[static_cast<size_t>(id)]).dump(), json(token).dump());
    id_to_token[static_cast<size_t>(id)] = token;
    has[static_cast<size_t>(id)] = 1;
  }
  model_token = id_to_token;
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& a = added[i];
    const size_t id = static_cast<size_t>(a.id);
    // An added token may repeat a vocabulary entry with its id (special tokens usually do).
    LT_CHECK(!has[id] || id_to_token[id] == a.content, "tokenizer '{}': added token {} has id {}, which the "
             "vocabulary gives to {}", path, json(a.content).dump(), id, json(id_to_token[id]).dump());
    id_to_token[id] = a.content;
    has[id] = 1;
    added_ids.emplace(a.content, a.id);
  }

  const auto text_field = [&](const char* key) {
    if (!model.contains(key) || model[key].is_null()) return std::string();
    LT_CHECK(model[key].is_string(), "tokenizer '{}': model.{} must be a string or null", path, key);
    return model[key].get<std::string>();
  };
  prefix = text_field("continuing_subword_prefix");
  suffix = text_field("end_of_word_suffix");
  const std::string unk_token = text_field("unk_token");
  if (!unk_token.empty()) {
    unk = model_lookup(unk_token);
    LT_CHECK(unk >= 0, "tokenizer '{}': model.unk_token {} is not in the vocabulary", path, json(unk_token).dump());
  }
  fuse_unk = flag(model, "fuse_unk", false);
  byte_fallback = flag(model, "byte_fallback", false);
  ignore_merges = flag(model, "ignore_merges", false);

  const json& list = model["merges"];
  for (size_t rank = 0; rank < list.size(); ++rank) {
    const json& m = list[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      LT_CHECK(space != std::string::npos && space > 0 && space + 1 < s.size() &&
                   s.find(' ', space + 1) == std::string::npos,
               "tokenizer '{}': model.merges[{}] = {} is not two tokens separated by one space", path, rank, m.dump());
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else {
      LT_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
               "tokenizer '{}': model.merges[{}] = {} is not a pair of tokens", path, rank, m.dump());
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    const int32_t a = model_lookup(left), b = model_lookup(right);
    const std::string merged =
        left + (!prefix.empty() && right.compare(0, prefix.size(), prefix) == 0 ? right.substr(prefix.size()) : right);
    const int32_t c = model_lookup(merged);
    LT_CHECK(a >= 0 && b >= 0 && c >= 0, "tokenizer '{}': model.merges[{}] ({} + {}) names a token that is not in "
             "the vocabulary ({})", path, rank, json(left).dump(), json(right).dump(),
             json(a < 0 ? left : b < 0 ? right : merged).dump());
    merges.emplace(pair_key(a, b), std::make_pair(static_cast<int32_t>(rank), c));  // the first rank wins
  }

  normalizer = parse_normalizer(root.value("normalizer", json()), "normalizer");
  // Added tokens matched on normalized text are looked for as the normalizer writes them.
  for (size_t i = 0; i < added.size(); ++i) {
    AddedToken& a = added[i];
    a.pattern = a.content;
    if (a.normalized && normalizer) {
      normalizer(a.pattern);
      // HF decodes such a token from its normalized form (normalized_cache, tokenizers >= 0.23).
      id_to_token[static_cast<size_t>(a.id)] = a.pattern;
    }
    if (a.pattern.empty()) continue;  // normalized away: it can match nothing
    (a.normalized ? normalized_added : raw_added)[static_cast<unsigned char>(a.pattern[0])].push_back(i);
    any_normalized_added = any_normalized_added || a.normalized;
  }
  std::unordered_set<std::string> special_contents;
  for (const AddedToken& a : added)
    if (a.special) special_contents.insert(a.content);
  skipped_as_special.assign(id_to_token.size(), 0);
  for (size_t id = 0; id < id_to_token.size(); ++id)
    skipped_as_special[id] = special_contents.count(id_to_token[id]) > 0;
  // Longest first, so the first match at a position is the longest.
  for (AddedIndex* index : {&raw_added, &normalized_added})
    for (auto& list : *index)
      std::stable_sort(list.begin(), list.end(),
                       [&](size_t x, size_t y) { return added[x].pattern.size() > added[y].pattern.size(); });
  pre_tokenizer = parse_pre_tokenizer(root.value("pre_tokenizer", json()), "pre_tokenizer");
  decoder = parse_decoder(root.value("decoder", json()), "decoder");
  parse_post_processor(root.value("post_processor", json()), "post_processor");

  // BOS/EOS: the template's, else tokenizer_config.json's, else a special token of a usual name.
  if (before.size() == 1) bos = before[0];
  if (after.size() == 1) eos = after[0];
  const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
  if ((bos < 0 || eos < 0) && fs::exists(config)) {
    json c;
    try {
      c = json::parse(read_file(config.string()));
    } catch (const json::exception& e) {
      LT_FAIL("'{}' is not valid JSON: {}", config.string(), e.what());
    }
    auto named = [&](const char* key) -> int32_t {
      if (!c.is_object() || !c.contains(key)) return -1;
      const json& v = c[key];
      const std::string name = v.is_string() ? v.get<std::string>()
                               : v.is_object() && v.contains("content") && v["content"].is_string()
                                   ? v["content"].get<std::string>()
                                   : std::string();
      return name.empty() ? -1 : lookup(name);
    };
    if (bos < 0) bos = named("bos_token");
    if (eos < 0) eos = named("eos_token");
  }
  for (const AddedToken& a : added) {
    if (!a.special) continue;
    if (bos < 0 && (a.content == "<|begin_of_text|>" || a.content == "<s>" || a.content == "<bos>")) bos = a.id;
    if (eos < 0 && (a.content == "<|end_of_text|>" || a.content == "<|endoftext|>" || a.content == "</s>" ||
                    a.content == "<eos>"))
      eos = a.id;
  }
}

void HfTokenizer::Impl::encode_word(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    if (const int32_t id = model_lookup(word); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // The word's characters as symbols (with prefix/suffix, byte fallback or unk as configured).
  std::vector<int32_t> ids;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_char_len(static_cast<unsigned char>(word[i])), word.size() - i);
    std::string piece = word.substr(i, n);
    if (i > 0) piece = prefix + piece;
    if (i + n == word.size()) piece += suffix;
    int32_t id = model_lookup(piece);
    if (id >= 0) {
      ids.push_back(id);
    } else {
      bool done = false;
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (size_t k = 0; k < n; ++k) {
          const int32_t b = model_lookup(fmt::format("<0x{:02X}>", static_cast<unsigned char>(word[i + k])));
          if (b < 0) break;
          bytes.push_back(b);
        }
        if (bytes.size() == n) {
          ids.insert(ids.end(), bytes.begin(), bytes.end());
          done = true;
        }
      }
      if (!done && unk >= 0 && !(fuse_unk && !ids.empty() && ids.back() == unk)) ids.push_back(unk);
    }
    i += n;
  }
  if (ids.size() <= 1) {
    out.insert(out.end(), ids.begin(), ids.end());
    return;
  }
  // Merge the pair of lowest rank (leftmost among equals) until none is left, as HF's BPE does.
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    sym[i] = {ids[i], static_cast<int>(i) - 1, i + 1 < ids.size() ? static_cast<int>(i) + 1 : -1, true};
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto consider = [&](int pos) {
    if (pos < 0 || sym[static_cast<size_t>(pos)].next < 0) return;
    const int next = sym[static_cast<size_t>(pos)].next;
    auto it = merges.find(pair_key(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(next)].id));
    if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& s = sym[static_cast<size_t>(c.pos)];
    if (!s.alive || s.next < 0) continue;
    Symbol& right = sym[static_cast<size_t>(s.next)];
    auto it = merges.find(pair_key(s.id, right.id));
    if (it == merges.end() || it->second.second != c.merged || it->second.first != c.rank) continue;
    s.id = c.merged;
    right.alive = false;
    s.next = right.next;
    if (s.next >= 0) sym[static_cast<size_t>(s.next)].prev = c.pos;
    consider(s.prev);
    consider(c.pos);
  }
  for (int i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next) out.push_back(sym[static_cast<size_t>(i)].id);
}

void HfTokenizer::Impl::encode_word_cached(const std::string& word, std::vector<int32_t>& out) const {
  // Words repeat (Zipf): a per-thread cache of the last words seen saves most of the BPE work.
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<int32_t>> words;
  };
  thread_local Cache cache;
  if (word.size() > 64) return encode_word(word, out);
  if (cache.owner != instance || cache.words.size() > (size_t{1} << 16)) {
    cache.words.clear();
    cache.owner = instance;
  }
  auto it = cache.words.find(word);
  if (it == cache.words.end()) {
    std::vector<int32_t> ids;
    encode_word(word, ids);
    it = cache.words.emplace(word, std::move(ids)).first;
  }
  out.insert(out.end(), it->second.begin(), it->second.end());
}

std::vector<std::pair<std::string_view, int32_t>> HfTokenizer::Impl::split_added(std::string_view text,
                                                                                  const AddedIndex& index) const {
  std::vector<std::pair<std::string_view, int32_t>> out;
  size_t segment = 0, i = 0;
  // As HF (Rust's regex \w and \s, Unicode): the code point that ends text[..at], and the one that
  // starts text[at..], with their lengths.
  const auto length_before = [&](size_t at) {
    size_t k = at - 1;
    while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
    return at - k;
  };
  const auto length_at = [&](size_t at) {
    return std::min(utf8_char_len(static_cast<unsigned char>(text[at])), text.size() - at);
  };
  const auto before = [&](size_t at) { return code_point_at(text, at - length_before(at), length_before(at)); };
  const auto after = [&](size_t at) { return code_point_at(text, at, length_at(at)); };
  while (i < text.size()) {
    const std::vector<size_t>& candidates = index[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (size_t k : candidates) {
      const std::string& c = added[k].pattern;
      if (text.compare(i, c.size(), c) == 0) {
        hit = &added[k];
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + hit->pattern.size();
    if (hit->single_word) {
      const bool left_ok = start == 0 || !is_unicode_word_char(before(start));
      const bool right_ok = stop == text.size() || !is_unicode_word_char(after(stop));
      if (!left_ok || !right_ok) {
        i = stop;  // the match is skipped whole, as the automaton moves past it
        continue;
      }
    }
    if (hit->lstrip)
      while (start > segment && is_unicode_whitespace(before(start))) start -= length_before(start);
    if (hit->rstrip)
      while (stop < text.size() && is_unicode_whitespace(after(stop))) stop += length_at(stop);
    if (start > segment) out.emplace_back(text.substr(segment, start - segment), -1);
    out.emplace_back(text.substr(start, stop - start), hit->id);
    segment = i = stop;
  }
  if (segment < text.size()) out.emplace_back(text.substr(segment), -1);
  return out;
}

void HfTokenizer::Impl::encode_pieces(std::string text, std::vector<int32_t>& ids,
                                      std::vector<std::string>* tokens) const {
  std::vector<std::string> pieces{std::move(text)};
  if (pre_tokenizer) pre_tokenizer(pieces);
  const size_t first = ids.size();
  for (const std::string& p : pieces)
    if (!p.empty()) encode_word_cached(p, ids);
  if (tokens)
    for (size_t k = first; k < ids.size(); ++k) tokens->push_back(model_token[static_cast<size_t>(ids[k])]);
}

void HfTokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& ids,
                                    std::vector<std::string>* tokens) const {
  // As HF: the added tokens matched on raw text split it first; each piece between them is
  // normalized, then split by the added tokens matched on normalized text. An added token's string
  // is the text it was matched in, as HF's AddedVocabulary::split_with_indices names it: the raw
  // span or the normalized one, with the whitespace lstrip/rstrip took.
  const auto added_token = [&](std::string_view span, int32_t id) {
    ids.push_back(id);
    if (tokens) tokens->emplace_back(span);
  };
  for (const auto& [segment, id] : split_added(text, raw_added)) {
    if (id >= 0) {
      added_token(segment, id);
      continue;
    }
    std::string s(segment);
    if (normalizer) normalizer(s);
    if (s.empty()) continue;
    if (!any_normalized_added) {
      encode_pieces(std::move(s), ids, tokens);
      continue;
    }
    for (const auto& [piece, added_id] : split_added(s, normalized_added)) {
      if (added_id >= 0) added_token(piece, added_id);
      else encode_pieces(std::string(piece), ids, tokens);
    }
  }
}

// ---------------------------------------------------------------------------------------------

HfTokenizer::HfTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  static std::atomic<uint64_t> instances{0};
  impl_->path = path;
  impl_->instance = ++instances;
  LT_CHECK(fs::is_regular_file(path), "tokenizer '{}' does not exist", path);
  json root;
  try {
    root = json::parse(read_file(path));
  } catch (const json::exception& e) {
    LT_FAIL("tokenizer '{}' is not valid JSON: {}", path, e.what());
  }
  try {
    impl_->load(root);
  } catch (const json::exception& e) {
    // A field of an unexpected type that the checks above did not name.
    LT_FAIL("tokenizer '{}' is malformed: {}", path, e.what());
  } catch (const Error& e) {
    const std::string what = e.what();
    // Errors about one part name the part; say which file it is in.
    if (what.find(path) != std::string::npos) throw;
    LT_FAIL("tokenizer '{}': {}", path, what);
  }
}

HfTokenizer::~HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = impl_->before;
  if (valid_utf8(text)) impl_->encode_text(text, ids, nullptr);
  else impl_->encode_text(lossy_utf8(text), ids, nullptr);
  if (add_special_tokens) ids.insert(ids.end(), impl_->after.begin(), impl_->after.end());
  return ids;
}

std::vector<std::string> HfTokenizer::encode_tokens(std::string_view text) const {
  std::vector<int32_t> ids;
  std::vector<std::string> out;
  if (valid_utf8(text)) impl_->encode_text(text, ids, &out);
  else impl_->encode_text(lossy_utf8(text), ids, &out);
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  for (int32_t id : ids) {
    // As HF tokenizers: an id with no token (a model's padded embedding rows) decodes to nothing.
    if (id < 0 || id >= vocab_size() || impl_->id_to_token[static_cast<size_t>(id)].empty()) continue;
    if (skip_special_tokens && impl_->skipped_as_special[static_cast<size_t>(id)]) continue;
    tokens.push_back(impl_->id_to_token[static_cast<size_t>(id)]);
  }
  if (impl_->decoder) impl_->decoder(tokens);
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

std::string HfTokenizer::token(int32_t id) const {
  LT_CHECK(id >= 0 && id < vocab_size(), "tokenizer '{}': id {} is outside the vocabulary [0, {})", impl_->path, id,
           vocab_size());
  return impl_->id_to_token[static_cast<size_t>(id)];
}

int32_t HfTokenizer::token_id(std::string_view token) const { return impl_->lookup(std::string(token)); }
int32_t HfTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }
int32_t HfTokenizer::bos_id() const { return impl_->bos; }
int32_t HfTokenizer::eos_id() const { return impl_->eos; }
int32_t HfTokenizer::unk_id() const { return impl_->unk; }
const std::string& HfTokenizer::path() const { return impl_->path; }

bool is_hf_tokenizer_file(const std::string& path) {
  if (fs::path(path).extension() == ".json") return true;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  int c = 0;
  while ((c = std::fgetc(f)) != EOF && (c == ' ' || c == '\n' || c == '\r' || c == '\t')) {
  }
  std::fclose(f);
  return c == '{';
}

}  // namespace longtrain::data
