// NcclCommunicator: the CUDA backend, over NCCL. Compiled only when longtrain is built with CUDA
// (LONGTRAIN_HAS_CUDA); make_communicator(Backend::nccl, ...) creates it.
//
// Creation: every member announces itself in the store (a rank that never joins is named, as with
// Gloo); group rank 0 creates the ncclUniqueId and publishes it under the communicator's key
// ("lt/nccl/<name>/<generation>/id"); every member then runs ncclCommInitRank on its current CUDA
// device (Distributed makes LOCAL_RANK's GPU current first: select_local_cuda_device).
//
// Streams: the communicator owns one CUDA stream for its communication. Every operation records an
// event on the compute stream (cudaStreamPerThread, the stream every longtrain CUDA op runs on, of
// the calling thread), makes the communication stream wait for it, runs the NCCL call there, and
// makes the compute stream wait for an event recorded after it. Ordering is by events only: the
// host never waits for the device, and compute queued before an operation overlaps communication
// queued before it. Consequently:
//   - all_reduce, reduce_scatter, all_gather and broadcast return as soon as they are queued; the
//     result is ready for whatever the caller queues next on the compute stream.
//   - start_p2p queues the whole batch (ncclGroupStart, ncclSend/ncclRecv, ncclGroupEnd) on the
//     communication stream and returns; P2PWork::wait() makes the compute stream wait for the batch.
//     wait() orders the device streams; it does NOT block the host (copy a result to the host, or
//     call synchronize(), to wait for it there). Between start and wait, compute on the compute
//     stream runs concurrently with the transfers.
//   - start_reduce_scatter_range queues its ncclReduce calls (one per intersected shard, in one
//     group) on the communication stream behind the compute work queued so far, and returns
//     without making the compute stream wait: compute queued afterwards (the next layers'
//     backward) overlaps it. CollectiveWork::wait() makes the compute stream wait for it.
//   - barrier() blocks the host until every rank reached it (an all_reduce of one integer that the
//     host waits for), so host-side effects before it (say, store keys) are visible after it.
//
// Timeouts: NCCL calls are asynchronous, so the bound is kept by a watchdog thread (the
// communicator is non-blocking: ncclConfig blocking = 0). It polls each queued operation's events
// and ncclCommGetAsyncError. An operation's clock starts when it can start on the device (the
// compute work queued before it and the earlier communication are done); when timeout() passes
// first, or NCCL reports an asynchronous error, the watchdog names the operation, its sequence
// number, the group and, from the progress every rank publishes through the store (as the Gloo
// backend does), the rank(s) that did not arrive; then it aborts the communicator (ncclCommAbort,
// which ends the stuck kernels), tells the other ranks through the store, and the error is thrown
// by the next call on this communicator on this rank (any operation, P2PWork::wait, barrier or
// synchronize). If no call collects it within kUncollectedFailureGrace, the process prints it and
// exits with status 1: after an abort the device has consumed garbage, and a rank must not carry on
// (say, to write a checkpoint) as if nothing happened. Queueing itself is bounded by the timeout too
// (NCCL may need the peers to set up connections at the first operation).
//
// Dtypes: f32, f64, i32 and bf16, all native in NCCL (bf16 is reduced by NCCL in bf16 hops: with 2
// ranks a sum is rounded once, as in the Gloo backend). Reductions: sum and max. Unlike the Gloo
// backend, max does NOT propagate NaN (NCCL takes fmax: max over {NaN, -5} is -5, seen on NCCL
// 2.28.9); a check for NaN or overflow on any rank must all-reduce a sum (NaN + x is NaN).
//
// Cost: NCCL launches every call of a non-blocking communicator from a thread it creates for the
// call, so each call costs the caller ~80 us on the host (H200 pair, NCCL 2.28.9): below ~16 MiB
// per call a blocking communicator (PyTorch's default) is up to 2x faster; from 32 MiB up they match
// (bench/results/comm-h200x2-*.json). Bucket small tensors into large calls.
//
// Traffic counters (CommStats) use the same ring volumes as the Gloo backend, in the tensor's own
// dtype (Gloo widens bf16 to f32 on the wire; NCCL sends bf16, 2 bytes an element). For n elements
// of b bytes on P ranks, chunk c of the balanced split holding n_c elements:
//   all_reduce: sent (n - n_rank)·b + (n - n_{rank+1})·b, received (n - n_{rank-1})·b + (n - n_rank)·b
//   reduce_scatter (n out) and all_gather (n in): (P-1)·n·b each way
//   reduce_scatter_range: reduce_scatter's ring volumes restricted to the bucket (communicator.h)
//   broadcast: (P-1)·n·b sent by the root, n·b received by the others     barrier: none counted
//   send/recv: the payload bytes of each transfer.
// They count payload handed to NCCL as a ring would move it, not NCCL's actual protocol traffic
// (which depends on its algorithm choice), so distributed-attention volume tests hold on both backends.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace longtrain::parallel {

// How long a failure found by the watchdog waits for a call on the communicator to throw it before
// the process prints it and exits.
constexpr Millis kUncollectedFailureGrace{5'000};

class NcclCommunicator final : public Communicator {
 public:
  // See make_communicator. Uses the calling thread's current CUDA device.
  NcclCommunicator(TcpStore& store, const std::string& name, std::vector<int> global_ranks, int my_global_rank,
                   CommOptions options);
  ~NcclCommunicator() override;

  Backend backend() const override { return Backend::nccl; }
  Device device() const override { return Device::cuda; }

  void all_reduce(Tensor t, ReduceOp op = ReduceOp::sum) override;
  void reduce_scatter(Tensor out, Tensor in, ReduceOp op = ReduceOp::sum) override;
  void all_gather(Tensor out, Tensor in) override;
  [[nodiscard]] std::unique_ptr<CollectiveWork> start_reduce_scatter_range(Tensor flat, int64_t begin, int64_t end,
                                                                          ReduceOp op = ReduceOp::sum) override;
  void broadcast(Tensor t, int root) override;
  void barrier() override;
  [[nodiscard]] std::unique_ptr<P2PWork> start_p2p(std::span<const P2POp> ops) override;

  // Blocks the host until everything queued on this communicator so far has completed on the
  // device; throws the communicator's failure, if any (bounded by the watchdog's timeout).
  void synchronize();

  int cuda_device() const;  // the device its communicator and stream live on

  struct Impl;  // nccl_communicator.cpp; keeps NCCL's and CUDA's headers out of this one

 private:
  std::unique_ptr<Impl> impl_;
};

// Makes GPU `local_rank` current for this process (cudaSetDevice), after checking that at least
// `local_world_size` GPUs are visible: one rank per GPU, as longtrain-run and torchrun start them.
void select_local_cuda_device(int local_rank, int local_world_size);

// The NCCL version the process runs with (NCCL_VERSION_CODE encoding, e.g. 22803 for 2.28.3).
int nccl_version();

}  // namespace longtrain::parallel
