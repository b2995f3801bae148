// The comparison helpers the other tests lean on: each must fail on a NaN or an infinity in either
// argument (std::max(0.0, NaN) is 0, so a NaN-blind maximum scores an all-NaN result as exact), on
// lengths that differ, and on worker output that does not parse as finite numbers.
#include <gtest/gtest-spi.h>  // ScopedFakeTestPartResultReporter
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "kernels/op_test_util.h"
#include "parallel/collective_reference.h"
#include "test_util.h"

namespace longtrain::test {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// The three ways a result can be unusable, in either argument, at the first, a middle and the last
// position.
std::vector<std::pair<std::vector<double>, std::vector<double>>> bad_pairs() {
  const std::vector<double> good = {0.5, -1.0, 2.0, 0.25};
  std::vector<std::pair<std::vector<double>, std::vector<double>>> out;
  for (double bad : {kNaN, kInf, -kInf}) {
    for (size_t at : {size_t{0}, size_t{2}, size_t{3}}) {
      std::vector<double> spoiled = good;
      spoiled[at] = bad;
      out.push_back({spoiled, good});
      out.push_back({good, spoiled});
    }
  }
  out.push_back({std::vector<double>(4, kNaN), std::vector<double>(4, 0.0)});  // all-NaN against zeros
  return out;
}

TEST(ComparisonHelpers, ErrorNormsAreInfiniteOnNaNAndInf) {
  for (const auto& [a, b] : bad_pairs()) {
    EXPECT_EQ(relative_error(a, b), kInf);
    EXPECT_EQ(norm_relative_error(a, b), kInf);
    EXPECT_FALSE(relative_error(a, b) < 1.0);  // what `EXPECT_LT(error, tol)` asks
  }
  for (double bad : {kNaN, kInf, -kInf}) {
    EXPECT_EQ(scalar_relative_error(bad, 1.0), kInf);
    EXPECT_EQ(scalar_relative_error(1.0, bad), kInf);
  }
  // Lengths that differ are no match either (the shorter one used to bound the loop).
  EXPECT_EQ(relative_error(std::vector<double>{1, 2}, std::vector<double>{1, 2, 3}), kInf);
  EXPECT_EQ(norm_relative_error(std::vector<double>{1, 2, 3}, std::vector<double>{1, 2}), kInf);
  // And finite values still measure what they should.
  EXPECT_DOUBLE_EQ(relative_error(std::vector<double>{1.0, 2.0}, std::vector<double>{1.0, 4.0}), 0.5);
  EXPECT_DOUBLE_EQ(norm_relative_error(std::vector<double>{3.0, 0.0}, std::vector<double>{0.0, 4.0}), 1.25);
  EXPECT_DOUBLE_EQ(scalar_relative_error(3.0, 2.0), 0.5);
  EXPECT_EQ(relative_error(std::vector<float>{1.0f, NAN}, std::vector<double>{1.0, 1.0}), kInf);
}

// The failures that `f` reports through GoogleTest, intercepted (they do not fail this test).
template <class F>
std::vector<std::string> failures_of(F&& f) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  std::vector<std::string> out;
  for (int i = 0; i < results.size(); ++i)
    if (results.GetTestPartResult(i).failed()) out.push_back(results.GetTestPartResult(i).message());
  return out;
}

TEST(ComparisonHelpers, CpuOpExpectCloseFailsOnNaNAndInf) {
  for (const auto& [a, b] : bad_pairs()) {
    EXPECT_FALSE(failures_of([&] { expect_close("spoiled", a, b); }).empty());
    const std::vector<float> af(a.begin(), a.end());
    EXPECT_FALSE(failures_of([&] { expect_close("spoiled f32", af, b); }).empty());
  }
  EXPECT_TRUE(failures_of([] { expect_close("exact", std::vector<double>{1, 2}, {1, 2}); }).empty());
}

