// The packing loader: fixed-length training sequences from memory-mapped token shards (shards.h).
//
// Windows. A split is one stream of T tokens (its shards back to back, documents separated by the
// EOS/BOS that `prepare` inserted). Window w is stream tokens [w*S, w*S + S + 1): S inputs plus the
// one extra token that is the last input's label. Windows pack across document (and shard)
// boundaries; there are W = floor((T - 1) / S) of them; consecutive windows share one token.
//
// Epochs and ranks. Epoch e visits the windows in a seeded order (a keyed bijection of [0, W), so
// no permutation table is stored; identity when shuffle is off, the default for "val"). Step k of
// the epoch gives data-parallel rank d the window at order position k*dp_size + d, so the ranks'
// windows are disjoint and their union over the epoch is every window of it. An epoch has
// floor(W / dp_size) steps; when dp_size does not divide W, the last W mod dp_size positions of
// the order (different windows each epoch) are skipped so that every rank takes the same steps.
//
// Sequence parallelism. The sp_size ranks of a group share one window. Rank r gets the S/P inputs
// that its layout (parallel/layout.h: contiguous or zigzag) assigns to it, in local order, with
//   tokens[i]    = window[g(i)]
//   labels[i]    = window[g(i) + 1]      (the next token of the global sequence, so a rank's last
//                                         token's label is the first token of the next chunk, and
//                                         global position S-1's label is window token S)
//   positions[i] = g(i)                  (global position id within the window, for RoPE)
// where g(i) = layout_global_index(layout, S, P, r, i).
//
// Document masking (LoaderOptions::document_mask, data.document_mask). The window's documents come
// from the .idx offsets (doc_starts; a document that crosses the window start is cut there, so the
// window's first token always starts one). Then, for each local token,
//   positions[i] = g(i) - (start of g(i)'s document)   (restart at 0 at each document start)
//   labels[i]    = kIgnoreLabel when g(i) + 1 starts a document (a document's last token would predict
//                  the next document's first token; this is also the window's last label when the
//                  token after the window starts a document)
// and tokens are unchanged. The layout still assigns tokens by their global index g(i), and the
// attention's document offsets (attention/document_mask.h) are in those global coordinates.
//
// Mixtures (mixture.h). With several sources, each source has its own windows, epochs and order
// (as above; source i shuffles with seed_i = seed for i = 0, seed ^ splitmix64(i) otherwise), and
// batch n of the run (counting from 0 across epochs) comes from source draw_source(seed, n): each
// source with probability weight / sum(weights), independently per batch. Every rank of the world
// draws the same source at each step, so data-parallel ranks still take disjoint windows of it. A
// source that runs out of windows starts its next epoch on its own. One source is exactly the
// single-corpus loader.
//
// Resume. state() is the position of the batch next() will return; restore() into a fresh loader
// built with the same options continues with exactly that batch. A background thread keeps up to
// `prefetch` batches ready; state() is unaffected by it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/mixture.h"
#include "data/shards.h"
#include "parallel/layout.h"

