// The parallel runtime of one process: who am I (from torchrun's or Slurm's environment), the
// rendezvous store, and the communicators of my process groups.
//
//   WorldInfo w = world_from_env();                 // RANK, WORLD_SIZE, ... (longtrain-run sets them)
//   Distributed dist(w, options_from_env({.sp_size = 2}));
//   dist.sp().all_reduce(t);
//
// Environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's
// names). Without RANK, Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
// and the first host of SLURM_JOB_NODELIST are used (srun launching one task per GPU). With neither,
// a single process (rank 0 of 1). A partial or inconsistent set is an error naming the variable.
// Timeouts: LONGTRAIN_TIMEOUT_S (every blocking collective and store wait, default 300) and
// LONGTRAIN_CONNECT_TIMEOUT_S (reaching the store, default 300).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "parallel/process_group.h"
#include "parallel/store.h"

namespace longtrain::parallel {

struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "default";  // "torchrun", "slurm" or "default": where the values came from
};

// Reads the variables from `env` (tests pass a map; the real process uses the environment).
using EnvLookup = std::function<const char*(const char* name)>;
WorldInfo world_from_env(const EnvLookup& env);
WorldInfo world_from_env();

// Slurm helpers (also used by longtrain-run).
// "node[03-05,9],gpu7" -> "node03"; "a,b" -> "a"; throws on an empty or malformed list.
std::string first_host_of_nodelist(std::string_view nodelist);
// SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE: "4", "4(x2)", "4(x2),3" -> 4 (the first node's count).
int first_tasks_per_node(std::string_view tasks_per_node);

struct DistributedOptions {
  int sp_size = 1;
  // parallel.ulysses_size: when 1 < it < sp_size, the Ulysses groups and the rings across them are
  // created too (process_group.h).
  int ulysses_size = 1;
  // gloo for CPU tensors; nccl for CUDA tensors (CUDA builds): the process then takes GPU
  // LOCAL_RANK (cudaSetDevice) before its communicators are created, one GPU per rank.
  Backend backend = Backend::gloo;
  Millis timeout{300'000};
  Millis connect_timeout{300'000};
  // How long the rendezvous store may stay silent before a rank calls it lost (StoreOptions).
  Millis store_timeout{30'000};
  // See StoreOptions::on_peer_failure (empty: print and exit with kExitPeerFailure).
  std::function<void(const std::string&)> on_peer_failure;
};

// `defaults` with LONGTRAIN_TIMEOUT_S / LONGTRAIN_CONNECT_TIMEOUT_S / LONGTRAIN_STORE_TIMEOUT_S applied
// (fractions allowed).
DistributedOptions options_from_env(DistributedOptions defaults);

class Distributed {
 public:
  Distributed(const WorldInfo& world, DistributedOptions options);

  const WorldInfo& world_info() const { return world_; }
  const ParallelShape& shape() const { return shape_; }
  int rank() const { return world_.rank; }
  TcpStore& store() { return store_; }
  Communicator& world() { return *groups_.world; }
  Communicator& sp() { return *groups_.sp; }
  Communicator& dp() { return *groups_.dp; }
  Communicator& intra_node() { return *groups_.intra_node; }
  Communicator& inter_node() { return *groups_.inter_node; }
  Communicator* ulysses() { return groups_.ulysses.get(); }            // null unless 1 < U < sp_size
  Communicator* ulysses_ring() { return groups_.ulysses_ring.get(); }  // likewise
  // burst's double ring over ulysses_ring (null unless it spans nodes: process_group.h ulysses_ring_nodes)
  Communicator* ulysses_ring_intra_node() { return groups_.ulysses_ring_intra.get(); }
  Communicator* ulysses_ring_inter_node() { return groups_.ulysses_ring_inter.get(); }

 private:
  WorldInfo world_;
  ParallelShape shape_;
  TcpStore store_;         // destroyed last: communicators unpublish from it
  ProcessGroups groups_;
};

}  // namespace longtrain::parallel
