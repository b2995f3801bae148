// embedding_forward / embedding_backward against a naive reference, finite differences and errors.
#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kVocab = 50, kDim = 13;

// out[t, :] = table[tokens[t], :]
std::vector<double> reference_forward(const std::vector<int32_t>& tokens, const std::vector<double>& table,
                                      int64_t dim) {
  std::vector<double> out(tokens.size() * dim);
  for (size_t t = 0; t < tokens.size(); ++t)
    for (int64_t c = 0; c < dim; ++c) out[t * dim + c] = table[tokens[t] * dim + c];
  return out;
}

// d_table[tokens[t], :] += d_out[t, :]
std::vector<double> reference_backward(std::vector<double> d_table, const std::vector<int32_t>& tokens,
                                       const std::vector<double>& d_out, int64_t dim) {
  for (size_t t = 0; t < tokens.size(); ++t)
    for (int64_t c = 0; c < dim; ++c) d_table[tokens[t] * dim + c] += d_out[t * dim + c];
  return d_table;
}

HostTensor<int32_t> random_tokens(uint64_t seed) {
  HostTensor<int32_t> tokens({kTokens});
  test::fill_ints(tokens, seed, 0, kVocab);
  tokens[3] = tokens[20] = tokens[29] = 7;  // repeated ids must accumulate
  tokens[0] = 0;
  tokens[1] = kVocab - 1;  // both ends of the vocabulary
  return tokens;
}

template <class T>
class EmbeddingTest : public ::testing::Test {};
TYPED_TEST_SUITE(EmbeddingTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(EmbeddingTest, ForwardGathersRows) {
  using T = TypeParam;
  HostTensor<int32_t> tokens = random_tokens(1);
  HostTensor<T> table({kVocab, kDim}), out({kTokens, kDim});
  test::fill_uniform(table, 2);
  ops::embedding_forward(out, tokens, table);
  const auto ref = reference_forward(tokens.values, test::as_double(table), kDim);
  test::expect_close("embedding out", out.values, ref);
}

TYPED_TEST(EmbeddingTest, ForwardIntoAStridedView) {
  // out is columns [4, 4 + C) of a wider buffer: the other columns must stay as they were.
  using T = TypeParam;
  HostTensor<int32_t> tokens = random_tokens(3);
  HostTensor<T> table({kVocab, kDim}), wide({kTokens, kDim + 9});
  test::fill_uniform(table, 4);
  test::fill_uniform(wide, 5);
  const HostTensor<T> before = wide;
  ops::embedding_forward(Tensor(wide).narrow(1, 4, kDim), tokens, table);
  const auto ref = reference_forward(tokens.values, test::as_double(table), kDim);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kDim + 9; ++c) {
      const size_t i = t * (kDim + 9) + c;
      if (c >= 4 && c < 4 + kDim)
        EXPECT_EQ(static_cast<double>(wide[i]), ref[t * kDim + c - 4]);
      else
        EXPECT_EQ(wide[i], before[i]) << "column " << c << " outside the view was written";
    }
}

TYPED_TEST(EmbeddingTest, BackwardAccumulatesInTokenOrder) {
  using T = TypeParam;
  HostTensor<int32_t> tokens = random_tokens(6);
  HostTensor<T> d_table({kVocab, kDim}), d_out({kTokens, kDim});
  test::fill_uniform(d_table, 7);  // existing gradient: must be added to, not replaced
  test::fill_uniform(d_out, 8);
  // Adding in T's own arithmetic, in token order: the op must match it bit for bit (deterministic
  // order, no reassociation across tokens).
  HostTensor<T> serial = d_table;
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t c = 0; c < kDim; ++c) serial[tokens[t] * kDim + c] += d_out[t * kDim + c];
  const auto ref = reference_backward(test::as_double(d_table), tokens.values, test::as_double(d_out), kDim);

  ops::embedding_backward(d_table, tokens, d_out);
  test::expect_close("embedding d_table", d_table.values, ref);
  EXPECT_EQ(d_table.values, serial.values);
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  HostTensor<int32_t> tokens = random_tokens(9);
  HostTensor<double> table({kVocab, kDim}), out({kTokens, kDim}), g({kTokens, kDim}), d_table({kVocab, kDim});
  test::fill_uniform(table, 10);
  test::fill_uniform(g, 11);
  auto loss = [&] {
    ops::embedding_forward(out, tokens, table);
    return test::weighted_sum(g, out);
  };
  const auto numeric = test::finite_difference(table.values, loss);
  ops::embedding_backward(d_table, tokens, g);
  const double err = test::relative_error(d_table.values, numeric);
  test::report_error("embedding d_table vs finite differences", err);
  EXPECT_LT(err, test::kGradientTolerance);
}

TEST(Embedding, TokenOutOfRangeIsAnErrorAndWritesNothing) {
  HostTensor<int32_t> tokens = random_tokens(12);
  HostTensor<float> table({kVocab, kDim}), out({kTokens, kDim}), d_table({kVocab, kDim}), d_out({kTokens, kDim});
  test::fill_uniform(d_out, 13);
  tokens[5] = kVocab;
  test::expect_error([&] { ops::embedding_forward(out, tokens, table); },
                     {"embedding_forward", "token id 50 at token index 5", "[0, 50)"});
  tokens[5] = -3;
  test::expect_error([&] { ops::embedding_backward(d_table, tokens, d_out); },
                     {"embedding_backward", "token id -3 at token index 5"});
  for (float v : d_table.values) ASSERT_EQ(v, 0.0f) << "d_table changed by a rejected batch";
}

TEST(Embedding, ShapeAndDtypeErrors) {
  HostTensor<int32_t> tokens = random_tokens(14);
  HostTensor<float> table({kVocab, kDim}), out({kTokens, kDim}), short_out({kTokens - 1, kDim});
  HostTensor<double> table64({kVocab, kDim});
  HostTensor<bf16> table16({kVocab, kDim}), out16({kTokens, kDim});
  HostTensor<float> float_tokens({kTokens});
  test::expect_error([&] { ops::embedding_forward(short_out, tokens, table); },
                     {"embedding_forward", "f32[36, 13]", "i32[37]"});
  test::expect_error([&] { ops::embedding_forward(out, tokens, table64); },
                     {"same dtype", "f32[37, 13]", "f64[50, 13]"});
  test::expect_error([&] { ops::embedding_forward(out16, tokens, table16); },
                     {"embedding_forward", "dtype bf16 is not supported"});
  test::expect_error([&] { ops::embedding_forward(out, float_tokens, table); }, {"tokens must be i32", "f32[37]"});
}

}  // namespace
}  // namespace longtrain
