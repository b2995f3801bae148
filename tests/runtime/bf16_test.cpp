#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

#include "runtime/dtype.h"

namespace longtrain {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 65536.0f, 1.0f / 128, 3.0e38f}) {
    bf16 b(f);
    EXPECT_EQ(static_cast<float>(bf16(static_cast<float>(b))), static_cast<float>(b));
  }
  EXPECT_EQ(static_cast<float>(bf16(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(bf16(-2.5f)), -2.5f);
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16(from_bits(0x3F808000u)).bits, 0x3F80u);
  // 1 + 3·2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up to even.
  EXPECT_EQ(bf16(from_bits(0x3F818000u)).bits, 0x3F82u);
  // Just above the tie rounds up, just below rounds down.
  EXPECT_EQ(bf16(from_bits(0x3F808001u)).bits, 0x3F81u);
  EXPECT_EQ(bf16(from_bits(0x3F807FFFu)).bits, 0x3F80u);
}

TEST(Bf16, NanStaysNanAndInfStaysInf) {
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not round to infinity.
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(from_bits(0x7F800001u)))));
  EXPECT_EQ(static_cast<float>(bf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  // The largest float rounds to infinity, as IEEE rounding to bf16 requires.
  EXPECT_TRUE(std::isinf(static_cast<float>(bf16(std::numeric_limits<float>::max()))));
}

TEST(Bf16, RelativeErrorIsAtMostHalfAnUlp) {
  for (int i = 1; i < 20000; ++i) {
    float f = std::sin(static_cast<float>(i)) * static_cast<float>(i);
    float r = static_cast<float>(bf16(f));
    EXPECT_LE(std::abs(r - f), std::abs(f) * (1.0f / 256) + 1e-30f) << f;
  }
}

}  // namespace
}  // namespace longtrain
