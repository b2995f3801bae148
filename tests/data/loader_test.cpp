// data/loader.h over synthetic shards whose tokens are their stream positions (mod vocabulary), so
// every token, label and position can be checked against where it must have come from.
#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "data/loader.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;

using test::expect_error;
using test::TempDir;

constexpr uint32_t kVocab = 1u << 20;  // larger than any stream here: token == stream position

struct SyntheticSet {
  TempDir dir;
  std::string path;
  int64_t train_tokens = 0;
  std::vector<int64_t> doc_offsets;  // train split document starts, and the end
  explicit SyntheticSet(int documents = 40, int64_t shard_tokens = 700) {
    path = dir / "shards";
    const auto train = test::positional_documents(documents, 5, 90, kVocab, 11);
    const auto val = test::positional_documents(6, 10, 40, kVocab, 12);
    doc_offsets.push_back(0);
    for (const auto& d : train) doc_offsets.push_back(doc_offsets.back() + static_cast<int64_t>(d.size()));
    train_tokens = doc_offsets.back();
    test::write_shard_set(path, kVocab, {{"train", train}, {"val", val}}, shard_tokens);
  }
  LoaderOptions options(int64_t S) const {
    LoaderOptions o;
    o.shard_dir = path;
    o.seq_len = S;
    o.seed = 1234;
    return o;
  }
};

TEST(Loader, WindowsAreConsecutiveStreamTokensWithNextTokenLabels) {
  SyntheticSet set;
  const int64_t S = 37;
  Loader loader(set.options(S));
  EXPECT_EQ(loader.num_windows(), (set.train_tokens - 1) / S);
  for (int k = 0; k < 10; ++k) {
    const Batch b = loader.next();
    ASSERT_EQ(b.tokens.size(), static_cast<size_t>(S));
    EXPECT_EQ(b.stream_offset, b.window * S);
    for (int64_t i = 0; i < S; ++i) {
      EXPECT_EQ(b.tokens[static_cast<size_t>(i)], b.stream_offset + i);
      EXPECT_EQ(b.labels[static_cast<size_t>(i)], b.stream_offset + i + 1);
      EXPECT_EQ(b.positions[static_cast<size_t>(i)], i);
    }
    // Document boundaries: exactly the document starts inside window tokens [0, S].
    std::vector<int32_t> want;
    for (int64_t off : set.doc_offsets)
      if (off >= b.stream_offset && off <= b.stream_offset + S && off < set.train_tokens)
        want.push_back(static_cast<int32_t>(off - b.stream_offset));
    EXPECT_EQ(b.doc_starts, want);
  }
}

TEST(Loader, EachEpochVisitsEveryWindowOnceInASeededOrder) {
  SyntheticSet set;
  LoaderOptions o = set.options(29);
  Loader a(o), b(o);
  o.seed = 99;
  Loader c(o);
  const int64_t W = a.num_windows();
  std::vector<int64_t> order_a, order_b, order_c;
  for (int64_t k = 0; k < 2 * W; ++k) {
    order_a.push_back(a.next().window);
    order_b.push_back(b.next().window);
    order_c.push_back(c.next().window);
  }
  EXPECT_EQ(order_a, order_b) << "same seed, same order";
  EXPECT_NE(order_a, order_c) << "another seed, another order";
  for (int e = 0; e < 2; ++e) {
    std::vector<int64_t> epoch(order_a.begin() + e * W, order_a.begin() + (e + 1) * W);
    std::set<int64_t> seen(epoch.begin(), epoch.end());
    EXPECT_EQ(static_cast<int64_t>(seen.size()), W);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), W - 1);
  }
  EXPECT_FALSE(std::equal(order_a.begin(), order_a.begin() + W, order_a.begin() + W)) << "epochs reshuffle";
  std::vector<int64_t> identity(static_cast<size_t>(W));
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(std::vector<int64_t>(order_a.begin(), order_a.begin() + W), identity) << "shuffled";
}

