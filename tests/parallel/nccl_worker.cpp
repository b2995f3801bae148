// The program the NCCL tests (nccl_communicator_test.cpp) run under longtrain-run, one rank per GPU
// (Distributed with Backend::nccl makes GPU LOCAL_RANK current). One mode per scenario:
//
//   parallel_nccl_worker collectives        every collective (f32, bf16, i32, f64; sum and max) against
//                                           a single-process computation, the bucketed
//                                           reduce_scatter_range against reduce_scatter and its
//                                           overlap with compute, grouped send/recv both ways,
//                                           the traffic counters, the barrier, every process group;
//                                           prints "CASE <name> <error> <tolerance>" lines, exits 0
//   parallel_nccl_worker timeout RANK MS    rank RANK skips an all_reduce; the others' synchronize()
//                                           throws after MS ms naming it: they print it, exit 1
//   parallel_nccl_worker missing-send MS    rank 1 posts one send to rank 0, which expects two: rank 0
//                                           prints the error naming rank 1, exits 1
//
// Every input reaches the device through the compute stream behind ~2 ms of other copies, after
// the buffer was zeroed (write_late): an operation that did not wait for the compute stream would
// read zeros. Every result is read back through the compute stream right after the call, with no
// host synchronisation in between: one the compute stream did not wait for would read stale data.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "collective_reference.h"
#include "parallel/distributed.h"
#include "parallel/nccl_communicator.h"
#include "runtime/cuda_check.h"
#include "runtime/device.h"

namespace {

using namespace longtrain;
using namespace longtrain::parallel;
using namespace longtrain::test;  // collective_reference.h: rank_input, the references, rel_error, tolerance
using namespace std::chrono_literals;

// ---- device memory and stream-ordered transfers ------------------------------------------------

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) : p(device_alloc(Device::cuda, bytes)) {}
  ~DeviceBuffer() { device_free(Device::cuda, p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  Tensor view(int64_t n) const {
    return Tensor(p, dtype_of<T>(), {n}, Device::cuda);
  }
};

// ~2 ms of device-to-device copies queued on the compute stream (64 MiB each way, 32 times).
void delay_compute_stream() {
  constexpr size_t kBytes = size_t{64} << 20;
  static DeviceBuffer a(kBytes), b(kBytes);
  for (int i = 0; i < 32; ++i) {
    LT_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, kBytes, cudaMemcpyDeviceToDevice, cuda_stream()));
  }
}

// dst := host, written on the compute stream after dst was zeroed and the stream was kept busy. It
// returns while the device is still busy (nothing here frees memory, which would wait for it).
template <class T>
void write_late(const Tensor& dst, const std::vector<T>& host) {
  constexpr size_t kStagingBytes = size_t{32} << 20;
  static DeviceBuffer staging(kStagingBytes);
  LT_CHECK(host.size() * sizeof(T) <= kStagingBytes, "write_late: {} bytes do not fit the staging buffer",
           host.size() * sizeof(T));
  const Tensor s = staging.view<T>(static_cast<int64_t>(host.size()));
  // From pageable memory this waits for the compute stream first: the staging buffer is free again.
  copy(s, Tensor(const_cast<T*>(host.data()), dtype_of<T>(), {static_cast<int64_t>(host.size())}));
  zero(dst);
  delay_compute_stream();
  LT_CUDA_CHECK(cudaMemcpyAsync(dst.data, s.data, dst.nbytes(), cudaMemcpyDeviceToDevice, cuda_stream()));
}

// The device tensor t, copied to the host through the compute stream (copy() then waits for it).
template <class T>
std::vector<T> read_back(const Tensor& t) {
  std::vector<T> host(static_cast<size_t>(t.numel()));
  copy(Tensor(host.data(), dtype_of<T>(), {t.numel()}), t);
  return host;
}

// ---- the checks --------------------------------------------------------------------------------

template <class T>
void check_all_reduce(Communicator& c, int64_t n, ReduceOp op, std::ostream& rep) {
  const uint64_t seed = next_seed();
  DeviceBuffer buf(static_cast<size_t>(n) * sizeof(T));
  const Tensor t = buf.view<T>(n);
  write_late(t, rank_input<T>(n, c.rank(), seed));
  c.all_reduce(t, op);
  rep << "CASE all_reduce/" << dtype_str<T>() << "/" << reduce_op_name(op) << "/n=" << n << " "
      << rel_error(read_back<T>(t), all_reduce_reference<T>(n, c.size(), op, seed)) << " " << tolerance<T>(op) << "\n";
}