namespace longtrain::data {

struct LoaderOptions {
  std::string shard_dir;        // a source spec (mixture.h): a shard set, a Megatron dataset, or a mixture
  std::string split = "train";  // "train" or "val"
  int64_t seq_len = 0;          // S, tokens per sequence (each window holds S + 1)
  uint64_t seed = 0;            // shuffle seed
  int dp_rank = 0, dp_size = 1;  // data-parallel rank and size
  int sp_rank = 0, sp_size = 1;  // sequence-parallel rank within its group, and group size P
  SeqLayout layout = SeqLayout::contiguous;
  int prefetch = 2;             // batches made ahead on a background thread; 0 makes them in next()
  std::optional<bool> shuffle;  // default: on for "train", off for "val"
  int64_t vocab_size = 0;       // > 0: the model's vocabulary, checked against the shards'
  bool document_mask = false;   // positions restart per document, boundary-crossing labels ignored
};

// The label the loss skips (= model::LlamaModel::kIgnoreIndex; trainer.cpp checks they agree).
inline constexpr int32_t kIgnoreLabel = -100;

// One source's place in a mixture.
struct SourceState {
  std::string path;
  double weight = 1.0;
  int64_t epoch = 0, cursor = 0;  // as LoaderState's, for this source's own windows
  int64_t num_windows = 0;
};

// Where a loader stands: everything that makes resume exact. JSON-serialisable (to_json/from_json)
// for trainer_state.json. The rank is not part of it: every rank of a run has the same state.
// Version 1 is one source (epoch, cursor, num_windows at the top); version 2 a mixture: `draws`
// batches taken so far and every source's place (the top-level epoch/cursor/num_windows unused).
struct LoaderState {
  int version = 1;
  std::string split;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t cursor = 0;  // steps already taken in `epoch` (the next batch is step `cursor`)
  // Checked on restore: a different value would make the same cursor mean other windows.
  int64_t seq_len = 0;
  int dp_size = 1;
  bool shuffle = true;
  int64_t num_windows = 0;
  int64_t draws = 0;                 // version 2
  std::vector<SourceState> sources;  // version 2
};

void to_json(nlohmann::json& j, const LoaderState& s);

// The same place for a run with `dp_size` data-parallel ranks (an elastic resume). Within an epoch
// the ranks take the order's positions in turn, so a state of D ranks at cursor c has consumed
// positions [0, c·D) of the epoch; D' ranks continue at cursor c·D / D' and see the same windows
// next. c·D must be a multiple of D' (it is whenever the global batch, in sequences per step, is):
// otherwise an error names the position. Reaching the end of the epoch for D' (fewer than D'
// positions left: an epoch of D' ranks skips its last W mod D' positions) moves to the next epoch.
// From then on the epochs are those of D' ranks.
LoaderState rescale_data_parallel(const LoaderState& state, int dp_size);
void from_json(const nlohmann::json& j, LoaderState& s);

// One sequence-parallel rank's share of one window.
struct Batch {
  int source = 0;             // index of the mixture source it came from (0 for one source)
  int64_t epoch = 0;          // the source's epoch
  int64_t step = 0;           // step within the source's epoch
  int64_t window = 0;         // window index w in the source's split
  int64_t stream_offset = 0;  // w * S: the window's first token in the split's stream
  int64_t seq_len = 0;        // S
  std::vector<int32_t> tokens;     // [S/P] input token ids
  std::vector<int32_t> labels;     // [S/P] next token of the global window (or kIgnoreLabel, see above)
  std::vector<int32_t> positions;  // [S/P] global position ids in [0, S); within-document with document_mask
  // Window positions p in [0, S] where a document starts (the token at p is a document's first),
  // ascending; p = S means the last label begins a new document. The same for every rank of the
  // group, so per-document masks can be built from it and `positions`.
  std::vector<int32_t> doc_starts;
  // LoaderOptions::document_mask: positions and labels are per document (above), and the attention
  // must keep to the documents of doc_starts.
  bool document_mask = false;
};

class Loader {
 public:
  // Opens the split and validates options and data; errors name the directory, file or option.
  explicit Loader(LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  Batch next();
  LoaderState state() const;
  // Continues from `state`; it must come from a loader over the same data with the same seq_len,
  // dp_size, seed and shuffle (any mismatch is an error naming the field).
  void restore(const LoaderState& state);

  // Of source 0 (the only one unless the loader reads a mixture).
  int64_t num_windows() const { return sources_[0].num_windows; }
  int64_t steps_per_epoch() const { return sources_[0].steps_per_epoch; }
  const TokenCorpus& corpus() const { return *sources_[0].corpus; }
  int64_t local_len() const { return static_cast<int64_t>(local_index_.size()); }  // S / P
  const LoaderOptions& options() const { return o_; }

  int num_sources() const { return static_cast<int>(sources_.size()); }
  const DataSource& source(int i) const { return sources_.at(static_cast<size_t>(i)).spec; }
  const TokenCorpus& corpus(int i) const { return *sources_.at(static_cast<size_t>(i)).corpus; }
  int64_t num_windows(int i) const { return sources_.at(static_cast<size_t>(i)).num_windows; }
  // Input tokens the whole data-parallel world has taken from each source up to the position
  // state() describes: windows taken x seq_len x dp_size.
  std::vector<int64_t> tokens_taken() const;

  // Window of data-parallel rank `dp_rank` at step `step` of `epoch` (of `source`).
  int64_t window_index(int64_t epoch, int64_t step, int dp_rank, int source = 0) const;
  // The batch of (epoch, step) of `source` for this rank; does not move the cursor.
  Batch make_batch(int64_t epoch, int64_t step, int source = 0) const;

 private:
  struct Source {
    DataSource spec;
    std::unique_ptr<TokenCorpus> corpus;
    uint64_t seed = 0;
    int64_t num_windows = 0, steps_per_epoch = 0;
  };
  // Where the loader stands: batches drawn so far and each source's (epoch, step).
  struct Position {
    int64_t draws = 0;
    std::vector<int64_t> epoch, step;
  };
  void start_prefetch();
  void stop_prefetch();
  int source_of(int64_t draw) const;
  void advance(Position& p, int source) const;
  // The batch at `p`, and p moved past it.
  Batch take(Position& p) const;

  LoaderOptions o_;
  bool shuffle_;
  std::vector<Source> sources_;
  std::vector<double> cumulative_;    // normalised running sums of the weights
  std::vector<LayoutRun> runs_;       // this sp rank's runs of global indices
  std::vector<int64_t> local_index_;  // [S/P] global index of each local token

  // The consumer's position: the batch next() returns.
  Position pos_;

  // Prefetch: the thread makes batches from prod_ on, in order, into queue_.
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  Position prod_;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// A keyed bijection of [0, n) (a Feistel network with cycle walking): the epoch's window order.
uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key);

}  // namespace longtrain::data
