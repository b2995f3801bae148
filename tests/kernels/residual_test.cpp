// add_inplace (the residual add y += x) on contiguous and strided views, and its errors. It has no
// backward op of its own: the gradient of a residual add is the identity, passed through by the model.
#include <gtest/gtest.h>

#include "kernels/ops.h"
#include "op_test_util.h"

namespace longtrain {
namespace {

using test::HostTensor;

constexpr int64_t kTokens = 37, kDim = 13;

template <class T>
class ResidualTest : public ::testing::Test {};
TYPED_TEST_SUITE(ResidualTest, test::FloatTypes, test::DTypeNames);

TYPED_TEST(ResidualTest, AddsInPlace) {
  using T = TypeParam;
  HostTensor<T> y({kTokens, kDim}), x({kTokens, kDim});
  test::fill_uniform(y, 1);
  test::fill_uniform(x, 2);
  std::vector<double> ref(y.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<double>(y[i]) + static_cast<double>(x[i]);
  ops::add_inplace(y, x);
  test::expect_close("add_inplace", y.values, ref);
}

TYPED_TEST(ResidualTest, StridedThreeDimensionalViews) {
  // y is heads [1, 3) of a [T, 5, 6] buffer, x heads [2, 4) of another: only y's heads change.
  using T = TypeParam;
  constexpr int64_t kHeads = 5, kHeadDim = 6;
  HostTensor<T> y_buf({kTokens, kHeads, kHeadDim}), x_buf({kTokens, kHeads, kHeadDim});
  test::fill_uniform(y_buf, 3);
  test::fill_uniform(x_buf, 4);
  const HostTensor<T> before = y_buf;
  ops::add_inplace(Tensor(y_buf).narrow(1, 1, 2), Tensor(x_buf).narrow(1, 2, 2));
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t d = 0; d < kHeadDim; ++d) {
        const size_t i = (t * kHeads + h) * kHeadDim + d;
        if (h == 1 || h == 2) {
          const size_t j = (t * kHeads + h + 1) * kHeadDim + d;  // the x element added here
          EXPECT_EQ(y_buf[i], static_cast<T>(before[i] + x_buf[j]));
        } else {
          EXPECT_EQ(y_buf[i], before[i]) << "head " << h << " outside the view was written";
        }
      }
}

TEST(Residual, Errors) {
  HostTensor<float> y({kTokens, kDim}), x_short({kTokens - 1, kDim}), x_flat({kTokens * kDim});
  HostTensor<double> x64({kTokens, kDim});
  HostTensor<bf16> y16({kTokens, kDim}), x16({kTokens, kDim});
  test::expect_error([&] { ops::add_inplace(y, x_short); },
                     {"add_inplace", "y f32[37, 13] cpu", "x f32[36, 13] cpu", "same shape"});
  test::expect_error([&] { ops::add_inplace(y, x_flat); }, {"same shape", "f32[481]"});
  test::expect_error([&] { ops::add_inplace(y, x64); }, {"same dtype", "f64[37, 13]"});
  test::expect_error([&] { ops::add_inplace(y16, x16); }, {"dtype bf16 is not supported"});
}

}  // namespace
}  // namespace longtrain