template <class T>
void check_reduce_scatter(Communicator& c, int64_t n, ReduceOp op, bool in_place, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  const std::vector<T> in = rank_input<T>(n * p, r, seed);
  DeviceBuffer bin(static_cast<size_t>(n * p) * sizeof(T)), bout(static_cast<size_t>(n) * sizeof(T));
  const Tensor tin = bin.view<T>(n * p);
  const Tensor tout = in_place ? tin.narrow(r * n, n) : bout.view<T>(n);
  write_late(tin, in);
  c.reduce_scatter(tout, tin, op);
  const std::string name = "reduce_scatter/" + dtype_str<T>() + "/" + std::string(reduce_op_name(op)) +
                           "/n=" + std::to_string(n) + (in_place ? "/in_place" : "");
  rep << "CASE " << name << " " << rel_error(read_back<T>(tout), reduce_scatter_reference<T>(n, p, r, op, seed)) << " "
      << tolerance<T>(op) << "\n";
  if (!in_place) {
    const std::vector<T> after = read_back<T>(tin);
    rep << "CASE " << name << "/input_unchanged " << (std::memcmp(after.data(), in.data(), in.size() * sizeof(T)) != 0)
        << " 0\n";
  }
}

// start_reduce_scatter_range: the buckets of each partition, issued from the top of the buffer
// down as backward reports them, leave this rank's shard as one in-place reduce_scatter does (bit
// for bit: with 2 ranks both add the same two values), the other shards' elements as they were,
// and count the same bytes. The input is written late on the compute stream (the buckets must wait
// for it) and read back through it right after wait() (which must order the compute stream).
template <class T>
void check_reduce_scatter_range(Communicator& c, int64_t n, ReduceOp op, std::ostream& rep) {
  const int p = c.size(), r = c.rank();
  int partition = 0;
  for (const std::vector<int64_t>& cuts : bucket_partitions(n, p)) {
    const uint64_t seed = next_seed();
    const std::vector<T> in = rank_input<T>(n * p, r, seed);
    DeviceBuffer bwhole(static_cast<size_t>(n * p) * sizeof(T)), bbuckets(static_cast<size_t>(n * p) * sizeof(T));
    const Tensor whole = bwhole.view<T>(n * p), bucketed = bbuckets.view<T>(n * p);
    write_late(whole, in);
    c.reset_stats();
    c.reduce_scatter(whole.narrow(0, r * n, n), whole, op);
    const CommStats one = c.stats();
    write_late(bucketed, in);
    c.reset_stats();
    std::vector<std::unique_ptr<CollectiveWork>> works;
    for (size_t i = cuts.size() - 1; i > 0; --i)
      works.push_back(c.start_reduce_scatter_range(bucketed, cuts[i - 1], cuts[i], op));
    for (auto& w : works) w->wait();
    const CommStats buckets = c.stats();
    const std::vector<T> got = read_back<T>(bucketed), want = read_back<T>(whole);
    const std::string name = fmt::format("reduce_scatter_range/{}/{}/n={}/partition={}", dtype_str<T>(),
                                         reduce_op_name(op), n, partition++);
    const size_t shard_bytes = static_cast<size_t>(n) * sizeof(T);
    // Bit for bit only with 2 ranks (both add the same two values); above that NCCL's reduce and
    // reduce_scatter may sum in different orders, and the reference check below bounds the error.
    if (p == 2)
      rep << "CASE " << name << "/equals_reduce_scatter "
          << (std::memcmp(got.data() + r * n, want.data() + r * n, shard_bytes) != 0) << " 0\n";
    rep << "CASE " << name << "/reference "
        << rel_error(got.data() + r * n, reduce_scatter_reference<T>(n, p, r, op, seed)) << " " << tolerance<T>(op)
        << "\n";
    const bool others_kept =
        std::memcmp(got.data(), in.data(), static_cast<size_t>(r * n) * sizeof(T)) == 0 &&
        std::memcmp(got.data() + (r + 1) * n, in.data() + (r + 1) * n, static_cast<size_t>((p - r - 1) * n) * sizeof(T)) == 0;
    rep << "CASE " << name << "/other_shards_kept " << !others_kept << " 0\n";
    rep << "CASE " << name << "/bytes_sent " << std::abs(buckets.bytes_sent - one.bytes_sent) << " 0\n";
    rep << "CASE " << name << "/bytes_received " << std::abs(buckets.bytes_received - one.bytes_received) << " 0\n";
  }
}

