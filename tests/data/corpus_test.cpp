// The demo corpus (Jane Austen's novels from Debian's r-cran-janeaustenr), end to end: extraction
// is stable, and the shards `prepare` makes from it decode back to the exact text of every book.
// Runs under the ctest fixtures that fetch the corpus (scripts/fetch-corpus.sh) and train its
// tokenizer; run alone, it needs both already there.
#include <gtest/gtest.h>
#include <zlib.h>

#include "data/loader.h"
#include "data/prepare.h"
#include "data/rdata.h"
#include "data/tokenizer.h"
#include "data_test_util.h"

namespace longtrain::data {
namespace {

namespace fs = std::filesystem;

const std::string kCorpusDir = LONGTRAIN_CORPUS_DIR;
const std::string kRdb = LONGTRAIN_CORPUS_RDB;
const std::string kTokenizer = LONGTRAIN_CORPUS_TOKENIZER;

const std::vector<std::string> kBooks = {"emma.txt",       "mansfield-park.txt",      "northanger-abbey.txt",
                                         "persuasion.txt", "pride-and-prejudice.txt", "sense-and-sensibility.txt"};

void require_corpus() {
  ASSERT_TRUE(fs::exists(kCorpusDir + "/.complete"))
      << "the corpus is not in " << kCorpusDir << ": run scripts/fetch-corpus.sh (ctest runs it as the "
      << "data_fetch_corpus fixture)";
}

TEST(Corpus, ExtractedTextHasAStableHash) {
  require_corpus();
  std::string all;
  std::vector<RdbText> from_rdb = read_rdb_texts(kRdb);
  ASSERT_EQ(from_rdb.size(), kBooks.size());
  for (size_t i = 0; i < kBooks.size(); ++i) {
    const std::string text = test::read_bytes(kCorpusDir + "/" + kBooks[i]);
    EXPECT_EQ(text, from_rdb[i].text) << kBooks[i];
    all += text;
  }
  // Pinned from the first extraction, cross-checked by an independent reader of the same file.
  EXPECT_EQ(all.size(), 4025029u);
  EXPECT_EQ(::crc32(0L, reinterpret_cast<const Bytef*>(all.data()), static_cast<uInt>(all.size())),
            1627748594u);
  EXPECT_EQ(from_rdb[0].title, "EMMA");
  EXPECT_EQ(from_rdb[3].title, "Persuasion");
}

TEST(Corpus, ShardsDecodeToTheExactTextOfEveryBook) {
  require_corpus();
  test::TempDir dir;
  const Tokenizer tok(kTokenizer);
  PrepareOptions o;
  o.tokenizer = kTokenizer;
  o.inputs = {kCorpusDir};
  o.output = dir / "shards";
  o.val_fraction = 0.1;
  o.threads = 2;
  o.progress = false;
  const PrepareSummary s = prepare_corpus(o);
  EXPECT_EQ(s.documents, 6);
  EXPECT_EQ(s.val_documents, 1);  // round(0.6) -> at least one book: document 3, persuasion

  // Every book, decoded from its shard tokens without the EOS, is the book: decode(encode(text))
  // is exact over the whole corpus.
  const TokenCorpus train(o.output, "train", tok.vocab_size()), val(o.output, "val", tok.vocab_size());
  int64_t t = 0;
  for (size_t b = 0; b < kBooks.size(); ++b) {
    const TokenCorpus& c = b == 3 ? val : train;
    const int64_t d = b == 3 ? 0 : t++;
    const int64_t begin = c.document_offset(d), end = c.document_offset(d + 1);
    std::vector<int32_t> ids(static_cast<size_t>(end - begin));
    c.read(begin, ids);
    ASSERT_EQ(ids.back(), tok.eos_id());
    ids.pop_back();
    const std::string text = test::read_bytes(kCorpusDir + "/" + kBooks[b]);
    const std::string decoded = tok.decode(ids);
    EXPECT_EQ(decoded.size(), text.size()) << kBooks[b];
    EXPECT_TRUE(decoded == text) << kBooks[b] << " does not round-trip";
  }

  // The loader reads long windows of it: a 2-rank zigzag group at S = 4096.
  LoaderOptions lo;
  lo.shard_dir = o.output;
  lo.seq_len = 4096;
  lo.sp_size = 2;
  lo.sp_rank = 1;
  lo.layout = SeqLayout::zigzag;
  lo.vocab_size = tok.vocab_size();
  Loader loader(lo);
  const Batch batch = loader.next();
  EXPECT_EQ(batch.tokens.size(), 2048u);
  EXPECT_EQ(batch.positions.front(), 1024);
  EXPECT_EQ(batch.positions.back(), 3071);
  EXPECT_GT(loader.num_windows(), 200);
}

}  // namespace
}  // namespace longtrain::data
