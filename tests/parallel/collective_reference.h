// Inputs and single-process references for checking a communicator's collectives, shared by the
// Gloo test (communicator_test.cpp, host tensors) and the NCCL worker (nccl_worker.cpp, device
// tensors). Every rank can generate every rank's input (rank_input), so each rank checks its own
// result against the whole computation done in double. Results are reported as
// "CASE <name> <error> <tolerance>" lines that the test asserts (error <= tolerance).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "parallel/distributed.h"
#include "parallel/store.h"
#include "runtime/dtype.h"

namespace longtrain::test {

using parallel::ReduceOp;

inline double as_double(float v) { return v; }
inline double as_double(double v) { return v; }
inline double as_double(int32_t v) { return v; }
inline double as_double(bf16 v) { return static_cast<float>(v); }

template <class T>
std::string dtype_str() {
  return std::string(dtype_name(dtype_of<T>()));
}

// A fresh seed for each case, the same sequence on every rank (each rank runs the same cases).
inline uint64_t next_seed() {
  static uint64_t s = 0;
  return ++s;
}

// Rank `rank`'s input for one case: uniform in [-1, 1) (integers in [-1000, 1000]); never NaN.
template <class T>
std::vector<T> rank_input(int64_t n, int rank, uint64_t case_seed) {
  std::mt19937_64 rng(case_seed * 1000003 + static_cast<uint64_t>(rank) * 7919 + 17);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, int32_t>) {
      x = static_cast<int32_t>(std::lround(u(rng) * 1000));
    } else if constexpr (std::is_same_v<T, bf16>) {
      x = bf16(static_cast<float>(u(rng)));
    } else {
      x = static_cast<T>(u(rng));
    }
  }
  return v;
}

// Rank `rank`'s input of one case in double: what a broadcast from it, or a transfer from it, delivers.
template <class T>
std::vector<double> rank_reference(int64_t n, int rank, uint64_t case_seed) {
  std::vector<double> ref;
  for (T v : rank_input<T>(n, rank, case_seed)) ref.push_back(as_double(v));
  return ref;
}

// max |got - ref| / max |ref| over ref.size() values. A NaN is expected exactly where ref has one
// (max must propagate NaN); a NaN anywhere else, or an infinity in either, is an infinite error.
template <class T>
double rel_error(const T* got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = as_double(got[i]);
    if (std::isnan(ref[i]) != std::isnan(g)) return std::numeric_limits<double>::infinity();
    if (std::isinf(ref[i]) || std::isinf(g)) return std::numeric_limits<double>::infinity();
    if (std::isnan(ref[i])) continue;
    num = std::max(num, std::abs(g - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return den > 0 ? num / den : num;
}

template <class T>
double rel_error(const std::vector<T>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  return rel_error(got.data(), ref);
}

// One tolerance per dtype for sums over the ranks of values in [-1, 1); max is exact in every dtype.
template <class T>
double tolerance(ReduceOp op) {
  if (op == ReduceOp::max || std::is_same_v<T, int32_t>) return 0.0;
  if (std::is_same_v<T, double>) return 1e-15;
  if (std::is_same_v<T, float>) return 1e-6;
  return 1.0 / 256;  // bf16: the sum rounded once to 8 significant bits
}

// op over the p ranks' inputs of n elements (the inputs hold no NaN).
template <class T>
std::vector<double> all_reduce_reference(int64_t n, int p, ReduceOp op, uint64_t case_seed) {
  std::vector<double> ref(static_cast<size_t>(n), op == ReduceOp::sum ? 0.0 : -INFINITY);
  for (int q = 0; q < p; ++q) {
    const std::vector<T> in = rank_input<T>(n, q, case_seed);
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = op == ReduceOp::sum ? ref[i] + as_double(in[i]) : std::max(ref[i], as_double(in[i]));
    }
  }
  return ref;
}

// Rank r's output of a reduce_scatter of n elements per rank: op over the p ranks' inputs (of n * p
// elements each) of the slice [r * n, (r + 1) * n).
template <class T>
std::vector<double> reduce_scatter_reference(int64_t n, int p, int r, ReduceOp op, uint64_t case_seed) {
  const std::vector<double> whole = all_reduce_reference<T>(n * p, p, op, case_seed);
  return std::vector<double>(whole.begin() + r * n, whole.begin() + (r + 1) * n);
}

// An all_gather's output: the p ranks' inputs of n elements, one after the other.
template <class T>
std::vector<double> all_gather_reference(int64_t n, int p, uint64_t case_seed) {
  std::vector<double> ref;
  for (int q = 0; q < p; ++q) {
    for (double v : rank_reference<T>(n, q, case_seed)) ref.push_back(v);
  }
  return ref;
}

// Element counts of the p chunks of the balanced split of n (the first n % p hold one more): the
// traffic counters' ring volumes.
inline std::vector<int64_t> balanced_chunks(int64_t n, int p) {
  std::vector<int64_t> sizes(p);
  for (int c = 0; c < p; ++c) sizes[c] = n / p + (c < n % p ? 1 : 0);
  return sizes;
}

// Bucket boundaries for start_reduce_scatter_range over a flat buffer of p shards of n elements
// (n >= 16): each list starts at 0, ends at p * n and never decreases, so its buckets partition the
// buffer. Together they hold buckets straddling every shard boundary, buckets inside one shard
// (empty intersection with every other), empty buckets (a repeated boundary), a bucket spanning
// several whole shards, and the whole buffer in one bucket.
inline std::vector<std::vector<int64_t>> bucket_partitions(int64_t n, int p) {
  const int64_t total = n * p;
  std::vector<std::vector<int64_t>> parts;
  // Around every shard boundary: [b - 1, b + 1) straddles it, [1, 7) sits inside shard 0, [b, b) is empty.
  std::vector<int64_t> around{0, 1, 7};
  for (int r = 1; r < p; ++r) {
    for (int64_t cut : {r * n - 1, r * n, r * n, r * n + 1, r * n + 5}) around.push_back(cut);
  }
  around.push_back(total);
  parts.push_back(around);
  // Layer-like buckets of uneven lengths.
  std::vector<int64_t> uneven{0};
  for (int64_t cut = 3, step = 5; cut < total; cut += step, step = step * 7 % 23 + n / 3) uneven.push_back(cut);
  uneven.push_back(total);
  parts.push_back(uneven);
  // One bucket from inside shard 0 to inside the last shard, spanning the whole shards between.
  parts.push_back({0, n / 2, total - n / 2, total});
  parts.push_back({0, total});
  return parts;
}

// The barrier blocks until every rank reached it: every rank's key set before it is visible after
// it (ranks arrive at staggered times).
inline void check_barrier(parallel::Distributed& d, std::ostream& rep) {
  parallel::Communicator& c = d.world();
  int missing = 0;
  for (int round = 0; round < 3; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * ((c.rank() + round) % c.size())));
    d.store().set(fmt::format("test/barrier/{}/{}", round, c.rank()), "1");
    c.barrier();
    for (int q = 0; q < c.size(); ++q) missing += !d.store().check({fmt::format("test/barrier/{}/{}", round, q)});
  }
  rep << "CASE barrier/keys_visible " << missing << " 0\n";
}

}  // namespace longtrain::test
