// parallel/layout.h: which global token indices each sequence-parallel rank holds.
#include <algorithm>
#include <numeric>

#include <gtest/gtest.h>

#include "data_test_util.h"
#include "parallel/layout.h"

namespace longtrain {
namespace {

// The layouts spelled out from their definition: cut [0, S) into chunks, hand them out.
std::vector<int64_t> reference_indices(SeqLayout layout, int64_t S, int P, int r) {
  const int64_t chunks = layout == SeqLayout::contiguous ? P : 2 * P;
  const int64_t c = S / chunks;
  std::vector<int64_t> held_chunks = layout == SeqLayout::contiguous ? std::vector<int64_t>{r}
                                                                    : std::vector<int64_t>{r, 2 * P - 1 - r};
  std::vector<int64_t> out;
  for (int64_t k : held_chunks)
    for (int64_t i = 0; i < c; ++i) out.push_back(k * c + i);
  return out;
}

class LayoutTest : public ::testing::TestWithParam<std::tuple<SeqLayout, int>> {};

TEST_P(LayoutTest, RanksPartitionTheSequenceAsDefined) {
  const auto [layout, P] = GetParam();
  for (int64_t per_chunk : {1, 7, 13}) {
    const int64_t S = per_chunk * layout_chunk_count(layout, P);
    std::vector<int> owner(static_cast<size_t>(S), -1);
    for (int r = 0; r < P; ++r) {
      const std::vector<int64_t> idx = layout_global_indices(layout, S, P, r);
      EXPECT_EQ(idx, reference_indices(layout, S, P, r)) << "S=" << S << " r=" << r;
      ASSERT_EQ(static_cast<int64_t>(idx.size()), layout_local_len(S, P));
      for (size_t i = 0; i < idx.size(); ++i) {
        EXPECT_EQ(layout_global_index(layout, S, P, r, static_cast<int64_t>(i)), idx[i]);
        ASSERT_GE(idx[i], 0);
        ASSERT_LT(idx[i], S);
        EXPECT_EQ(owner[static_cast<size_t>(idx[i])], -1) << "index " << idx[i] << " held twice";
        owner[static_cast<size_t>(idx[i])] = r;
      }
      // The runs describe the same indices.
      int64_t local = 0;
      for (const LayoutRun& run : layout_runs(layout, S, P, r)) {
        EXPECT_EQ(run.local_start, local);
        for (int64_t i = 0; i < run.length; ++i) EXPECT_EQ(idx[static_cast<size_t>(local + i)], run.global_start + i);
        local += run.length;
      }
      EXPECT_EQ(local, S / P);
    }
    EXPECT_TRUE(std::none_of(owner.begin(), owner.end(), [](int o) { return o < 0; })) << "S=" << S;
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, LayoutTest,
                         ::testing::Combine(::testing::Values(SeqLayout::contiguous, SeqLayout::zigzag),
                                            ::testing::Values(1, 2, 3, 4, 5)),
                         [](const auto& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_P" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Layout, ZigzagBalancesCausalWork) {
  // Causal attention work of a query at global index g is g + 1 keys; zigzag gives every rank the
  // same total, contiguous gives the last rank the most.
  const int P = 4;
  const int64_t S = 8 * 5;
  std::vector<int64_t> work;
  for (int r = 0; r < P; ++r) {
    int64_t w = 0;
    for (int64_t g : layout_global_indices(SeqLayout::zigzag, S, P, r)) w += g + 1;
    work.push_back(w);
  }
  EXPECT_TRUE(std::all_of(work.begin(), work.end(), [&](int64_t w) { return w == work[0]; }));
}

TEST(Layout, RejectsLengthsThatDoNotSplit) {
  using data::test::expect_error;
  expect_error([] { check_layout(SeqLayout::zigzag, 30, 4); }, {"30", "zigzag", "multiple of 8"});
  expect_error([] { check_layout(SeqLayout::contiguous, 10, 3); }, {"10", "contiguous", "multiple of 3"});
  expect_error([] { check_layout(SeqLayout::contiguous, 12, 3, 3); }, {"rank 3"});
  expect_error([] { parse_layout("ring"); }, {"'ring'", "contiguous", "zigzag"});
  EXPECT_EQ(parse_layout("zigzag"), SeqLayout::zigzag);
}

}  // namespace
}  // namespace longtrain
