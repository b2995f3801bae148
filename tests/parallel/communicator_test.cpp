// The Gloo communicator with real processes (fork): every collective against a single-process
// computation for 2 and 3 ranks (each rank can generate every rank's input, so each checks its own
// result against the reference computed in double), the bucketed reduce_scatter_range against
// reduce_scatter bit for bit, exact traffic counters, grouped send/recv
// overlapped with compute, the process groups, and failures: a rank that never arrives, never joins,
// or dies is named in the others' errors, within the timeout.
//
// Children report "CASE <name> <error> <tolerance>" lines; the parent asserts error <= tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <sstream>

#include "collective_reference.h"
#include "loopback_world.h"
#include "multiproc_util.h"
#include "parallel/distributed.h"
#include "parallel/net.h"
#include "runtime/device.h"

namespace longtrain::parallel {
namespace {

using namespace std::chrono_literals;
using namespace test;  // collective_reference.h: rank_input, the references, rel_error, tolerance

template <class T>
Tensor view(std::vector<T>& v) {
  return Tensor(v.data(), dtype_of<T>(), {static_cast<int64_t>(v.size())});
}

template <class T>
void check_all_reduce(Communicator& c, int64_t n, ReduceOp op, std::ostream& rep) {
  const uint64_t seed = next_seed();
  std::vector<T> mine = rank_input<T>(n, c.rank(), seed);
  c.all_reduce(view(mine), op);
  rep << "CASE all_reduce/" << dtype_str<T>() << "/" << reduce_op_name(op) << "/n=" << n << " "
      << rel_error(mine, all_reduce_reference<T>(n, c.size(), op, seed)) << " " << tolerance<T>(op) << "\n";
}

template <class T>
void check_reduce_scatter(Communicator& c, int64_t n, ReduceOp op, bool in_place, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  std::vector<T> in = rank_input<T>(n * p, r, seed);
  const std::vector<T> in_before = in;
  std::vector<T> out(static_cast<size_t>(n));
  Tensor out_view = in_place ? view(in).narrow(r * n, n) : view(out);
  c.reduce_scatter(out_view, view(in), op);
  const std::string name = "reduce_scatter/" + dtype_str<T>() + "/" + std::string(reduce_op_name(op)) +
                           "/n=" + std::to_string(n) + (in_place ? "/in_place" : "");
  rep << "CASE " << name << " "
      << rel_error(static_cast<const T*>(out_view.data), reduce_scatter_reference<T>(n, p, r, op, seed)) << " "
      << tolerance<T>(op) << "\n";
  if (!in_place) {
    rep << "CASE " << name << "/input_unchanged " << (std::memcmp(in.data(), in_before.data(), in.size() * sizeof(T)) != 0)
        << " 0\n";
  }
}

// start_reduce_scatter_range: the buckets of each partition, issued from the top of the buffer
// down as backward reports them, leave this rank's shard exactly as one in-place reduce_scatter
// does (bit for bit), leave the other shards' elements as they were, and move the same bytes.
template <class T>
void check_reduce_scatter_range(Communicator& c, int64_t n, ReduceOp op, std::ostream& rep) {
  const int p = c.size(), r = c.rank();
  const size_t bytes_before = static_cast<size_t>(r * n) * sizeof(T), shard_bytes = static_cast<size_t>(n) * sizeof(T);
  int partition = 0;
  for (const std::vector<int64_t>& cuts : bucket_partitions(n, p)) {
    const uint64_t seed = next_seed();
    const std::vector<T> in = rank_input<T>(n * p, r, seed);
    std::vector<T> whole = in, bucketed = in;
    c.reset_stats();
    c.reduce_scatter(view(whole).narrow(0, r * n, n), view(whole), op);
    const CommStats one = c.stats();
    c.reset_stats();
    std::vector<std::unique_ptr<CollectiveWork>> works;
    for (size_t i = cuts.size() - 1; i > 0; --i)
      works.push_back(c.start_reduce_scatter_range(view(bucketed), cuts[i - 1], cuts[i], op));
    for (auto& w : works) w->wait();
    const CommStats buckets = c.stats();
    const std::string name = fmt::format("reduce_scatter_range/{}/{}/n={}/partition={}", dtype_str<T>(),
                                         reduce_op_name(op), n, partition++);
    const T* mine = bucketed.data() + r * n;
    rep << "CASE " << name << "/equals_reduce_scatter " << (std::memcmp(mine, whole.data() + r * n, shard_bytes) != 0)
        << " 0\n";
    rep << "CASE " << name << "/reference " << rel_error(mine, reduce_scatter_reference<T>(n, p, r, op, seed)) << " "
        << tolerance<T>(op) << "\n";
    const bool others_kept =
        std::memcmp(bucketed.data(), in.data(), bytes_before) == 0 &&
        std::memcmp(mine + n, in.data() + (r + 1) * n, static_cast<size_t>((p - r - 1) * n) * sizeof(T)) == 0;
    rep << "CASE " << name << "/other_shards_kept " << !others_kept << " 0\n";
    rep << "CASE " << name << "/bytes_sent " << std::abs(buckets.bytes_sent - one.bytes_sent) << " 0\n";
    rep << "CASE " << name << "/bytes_received " << std::abs(buckets.bytes_received - one.bytes_received) << " 0\n";
    rep << "CASE " << name << "/collectives "
        << std::abs(buckets.collectives - static_cast<int64_t>(cuts.size() - 1)) << " 0\n";
  }
}

// Bad buckets are refused before anything is sent, naming the operation, the group and the values;
// the communicator stays usable (the next collectives of this test run on it).
void check_reduce_scatter_range_errors(Communicator& c, std::ostream& rep) {
  std::vector<float> buf(static_cast<size_t>(c.size()) * 5 + 1);
  auto error_of = [&](int64_t numel, int64_t begin, int64_t end) -> std::string {
    try {
      c.reduce_scatter_range(view(buf).narrow(0, 0, numel), begin, end);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string uneven = error_of(c.size() * 5 + 1, 0, 1);
  rep << "CASE errors/range_uneven_buffer "
      << (uneven.find("reduce_scatter_range on 'world'") == std::string::npos ||
          uneven.find(fmt::format("does not split into {} equal shards", c.size())) == std::string::npos)
      << " 0\n";
  const std::string backwards = error_of(c.size() * 5, 4, 3);
  rep << "CASE errors/range_outside " << (backwards.find("the range [4, 3) is not inside") == std::string::npos)
      << " 0\n";
}

template <class T>
void check_all_gather(Communicator& c, int64_t n, bool in_place, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  std::vector<T> in = rank_input<T>(n, r, seed);
  std::vector<T> out(static_cast<size_t>(n * p));
  Tensor in_view = view(in);
  if (in_place) {
    std::copy(in.begin(), in.end(), out.begin() + r * n);
    in_view = view(out).narrow(r * n, n);
  }
  c.all_gather(view(out), in_view);
  rep << "CASE all_gather/" << dtype_str<T>() << "/n=" << n << (in_place ? "/in_place" : "") << " "
      << rel_error(out, all_gather_reference<T>(n, p, seed)) << " 0\n";
}

template <class T>
void check_broadcast(Communicator& c, int64_t n, std::ostream& rep) {
  for (int root = 0; root < c.size(); ++root) {
    const uint64_t seed = next_seed();
    std::vector<T> t = rank_input<T>(n, c.rank(), seed);
    c.broadcast(view(t), root);
    rep << "CASE broadcast/" << dtype_str<T>() << "/root=" << root << " "
        << rel_error(t, rank_reference<T>(n, root, seed)) << " 0\n";
  }
}

// K/V-style rotation: every step posts the next transfer, computes on the current block, then waits.
// After size-1 steps every rank has summed every rank's block.
void check_ring_rotation(Communicator& c, std::ostream& rep) {
  const int64_t n = 1031;
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  std::vector<float> cur = rank_input<float>(n, r, seed), incoming(n);
  std::vector<double> acc(cur.begin(), cur.end());
  const int64_t sent_before = c.stats().bytes_sent;
  for (int step = 0; step < p - 1; ++step) {
    const P2POp ops[] = {P2POp::send(view(cur), next), P2POp::recv(view(incoming), prev)};
    auto work = c.start_p2p(ops);
    volatile double busy = 0;  // stands for the attention block computed meanwhile
    for (int i = 0; i < 200000; ++i) busy = busy + std::sqrt(static_cast<double>(i));
    work->wait();
    for (int64_t i = 0; i < n; ++i) acc[i] += incoming[i];
    std::swap(cur, incoming);
  }
  rep << "CASE p2p/ring_rotation "
      << rel_error(std::vector<float>(acc.begin(), acc.end()), all_reduce_reference<float>(n, p, ReduceOp::sum, seed))
      << " 1e-6\n";
  rep << "CASE bytes/p2p_ring " << std::abs(c.stats().bytes_sent - sent_before - (p - 1) * n * 4) << " 0\n";
}

// One batch with two dtypes in both directions around the ring.
void check_bidirectional_batch(Communicator& c, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  std::vector<int32_t> ints = rank_input<int32_t>(37, r, seed), ints_in(37);
  std::vector<bf16> halves = rank_input<bf16>(53, r, seed + 1), halves_in(53);
  const P2POp ops[] = {P2POp::recv(view(ints_in), prev), P2POp::send(view(ints), next),
                       P2POp::send(view(halves), prev), P2POp::recv(view(halves_in), next)};
  c.p2p(ops);
  rep << "CASE p2p/bidirectional_i32 " << rel_error(ints_in, rank_reference<int32_t>(37, prev, seed)) << " 0\n";
  rep << "CASE p2p/bidirectional_bf16 " << rel_error(halves_in, rank_reference<bf16>(53, next, seed + 1)) << " 0\n";
}

// The counters against the volumes documented in gloo_communicator.h.
void check_byte_counters(Communicator& c, std::ostream& rep) {
  const int p = c.size(), r = c.rank();
  const int64_t n = 1031;
  auto chunks = balanced_chunks(n, p);
  std::vector<float> buf(n * p, 1.0f), out(n);

  c.reset_stats();
  c.all_reduce(view(buf).narrow(0, n));
  const int64_t expect_ar = 4 * ((n - chunks[r]) + (n - chunks[(r + 1) % p]));
  rep << "CASE bytes/all_reduce " << std::abs(c.stats().bytes_sent - expect_ar) << " 0\n";
  // Received: every chunk but (rank-1) in the reduce-scatter, every chunk but rank in the all-gather.
  const int64_t expect_ar_in = 4 * ((n - chunks[(r + p - 1) % p]) + (n - chunks[r]));
  rep << "CASE bytes/all_reduce_received " << std::abs(c.stats().bytes_received - expect_ar_in) << " 0\n";

  c.reset_stats();
  c.reduce_scatter(view(out), view(buf));
  rep << "CASE bytes/reduce_scatter " << std::abs(c.stats().bytes_sent - 4 * (p - 1) * n) << " 0\n";

  c.reset_stats();
  c.all_gather(view(buf), view(out));
  rep << "CASE bytes/all_gather " << std::abs(c.stats().bytes_sent - 4 * (p - 1) * n) << " 0\n";

  c.reset_stats();
  c.broadcast(view(out), 1);
  rep << "CASE bytes/broadcast " << std::abs(c.stats().bytes_sent - (r == 1 ? 4 * (p - 1) * n : 0)) << " 0\n";
  rep << "CASE bytes/collective_count " << std::abs(c.stats().collectives - 1) << " 0\n";

  // bf16 is reduced in f32: the wire carries 4 bytes per element.
  std::vector<bf16> h(n, bf16(1.0f));
  c.reset_stats();
  c.all_reduce(view(h));
  rep << "CASE bytes/all_reduce_bf16_in_f32 " << std::abs(c.stats().bytes_sent - expect_ar) << " 0\n";
}

// Max sees a NaN from any rank (overflow / grad-norm checks rely on it).
void check_max_propagates_nan(Communicator& c, std::ostream& rep) {
  std::vector<float> v = {1.0f * c.rank(), -5.0f, 2.0f};
  if (c.rank() == c.size() - 1) v[1] = std::nanf("");
  c.all_reduce(view(v), ReduceOp::max);
  std::vector<double> ref = {static_cast<double>(c.size() - 1), std::nan(""), 2.0};
  rep << "CASE all_reduce/max_nan " << rel_error(v, ref) << " 0\n";
}

std::string collectives_on_every_dtype(int rank, int p, int port) {
  Distributed d(loopback_world(rank, p, port), distributed_options(1, 20s));
  Communicator& c = d.world();
  std::ostringstream rep;
  rep.precision(3);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    for (int64_t n : {1, 2, 7, 1031, 65537}) {
      check_all_reduce<float>(c, n, op, rep);
      check_all_reduce<double>(c, n, op, rep);
      check_all_reduce<bf16>(c, n, op, rep);
      check_all_reduce<int32_t>(c, n, op, rep);
    }
    for (int64_t n : {1, 7, 1031}) {
      check_reduce_scatter<float>(c, n, op, false, rep);
      check_reduce_scatter<double>(c, n, op, false, rep);
      check_reduce_scatter<bf16>(c, n, op, false, rep);
      check_reduce_scatter<int32_t>(c, n, op, false, rep);
    }
  }
  check_reduce_scatter<float>(c, 1031, ReduceOp::sum, true, rep);
  check_reduce_scatter<bf16>(c, 7, ReduceOp::sum, true, rep);
  check_reduce_scatter_range_errors(c, rep);
  for (int64_t n : {17, 1031}) {
    check_reduce_scatter_range<float>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<bf16>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<double>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<int32_t>(c, n, ReduceOp::sum, rep);
  }
  check_reduce_scatter_range<float>(c, 17, ReduceOp::max, rep);
  for (int64_t n : {1, 7, 1031}) {
    check_all_gather<float>(c, n, false, rep);
    check_all_gather<bf16>(c, n, false, rep);
    check_all_gather<int32_t>(c, n, false, rep);
    check_all_gather<double>(c, n, true, rep);
  }
  check_broadcast<float>(c, 1031, rep);
  check_broadcast<bf16>(c, 7, rep);
  check_broadcast<int32_t>(c, 1, rep);
  check_max_propagates_nan(c, rep);
  check_barrier(d, rep);
  check_ring_rotation(c, rep);
  check_bidirectional_batch(c, rep);
  check_byte_counters(c, rep);
  return rep.str();
}

// Parses the CASE lines of every rank; asserts each; returns the worst error per dtype prefix.
void expect_cases(const std::vector<test::RankOutcome>& outcomes, int min_cases) {
  std::map<std::string, double> worst;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    ASSERT_TRUE(outcomes[r].exited(0)) << "rank " << r << ":\n" << outcomes[r].text;
    const std::vector<test::CaseLine> cases = test::case_lines(outcomes[r].text, "rank " + std::to_string(r));
    for (const test::CaseLine& c : cases) {
      EXPECT_LE(c.error, c.tolerance) << "rank " << r << ": " << c.name;
      const std::string kind = c.name.substr(0, c.name.find('/', c.name.find('/') + 1));
      worst[kind] = std::max(worst[kind], c.error);
    }
    EXPECT_GE(static_cast<int>(cases.size()), min_cases) << "rank " << r << " reported too few cases:\n" << outcomes[r].text;
  }
  for (const auto& [kind, err] : worst) std::cout << "  worst " << kind << ": " << err << "\n";
}

// all_to_all: rank r's chunk s arrives as chunk r of rank s, in every dtype, with exactly (P-1)·n
// elements sent; and the multi-tensor form with two parts of other dtypes and sizes per peer.
template <class T>
void check_all_to_all(Communicator& c, int64_t n, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  std::vector<T> in = rank_input<T>(p * n, r, seed);
  std::vector<T> out(static_cast<size_t>(p * n));
  std::vector<double> ref;
  for (int s = 0; s < p; ++s) {
    const std::vector<double> theirs = rank_reference<T>(p * n, s, seed);
    ref.insert(ref.end(), theirs.begin() + r * n, theirs.begin() + (r + 1) * n);
  }
  c.reset_stats();
  c.all_to_all(view(out), view(in));
  rep << "CASE all_to_all/" << dtype_str<T>() << "/n=" << n << " " << rel_error(out, ref) << " 0\n";
  rep << "CASE bytes/all_to_all/" << dtype_str<T>() << "/n=" << n << " "
      << std::abs(c.stats().bytes_sent - static_cast<int64_t>(sizeof(T)) * (p - 1) * n) << " 0\n";
}

// Parts of unequal size per destination (rank r sends d + r + 1 floats and 2 doubles to rank d).
void check_all_to_all_parts(Communicator& c, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  auto len = [](int from, int to) { return static_cast<int64_t>(to + from + 1); };
  std::vector<std::vector<float>> send_f(p), recv_f(p);
  std::vector<std::vector<double>> send_d(p), recv_d(p);
  std::vector<std::vector<Tensor>> send(p), recv(p);
  int64_t expect_bytes = 0;
  for (int d = 0; d < p; ++d) {
    send_f[d] = rank_input<float>(len(r, d), r * 100 + d, seed);
    send_d[d] = rank_input<double>(2, r * 100 + d, seed + 1);
    recv_f[d].assign(static_cast<size_t>(len(d, r)), -7.0f);
    recv_d[d].assign(2, -7.0);
    send[d] = {view(send_f[d]), view(send_d[d])};
    recv[d] = {view(recv_f[d]), view(recv_d[d])};
    if (d != r) expect_bytes += 4 * len(r, d) + 16;
  }
  c.reset_stats();
  c.start_all_to_all(send, recv)->wait();
  double err = 0;
  for (int s = 0; s < p; ++s) {
    err = std::max(err, rel_error(recv_f[s], rank_reference<float>(len(s, r), s * 100 + r, seed)));
    err = std::max(err, rel_error(recv_d[s], rank_reference<double>(2, s * 100 + r, seed + 1)));
  }
  rep << "CASE all_to_all/parts " << err << " 0\n";
  rep << "CASE bytes/all_to_all/parts " << std::abs(c.stats().bytes_sent - expect_bytes) << " 0\n";
}

std::string all_to_all_cases(int rank, int p, int port) {
  Distributed d(loopback_world(rank, p, port), distributed_options(1, 20s));
  Communicator& c = d.world();
  std::ostringstream rep;
  rep.precision(3);
  for (int64_t n : {1, 5, 1031}) {
    check_all_to_all<float>(c, n, rep);
    check_all_to_all<double>(c, n, rep);
    check_all_to_all<bf16>(c, n, rep);
    check_all_to_all<int32_t>(c, n, rep);
  }
  check_all_to_all_parts(c, rep);
  return rep.str();
}

class AllToAllRanks : public testing::TestWithParam<int> {};

TEST_P(AllToAllRanks, EveryChunkArrivesAtItsRankAndOnlyRemoteBytesCount) {
  const int p = GetParam();
  const int port = net::pick_free_port();
  auto out = test::run_ranks(p, [&](int r) { return all_to_all_cases(r, p, port); }, 60s);
  expect_cases(out, 26);
}

INSTANTIATE_TEST_SUITE_P(Gloo, AllToAllRanks, testing::Values(2, 3, 4),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

class CommunicatorRanks : public testing::TestWithParam<int> {};

TEST_P(CommunicatorRanks, EveryCollectiveMatchesASingleProcessComputation) {
  const int p = GetParam();
  const int port = net::pick_free_port();
  auto out = test::run_ranks(p, [&](int r) { return collectives_on_every_dtype(r, p, port); }, 60s);
  expect_cases(out, 100);
}

INSTANTIATE_TEST_SUITE_P(Gloo, CommunicatorRanks, testing::Values(2, 3),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// A one-process world (what a plain `longtrain train` without the launcher gets): every collective
// is the identity, nothing is sent, and no port is needed.
TEST(OneRankWorld, CollectivesAreTheIdentity) {
  Distributed d(WorldInfo{}, distributed_options(1, 5s));
  Communicator& c = d.world();
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(d.sp().size(), 1);
  std::vector<float> t = {1.5f, -2.0f, 3.25f}, out(3), gathered(3);
  c.all_reduce(view(t));
  c.reduce_scatter(view(out), view(t));
  c.all_gather(view(gathered), view(out));
  c.broadcast(view(gathered), 0);
  c.reduce_scatter_range(view(gathered), 1, 3);
  c.barrier();
  EXPECT_EQ(gathered, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  EXPECT_EQ(c.stats().bytes_sent, 0);
  EXPECT_EQ(c.stats().collectives, 6);
}

// all_reduce_host_values' device buffer (host_values_staging) is the communicator's: asked again for as
// many values or fewer it allocates nothing and hands out the same memory; asked for more it grows.
TEST(OneRankWorld, HostValuesStagingIsKeptAcrossCallsAndGrows) {
  Distributed d(WorldInfo{}, distributed_options(1, 5s));
  Communicator& c = d.world();
  const Tensor first = c.host_values_staging(3);
  EXPECT_EQ(first.numel(), 3);
  const size_t live = allocation_stats(c.device()).live;
  const Tensor again = c.host_values_staging(2);
  EXPECT_EQ(again.data, first.data);
  EXPECT_EQ(again.numel(), 2);
  EXPECT_EQ(allocation_stats(c.device()).live, live) << "a second call must not allocate";
  const Tensor larger = c.host_values_staging(1000);
  EXPECT_EQ(larger.numel(), 1000);
  std::vector<double> v = {1.0, 2.0};
  all_reduce_host_values(c, v.data(), 2);  // one rank: the identity
  EXPECT_EQ(v, (std::vector<double>{1.0, 2.0}));
}

TEST(OneRankWorld, BadArgumentsNameTheOperationAndTheGroup) {
  Distributed d(WorldInfo{}, distributed_options(1, 5s));
  std::vector<float> in(4), out(3);
  try {
    d.world().reduce_scatter(view(out), view(in));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.what()).find("reduce_scatter on 'world' (global ranks 0)") != std::string::npos)
        << e.what();
  }
  std::vector<float> big(8);
  Tensor strided = view(big).reshape({4, 2}).narrow(1, 0, 1);
  try {
    d.world().all_reduce(strided);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.what()).find("all_reduce: the tensor f32[4, 1] cpu is not contiguous") !=
                std::string::npos)
        << e.what();
  }
#ifndef LONGTRAIN_HAS_CUDA
  try {
    make_communicator(Backend::nccl, d.store(), "gpu", {0}, 0);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(std::string(e.what()).find("the NCCL backend is not in this build") != std::string::npos) << e.what();
  }
#endif
}

// World 4 = 2 "nodes" x 2, sp 2: every group's communicator reduces exactly its members.
TEST(ProcessGroupCommunicators, EachGroupReducesExactlyItsMembers) {
  const int port = net::pick_free_port();
  auto out = test::run_ranks(4, [&](int r) {
    Distributed d(loopback_world(r, 4, port, 2), distributed_options(2, 20s));
    std::ostringstream rep;
    auto check = [&](const char* name, Communicator& c, const RankGroup& g) {
      int32_t x = r + 1;
      c.all_reduce(Tensor(&x, DType::i32, {1}));
      int32_t expect = 0;
      for (int q : g.ranks) expect += q + 1;
      rep << "CASE group/" << name << " " << std::abs(x - expect) << " 0\n";
      rep << "CASE group/" << name << "_members " << (c.ranks() != g.ranks) << " 0\n";
    };
    const ParallelShape s = d.shape();
    check("world", d.world(), world_group(s));
    check("sp", d.sp(), sp_group(s, r));
    check("dp", d.dp(), dp_group(s, r));
    check("intra", d.intra_node(), intra_node_ring(s, r));
    check("inter", d.inter_node(), inter_node_ring(s, r));
    return rep.str();
  }, 30s);
  expect_cases(out, 10);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Rank 2 never calls the all_reduce: ranks 0 and 1 fail after the 1 s timeout naming rank 2 and what
// it was doing; rank 2 itself is stopped through the store (kExitPeerFailure), long before its sleep ends.
TEST(CommunicatorFailure, AMissingRankIsNamedWhenTheCollectiveTimesOut) {
  const int port = net::pick_free_port();
  const auto start = Clock::now();
  auto out = test::run_ranks(3, [&](int r) -> std::string {
    Distributed d(loopback_world(r, 3, port), distributed_options(1, 20s));  // a slow start must not trip the test
    d.world().barrier();
    d.world().set_timeout(1s);
    if (r == 2) {
      std::this_thread::sleep_for(30s);
      return "rank 2 was never stopped";
    }
    std::vector<float> t(1031, 1.0f);
    try {
      d.world().all_reduce(view(t));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }, 20s);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_TRUE(out[2].exited(kExitPeerFailure)) << out[2].text;
  int named = 0;
  for (int r = 0; r < 2; ++r) {
    if (out[r].exited(kExitPeerFailure)) continue;  // stopped by the other's report first
    ASSERT_TRUE(out[r].exited(0)) << out[r].text;
    const std::string& msg = out[r].text;
    EXPECT_TRUE(contains(msg, "all_reduce #2 (sum, f32[1031] cpu) on communicator 'world' (global ranks 0, 1, 2)"))
        << msg;
    EXPECT_TRUE(contains(msg, "rank 2 did not arrive")) << msg;
    EXPECT_TRUE(contains(msg, "rank 2 is still at collective #1 (barrier, completed)")) << msg;
    EXPECT_TRUE(contains(msg, "timeout 1000 ms")) << msg;
    ++named;
  }
  EXPECT_GE(named, 1) << "neither rank 0 nor rank 1 reported the timeout";
  std::cout << "  rank 0 said: " << out[0].text << "\n";
}

// A receive whose sender never posts the send: the error names the peer and how far it got.
TEST(CommunicatorFailure, AMissingSendIsNamed) {
  const int port = net::pick_free_port();
  auto out = test::run_ranks(2, [&](int r) -> std::string {
    Distributed d(loopback_world(r, 2, port), distributed_options(1, 20s));
    d.world().barrier();
    d.world().set_timeout(1s);
    std::vector<float> t(64, 1.0f);
    if (r == 1) {
      const P2POp first[] = {P2POp::send(view(t), 0)};
      d.world().p2p(first);  // send #1 arrives; #2 never will
      std::this_thread::sleep_for(30s);
      return "rank 1 was never stopped";
    }
    try {
      const P2POp ops[] = {P2POp::recv(view(t), 1)};
      d.world().p2p(ops);
      auto work = d.world().start_p2p(ops);
      work->wait();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }, 20s);
  ASSERT_TRUE(out[0].exited(0)) << out[0].text;
  EXPECT_TRUE(contains(out[0].text, "recv #2 from rank 1 on communicator 'world'")) << out[0].text;
  EXPECT_TRUE(contains(out[0].text, "rank 1 did not arrive: it has posted 1 send(s) to rank 0, not send #2"))
      << out[0].text;
  EXPECT_TRUE(out[1].exited(kExitPeerFailure)) << out[1].text;
}

// Ranks 0 and 1 create a communicator over {0, 1, 2} that rank 2 never creates. The world barrier
// first: without it rank 2 could leave while rank 0 was still connecting the world's own Gloo pairs
// to it ("Connection closed by peer" in Distributed's constructor, seen once in CI).
TEST(CommunicatorFailure, ARankThatNeverJoinsIsNamed) {
  const int port = net::pick_free_port();
  auto out = test::run_ranks(3, [&](int r) -> std::string {
    Distributed d(loopback_world(r, 3, port), distributed_options(1, 20s));
    d.world().barrier();
    if (r == 2) return "skipped";
    try {
      make_communicator(Backend::gloo, d.store(), "late", {0, 1, 2}, r, CommOptions{1s});
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }, 20s);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(out[r].exited(0)) << out[r].text;
    EXPECT_TRUE(contains(out[r].text, "creating communicator 'late' (global ranks 0, 1, 2)")) << out[r].text;
    EXPECT_TRUE(contains(out[r].text, "rank 2 did not join within 1000 ms")) << out[r].text;
  }
  EXPECT_TRUE(out[2].exited(0));
}

// Rank 1 dies between collectives; the others, blocked in an all_reduce with a 20 s timeout, fail
// within seconds: the dead rank's sockets close and the store reports it.
TEST(CommunicatorFailure, ARankThatDiesStopsTheOthersWithinSeconds) {
  const int port = net::pick_free_port();
  const auto start = Clock::now();
  auto out = test::run_ranks(3, [&](int r) -> std::string {
    Distributed d(loopback_world(r, 3, port), distributed_options(1, 20s));
    d.world().barrier();
    if (r == 1) ::_exit(3);
    std::vector<double> t(100, 1.0);
    try {
      d.world().all_reduce(view(t));
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  }, 30s);
  EXPECT_LT(Clock::now() - start, 8s);
  EXPECT_TRUE(out[1].exited(3));
  for (int r : {0, 2}) {
    if (out[r].exited(kExitPeerFailure)) continue;  // stopped by the store's report
    ASSERT_TRUE(out[r].exited(0)) << out[r].text;
    EXPECT_TRUE(contains(out[r].text, "rank 1")) << out[r].text;
  }
}

}  // namespace
}  // namespace longtrain::parallel
