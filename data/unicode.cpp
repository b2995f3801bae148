#include "data/unicode.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>

#include <algorithm>

#include "runtime/error.h"

namespace longtrain::data {

namespace {

// ICU counts in int32_t: one text handed to it must stay below 2 GiB (UTF-16 doubles ASCII's size).
void check_size(std::string_view s) {
  LT_CHECK(s.size() < (size_t{1} << 30), "a text of {} bytes is too long for one Unicode normalization (at most 1 GiB "
           "between two added tokens); split the document", s.size());
}

bool all_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// UTF-8 -> UTF-16, every ill-formed sequence read as U+FFFD.
std::u16string to_utf16(std::string_view s) {
  std::u16string out(s.size(), u'\0');  // never more UTF-16 units than UTF-8 bytes
  int32_t length = 0;
  UErrorCode error = U_ZERO_ERROR;
  u_strFromUTF8WithSub(out.data(), static_cast<int32_t>(out.size()), &length, s.data(), static_cast<int32_t>(s.size()),
                       0xFFFD, nullptr, &error);
  LT_CHECK(U_SUCCESS(error), "could not read text as UTF-8 for Unicode normalization: {}", u_errorName(error));
  out.resize(static_cast<size_t>(length));
  return out;
}

void append_utf16_as_utf8(std::string& out, const char16_t* s, int32_t n) {
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(n) * 3);  // at most 3 UTF-8 bytes per UTF-16 unit
  int32_t length = 0;
  UErrorCode error = U_ZERO_ERROR;
  u_strToUTF8WithSub(out.data() + at, static_cast<int32_t>(out.size() - at), &length, s, n, 0xFFFD, nullptr, &error);
  LT_CHECK(U_SUCCESS(error), "could not write normalized text as UTF-8: {}", u_errorName(error));
  out.resize(at + static_cast<size_t>(length));
}

const UNormalizer2* normalizer_of(UnicodeForm form) {
  UErrorCode error = U_ZERO_ERROR;
  const UNormalizer2* n = nullptr;
  switch (form) {
    case UnicodeForm::nfc: n = unorm2_getNFCInstance(&error); break;
    case UnicodeForm::nfd: n = unorm2_getNFDInstance(&error); break;
    case UnicodeForm::nfkc: n = unorm2_getNFKCInstance(&error); break;
    case UnicodeForm::nfkd: n = unorm2_getNFKDInstance(&error); break;
  }
  LT_CHECK(U_SUCCESS(error) && n, "ICU has no Unicode normalization data ({}); is libicu's data library installed?",
           u_errorName(error));
  return n;  // owned by ICU, shared and thread-safe
}

}  // namespace

std::string unicode_normalize(std::string_view text, UnicodeForm form) {
  if (all_ascii(text)) return std::string(text);  // ASCII is in every normalization form
  check_size(text);
  const UNormalizer2* n = normalizer_of(form);
  const std::u16string in = to_utf16(text);
  // Decomposition can grow the text (by up to 18x for one code point, UAX #15): start at 2x, retry
  // at the length ICU asks for.
  std::u16string out(in.size() * 2 + 16, u'\0');
  UErrorCode error = U_ZERO_ERROR;
  int32_t length = unorm2_normalize(n, in.data(), static_cast<int32_t>(in.size()), out.data(),
                                    static_cast<int32_t>(out.size()), &error);
  if (error == U_BUFFER_OVERFLOW_ERROR) {
    out.assign(static_cast<size_t>(length), u'\0');
    error = U_ZERO_ERROR;
    length = unorm2_normalize(n, in.data(), static_cast<int32_t>(in.size()), out.data(),
                              static_cast<int32_t>(out.size()), &error);
  }
  LT_CHECK(U_SUCCESS(error), "Unicode normalization failed: {}", u_errorName(error));
  std::string result;
  result.reserve(text.size() + text.size() / 4);
  append_utf16_as_utf8(result, out.data(), length);
  return result;
}

std::string lowercase_code_points(std::string_view text) {
  check_size(text);
  std::string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t size = static_cast<int32_t>(text.size());
  for (int32_t i = 0; i < size;) {
    if (s[i] < 0x80) {
      const char c = static_cast<char>(s[i++]);
      out += c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
      continue;
    }
    UChar32 cp = 0;
    U8_NEXT(s, i, size, cp);
    if (cp < 0) cp = 0xFFFD;
    char16_t one[2];
    int32_t n = 0;
    U16_APPEND_UNSAFE(one, n, cp);
    // One code point alone: no context, so none of the contextual mappings (final sigma) applies;
    // "root" keeps the language-specific ones (Turkish, Lithuanian) out whatever the default locale.
    char16_t lower[8];
    UErrorCode error = U_ZERO_ERROR;
    const int32_t m = u_strToLower(lower, 8, one, n, "root", &error);
    LT_CHECK(U_SUCCESS(error), "lowercasing U+{:04X} failed: {}", static_cast<uint32_t>(cp), u_errorName(error));
    append_utf16_as_utf8(out, lower, m);
  }
  return out;
}

std::string remove_combining_marks(std::string_view text) {
  check_size(text);
  std::string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t size = static_cast<int32_t>(text.size());
  for (int32_t i = 0; i < size;) {
    const int32_t start = i;
    UChar32 cp = 0;
    U8_NEXT(s, i, size, cp);
    if (cp < 0) {
      out += "\xEF\xBF\xBD";
      continue;
    }
    if ((U_GET_GC_MASK(cp) & U_GC_M_MASK) == 0)
      out.append(text.substr(static_cast<size_t>(start), static_cast<size_t>(i - start)));
  }
  return out;
}

bool is_unicode_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_unicode_word_char(uint32_t c) {
  const auto cp = static_cast<UChar32>(c);
  return u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) || (U_GET_GC_MASK(cp) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) ||
         u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL);
}

}  // namespace longtrain::data
