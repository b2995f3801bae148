#include <gtest/gtest.h>

#include "runtime/tensor.h"
#include "test_util.h"

namespace longtrain {
namespace {

TEST(Tensor, ContiguousShapeAndStrides) {
  test::HostTensor<float> t({5, 3, 4});
  Tensor v = t;
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.numel(), 60);
  EXPECT_EQ(v.stride[0], 12);
  EXPECT_EQ(v.stride[1], 4);
  EXPECT_EQ(v.stride[2], 1);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "f32[5, 3, 4] cpu");
}

TEST(Tensor, NarrowIsAViewIntoTheSameMemory) {
  test::HostTensor<float> t({6, 10});
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(i);
  Tensor rows = Tensor(t).narrow(2, 3);
  EXPECT_EQ(rows.size(0), 3);
  EXPECT_EQ(rows.ptr<float>()[0], 20.0f);
  EXPECT_TRUE(rows.is_contiguous());
  Tensor cols = Tensor(t).narrow(1, 4, 3);  // columns 4..6: strided
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_EQ(cols.ptr<float>()[cols.stride[0] * 1 + 2], 16.0f);
}

TEST(Tensor, ErrorsNameTheProblem) {
  test::HostTensor<float> t({4, 4});
  try {
    Tensor(t).narrow(3, 2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside extent 4"), std::string::npos) << e.what();
    // The source location is kept for debugging, apart from the message a user reads.
    EXPECT_EQ(std::string(e.what()).find("tensor.cpp:"), std::string::npos) << e.what();
    EXPECT_NE(e.where().find("tensor.cpp:"), std::string::npos) << e.where();
  }
  EXPECT_THROW(Tensor(t).ptr<double>(), Error);
  EXPECT_THROW(Tensor(t).narrow(1, 0, 2).reshape({8}), Error);
}

}  // namespace
}  // namespace longtrain
