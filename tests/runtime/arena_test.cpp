#include <gtest/gtest.h>

#include "runtime/arena.h"

namespace longtrain {
namespace {

TEST(Arena, EntriesAreZeroedNamedViewsOfOneAllocation) {
  Arena a("parameters", Device::cpu);
  a.add("w1", {3, 5}, DType::f32);
  a.add("w2", {7}, DType::f32);
  a.allocate();
  Tensor w1 = a.get("w1"), w2 = a.get("w2");
  EXPECT_EQ(w1.ndim, 2);
  EXPECT_EQ(w1.size(1), 5);
  EXPECT_EQ(static_cast<char*>(w2.data) - static_cast<char*>(a.base()), 256);  // aligned start
  for (int i = 0; i < 7; ++i) EXPECT_EQ(w2.ptr<float>()[i], 0.0f);
  Tensor flat = a.flat();
  EXPECT_EQ(flat.numel(), static_cast<int64_t>(a.bytes() / 4));
  w2.ptr<float>()[3] = 2.0f;
  EXPECT_EQ(flat.ptr<float>()[64 + 3], 2.0f);
}

TEST(Arena, UnalignedEntriesFollowEachOtherForFusedOperands) {
  Arena a("parameters", Device::cpu);
  a.add("q", {3, 2}, DType::f64);
  a.add("k", {1, 2}, DType::f64, /*align=*/false);
  a.allocate();
  EXPECT_EQ(static_cast<double*>(a.get("k").data), static_cast<double*>(a.get("q").data) + 6);
}

TEST(Arena, MisuseIsAClearError) {
  Arena a("gradients", Device::cpu);
  a.add("x", {2}, DType::f32);
  EXPECT_THROW(a.add("x", {2}, DType::f32), Error);
  EXPECT_THROW(a.get("x"), Error);  // before allocation
  a.allocate();
  try {
    a.get("missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("arena 'gradients' has no entry 'missing'"), std::string::npos);
  }
  EXPECT_THROW(a.add("y", {2}, DType::f32), Error);
}

TEST(Arena, MixedDtypesHaveNoFlatView) {
  Arena a("activations", Device::cpu);
  a.add("x", {2}, DType::bf16);
  a.add("lse", {2}, DType::f32);
  a.allocate();
  EXPECT_THROW(a.flat(), Error);
}

}  // namespace
}  // namespace longtrain
