// data/unicode.h: the Unicode operations of tokenizer.json's normalizers, on facts checked by hand
// against the Unicode Character Database (UnicodeData.txt decompositions, SpecialCasing.txt,
// PropList.txt White_Space) and UAX #15's examples. Parity with HF tokenizers itself is
// hf_tokenizer_test's fixture.
#include <gtest/gtest.h>

#include <string>

#include "data/unicode.h"

namespace longtrain::data {
namespace {

using F = UnicodeForm;

TEST(Unicode, NormalizationFormsComposeAndDecompose) {
  // Canonical: é composed <-> e + U+0301 COMBINING ACUTE ACCENT.
  EXPECT_EQ(unicode_normalize("cafe\u0301", F::nfc), "caf\u00e9");
  EXPECT_EQ(unicode_normalize("caf\u00e9", F::nfd), "cafe\u0301");
  // Singletons: U+212B ANGSTROM SIGN and U+2126 OHM SIGN are canonically Å and Ω (NFC changes them).
  EXPECT_EQ(unicode_normalize("\u212b \u2126", F::nfc), "\u00c5 \u03a9");
  // Compatibility: ligature ﬁ, full-width Ａ１, superscript ² only under NFKC/NFKD.
  EXPECT_EQ(unicode_normalize("\ufb01 \uff21\uff11 x\u00b2", F::nfc), "\ufb01 \uff21\uff11 x\u00b2");
  EXPECT_EQ(unicode_normalize("\ufb01 \uff21\uff11 x\u00b2", F::nfkc), "fi A1 x2");
  EXPECT_EQ(unicode_normalize("\ufb01 \u00e9", F::nfkd), "fi e\u0301");
  // Hangul: 한 is L + V + T jamo, recomposed by NFC.
  EXPECT_EQ(unicode_normalize("\ud55c", F::nfd), "\u1112\u1161\u11ab");
  EXPECT_EQ(unicode_normalize("\u1112\u1161\u11ab", F::nfc), "\ud55c");
  // Canonical ordering: dot below (ccc 220) before circumflex (ccc 230), then composition (UAX #15).
  EXPECT_EQ(unicode_normalize("a\u0302\u0323", F::nfd), "a\u0323\u0302");
  EXPECT_EQ(unicode_normalize("a\u0302\u0323", F::nfc), "\u1ead");
  // A 1 -> 18 code point expansion (U+FDFA), twice: longer than the first output buffer.
  const std::string salla = unicode_normalize("\ufdfa\ufdfa", F::nfkd);
  EXPECT_EQ(salla.substr(0, salla.size() / 2), salla.substr(salla.size() / 2));
  EXPECT_EQ(salla.substr(0, salla.size() / 2),
            "\u0635\u0644\u0649 \u0627\u0644\u0644\u0647 \u0639\u0644\u064a\u0647 \u0648\u0633\u0644\u0645");
  // ASCII is every form; ill-formed UTF-8 becomes U+FFFD.
  EXPECT_EQ(unicode_normalize("plain ASCII\n", F::nfkd), "plain ASCII\n");
  EXPECT_EQ(unicode_normalize("\xff\u00e9", F::nfd), "\ufffde\u0301");
}

TEST(Unicode, LowercaseMapsEachCodePointWithoutContext) {
  EXPECT_EQ(lowercase_code_points("ASCII Text 123"), "ascii text 123");
  // Capital sigma is σ everywhere, also at the end of a word (no final ς): char::to_lowercase.
  EXPECT_EQ(lowercase_code_points("\u039f\u0394\u03a5\u03a3\u03a3\u0395\u03a5\u03a3"),
            "\u03bf\u03b4\u03c5\u03c3\u03c3\u03b5\u03c5\u03c3");
  // İ (U+0130) has a two code point lowercase (SpecialCasing): i + U+0307; I is i (no Turkish rule).
  EXPECT_EQ(lowercase_code_points("\u0130I"), "i\u0307i");
  // ẞ -> ß, KELVIN SIGN -> k, titlecase ǅ -> ǆ, full-width Ａ -> ａ, Deseret 𐐀 (outside the BMP) -> 𐐨.
  EXPECT_EQ(lowercase_code_points("\u1e9e\u212a\u01c5\uff21\U00010400"), "\u00dfk\u01c6\uff41\U00010428");
  // No lowercase mapping: unchanged (ligature, CJK, already lower).
  EXPECT_EQ(lowercase_code_points("\ufb01\u65e5\u00e9"), "\ufb01\u65e5\u00e9");
}

TEST(Unicode, CombiningMarksAndWhitespace) {
  // Mn (U+0301), Mc (U+0903), Me (U+20DD) go; precomposed letters stay (StripAccents follows NFD).
  EXPECT_EQ(remove_combining_marks("e\u0301 \u0915\u0903 a\u20dd \u00e9"), "e \u0915 a \u00e9");
  for (uint32_t c : {0x09u, 0x0Au, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2003u, 0x2028u, 0x202Fu, 0x3000u})
    EXPECT_TRUE(is_unicode_whitespace(c)) << c;
  // Zero-width space, word joiner and U+180E (no longer White_Space since Unicode 6.3) are not.
  for (uint32_t c : {0x200Bu, 0x2060u, 0x180Eu, 0xFEFFu, 0x41u}) EXPECT_FALSE(is_unicode_whitespace(c)) << c;
}

}  // namespace
}  // namespace longtrain::data
