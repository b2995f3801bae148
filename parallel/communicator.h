// Communicator: collectives and point-to-point transfers among the ranks of one process group. One
// interface, two backends: Gloo for CPU tensors (gloo_communicator.h; every parallel algorithm runs
// and is tested on CPU with several processes) and NCCL for CUDA tensors (nccl_communicator.h, in
// CUDA builds: its operations are queued on a communication stream ordered against the compute
// stream by events, so they return before the device has done them; see there).
//
// Tensors are contiguous views (f32, f64, bf16, i32) used as flat ranges; the element counts below
// are numel(). Ranks are numbered inside the group: rank() in [0, size()); ranks() maps them to
// global ranks. Collectives are called by every member in the same order. A communicator is used
// by one thread at a time.
//
// Failure: every blocking call is bounded by timeout(). When it passes, or a peer's connection
// breaks, the call throws longtrain::Error naming the operation, its sequence number, the group and
// the rank(s) that did not arrive (each rank's progress is published through the store), and the
// communicator is unusable afterwards. (NCCL: a watchdog keeps the bound on the device and the next
// call on the communicator throws; nccl_communicator.h.)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/arena.h"
#include "runtime/tensor.h"

namespace longtrain::parallel {

using Millis = std::chrono::milliseconds;

class TcpStore;

enum class ReduceOp : uint8_t { sum, max };

std::string_view reduce_op_name(ReduceOp op);

// One transfer of a grouped send/recv batch: send `tensor` to group rank `peer`, or receive into it
// from `peer`. A recv's tensor must have the byte size of the matching send. Between two ranks,
// sends match receives in the order they were issued.
struct P2POp {
  enum class Kind : uint8_t { send, recv };
  Kind kind;
  Tensor tensor;
  int peer;

  static P2POp send(Tensor t, int peer) { return {Kind::send, t, peer}; }
  static P2POp recv(Tensor t, int peer) { return {Kind::recv, t, peer}; }
};

// A batch of transfers in flight. wait() blocks until all of them completed (bounded by the
// communicator's timeout, counted from the wait() call, so compute between start and wait is
// free). Destroying an unwaited handle waits, so the tensors' memory is never left in use. The
// tensors must stay alive, and the communicator too, until then. NCCL: wait() makes the compute
// stream wait for the transfers instead of blocking the host (nccl_communicator.h).
class P2PWork {
 public:
  virtual ~P2PWork() = default;
  virtual void wait() = 0;
};

// A collective in flight (start_reduce_scatter_range). wait() makes its result usable: Gloo runs
// the collective before start returns, so wait() has nothing left to do; NCCL: wait() makes the
// compute stream wait for it, without blocking the host (P2PWork's rules). Destroying an unwaited
// handle waits. The tensor must stay alive, and the communicator too, until then.
class CollectiveWork {
 public:
  virtual ~CollectiveWork() = default;
  virtual void wait() = 0;
};

// Traffic of this rank through one communicator (the payload bytes it handed to the transport).
struct CommStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t collectives = 0;    // collective calls, barriers included
  int64_t p2p_messages = 0;   // sends and receives posted
};

enum class Backend : uint8_t { gloo, nccl };

struct CommOptions {
  Millis timeout{300'000};  // bound of every blocking call
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }  // group rank -> global rank
  virtual Backend backend() const = 0;
  virtual Device device() const = 0;  // where its tensors must live

  // In place: t := op over ranks of t.
  virtual void all_reduce(Tensor t, ReduceOp op = ReduceOp::sum) = 0;
  // in [size * n] on every rank; out [n] := op over ranks of in[rank * n, (rank + 1) * n). out may be
  // that slice of in.
  virtual void reduce_scatter(Tensor out, Tensor in, ReduceOp op = ReduceOp::sum) = 0;
  // in [n]; out [size * n] with out[r * n, (r + 1) * n) := in of rank r. in may be this rank's slice.
  virtual void all_gather(Tensor out, Tensor in) = 0;
  // One bucket of a reduce_scatter in place, for overlapping gradient reduction with backward.
  // flat [size * n] is laid out alike on every rank and split as reduce_scatter splits it: rank r
  // owns the shard [r * n, (r + 1) * n). For every rank r whose shard intersects [begin, end),
  // the intersection is reduced (op over ranks) into rank r's flat; elements of flat outside this
  // rank's shard are left unchanged. So buckets that partition [0, size * n) together do exactly
  // reduce_scatter(flat.narrow(0, rank * n, n), flat): the same result on this rank's shard and
  // the same traffic (Gloo: bit for bit, the same ring order per element; NCCL: one ncclReduce per
  // intersected shard, in one group, which with 2 ranks adds the same two values, and with more
  // may add in another order than ncclReduceScatter). Traffic counters: sent Σ over intersected
  // shards c != rank of their length, received Σ over c != rank - 1 (the ring reduce-scatter's
  // volumes restricted to the bucket). Every rank calls it with the same flat size, begin and end.
  // Gloo: runs the collective before it returns. NCCL: queued on the communication stream behind
  // the compute work queued so far; the compute stream does not wait for it until wait().
  [[nodiscard]] virtual std::unique_ptr<CollectiveWork> start_reduce_scatter_range(Tensor flat, int64_t begin,
                                                                                  int64_t end,
                                                                                  ReduceOp op = ReduceOp::sum) = 0;
  void reduce_scatter_range(Tensor flat, int64_t begin, int64_t end, ReduceOp op = ReduceOp::sum) {
    start_reduce_scatter_range(flat, begin, end, op)->wait();
  }
  // t := t of rank `root`.
  virtual void broadcast(Tensor t, int root) = 0;
  virtual void barrier() = 0;
  // Posts every transfer of the batch and returns at once (communication overlaps compute).
  [[nodiscard]] virtual std::unique_ptr<P2PWork> start_p2p(std::span<const P2POp> ops) = 0;
  void p2p(std::span<const P2POp> ops) { start_p2p(ops)->wait(); }
  // All-to-all of several tensors per peer, as one grouped send/recv batch (both backends: Gloo's
  // send/recv; NCCL's ncclSend/ncclRecv inside one ncclGroupStart/End on the communication stream).
  // send[r][j] goes to rank r, arriving in rank r's recv[this rank][j], which must have its byte
  // size. send.size() == recv.size() == size(); send[rank()][j] is copied into recv[rank()][j]
  // locally (contiguous tensors of one dtype; on CUDA queued on the compute stream) and never
  // counted as traffic. Tensors must stay alive until the work is waited for (P2PWork's rules).
  // Sent bytes: the sum over r != rank() of send[r]'s bytes.
  [[nodiscard]] std::unique_ptr<P2PWork> start_all_to_all(const std::vector<std::vector<Tensor>>& send,
                                                          const std::vector<std::vector<Tensor>>& recv);
  // Equal split: in and out [size() * n]; out[r * n, (r + 1) * n) := rank r's in[rank() * n, ...).
  // Sends (size() - 1) · n elements. in and out must not overlap.
  void all_to_all(Tensor out, Tensor in);