// The overlap: start_reduce_scatter_range does not make the compute stream wait. Rank 0 starts a
// bucket that rank 1 joins only 300 ms later; meanwhile rank 0's compute stream, given more work,
// drains at once. After wait() the compute stream sees the reduced values.
void check_reduce_scatter_range_overlaps(Communicator& c, std::ostream& rep) {
  const int p = c.size(), r = c.rank();
  const int64_t n = 4099;
  const uint64_t seed = next_seed();
  DeviceBuffer buf(static_cast<size_t>(n * p) * sizeof(float));
  const Tensor flat = buf.view<float>(n * p);
  write_late(flat, rank_input<float>(n * p, r, seed));
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  c.barrier();
  if (r != 0) std::this_thread::sleep_for(300ms);
  const auto queued = std::chrono::steady_clock::now();
  auto work = c.start_reduce_scatter_range(flat, 0, n * p);
  const auto start = std::chrono::steady_clock::now();
  delay_compute_stream();  // the next layer's backward
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  const double compute_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  work->wait();
  const std::vector<float> got = read_back<float>(flat.narrow(0, r * n, n));
  if (r == 0) {
    // Not asserted: queueing returns at once unless NCCL waits for the late peer to connect.
    std::printf("NOTE rank 0: start_reduce_scatter_range returned after %.1f ms (peer 300 ms late)\n",
                std::chrono::duration<double, std::milli>(start - queued).count());
    rep << "CASE reduce_scatter_range/compute_not_blocked_ms " << compute_ms << " 150\n";
  }
  rep << "CASE reduce_scatter_range/overlapped_result "
      << rel_error(got, reduce_scatter_reference<float>(n, p, r, ReduceOp::sum, seed)) << " 1e-6\n";
}

template <class T>
void check_all_gather(Communicator& c, int64_t n, bool in_place, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank();
  DeviceBuffer bin(static_cast<size_t>(n) * sizeof(T)), bout(static_cast<size_t>(n * p) * sizeof(T));
  const Tensor tout = bout.view<T>(n * p);
  const Tensor tin = in_place ? tout.narrow(r * n, n) : bin.view<T>(n);
  write_late(tin, rank_input<T>(n, r, seed));
  c.all_gather(tout, tin);
  rep << "CASE all_gather/" << dtype_str<T>() << "/n=" << n << (in_place ? "/in_place" : "") << " "
      << rel_error(read_back<T>(tout), all_gather_reference<T>(n, p, seed)) << " 0\n";
}

template <class T>
void check_broadcast(Communicator& c, int64_t n, std::ostream& rep) {
  for (int root = 0; root < c.size(); ++root) {
    const uint64_t seed = next_seed();
    DeviceBuffer buf(static_cast<size_t>(n) * sizeof(T));
    const Tensor t = buf.view<T>(n);
    write_late(t, rank_input<T>(n, c.rank(), seed));
    c.broadcast(t, root);
    rep << "CASE broadcast/" << dtype_str<T>() << "/n=" << n << "/root=" << root << " "
        << rel_error(read_back<T>(t), rank_reference<T>(n, root, seed)) << " 0\n";
  }
}

