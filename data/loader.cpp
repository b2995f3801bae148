#include "data/loader.h"

#include <algorithm>
#include <bit>
#include <filesystem>
#include <limits>

#include "runtime/error.h"

namespace longtrain::data {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t epoch_key(uint64_t seed, int64_t epoch) {
  return splitmix64(seed ^ splitmix64(static_cast<uint64_t>(epoch) + 0x5eed));
}

}  // namespace

uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key) {
  if (n <= 1) return i;
  // A Feistel network permutes [0, 2^bits) for any round function; bits is even so the two halves
  // are equal, and 2^bits < 4n, so walking the cycle until the value lands in [0, n) takes a few
  // steps on average and stays a bijection of [0, n).
  int bits = std::bit_width(n - 1);
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = splitmix64(right ^ splitmix64(key + round)) & mask;
      const uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

void to_json(nlohmann::json& j, const SourceState& s) {
  j = {{"path", s.path}, {"weight", s.weight}, {"epoch", s.epoch}, {"cursor", s.cursor},
       {"num_windows", s.num_windows}};
}

void from_json(const nlohmann::json& j, SourceState& s) {
  LT_CHECK(j.is_object(), "loader state: a mixture source must be a JSON object, got {}", j.type_name());
  for (const char* key : {"path", "weight", "epoch", "cursor", "num_windows"})
    LT_CHECK(j.contains(key), "loader state: a mixture source lacks \"{}\"", key);
  j.at("path").get_to(s.path);
  j.at("weight").get_to(s.weight);
  j.at("epoch").get_to(s.epoch);
  j.at("cursor").get_to(s.cursor);
  j.at("num_windows").get_to(s.num_windows);
}

void to_json(nlohmann::json& j, const LoaderState& s) {
  if (s.version == 1) {
    j = {{"version", s.version}, {"split", s.split},     {"seed", s.seed},
         {"epoch", s.epoch},     {"cursor", s.cursor},   {"seq_len", s.seq_len},
         {"dp_size", s.dp_size}, {"shuffle", s.shuffle}, {"num_windows", s.num_windows}};
    return;
  }
  j = {{"version", s.version}, {"split", s.split},     {"seed", s.seed},   {"seq_len", s.seq_len},
       {"dp_size", s.dp_size}, {"shuffle", s.shuffle}, {"draws", s.draws}, {"sources", s.sources}};
}

void from_json(const nlohmann::json& j, LoaderState& s) {
  LT_CHECK(j.is_object(), "loader state must be a JSON object, got {}", j.type_name());
  LT_CHECK(j.contains("version"), "loader state lacks \"version\"");
  j.at("version").get_to(s.version);
  LT_CHECK(s.version == 1 || s.version == 2, "loader state version {} is not supported (1 or 2)", s.version);
  const std::vector<const char*> keys =
      s.version == 1
          ? std::vector<const char*>{"split", "seed", "epoch", "cursor", "seq_len", "dp_size", "shuffle", "num_windows"}
          : std::vector<const char*>{"split", "seed", "seq_len", "dp_size", "shuffle", "draws", "sources"};
  for (const char* key : keys) LT_CHECK(j.contains(key), "loader state lacks \"{}\"", key);
  j.at("split").get_to(s.split);
  j.at("seed").get_to(s.seed);
  j.at("seq_len").get_to(s.seq_len);
  j.at("dp_size").get_to(s.dp_size);
  j.at("shuffle").get_to(s.shuffle);
  if (s.version == 1) {
    j.at("epoch").get_to(s.epoch);
    j.at("cursor").get_to(s.cursor);
    j.at("num_windows").get_to(s.num_windows);
  } else {
    j.at("draws").get_to(s.draws);
    j.at("sources").get_to(s.sources);
  }
}

Loader::Loader(LoaderOptions options)
    : o_(std::move(options)), shuffle_(o_.shuffle.value_or(o_.split != "val")) {
  const int64_t S = o_.seq_len;
  LT_CHECK(S >= 1, "loader: seq_len must be >= 1, got {}", S);
  LT_CHECK(S < std::numeric_limits<int32_t>::max(), "loader: seq_len {} does not fit int32 positions", S);
  LT_CHECK(o_.dp_size >= 1 && o_.dp_rank >= 0 && o_.dp_rank < o_.dp_size,
           "loader: data-parallel rank {} is outside [0, {})", o_.dp_rank, o_.dp_size);
  LT_CHECK(o_.prefetch >= 0, "loader: prefetch depth {} must be >= 0", o_.prefetch);
  check_layout(o_.layout, S, o_.sp_size, o_.sp_rank);
  const std::vector<DataSource> specs = parse_data_sources(o_.shard_dir);
  double total_weight = 0.0;
  for (size_t i = 0; i < specs.size(); ++i) {
    Source src;
    src.spec = specs[i];
    const std::string& path = src.spec.path;
    const std::string name = specs.size() > 1 ? fmt::format("mixture source {} ('{}')", i, path) : fmt::format("'{}'", path);
    LT_CHECK(!megatron_prefix(path).empty() || std::filesystem::exists(path) ||
                 std::filesystem::exists(path + ".idx") || std::filesystem::exists(path + ".bin"),
             "loader: {} does not exist: give a directory made by `longtrain prepare` or a Megatron dataset "
             "(PREFIX of PREFIX.bin/PREFIX.idx)", name);
    src.corpus = std::make_unique<TokenCorpus>(path, o_.split, o_.vocab_size);
    src.seed = i == 0 ? o_.seed : o_.seed ^ splitmix64(static_cast<uint64_t>(i));
    const int64_t T = src.corpus->num_tokens();
    LT_CHECK(S + 1 <= T,
             "loader: a sequence of {} tokens needs windows of S+1 = {} tokens, longer than the \"{}\" split "
             "of {} ({} tokens): lower seq_len or prepare more text", S, S + 1, o_.split, name, T);
    src.num_windows = (T - 1) / S;
    LT_CHECK(src.num_windows >= o_.dp_size,
             "loader: the \"{}\" split of {} has {} windows of {} tokens, fewer than the {} data-parallel "
             "ranks: lower seq_len or dp_size, or prepare more text", o_.split, name, src.num_windows, S + 1,
             o_.dp_size);
    src.steps_per_epoch = src.num_windows / o_.dp_size;
    total_weight += src.spec.weight;
    sources_.push_back(std::move(src));
  }
  double running = 0.0;
  for (const Source& src : sources_) cumulative_.push_back((running += src.spec.weight) / total_weight);
  cumulative_.back() = 1.0;
  pos_.epoch.assign(sources_.size(), 0);
  pos_.step.assign(sources_.size(), 0);
  runs_ = layout_runs(o_.layout, S, o_.sp_size, o_.sp_rank);
  local_index_ = layout_global_indices(o_.layout, S, o_.sp_size, o_.sp_rank);
  start_prefetch();
}

Loader::~Loader() { stop_prefetch(); }

int64_t Loader::window_index(int64_t epoch, int64_t step, int dp_rank, int source) const {
  const Source& src = sources_.at(static_cast<size_t>(source));
  const uint64_t position = static_cast<uint64_t>(step) * static_cast<uint64_t>(o_.dp_size) +
                            static_cast<uint64_t>(dp_rank);
  if (!shuffle_) return static_cast<int64_t>(position);
  return static_cast<int64_t>(
      permute_index(position, static_cast<uint64_t>(src.num_windows), epoch_key(src.seed, epoch)));
}

Batch Loader::make_batch(int64_t epoch, int64_t step, int source) const {
  const int64_t S = o_.seq_len;
  const TokenCorpus& corpus = *sources_.at(static_cast<size_t>(source)).corpus;
  Batch b;
  b.source = source;
  b.epoch = epoch;
  b.step = step;
  b.seq_len = S;
  b.window = window_index(epoch, step, o_.dp_rank, source);
  b.stream_offset = b.window * S;
  const size_t n = local_index_.size();
  b.tokens.resize(n);
  b.labels.resize(n);
  b.positions.resize(n);
  // Each run of consecutive global indices [g, g+len) needs window tokens [g, g+len+1): its inputs
  // and, shifted by one, its labels.
  std::vector<int32_t> buffer;
  for (const LayoutRun& run : runs_) {
    buffer.resize(static_cast<size_t>(run.length + 1));
    corpus.read(b.stream_offset + run.global_start, buffer);
    for (int64_t i = 0; i < run.length; ++i) {
      const size_t l = static_cast<size_t>(run.local_start + i);
      b.tokens[l] = buffer[static_cast<size_t>(i)];
      b.labels[l] = buffer[static_cast<size_t>(i + 1)];
      b.positions[l] = static_cast<int32_t>(run.global_start + i);
    }
  }
  for (int64_t t : corpus.document_starts(b.stream_offset, b.stream_offset + S + 1))
    b.doc_starts.push_back(static_cast<int32_t>(t - b.stream_offset));
  b.document_mask = o_.document_mask;
  if (o_.document_mask) {
    // doc_starts ascends; the window start begins a document whether or not one starts there.
    for (size_t l = 0; l < n; ++l) {
      const int32_t g = b.positions[l];
      const auto after = std::upper_bound(b.doc_starts.begin(), b.doc_starts.end(), g);
      const int32_t start = after == b.doc_starts.begin() ? 0 : *(after - 1);
      b.positions[l] = g - start;
      if (std::binary_search(b.doc_starts.begin(), b.doc_starts.end(), g + 1)) b.labels[l] = kIgnoreLabel;
    }
  }
  return b;
}

int Loader::source_of(int64_t draw) const { return draw_source(o_.seed, draw, cumulative_); }

void Loader::advance(Position& p, int source) const {
  const size_t k = static_cast<size_t>(source);
  ++p.draws;
  if (++p.step[k] == sources_[k].steps_per_epoch) {
    p.step[k] = 0;
    ++p.epoch[k];
  }
}

Batch Loader::take(Position& p) const {
  const int i = source_of(p.draws);
  Batch b = make_batch(p.epoch[static_cast<size_t>(i)], p.step[static_cast<size_t>(i)], i);
  advance(p, i);
  return b;
}

void Loader::start_prefetch() {
  if (o_.prefetch == 0) return;
  std::lock_guard lock(m_);
  queue_.clear();
  error_ = nullptr;
  stop_ = false;
  prod_ = pos_;
  thread_ = std::thread([this] {
    while (true) {
      Position at;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || static_cast<int>(queue_.size()) < o_.prefetch; });
        if (stop_) return;
        // Only the position moves under the lock; the batch is read outside it.
        at = prod_;
        advance(prod_, source_of(prod_.draws));
      }
      try {
        Batch b = take(at);
        std::lock_guard lock(m_);
        if (stop_) return;
        queue_.push_back(std::move(b));
      } catch (...) {
        std::lock_guard lock(m_);
        error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      cv_.notify_all();
    }
  });
}

