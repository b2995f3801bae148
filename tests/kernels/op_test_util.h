// Helpers shared by the CPU op tests: the one tolerance per dtype, the dtype list of the typed
// tests, integer fills, Σ G ⊙ out losses and error-message checks.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/error.h"
#include "test_util.h"

namespace longtrain::test {

// The error every op is held to against its naive double-precision reference, relative to the
// reference's largest magnitude (test::relative_error). f64 ops differ from the reference only by
// summation order, a few ulps. f32 ops round inputs-to-outputs once or twice (the CPU reference
// accumulates in double; only BLAS GEMMs accumulate in float, over at most a few dozen terms here),
// so they sit within ~10 f32 ulps (1.2e-7 each) of the exact result.
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}

// Analytic gradients against central finite differences (h = 1e-6, in double): truncation error
// O(h²) and rounding O(1e-16 · |L| / h) keep the true difference near 1e-9.
constexpr double kGradientTolerance = 1e-6;

// The typed tests run every op in f32 and f64, named by dtype.
using FloatTypes = ::testing::Types<float, double>;
struct DTypeNames {
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, double> ? "f64" : "f32";
  }
};

// Uniform integers in [lo, hi) from a fixed seed.
inline void fill_ints(HostTensor<int32_t>& t, uint64_t seed, int32_t lo, int32_t hi) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi - 1);
  for (auto& v : t.values) v = dist(rng);
}

// The values of t, converted to double (the references always compute in double).
template <class T>
std::vector<double> as_double(const HostTensor<T>& t) {
  return std::vector<double>(t.values.begin(), t.values.end());
}

// L = Σ G ⊙ out: the scalar loss whose gradient with respect to out is G.
inline double weighted_sum(const HostTensor<double>& g, const HostTensor<double>& out) {
  double sum = 0.0;
  for (size_t i = 0; i < out.size(); ++i) sum += g[i] * out[i];
  return sum;
}

// a - b, element by element (what an accumulating gradient added to its starting value).
inline std::vector<double> difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Prints a measured error (the evidence a reader of the test log wants) and records it in the
// GoogleTest XML output.
inline void report_error(const std::string& what, double error) {
  std::printf("  %-40s %.3e\n", what.c_str(), error);
  ::testing::Test::RecordProperty(what, std::to_string(error));
}

// Expects `got` (an op's output in T) within tolerance<T>() of the double reference, and reports
// the error.
template <class T>
void expect_close(const std::string& what, const std::vector<T>& got, const std::vector<double>& reference) {
  ASSERT_EQ(got.size(), reference.size()) << what;
  const double error = relative_error(got, reference);
  report_error(what + (std::is_same_v<T, double> ? " f64" : " f32"), error);
  EXPECT_LT(error, tolerance<T>()) << what;
}

}  // namespace longtrain::test