// K/V-style rotation: post the transfer, queue compute on the compute stream, then wait (which
// orders the compute stream, not the host). After size-1 steps every rank has summed every block.
void check_ring_rotation(Communicator& c, std::ostream& rep) {
  const int64_t n = 1031;
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  DeviceBuffer a(n * sizeof(float)), b(n * sizeof(float));
  Tensor cur = a.view<float>(n), incoming = b.view<float>(n);
  std::vector<float> mine = rank_input<float>(n, r, seed);
  std::vector<double> acc(mine.begin(), mine.end());
  write_late(cur, mine);  // the send must wait for it
  const CommStats before = c.stats();
  for (int step = 0; step < p - 1; ++step) {
    const P2POp ops[] = {P2POp::send(cur, next), P2POp::recv(incoming, prev)};
    auto work = c.start_p2p(ops);
    delay_compute_stream();  // stands for the attention block computed meanwhile
    work->wait();
    for (int64_t i = 0; const float v : read_back<float>(incoming)) acc[i++] += v;
    std::swap(cur, incoming);
  }
  rep << "CASE p2p/ring_rotation "
      << rel_error(std::vector<float>(acc.begin(), acc.end()), all_reduce_reference<float>(n, p, ReduceOp::sum, seed))
      << " 1e-6\n";
  const CommStats after = c.stats();
  rep << "CASE bytes/p2p_ring_sent " << std::abs(after.bytes_sent - before.bytes_sent - (p - 1) * n * 4) << " 0\n";
  rep << "CASE bytes/p2p_ring_received " << std::abs(after.bytes_received - before.bytes_received - (p - 1) * n * 4)
      << " 0\n";
  rep << "CASE bytes/p2p_ring_messages " << std::abs(after.p2p_messages - before.p2p_messages - 2 * (p - 1))
      << " 0\n";
}

// One batch with two dtypes in both directions around the ring.
void check_bidirectional_batch(Communicator& c, std::ostream& rep) {
  const uint64_t seed = next_seed();
  const int p = c.size(), r = c.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
  DeviceBuffer i_out(37 * 4), i_in(37 * 4), h_out(53 * 2), h_in(53 * 2);
  write_late(i_out.view<int32_t>(37), rank_input<int32_t>(37, r, seed));
  write_late(h_out.view<bf16>(53), rank_input<bf16>(53, r, seed + 1));
  const P2POp ops[] = {P2POp::recv(i_in.view<int32_t>(37), prev), P2POp::send(i_out.view<int32_t>(37), next),
                       P2POp::send(h_out.view<bf16>(53), prev), P2POp::recv(h_in.view<bf16>(53), next)};
  c.p2p(ops);
  rep << "CASE p2p/bidirectional_i32 "
      << rel_error(read_back<int32_t>(i_in.view<int32_t>(37)), rank_reference<int32_t>(37, prev, seed)) << " 0\n";
  rep << "CASE p2p/bidirectional_bf16 "
      << rel_error(read_back<bf16>(h_in.view<bf16>(53)), rank_reference<bf16>(53, next, seed + 1)) << " 0\n";
}

// The counters against the volumes documented in nccl_communicator.h (the Gloo backend's, with
// bf16 at 2 bytes an element).
void check_byte_counters(Communicator& c, std::ostream& rep) {
  const int p = c.size(), r = c.rank();
  const int64_t n = 1031;
  auto chunks = balanced_chunks(n, p);
  DeviceBuffer buf(n * p * 4), out(n * 4), halves(n * 2);
  zero(buf.view<float>(n * p));
  zero(out.view<float>(n));
  zero(halves.view<bf16>(n));

  c.reset_stats();
  c.all_reduce(buf.view<float>(n));
  const int64_t expect_ar = (n - chunks[r]) + (n - chunks[(r + 1) % p]);
  const int64_t expect_ar_in = (n - chunks[(r + p - 1) % p]) + (n - chunks[r]);
  rep << "CASE bytes/all_reduce " << std::abs(c.stats().bytes_sent - 4 * expect_ar) << " 0\n";
  rep << "CASE bytes/all_reduce_received " << std::abs(c.stats().bytes_received - 4 * expect_ar_in) << " 0\n";

  c.reset_stats();
  c.reduce_scatter(out.view<float>(n), buf.view<float>(n * p));
  rep << "CASE bytes/reduce_scatter " << std::abs(c.stats().bytes_sent - 4 * (p - 1) * n) << " 0\n";
  rep << "CASE bytes/reduce_scatter_received " << std::abs(c.stats().bytes_received - 4 * (p - 1) * n) << " 0\n";

  c.reset_stats();
  c.all_gather(buf.view<float>(n * p), out.view<float>(n));
  rep << "CASE bytes/all_gather " << std::abs(c.stats().bytes_sent - 4 * (p - 1) * n) << " 0\n";

  c.reset_stats();
  c.broadcast(out.view<float>(n), 1);
  rep << "CASE bytes/broadcast_sent " << std::abs(c.stats().bytes_sent - (r == 1 ? 4 * (p - 1) * n : 0)) << " 0\n";
  rep << "CASE bytes/broadcast_received " << std::abs(c.stats().bytes_received - (r == 1 ? 0 : 4 * n)) << " 0\n";
  rep << "CASE bytes/collective_count " << std::abs(c.stats().collectives - 1) << " 0\n";

  c.reset_stats();
  c.all_reduce(halves.view<bf16>(n));
  rep << "CASE bytes/all_reduce_bf16_native " << std::abs(c.stats().bytes_sent - 2 * expect_ar) << " 0\n";

  c.reset_stats();
  c.barrier();
  rep << "CASE bytes/barrier_counts_no_bytes " << c.stats().bytes_sent + c.stats().bytes_received << " 0\n";
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}