TEST(Loader, PermutationIsABijectionForEverySize) {
  for (uint64_t n : {1, 2, 3, 5, 16, 17, 1000, 4097}) {
    std::vector<bool> hit(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t p = permute_index(i, n, 42);
      ASSERT_LT(p, n);
      EXPECT_FALSE(hit[p]) << "n=" << n;
      hit[p] = true;
    }
  }
}

TEST(Loader, DataParallelRanksAreDisjointAndCoverTheEpoch) {
  SyntheticSet set;
  for (int dp : {2, 3, 5}) {
    for (int64_t S : {16, 31}) {
      std::vector<std::unique_ptr<Loader>> ranks;
      for (int r = 0; r < dp; ++r) {
        LoaderOptions o = set.options(S);
        o.dp_rank = r;
        o.dp_size = dp;
        ranks.push_back(std::make_unique<Loader>(o));
      }
      const int64_t W = ranks[0]->num_windows(), steps = ranks[0]->steps_per_epoch();
      EXPECT_EQ(steps, W / dp);
      std::set<int64_t> seen;
      for (int64_t k = 0; k < steps; ++k)
        for (auto& loader : ranks) {
          const Batch b = loader->next();
          EXPECT_EQ(b.epoch, 0);
          EXPECT_TRUE(seen.insert(b.window).second) << "window " << b.window << " given twice";
        }
      // The union is the epoch: every window but the W mod dp skipped to keep ranks in step.
      EXPECT_EQ(static_cast<int64_t>(seen.size()), steps * dp) << "dp=" << dp << " S=" << S;
      EXPECT_EQ(ranks[0]->next().epoch, 1);
      // Exactly the epoch's order positions [0, steps * dp) of the single-rank order.
      LoaderOptions o = set.options(S);
      Loader single(o);
      std::set<int64_t> first;
      for (int64_t k = 0; k < steps * dp; ++k) first.insert(single.window_index(0, k, 0));
      EXPECT_EQ(seen, first);
    }
  }
}

TEST(Loader, DataParallelCoversEveryWindowWhenTheSizeDivides) {
  SyntheticSet set;
  const int dp = 3;
  int64_t S = 16;
  while (Loader(set.options(S)).num_windows() % dp != 0) ++S;
  const int64_t W = Loader(set.options(S)).num_windows();
  std::set<int64_t> seen;
  for (int r = 0; r < dp; ++r) {
    LoaderOptions o = set.options(S);
    o.dp_rank = r;
    o.dp_size = dp;
    Loader l(o);
    for (int64_t k = 0; k < l.steps_per_epoch(); ++k) seen.insert(l.next().window);
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), W) << "S=" << S;
}

class SequenceParallelTest : public ::testing::TestWithParam<std::tuple<SeqLayout, int>> {};

