// runtime/text.h: numbers read whole, as the config and the benchmarks' flags take them.
#include "runtime/text.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

namespace longtrain {
namespace {

TEST(Text, IntegersAreReadWhole) {
  for (const auto& [text, want] : {std::pair{"8192", int64_t{8192}}, std::pair{" +8192\t", int64_t{8192}},
                                   std::pair{"-3", int64_t{-3}}, std::pair{"1e6", int64_t{1000000}},
                                   std::pair{"4096.0", int64_t{4096}}}) {
    int64_t v = 0;
    EXPECT_TRUE(parse_int(text, v)) << text;
    EXPECT_EQ(v, want) << text;
  }
  for (const char* text : {"", " ", "3x", "abc", "2.5", "8192,16384", "1e300", "nan", "99999999999999999999"}) {
    int64_t v = 0;
    EXPECT_FALSE(parse_int(text, v)) << "'" << text << "'";
  }
}

TEST(Text, NumbersAreFiniteAndReadWhole) {
  double v = 0;
  EXPECT_TRUE(parse_double(" 2.5 ", v));
  EXPECT_EQ(v, 2.5);
  EXPECT_TRUE(parse_double("+1e-3", v));
  EXPECT_EQ(v, 1e-3);
  for (const char* text : {"", "2.5x", "nan", "inf", "-inf", "1e999", "one"}) EXPECT_FALSE(parse_double(text, v)) << text;
}

TEST(Text, TrimmedDropsSurroundingWhiteSpaceOnly) {
  EXPECT_EQ(trimmed("  a b\t\n"), "a b");
  EXPECT_EQ(trimmed(""), "");
  EXPECT_EQ(trimmed(" \t "), "");
}

}  // namespace
}  // namespace longtrain