// Not asserted, printed: what NCCL's max does with a NaN (it drops it, unlike the Gloo backend;
// documented in nccl_communicator.h).
void note_max_with_nan(Communicator& c) {
  DeviceBuffer buf(3 * 4);
  std::vector<float> v = {1.0f * c.rank(), -5.0f, 2.0f};
  if (c.rank() == c.size() - 1) v[1] = std::nanf("");
  write_late(buf.view<float>(3), v);
  c.all_reduce(buf.view<float>(3), ReduceOp::max);
  std::printf("NOTE rank %d: max over ranks of {rank, -5 or NaN on the last rank, 2} = {%g, %g, %g}\n", c.rank(),
              static_cast<double>(read_back<float>(buf.view<float>(3))[0]),
              static_cast<double>(read_back<float>(buf.view<float>(3))[1]),
              static_cast<double>(read_back<float>(buf.view<float>(3))[2]));
}

// Every group of Distributed reduces exactly its members (groups of one are the identity).
void check_groups(Distributed& d, std::ostream& rep) {
  const int r = d.rank();
  const ParallelShape s = d.shape();
  DeviceBuffer buf(4);
  auto check = [&](const char* name, Communicator& c, const RankGroup& g) {
    write_late(buf.view<int32_t>(1), std::vector<int32_t>{r + 1});
    c.all_reduce(buf.view<int32_t>(1));
    int32_t expect = 0;
    for (int q : g.ranks) expect += q + 1;
    rep << "CASE group/" << name << " " << std::abs(read_back<int32_t>(buf.view<int32_t>(1))[0] - expect) << " 0\n";
    rep << "CASE group/" << name << "_members " << (c.ranks() != g.ranks) << " 0\n";
    rep << "CASE group/" << name << "_backend " << (c.backend() != Backend::nccl) << " 0\n";
  };
  check("world", d.world(), world_group(s));
  check("sp", d.sp(), sp_group(s, r));
  check("dp", d.dp(), dp_group(s, r));
  check("intra", d.intra_node(), intra_node_ring(s, r));
  check("inter", d.inter_node(), inter_node_ring(s, r));
}

// A CPU tensor is refused with a message naming the operation.
void check_cpu_tensor_refused(Communicator& c, std::ostream& rep) {
  std::vector<float> host(4, 1.0f);
  std::string what;
  try {
    c.all_reduce(Tensor(host.data(), DType::f32, {4}));
  } catch (const Error& e) {
    what = e.what();
  }
  rep << "CASE errors/cpu_tensor_refused " << (what.find("all_reduce: the tensor f32[4] cpu is on the wrong device") == std::string::npos)
      << " 0\n";
}

DistributedOptions nccl_options() {
  DistributedOptions o;
  o.backend = Backend::nccl;
  return options_from_env(o);
}

