#include "data/loader.h"

#include <algorithm>
#include <bit>
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

void to_json(nlohmann::json& j, const LoaderState& s) {
  j = {{"version", s.version}, {"split", s.split},     {"seed", s.seed},
       {"epoch", s.epoch},     {"cursor", s.cursor},   {"seq_len", s.seq_len},
       {"dp_size", s.dp_size}, {"shuffle", s.shuffle}, {"num_windows", s.num_windows}};
}

void from_json(const nlohmann::json& j, LoaderState& s) {
  LT_CHECK(j.is_object(), "loader state must be a JSON object, got {}", j.type_name());
  for (const char* key : {"version", "split", "seed", "epoch", "cursor", "seq_len", "dp_size", "shuffle",
                          "num_windows"})
    LT_CHECK(j.contains(key), "loader state lacks \"{}\"", key);
  j.at("version").get_to(s.version);
  LT_CHECK(s.version == 1, "loader state version {} is not supported (1)", s.version);
  j.at("split").get_to(s.split);
  j.at("seed").get_to(s.seed);
  j.at("epoch").get_to(s.epoch);
  j.at("cursor").get_to(s.cursor);
  j.at("seq_len").get_to(s.seq_len);
  j.at("dp_size").get_to(s.dp_size);
  j.at("shuffle").get_to(s.shuffle);
  j.at("num_windows").get_to(s.num_windows);
}

Loader::Loader(LoaderOptions options)
    : o_(std::move(options)),
      shuffle_(o_.shuffle.value_or(o_.split != "val")),
      corpus_(o_.shard_dir, o_.split, o_.vocab_size) {
  const int64_t S = o_.seq_len;
  LT_CHECK(S >= 1, "loader: seq_len must be >= 1, got {}", S);
  LT_CHECK(S < std::numeric_limits<int32_t>::max(), "loader: seq_len {} does not fit int32 positions", S);
  LT_CHECK(o_.dp_size >= 1 && o_.dp_rank >= 0 && o_.dp_rank < o_.dp_size,
           "loader: data-parallel rank {} is outside [0, {})", o_.dp_rank, o_.dp_size);
  LT_CHECK(o_.prefetch >= 0, "loader: prefetch depth {} must be >= 0", o_.prefetch);
  check_layout(o_.layout, S, o_.sp_size, o_.sp_rank);
  const int64_t T = corpus_.num_tokens();
  LT_CHECK(S + 1 <= T,
           "loader: a sequence of {} tokens needs windows of S+1 = {} tokens, longer than the \"{}\" split "
           "of '{}' ({} tokens): lower seq_len or prepare more text", S, S + 1, o_.split, o_.shard_dir, T);
  num_windows_ = (T - 1) / S;
  LT_CHECK(num_windows_ >= o_.dp_size,
           "loader: the \"{}\" split of '{}' has {} windows of {} tokens, fewer than the {} data-parallel "
           "ranks: lower seq_len or dp_size, or prepare more text", o_.split, o_.shard_dir, num_windows_,
           S + 1, o_.dp_size);
  steps_per_epoch_ = num_windows_ / o_.dp_size;
  runs_ = layout_runs(o_.layout, S, o_.sp_size, o_.sp_rank);
  local_index_ = layout_global_indices(o_.layout, S, o_.sp_size, o_.sp_rank);
  start_prefetch();
}

Loader::~Loader() { stop_prefetch(); }

int64_t Loader::window_index(int64_t epoch, int64_t step, int dp_rank) const {
  const uint64_t position = static_cast<uint64_t>(step) * static_cast<uint64_t>(o_.dp_size) +
                            static_cast<uint64_t>(dp_rank);
  if (!shuffle_) return static_cast<int64_t>(position);
  return static_cast<int64_t>(
      permute_index(position, static_cast<uint64_t>(num_windows_), epoch_key(o_.seed, epoch)));
}

Batch Loader::make_batch(int64_t epoch, int64_t step) const {
  const int64_t S = o_.seq_len;
  Batch b;
  b.epoch = epoch;
  b.step = step;
  b.seq_len = S;
  b.window = window_index(epoch, step, o_.dp_rank);
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
    corpus_.read(b.stream_offset + run.global_start, buffer);
    for (int64_t i = 0; i < run.length; ++i) {
      const size_t l = static_cast<size_t>(run.local_start + i);
      b.tokens[l] = buffer[static_cast<size_t>(i)];
      b.labels[l] = buffer[static_cast<size_t>(i + 1)];
      b.positions[l] = static_cast<int32_t>(run.global_start + i);
    }
  }
  for (int64_t t : corpus_.document_starts(b.stream_offset, b.stream_offset + S + 1))
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

void Loader::advance(int64_t& epoch, int64_t& step) const {
  if (++step == steps_per_epoch_) {
    step = 0;
    ++epoch;
  }
}

void Loader::start_prefetch() {
  if (o_.prefetch == 0) return;
  std::lock_guard lock(m_);
  queue_.clear();
  error_ = nullptr;
  stop_ = false;
  prod_epoch_ = epoch_;
  prod_step_ = step_;
  thread_ = std::thread([this] {
    while (true) {
      int64_t epoch, step;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || static_cast<int>(queue_.size()) < o_.prefetch; });
        if (stop_) return;
        epoch = prod_epoch_;
        step = prod_step_;
        advance(prod_epoch_, prod_step_);
      }
      try {
        Batch b = make_batch(epoch, step);
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
  if (o_.prefetch == 0) {
    Batch b = make_batch(epoch_, step_);
    advance(epoch_, step_);
    return b;
  }
  std::unique_lock lock(m_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  // Batches made before a failure are still handed out, in order; then the error.
  if (queue_.empty()) std::rethrow_exception(error_);
  Batch b = std::move(queue_.front());
  queue_.pop_front();
  advance(epoch_, step_);
  cv_.notify_all();
  return b;
}

LoaderState Loader::state() const {
  std::lock_guard lock(m_);
  LoaderState s;
  s.split = o_.split;
  s.seed = o_.seed;
  s.epoch = epoch_;
  s.cursor = step_;
  s.seq_len = o_.seq_len;
  s.dp_size = o_.dp_size;
  s.shuffle = shuffle_;
  s.num_windows = num_windows_;
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
  const auto mismatch = [&](const char* field, auto saved, auto now) {
    LT_CHECK(saved == now,
             "loader: cannot resume: the saved state has {} = {} but this loader ('{}', split \"{}\") has "
             "{}; resume with the run's original settings and data", field, saved, o_.shard_dir, o_.split, now);
  };
  mismatch("split", s.split, o_.split);
  mismatch("seq_len", s.seq_len, o_.seq_len);
  mismatch("dp_size", s.dp_size, o_.dp_size);
  mismatch("seed", s.seed, o_.seed);
  mismatch("shuffle", s.shuffle, shuffle_);
  mismatch("num_windows", s.num_windows, num_windows_);
  LT_CHECK(s.epoch >= 0 && s.cursor >= 0 && s.cursor < steps_per_epoch_,
           "loader: saved state epoch {} cursor {} is outside an epoch of {} steps", s.epoch, s.cursor,
           steps_per_epoch_);
  stop_prefetch();
  epoch_ = s.epoch;
  step_ = s.cursor;
  start_prefetch();
}

}  // namespace longtrain::data