TEST(ComparisonHelpers, GpuExpectCloseFailsOnNaNAndInf) {
  for (const auto& [a, b] : bad_pairs()) {
    EXPECT_FALSE(failures_of([&] { expect_close("spoiled", DType::bf16, a, b); }).empty());
    EXPECT_FALSE(failures_of([&] { expect_close("spoiled", DType::f32, a, b); }).empty());
  }
  EXPECT_TRUE(failures_of([] { expect_close("exact", DType::bf16, {1, 2}, {1, 2}); }).empty());
  // The norm-wise bound catches what the max-normalised one lets through: many small values that are
  // wrong (here: zero) beside a few large exact ones, max-normalised error 1e-2.
  std::vector<double> ref(1024, 1.0), got(1024, 0.0);
  for (size_t i = 0; i < 8; ++i) ref[i] = got[i] = 100.0;
  EXPECT_LT(relative_error(got, ref), gpu_tolerance(DType::bf16));
  const std::vector<std::string> f = failures_of([&] { expect_close("wrong small values", DType::bf16, got, ref); });
  ASSERT_EQ(f.size(), 1u);
  EXPECT_NE(f[0].find("norm-wise"), std::string::npos) << f[0];
}

TEST(ComparisonHelpers, CollectiveReferenceFailsOnInfAndMisplacedNaN) {
  const std::vector<double> ref = {1.0, 2.0, 3.0};
  for (double bad : {kNaN, kInf, -kInf}) {
    for (size_t at = 0; at < ref.size(); ++at) {
      std::vector<float> got = {1.0f, 2.0f, 3.0f};
      got[at] = static_cast<float>(bad);
      EXPECT_EQ(rel_error(got, ref), kInf) << bad << " at " << at;
      std::vector<double> spoiled_ref = ref;
      spoiled_ref[at] = bad;
      if (!std::isnan(bad)) {
        EXPECT_EQ(rel_error(std::vector<float>{1.0f, 2.0f, 3.0f}, spoiled_ref), kInf);
      }
    }
  }
  // A NaN expected exactly where the reference has one (max propagates NaN) is a match.
  EXPECT_EQ(rel_error(std::vector<float>{1.0f, NAN, 3.0f}, std::vector<double>{1.0, kNaN, 3.0}), 0.0);
  EXPECT_EQ(rel_error(std::vector<float>{1.0f, 2.0f, 3.0f}, std::vector<double>{1.0, kNaN, 3.0}), kInf);
  EXPECT_EQ(rel_error(std::vector<float>{1.0f, 2.0f}, ref), kInf);
}

TEST(ComparisonHelpers, WorkerFieldsMustParseAsFiniteNumbers) {
  double err = -1, tol = -1;
  int64_t n = -1;
  {
    std::istringstream in("1.5e-3 2e-2 7");
    EXPECT_TRUE(read_fields(in, err, tol, n));
    EXPECT_EQ(err, 1.5e-3);
    EXPECT_EQ(tol, 2e-2);
    EXPECT_EQ(n, 7);
  }
  for (const char* line : {"nan 1e-3", "inf 1e-3", "-inf 1e-3", "1e-3 nan", "1e-3", "", "1e-3x 1", "abc 1", "1e999 1"}) {
    std::istringstream in(line);
    EXPECT_FALSE(read_fields(in, err, tol)) << "'" << line << "' was accepted";
  }
  for (const char* line : {"7.5", "x", ""}) {
    std::istringstream in(line);
    EXPECT_FALSE(read_fields(in, n)) << "'" << line << "' was accepted as an integer";
  }
}

TEST(ComparisonHelpers, ReadingAMissingFileIsAnError) {
  const std::filesystem::path missing = std::filesystem::temp_directory_path() / "longtrain-no-such-file";
  std::filesystem::remove(missing);
  EXPECT_THROW(read_file(missing), std::runtime_error);
  // Two missing files are not equal: the comparison never happens.
  EXPECT_THROW((void)(read_file(missing) == read_file(missing)), std::runtime_error);
}

}  // namespace
}  // namespace longtrain::test