int run_collectives() {
  const WorldInfo w = world_from_env();
  Distributed d(w, nccl_options());
  Communicator& c = d.world();
  std::ostringstream rep;
  rep.precision(3);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    for (int64_t n : {1, 7, 1031, 65537, 1048579}) {
      check_all_reduce<float>(c, n, op, rep);
      check_all_reduce<bf16>(c, n, op, rep);
      check_all_reduce<double>(c, n, op, rep);
      check_all_reduce<int32_t>(c, n, op, rep);
    }
    for (int64_t n : {1, 7, 1031, 65537}) {
      check_reduce_scatter<float>(c, n, op, false, rep);
      check_reduce_scatter<bf16>(c, n, op, false, rep);
      check_reduce_scatter<double>(c, n, op, false, rep);
      check_reduce_scatter<int32_t>(c, n, op, false, rep);
    }
  }
  check_reduce_scatter<float>(c, 1031, ReduceOp::sum, true, rep);
  check_reduce_scatter<bf16>(c, 7, ReduceOp::sum, true, rep);
  for (int64_t n : {17, 65537}) {
    check_reduce_scatter_range<float>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<bf16>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<double>(c, n, ReduceOp::sum, rep);
    check_reduce_scatter_range<int32_t>(c, n, ReduceOp::sum, rep);
  }
  check_reduce_scatter_range<float>(c, 17, ReduceOp::max, rep);
  check_reduce_scatter_range_overlaps(c, rep);
  for (int64_t n : {1, 7, 1031, 65537}) {
    check_all_gather<float>(c, n, false, rep);
    check_all_gather<bf16>(c, n, false, rep);
    check_all_gather<int32_t>(c, n, false, rep);
    check_all_gather<double>(c, n, true, rep);
  }
  check_broadcast<float>(c, 1031, rep);
  check_broadcast<bf16>(c, 65537, rep);
  check_broadcast<int32_t>(c, 1, rep);
  check_barrier(d, rep);
  check_ring_rotation(c, rep);
  check_bidirectional_batch(c, rep);
  check_byte_counters(c, rep);
  check_groups(d, rep);
  check_cpu_tensor_refused(c, rep);
  note_max_with_nan(c);
  std::printf("%s", rep.str().c_str());
  std::printf("rank %d: done on GPU %d, NCCL %d\n", w.rank, dynamic_cast<NcclCommunicator&>(c).cuda_device(),
              nccl_version());
  std::fflush(stdout);
  return 0;
}

// Prints a failure the moment it is caught (the launcher may stop this rank soon after).
int report(const Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  std::fflush(stderr);
  return 1;
}

int run_timeout(int missing, int timeout_ms) {
  const WorldInfo w = world_from_env();
  Distributed d(w, nccl_options());
  d.world().barrier();
  d.world().set_timeout(Millis(timeout_ms));
  if (w.rank == missing) {
    std::this_thread::sleep_for(60s);
    return 0;
  }
  DeviceBuffer buf(1031 * 4);
  zero(buf.view<float>(1031));
  try {
    d.world().all_reduce(buf.view<float>(1031));
    dynamic_cast<NcclCommunicator&>(d.world()).synchronize();
  } catch (const Error& e) {
    return report(e);
  }
  std::printf("rank %d: no error\n", w.rank);
  return 0;
}

int run_missing_send(int timeout_ms) {
  const WorldInfo w = world_from_env();
  Distributed d(w, nccl_options());
  d.world().barrier();
  d.world().set_timeout(Millis(timeout_ms));
  DeviceBuffer buf(64 * 4);
  const Tensor t = buf.view<float>(64);
  zero(t);
  if (w.rank == 1) {
    const P2POp first[] = {P2POp::send(t, 0)};
    d.world().p2p(first);  // send #1 arrives; #2 never will
    std::this_thread::sleep_for(60s);
    return 0;
  }
  if (w.rank != 0) return 0;
  try {
    const P2POp ops[] = {P2POp::recv(t, 1)};
    d.world().p2p(ops);
    auto work = d.world().start_p2p(ops);
    work->wait();
    dynamic_cast<NcclCommunicator&>(d.world()).synchronize();
  } catch (const Error& e) {
    return report(e);
  }
  std::printf("rank %d: no error\n", w.rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv + 1, argv + argc);
    if (a.size() == 1 && a[0] == "collectives") return run_collectives();
    if (a.size() == 3 && a[0] == "timeout") return run_timeout(std::stoi(a[1]), std::stoi(a[2]));
    if (a.size() == 2 && a[0] == "missing-send") return run_missing_send(std::stoi(a[1]));
    std::fprintf(stderr, "usage: parallel_nccl_worker collectives | timeout RANK MS | missing-send MS\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
