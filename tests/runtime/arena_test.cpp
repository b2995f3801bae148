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

// f32 gradients beside bf16 parameters: entry i of the mirror starts at the same element of its
// flat view, so one flat element range (a ZeRO-1 shard, a gradient range) means the same tensors in
// both. Plain byte alignment would not give that: a 100-element bf16 entry pads to 128 elements,
// a 100-element f32 one to 64.
TEST(Arena, MirrorKeepsElementOffsetsInAnotherDtype) {
  Arena params("parameters", Device::cpu);
  params.add("a", {100}, DType::bf16);
  params.add("b", {3, 7}, DType::bf16);
  params.add("c", {5}, DType::bf16, /*align=*/false);
  params.pad_to_multiple(2 * 3);
  Arena grads("gradients", Device::cpu);
  grads.add_mirror(params, DType::f32);
  ASSERT_EQ(grads.table().size(), params.table().size());
  for (size_t i = 0; i < params.table().size(); ++i) {
    const ArenaEntry &p = params.table()[i], &g = grads.table()[i];
    EXPECT_EQ(g.name, p.name);
    EXPECT_EQ(g.shape, p.shape);
    EXPECT_EQ(g.dtype, DType::f32);
    EXPECT_EQ(g.offset / 4, p.offset / 2) << p.name;
  }
  EXPECT_EQ(grads.bytes() / 4, params.bytes() / 2);
  params.allocate();
  grads.allocate();
  EXPECT_EQ(grads.flat().numel(), params.flat().numel());
  const std::string msg = [&] {
    try {
      grads.add_mirror(params, DType::f32);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_NE(msg.find("add_mirror needs an empty arena"), std::string::npos) << msg;
  Arena mixed("activations", Device::cpu), m2("m2", Device::cpu);
  mixed.add("x", {2}, DType::bf16);
  mixed.add("lse", {2}, DType::f32);
  EXPECT_THROW(m2.add_mirror(mixed, DType::f32), Error);
}

}  // namespace
}  // namespace longtrain
