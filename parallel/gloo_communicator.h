// GlooCommunicator: the CPU backend, over Debian's Gloo (0.5, 2022): Gloo's TCP transport, its
// rendezvous (our TcpStore behind gloo::rendezvous::Store) and its barrier. The data collectives are
// rings written here over Gloo's unbound-buffer send/recv, not Gloo's own algorithms, because:
//   - this Gloo has no new-style reduce-scatter, and no bf16 type;
//   - the byte counters must be exact (distributed-attention tests assert traffic volumes), and
//     Gloo's segmented ring sends amounts that depend on internal segment rounding.
// Volumes per rank, for n elements of b bytes on P ranks (chunk c of the balanced split has n_c):
//   reduce_scatter (n per rank out): (P-1)·n·b        all_gather (n per rank in): (P-1)·n·b
//   all_reduce: (n - n_rank)·b + (n - n_{rank+1})·b   (ring reduce-scatter + ring all-gather)
//   broadcast: (P-1)·n·b from the root, 0 from the others      barrier: none counted
//   reduce_scatter_range: reduce_scatter's ring restricted to the bucket (communicator.h)
// bf16 is reduced in f32: the tensor is widened, the ring runs in f32 (so the counters show f32
// bytes) and the result is rounded once to bf16, so no partial sum is rounded at every hop.
// Reductions: sum and max; max propagates NaN, so an overflow check sees any rank's NaN.
//
// Gloo binds its pair sockets to LONGTRAIN_GLOO_IFNAME (an interface name) or LONGTRAIN_GLOO_HOST
// (an address) when set, else to this machine's address on the route to the store (127.0.0.1 when
// MASTER_ADDR is loopback).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace longtrain::parallel {

class GlooCommunicator final : public Communicator {
 public:
  // See make_communicator.
  GlooCommunicator(TcpStore& store, const std::string& name, std::vector<int> global_ranks, int my_global_rank,
                   CommOptions options);
  ~GlooCommunicator() override;

  Backend backend() const override { return Backend::gloo; }
  Device device() const override { return Device::cpu; }

  void all_reduce(Tensor t, ReduceOp op = ReduceOp::sum) override;
  void reduce_scatter(Tensor out, Tensor in, ReduceOp op = ReduceOp::sum) override;
  void all_gather(Tensor out, Tensor in) override;
  // The ring reduce-scatter over the bucket's parts of the shards: synchronous, so the work it
  // returns is already complete.
  [[nodiscard]] std::unique_ptr<CollectiveWork> start_reduce_scatter_range(Tensor flat, int64_t begin, int64_t end,
                                                                          ReduceOp op = ReduceOp::sum) override;
  void broadcast(Tensor t, int root) override;
  void barrier() override;
  [[nodiscard]] std::unique_ptr<P2PWork> start_p2p(std::span<const P2POp> ops) override;

  struct Impl;  // gloo_communicator.cpp; keeps Gloo's headers out of this one

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace longtrain::parallel