  CommStats stats() const;
  void reset_stats();
  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

  // A device buffer of at least n f64 values, kept by the communicator for all_reduce_host_values (so a
  // step's loss and count reductions allocate nothing after the first); grows, never shrinks.
  Tensor host_values_staging(int64_t n);

  // "rank 3" or "ranks 3, 5" from group ranks, shown as global ranks.
  std::string describe_ranks(const std::vector<int>& group_ranks) const;
  std::string describe_group() const;  // "'sp1' (global ranks 2, 3)"

 protected:
  Communicator(std::string name, std::vector<int> ranks, int rank, Millis timeout);

  void count_sent(int64_t bytes) { bytes_sent_ += bytes; }
  void count_received(int64_t bytes) { bytes_received_ += bytes; }
  void count_collective() { ++collectives_; }
  void count_p2p(int64_t n) { p2p_messages_ += n; }

  std::string name_;
  std::vector<int> ranks_;
  int rank_;
  Millis timeout_;

 private:
  std::atomic<int64_t> bytes_sent_{0}, bytes_received_{0}, collectives_{0}, p2p_messages_{0};
  std::unique_ptr<Arena> host_values_;
};

// Argument checks shared by the backends; throw naming the operation, the group and the tensors.
void check_comm_tensor(const char* op, const Tensor& t, Device device);
// reduce_scatter's arguments: both on `device`, one dtype, in holding size() x out's elements. Returns
// out's element count n.
int64_t check_reduce_scatter(const Communicator& c, const Tensor& out, const Tensor& in, Device device);
// all_gather's: both on `device`, one dtype, out holding size() x in's elements. Returns in's count n.
int64_t check_all_gather(const Communicator& c, const Tensor& out, const Tensor& in, Device device);
// start_reduce_scatter_range's arguments: flat on `device`, splitting into size() equal shards,
// 0 <= begin <= end <= numel. Returns the shard length n.
int64_t check_reduce_scatter_range(const Communicator& c, const Tensor& flat, int64_t begin, int64_t end,
                                   Device device);

// The intersection [begin, end) of a bucket with shard `shard` of length n (empty: begin == end),
// and the ring volumes start_reduce_scatter_range counts for this rank (in elements).
struct RangeShare {
  int64_t begin, end;
};
RangeShare shard_share(int64_t range_begin, int64_t range_end, int64_t n, int shard);
struct RangeVolumes {
  int64_t sent = 0, received = 0;
};
RangeVolumes reduce_scatter_range_volumes(int64_t range_begin, int64_t range_end, int64_t n, int size, int rank);

// In place over the ranks of `comm`: the sum (or max) of a few host values (losses, counts, timings).
// NCCL reduces device memory, so there they travel through the communicator's small device buffer
// (host_values_staging: allocated once, not per call).
void all_reduce_host_values(Communicator& comm, double* values, int64_t n, ReduceOp op = ReduceOp::sum);

// Creates the communicator `name` over `global_ranks` (ascending or ring order) for this process,
// global rank `my_global_rank`, which must be one of them. Every member calls it with the same name
// and ranks; it returns once all have joined, or throws naming the ranks that did not join within
// the timeout. Names are scoped by a generation counter, so creating the same group twice in one
// process is fine as long as every member does it. Backend::nccl uses the calling thread's current
// CUDA device (one GPU per rank) and exists only in CUDA builds; elsewhere it throws.
std::unique_ptr<Communicator> make_communicator(Backend backend, TcpStore& store, const std::string& name,
                                                const std::vector<int>& global_ranks, int my_global_rank,
                                                CommOptions options = {});

}  // namespace longtrain::parallel