TEST_P(SequenceParallelTest, RanksRebuildTheWindowAndLabelsAreNextTokens) {
  const auto [layout, P] = GetParam();
  SyntheticSet set;
  const int64_t S = 2 * P * 7;  // odd chunk length
  for (int dp_rank = 0; dp_rank < 2; ++dp_rank) {
    std::vector<std::unique_ptr<Loader>> ranks;
    for (int r = 0; r < P; ++r) {
      LoaderOptions o = set.options(S);
      o.sp_rank = r;
      o.sp_size = P;
      o.layout = layout;
      o.dp_rank = dp_rank;
      o.dp_size = 2;
      ranks.push_back(std::make_unique<Loader>(o));
    }
    for (int k = 0; k < 5; ++k) {
      std::vector<int64_t> tokens(static_cast<size_t>(S), -1), labels(static_cast<size_t>(S), -1);
      std::vector<Batch> batches;
      for (auto& l : ranks) batches.push_back(l->next());
      for (const Batch& b : batches) {
        ASSERT_EQ(b.tokens.size(), static_cast<size_t>(S / P));
        EXPECT_EQ(b.window, batches[0].window) << "the group shares one window";
        EXPECT_EQ(b.doc_starts, batches[0].doc_starts);
        for (size_t i = 0; i < b.tokens.size(); ++i) {
          const int32_t p = b.positions[i];
          ASSERT_GE(p, 0);
          ASSERT_LT(p, S);
          EXPECT_EQ(tokens[static_cast<size_t>(p)], -1) << "position " << p << " given twice";
          tokens[static_cast<size_t>(p)] = b.tokens[i];
          labels[static_cast<size_t>(p)] = b.labels[i];
        }
      }
      // The ranks' tokens placed at their positions are the window; labels are the next tokens,
      // the last one being window token S.
      const int64_t offset = batches[0].stream_offset;
      for (int64_t p = 0; p < S; ++p) {
        EXPECT_EQ(tokens[static_cast<size_t>(p)], offset + p) << "p=" << p;
        EXPECT_EQ(labels[static_cast<size_t>(p)], offset + p + 1) << "p=" << p;
      }
      // Against a single-rank loader of the same window.
      Loader whole(set.options(S));
      const Batch ref = whole.make_batch(batches[0].epoch, batches[0].step * 2 + dp_rank);
      for (int64_t p = 0; p < S; ++p) {
        EXPECT_EQ(tokens[static_cast<size_t>(p)], ref.tokens[static_cast<size_t>(p)]);
        EXPECT_EQ(labels[static_cast<size_t>(p)], ref.labels[static_cast<size_t>(p)]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, SequenceParallelTest,
                         ::testing::Combine(::testing::Values(SeqLayout::contiguous, SeqLayout::zigzag),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_P" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Runs k batches, saves the state through JSON text, restores it into a fresh loader and checks
// the next batches equal those of an uninterrupted loader.
void check_resume(const LoaderOptions& o, int k, int more, int fresh_prefetch) {
  Loader uninterrupted(o);
  std::vector<Batch> want;
  for (int i = 0; i < k + more; ++i) want.push_back(uninterrupted.next());

  std::string saved;
  {
    Loader first(o);
    for (int i = 0; i < k; ++i) first.next();
    saved = nlohmann::json(first.state()).dump();
  }
  LoaderOptions o2 = o;
  o2.prefetch = fresh_prefetch;
  Loader resumed(o2);
  resumed.next();  // move it first, so restore has to move it back
  resumed.restore(nlohmann::json::parse(saved).get<LoaderState>());
  for (int i = 0; i < more; ++i) {
    const Batch b = resumed.next();
    const Batch& w = want[static_cast<size_t>(k + i)];
    EXPECT_EQ(b.window, w.window) << "k=" << k << " i=" << i;
    EXPECT_EQ(b.epoch, w.epoch);
    EXPECT_EQ(b.step, w.step);
    EXPECT_EQ(b.tokens, w.tokens);
    EXPECT_EQ(b.labels, w.labels);
    EXPECT_EQ(b.positions, w.positions);
    EXPECT_EQ(b.doc_starts, w.doc_starts);
  }
}

// data.document_mask: against the document offsets the set was written with, every rank's positions
// restart at each document start (a document crossing the window start counts from the window
// start), the label from a document's last token to the next document's first is ignored (the
// window's last label too when the token after the window starts a document), and everything else
// is the unmasked batch. Windows of 29 tokens over documents of 5..90 tokens: documents inside a
// window, across its start and across its end.
TEST(Loader, DocumentMaskRestartsPositionsAndIgnoresLabelsAcrossDocuments) {
  SyntheticSet set;
  const int64_t S = 28;
  int64_t ignored_total = 0, restarts_total = 0;
  for (SeqLayout layout : {SeqLayout::contiguous, SeqLayout::zigzag}) {
    for (int P : {1, 2}) {
      for (int r = 0; r < P; ++r) {
        LoaderOptions o = set.options(S);
        o.sp_rank = r;
        o.sp_size = P;
        o.layout = layout;
        o.prefetch = 0;
        Loader plain(o);
        o.document_mask = true;
        Loader masked(o);
        const std::vector<int64_t> g = layout_global_indices(layout, S, P, r);
        for (int k = 0; k < 12; ++k) {
          const Batch a = plain.next(), b = masked.next();
          ASSERT_EQ(a.window, b.window);
          EXPECT_FALSE(a.document_mask);
          EXPECT_TRUE(b.document_mask);
          EXPECT_EQ(a.tokens, b.tokens);
          EXPECT_EQ(a.doc_starts, b.doc_starts);
          for (size_t i = 0; i < g.size(); ++i) {
            const int64_t stream = b.stream_offset + g[i];
            // The document of the token: the last offset <= its stream position, cut at the window start.
            const auto it = std::upper_bound(set.doc_offsets.begin(), set.doc_offsets.end(), stream);
            const int64_t doc_start = std::max(*(it - 1), b.stream_offset);
            const bool next_starts_document =
                std::binary_search(set.doc_offsets.begin(), set.doc_offsets.end(), stream + 1);
            EXPECT_EQ(a.positions[i], g[i]) << "document_mask false keeps global positions";
            EXPECT_EQ(b.positions[i], stream - doc_start) << "window " << b.window << " token " << g[i];
            EXPECT_EQ(a.labels[i], stream + 1);
            EXPECT_EQ(b.labels[i], next_starts_document ? kIgnoreLabel : stream + 1)
                << "window " << b.window << " token " << g[i];
            ignored_total += b.labels[i] == kIgnoreLabel;
            restarts_total += b.positions[i] == 0 && g[i] != 0;
          }
        }
      }
    }
  }
  // The windows really held boundaries.
  EXPECT_GT(ignored_total, 10);
  EXPECT_GT(restarts_total, 10);
}

TEST(Loader, ResumeContinuesWithExactlyTheNextBatch) {
  SyntheticSet set;
  LoaderOptions o = set.options(24);
  o.prefetch = 3;
  const int64_t steps = Loader(o).steps_per_epoch();
  for (int k : {0, 1, 5, static_cast<int>(steps) - 1, static_cast<int>(steps) + 2})
    check_resume(o, k, 4, /*fresh_prefetch=*/2);
  o.prefetch = 0;
  check_resume(o, 7, 3, 0);
  // With data and sequence parallelism.
  o = set.options(24);
  o.dp_rank = 1;
  o.dp_size = 3;
  o.sp_rank = 1;
  o.sp_size = 2;
  o.layout = SeqLayout::zigzag;
  check_resume(o, 9, 4, 1);
}

TEST(Loader, StateSurvivesJsonAndNamesMismatches) {
  SyntheticSet set;
  LoaderOptions o = set.options(24);
  Loader a(o);
  for (int i = 0; i < 3; ++i) a.next();
  const LoaderState s = a.state();
  EXPECT_EQ(s.epoch, 0);
  EXPECT_EQ(s.cursor, 3);
  EXPECT_EQ(s.seed, 1234u);
  const nlohmann::json j = s;
  EXPECT_EQ(j["cursor"], 3);
  o.seq_len = 32;
  Loader other_len(o);
  expect_error([&] { other_len.restore(s); }, {"seq_len = 24", "32"});
  o = set.options(24);
  o.seed = 5;
  Loader other_seed(o);
  expect_error([&] { other_seed.restore(s); }, {"seed = 1234", "5"});
  nlohmann::json broken = j;
  broken.erase("cursor");
  expect_error([&] { broken.get<LoaderState>(); }, {"lacks \"cursor\""});
}

// An elastic resume: a state of D ranks, rescaled for D' ranks, continues with exactly the windows
// the D ranks would have taken next (the epoch's order positions from c·D on), until the epoch ends.
TEST(Loader, RescaledStateContinuesAtTheSameWindowsOnAnotherDataParallelSize) {
  SyntheticSet set;
  const int64_t S = 16;
  auto make = [&](int dp, int rank) {
    LoaderOptions o = set.options(S);
    o.dp_rank = rank;
    o.dp_size = dp;
    o.prefetch = 0;
    return std::make_unique<Loader>(o);
  };
  int checked = 0;
  for (auto [from, to] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 4}, {4, 2}, {3, 1}, {1, 3}}) {
    const int64_t cursor = 6 * std::max(from, to) / from;  // a place every size can hold
    const LoaderState saved = [&] {
      auto l = make(from, 0);
      for (int64_t k = 0; k < cursor; ++k) l->next();
      return l->state();
    }();
    const LoaderState now = rescale_data_parallel(saved, to);
    EXPECT_EQ(now.dp_size, to);
    EXPECT_EQ(now.cursor * to, saved.cursor * from) << from << " -> " << to;
    EXPECT_EQ(now.epoch, saved.epoch);
    // The next 12 order positions, as the new ranks take them, are the single-rank order's.
    auto single = make(1, 0);
    std::vector<std::unique_ptr<Loader>> ranks;
    for (int r = 0; r < to; ++r) {
      ranks.push_back(make(to, r));
      ranks.back()->restore(now);
    }
    for (int64_t p = saved.cursor * from; p < saved.cursor * from + 12;) {
      for (auto& l : ranks) {
        const Batch b = l->next();
        EXPECT_EQ(b.window, single->window_index(0, p, 0)) << from << " -> " << to << ", position " << p;
        ++p;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 6);
  // A place the new size cannot hold is named; the last positions of an epoch move to the next one.
  LoaderState odd = make(1, 0)->state();
  odd.cursor = 3;
  expect_error([&] { rescale_data_parallel(odd, 2); }, {"position 3 of epoch 0", "not a multiple of 2"});
  // W - (W mod t) positions taken by one rank: t ranks have no step left in the epoch.
  LoaderState end = odd;
  int t = 2;
  while (end.num_windows % t == 0) ++t;
  end.cursor = end.num_windows - end.num_windows % t;
  const LoaderState moved = rescale_data_parallel(end, t);
  EXPECT_EQ(moved.epoch, 1) << "t=" << t;
  EXPECT_EQ(moved.cursor, 0);
}

TEST(Loader, ValidationSplitIsReadInOrder) {
  SyntheticSet set;
  LoaderOptions o = set.options(10);
  o.split = "val";
  Loader val(o);
  for (int64_t k = 0; k < val.steps_per_epoch(); ++k) {
    const Batch b = val.next();
    EXPECT_EQ(b.window, k);
    EXPECT_EQ(b.tokens[0], k * 10);  // val tokens are positions of the val stream
  }
  EXPECT_EQ(val.next().epoch, 1);
}

TEST(Loader, WindowsCrossShardBoundaries) {
  // Tiny shards (one document each): the stream, not the shard, is what windows cut.
  SyntheticSet set(40, 1);
  EXPECT_EQ(read_manifest(set.path)["splits"]["train"]["shards"].size(), 40u);
  Loader l(set.options(53));
  for (int k = 0; k < 20; ++k) {
    const Batch b = l.next();
    for (int64_t i = 0; i < 53; ++i) ASSERT_EQ(b.tokens[static_cast<size_t>(i)], b.stream_offset + i);
  }
}

TEST(Loader, BadInputIsAClearError) {
  SyntheticSet set;
  TempDir scratch;
  const auto open = [](const std::string& dir, int64_t S, int64_t vocab = 0) {
    LoaderOptions o;
    o.shard_dir = dir;
    o.seq_len = S;
    o.vocab_size = vocab;
    Loader l(o);
  };
  expect_error([&] { open(scratch / "nowhere", 8); }, {"nowhere", "does not exist"});
  // An interrupted prepare leaves no manifest.
  fs::create_directories(scratch / "interrupted");
  fs::copy_file(set.path + "/train-00000.bin", scratch / "interrupted/train-00000.bin");
  expect_error([&] { open(scratch / "interrupted", 8); }, {"manifest.json", "not a complete shard set"});
  // S+1 longer than the split.
  expect_error([&] { open(set.path, set.train_tokens); },
               {"S+1 = " + std::to_string(set.train_tokens + 1), "train", std::to_string(set.train_tokens) + " tokens"});
  // Vocabulary mismatch between the model/tokenizer and the shards.
  expect_error([&] { open(set.path, 8, 32000); }, {"vocabulary mismatch", "32000", std::to_string(kVocab)});
  // Sequence layout that does not split.
  expect_error([&] {
    LoaderOptions o = set.options(30);
    o.sp_size = 4;
    o.layout = SeqLayout::zigzag;
    Loader l(o);
  }, {"30", "multiple of 8"});

  const auto corrupt = [&](const std::string& name, const std::function<void(std::string&)>& edit) {
    const std::string dir = scratch / name;
    fs::copy(set.path, dir);
    const std::string file = dir + "/train-00001.idx";
    std::string bytes = test::read_bytes(file);
    edit(bytes);
    test::write_file(file, bytes);
    return dir;
  };
  const std::string magic = corrupt("magic", [](std::string& b) { b[0] = 'X'; });
  expect_error([&] { open(magic, 8); }, {"train-00001.idx", "wrong magic"});
  const std::string version = corrupt("version", [](std::string& b) { b[8] = 7; });
  expect_error([&] { open(version, 8); }, {"train-00001.idx", "version 7"});
  const std::string idx_vocab = corrupt("idxvocab", [](std::string& b) { b[16] = 1; });
  expect_error([&] { open(idx_vocab, 8); }, {"train-00001.idx", "vocabulary mismatch"});
  const std::string short_idx = corrupt("shortidx", [](std::string& b) { b.resize(b.size() - 8); });
  expect_error([&] { open(short_idx, 8); }, {"train-00001.idx", "truncated"});

  // A shard entry's count that is not an integer (the shards fuzz target found 1e78 read unchecked).
  const std::string float_count = scratch / "floatcount";
  fs::copy(set.path, float_count);
  {
    nlohmann::json m = read_manifest(float_count);
    m["splits"]["train"]["shards"][0]["tokens"] = 1.0e78;
    test::write_file(float_count + "/manifest.json", m.dump());
  }
  expect_error([&] { open(float_count, 8); }, {"manifest.json", "non-integer \"tokens\"", "1e+78"});
  // A truncated .bin.
  const std::string truncated = scratch / "truncated";
  fs::copy(set.path, truncated);
  const std::string bin = truncated + "/train-00002.bin";
  fs::resize_file(bin, fs::file_size(bin) - 6);
  expect_error([&] { open(truncated, 8); }, {"train-00002.bin", "truncated"});
  // A missing .bin.
  const std::string missing = scratch / "missing";
  fs::copy(set.path, missing);
  fs::remove(missing + "/train-00001.bin");
  expect_error([&] { open(missing, 8); }, {"train-00001.bin", "missing"});
  // A token id outside the vocabulary is reported by next(), naming the file, even from the
  // prefetch thread.
  const std::string bad_token = scratch / "badtoken";
  test::write_shard_set(bad_token, 100, {{"train", {{1, 2, 3, 4, 5, 6, 7, 8, 9, 200, 11, 12}}}});
  LoaderOptions o;
  o.shard_dir = bad_token;
  o.seq_len = 11;
  o.prefetch = 2;
  Loader l(o);
  expect_error([&] { l.next(); }, {"train-00000.bin", "id 200", "vocabulary size 100"});
  // Too few windows for the data-parallel ranks.
  expect_error([&] {
    LoaderOptions o2 = set.options(set.train_tokens / 2);
    o2.dp_size = 4;
    Loader l2(o2);
  }, {"fewer than the 4 data-parallel ranks"});
}

}  // namespace
}  // namespace longtrain::data
