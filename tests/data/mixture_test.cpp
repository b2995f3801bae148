// Weighted mixtures (data/mixture.h) through the loader: the share of windows each source gives is
// its weight's within sampling error, every batch is a window of the source it names, each source
// walks its own epochs, a mixture resumes exactly, and bad specs and states are refused by name.
#include <cmath>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "data/loader.h"
#include "data/mixture.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

constexpr uint32_t kVocab = 1u << 22;
constexpr uint64_t kSourceStride = 1u << 20;  // source k's tokens are k * 2^20 + stream position

// Three shard sets of different sizes whose tokens say which source and stream position they are.
struct ThreeSources {
  TempDir dir;
  std::vector<std::string> paths;
  ThreeSources() {
    const int documents[3] = {12, 30, 60};
    for (int k = 0; k < 3; ++k) {
      paths.push_back(dir / fmt::format("source{}", k));
      const auto train = test::positional_documents(documents[k], 5, 40, kVocab, 20 + k, k * kSourceStride);
      const auto val = test::positional_documents(4, 10, 30, kVocab, 30 + k, k * kSourceStride);
      test::write_shard_set(paths.back(), kVocab, {{"train", train}, {"val", val}});
    }
  }
  std::string spec(const std::vector<double>& weights) const {
    std::vector<DataSource> s;
    for (size_t k = 0; k < weights.size(); ++k) s.push_back({paths[k], weights[k]});
    return data_sources_text(s);
  }
  LoaderOptions options(const std::vector<double>& weights, int64_t S = 8) const {
    LoaderOptions o;
    o.shard_dir = spec(weights);
    o.seq_len = S;
    o.seed = 99;
    o.prefetch = 0;
    return o;
  }
};

TEST(Mixture, SpecsParseAndPrintBack) {
  EXPECT_EQ(parse_data_sources("data/x").size(), 1u);
  EXPECT_EQ(data_sources_text({{"data/x", 1.0}}), "data/x");
  const auto two = parse_data_sources(R"([{"path": "a", "weight": 0.3}, {"weight": 2, "path": "b"}])");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].path, "a");
  EXPECT_EQ(two[0].weight, 0.3);
  EXPECT_EQ(two[1].weight, 2.0);
  const auto again = parse_data_sources(data_sources_text(two));
  ASSERT_EQ(again.size(), 2u);
  EXPECT_EQ(again[1].path, "b");
  EXPECT_EQ(again[1].weight, 2.0);
}

TEST(Mixture, BadWeightsAndPathsAreRefusedByName) {
  expect_error([] { parse_data_sources(R"([{"path": "a", "weight": 0}])"); }, {"data.train[0] (a)", "positive"});
  expect_error([] { parse_data_sources(R"([{"path": "a", "weight": 1}, {"path": "b", "weight": -2}])"); },
               {"data.train[1] (b)", "weight -2 must be positive"});
  expect_error([] { parse_data_sources(R"([{"path": "a", "weight": "lots"}])"); }, {"data.train[0]", "number"});
  expect_error([] { parse_data_sources(R"([{"path": "a"}])"); }, {"data.train[0]", "weight must be a number"});
  expect_error([] { parse_data_sources(R"([{"weight": 1}])"); }, {"data.train[0]", "path must be"});
  expect_error([] { parse_data_sources(R"([{"path": "a", "weight": 1, "wieght": 2}])"); }, {"unknown field 'wieght'"});
  expect_error([] { parse_data_sources("[]"); }, {"non-empty list"});
  expect_error([] { parse_data_sources("[{"); }, {"not a list"});
  expect_error([] { parse_data_sources(""); }, {"data.train is empty"});
  ThreeSources set;
  LoaderOptions o = set.options({1, 1});
  o.shard_dir = data_sources_text({{set.paths[0], 1}, {set.dir / "nowhere", 1}});
  expect_error([&] { Loader l(o); }, {"mixture source 1", set.dir / "nowhere", "does not exist"});
}

// Counts of each source over n batches: within 5 standard deviations of n * w_i / sum(w). The
// draws are a fixed function of the seed, so the test is deterministic; for a correct sampler a
// 5-sigma miss has probability < 6e-7 per source.
TEST(Mixture, WindowsAreDrawnInProportionToTheWeights) {
  ThreeSources set;
  const std::vector<double> weights = {0.3, 0.3, 0.4};
  for (uint64_t seed : {99u, 7u}) {
    LoaderOptions o = set.options(weights);
    o.seed = seed;
    Loader loader(o);
    const int n = 20000;
    std::vector<int64_t> count(3, 0);
    for (int i = 0; i < n; ++i) {
      const Batch b = loader.next();
      ASSERT_GE(b.source, 0);
      ASSERT_LT(b.source, 3);
      ++count[static_cast<size_t>(b.source)];
      // The batch is the window its source and index say (tokens carry their source).
      if (i % 97 == 0) {
        std::vector<int32_t> window(9);
        loader.corpus(b.source).read(b.window * 8, window);
        for (int t = 0; t < 8; ++t) {
          EXPECT_EQ(b.tokens[static_cast<size_t>(t)], window[static_cast<size_t>(t)]);
          EXPECT_EQ(static_cast<uint64_t>(b.tokens[static_cast<size_t>(t)]) / kSourceStride,
                    static_cast<uint64_t>(b.source));
        }
      }
    }
    const std::vector<int64_t> taken = loader.tokens_taken();
    for (size_t k = 0; k < 3; ++k) {
      const double p = weights[k], sigma = std::sqrt(n * p * (1 - p));
      EXPECT_LE(std::abs(static_cast<double>(count[k]) - n * p), 5 * sigma)
          << "seed " << seed << " source " << k << ": " << count[k] << " of " << n;
      EXPECT_EQ(taken[k], count[k] * 8) << "tokens taken from source " << k;
    }
  }
  // Weights need not sum to one: {3, 3, 4} is the same mixture.
  Loader a(set.options({0.3, 0.3, 0.4})), b(set.options({3, 3, 4}));
  for (int i = 0; i < 200; ++i) EXPECT_EQ(a.next().source, b.next().source);
}

