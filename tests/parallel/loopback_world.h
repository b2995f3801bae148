// The world of the multi-process tests: ranks forked on this machine (run_ranks, multiproc_util.h)
// meeting at 127.0.0.1, and the Distributed options they run under.
#pragma once

#include <chrono>

#include "parallel/distributed.h"

namespace longtrain::test {

// Rank `rank` of `n` processes on this machine, meeting at 127.0.0.1:`port`, `per_node` ranks per node
// (0: all n on one node; fewer makes a several-node topology out of one machine).
inline parallel::WorldInfo loopback_world(int rank, int n, int port, int per_node = 0) {
  parallel::WorldInfo w;
  w.rank = rank;
  w.world_size = n;
  w.local_world_size = per_node > 0 ? per_node : n;
  w.local_rank = rank % w.local_world_size;
  w.master_addr = "127.0.0.1";
  w.master_port = port;
  w.source = "test";
  return w;
}

// `sp` ranks per sequence-parallel group, `timeout` for a collective, 10 s to connect: a test that
// hangs fails in seconds instead of the defaults' minutes.
inline parallel::DistributedOptions distributed_options(int sp,
                                                        std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  parallel::DistributedOptions o;
  o.sp_size = sp;
  o.timeout = timeout;
  o.connect_timeout = std::chrono::seconds(10);
  return o;
}

}  // namespace longtrain::test