void Loader::stop_prefetch() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  queue_.clear();
}

Batch Loader::next() {
  if (o_.prefetch == 0) return take(pos_);
  std::unique_lock lock(m_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  // Batches made before a failure are still handed out, in order; then the error.
  if (queue_.empty()) std::rethrow_exception(error_);
  Batch b = std::move(queue_.front());
  queue_.pop_front();
  // The consumer's position follows the batch it took (the same walk the producer made).
  advance(pos_, b.source);
  cv_.notify_all();
  return b;
}

std::vector<int64_t> Loader::tokens_taken() const {
  std::lock_guard lock(m_);
  std::vector<int64_t> out;
  for (size_t k = 0; k < sources_.size(); ++k)
    out.push_back((pos_.epoch[k] * sources_[k].steps_per_epoch + pos_.step[k]) * o_.seq_len * o_.dp_size);
  return out;
}

LoaderState Loader::state() const {
  std::lock_guard lock(m_);
  LoaderState s;
  s.split = o_.split;
  s.seed = o_.seed;
  s.seq_len = o_.seq_len;
  s.dp_size = o_.dp_size;
  s.shuffle = shuffle_;
  if (sources_.size() == 1) {
    s.version = 1;
    s.epoch = pos_.epoch[0];
    s.cursor = pos_.step[0];
    s.num_windows = sources_[0].num_windows;
    return s;
  }
  s.version = 2;
  s.draws = pos_.draws;
  for (size_t k = 0; k < sources_.size(); ++k)
    s.sources.push_back({sources_[k].spec.path, sources_[k].spec.weight, pos_.epoch[k], pos_.step[k],
                         sources_[k].num_windows});
  return s;
}

LoaderState rescale_data_parallel(const LoaderState& s, int dp_size) {
  LT_CHECK(dp_size >= 1 && s.dp_size >= 1, "loader: data-parallel sizes must be at least 1 (got {} and {})",
           s.dp_size, dp_size);
  if (dp_size == s.dp_size) return s;
  const int64_t consumed = s.cursor * s.dp_size;  // positions of the epoch's order already taken
  LT_CHECK(consumed % dp_size == 0,
           "loader: cannot continue on {} data-parallel ranks: the saved place is position {} of epoch {} (cursor "
           "{} of {} ranks), not a multiple of {}; resume on {} data-parallel ranks until the epoch ends, or with a "
           "data-parallel size that divides {}",
           dp_size, consumed, s.epoch, s.cursor, s.dp_size, dp_size, s.dp_size, consumed);
  LT_CHECK(s.num_windows >= dp_size,
           "loader: cannot continue on {} data-parallel ranks: the split has only {} windows", dp_size, s.num_windows);
  LoaderState out = s;
  out.dp_size = dp_size;
  out.cursor = consumed / dp_size;
  if (out.cursor >= s.num_windows / dp_size) {  // fewer than dp_size positions left in the epoch
    out.epoch += 1;
    out.cursor = 0;
  }
  return out;
}

void Loader::restore(const LoaderState& s) {
  const auto mismatch = [&](const std::string& field, auto saved, auto now) {
    LT_CHECK(saved == now,
             "loader: cannot resume: the saved state has {} = {} but this loader ('{}', split \"{}\") has "
             "{}; resume with the run's original settings and data", field, saved, o_.shard_dir, o_.split, now);
  };
  mismatch("split", s.split, o_.split);
  mismatch("seq_len", s.seq_len, o_.seq_len);
  mismatch("dp_size", s.dp_size, o_.dp_size);
  mismatch("seed", s.seed, o_.seed);
  mismatch("shuffle", s.shuffle, shuffle_);
  Position p;
  if (s.version == 1) {
    mismatch("the number of sources", size_t{1}, sources_.size());
    mismatch("num_windows", s.num_windows, sources_[0].num_windows);
    p.epoch = {s.epoch};
    p.step = {s.cursor};
    // One source: every batch so far was drawn from it.
    p.draws = s.epoch * sources_[0].steps_per_epoch + s.cursor;
  } else {
    mismatch("the number of sources", s.sources.size(), sources_.size());
    p.draws = s.draws;
    LT_CHECK(s.draws >= 0, "loader: saved state has a negative draw count {}", s.draws);
    for (size_t k = 0; k < sources_.size(); ++k) {
      mismatch(fmt::format("sources[{}].weight", k), s.sources[k].weight, sources_[k].spec.weight);
      mismatch(fmt::format("sources[{}].num_windows", k), s.sources[k].num_windows, sources_[k].num_windows);
      p.epoch.push_back(s.sources[k].epoch);
      p.step.push_back(s.sources[k].cursor);
    }
  }
  for (size_t k = 0; k < sources_.size(); ++k)
    LT_CHECK(p.epoch[k] >= 0 && p.step[k] >= 0 && p.step[k] < sources_[k].steps_per_epoch,
             "loader: saved state epoch {} cursor {} is outside an epoch of {} steps", p.epoch[k], p.step[k],
             sources_[k].steps_per_epoch);
  stop_prefetch();
  pos_ = std::move(p);
  start_prefetch();
}

}  // namespace longtrain::data