TEST(Mixture, EachSourceWalksItsOwnEpochsOverAllItsWindows) {
  ThreeSources set;
  Loader loader(set.options({1, 1, 1}));
  std::vector<std::map<int64_t, std::set<int64_t>>> seen(3);  // source -> epoch -> windows
  for (int i = 0; i < 3000; ++i) {
    const Batch b = loader.next();
    EXPECT_TRUE(seen[static_cast<size_t>(b.source)][b.epoch].insert(b.window).second)
        << "source " << b.source << " epoch " << b.epoch << " window " << b.window << " twice";
  }
  for (int k = 0; k < 3; ++k) {
    ASSERT_GE(seen[static_cast<size_t>(k)].size(), 2u) << "source " << k;
    // Every finished epoch visited each of the source's windows once.
    const auto& epochs = seen[static_cast<size_t>(k)];
    for (auto it = epochs.begin(); std::next(it) != epochs.end(); ++it)
      EXPECT_EQ(static_cast<int64_t>(it->second.size()), loader.num_windows(k)) << "source " << k;
  }
}

void expect_same(const Batch& b, const Batch& w, int i) {
  EXPECT_EQ(b.source, w.source) << "batch " << i;
  EXPECT_EQ(b.window, w.window) << "batch " << i;
  EXPECT_EQ(b.epoch, w.epoch) << "batch " << i;
  EXPECT_EQ(b.tokens, w.tokens) << "batch " << i;
  EXPECT_EQ(b.labels, w.labels) << "batch " << i;
  EXPECT_EQ(b.positions, w.positions) << "batch " << i;
  EXPECT_EQ(b.doc_starts, w.doc_starts) << "batch " << i;
}

TEST(Mixture, ResumeEqualsUninterrupted) {
  ThreeSources set;
  for (int prefetch : {0, 3}) {
    for (int dp_rank : {0, 1}) {
      LoaderOptions o = set.options({0.2, 0.5, 0.3});
      o.prefetch = prefetch;
      o.dp_rank = dp_rank;
      o.dp_size = 2;
      Loader uninterrupted(o);
      std::vector<Batch> want;
      for (int i = 0; i < 400; ++i) want.push_back(uninterrupted.next());
      for (int k : {0, 1, 37, 250}) {
        std::string saved;
        std::vector<int64_t> taken;
        {
          Loader first(o);
          for (int i = 0; i < k; ++i) first.next();
          saved = nlohmann::json(first.state()).dump();
          taken = first.tokens_taken();
        }
        EXPECT_NE(saved.find("\"version\":2"), std::string::npos) << saved;
        Loader resumed(o);
        resumed.next();  // move it first, so restore has to move it back
        resumed.restore(nlohmann::json::parse(saved).get<LoaderState>());
        EXPECT_EQ(resumed.tokens_taken(), taken);
        for (int i = k; i < 400; ++i) expect_same(resumed.next(), want[static_cast<size_t>(i)], i);
      }
    }
  }
}

TEST(Mixture, RestoreRefusesAStateOfAnotherMixture) {
  ThreeSources set;
  Loader a(set.options({1, 2, 3}));
  for (int i = 0; i < 5; ++i) a.next();
  const LoaderState s = a.state();
  Loader reweighted(set.options({1, 2, 4}));
  expect_error([&] { reweighted.restore(s); }, {"sources[2].weight = 3", "4"});
  Loader two(set.options({1, 2}));
  expect_error([&] { two.restore(s); }, {"the number of sources = 3", "2"});
  LoaderOptions single;
  single.shard_dir = set.paths[0];
  single.seq_len = 8;
  single.seed = 99;
  Loader one(single);
  expect_error([&] { one.restore(s); }, {"the number of sources = 3", "1"});
  expect_error([&] { a.restore(one.state()); }, {"the number of sources = 1", "3"});
  nlohmann::json broken = s;
  broken["sources"][1].erase("cursor");
  expect_error([&] { broken.get<LoaderState>(); }, {"lacks \"cursor\""});
}

TEST(Mixture, MegatronAndShardSetsMix) {
  ThreeSources set;
  LoaderOptions o;
  o.shard_dir = data_sources_text({{set.paths[2], 1}, {std::string(LONGTRAIN_MEGATRON_FIXTURES) + "/tiny_uint16", 1}});
  o.seq_len = 4;
  o.prefetch = 0;
  o.vocab_size = kVocab;  // also the Megatron source's bound
  Loader l(o);
  std::set<int> sources;
  for (int i = 0; i < 50; ++i) sources.insert(l.next().source);
  EXPECT_EQ(sources, (std::set<int>{0, 1}));
  EXPECT_TRUE(l.corpus(1).is_megatron());
}

}  // namespace
}  // namespace longtrain::data
