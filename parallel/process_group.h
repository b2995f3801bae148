// Process groups: which global ranks talk to which. World = DP x SP.
//
//   world            every rank
//   sequence-parallel (SP) group k: the sp_size consecutive ranks [k·sp, (k+1)·sp); they share one
//                    sequence (consecutive, so a group sits inside a node whenever sp <= ranks/node)
//   data-parallel (DP) group j: the ranks at position j of every SP group: j, j+sp, j+2sp, ...
//   intra-node ring: the members of this rank's SP group on this rank's node
//   inter-node ring: the members of this rank's SP group with this rank's local rank (one per node)
// The two rings are what the topology-aware (BurstAttention double-ring) schedule needs: K/V
// circulate inside a node, and each inter-node hop is hidden behind a whole intra-node cycle.
//
// World 8 = 2 nodes x 4, sp 8:  SP {0..7}; DP {r}; intra of 5: {4,5,6,7}; inter of 5: {1,5}.
// World 8 = 2 nodes x 4, sp 2:  SP of 5: {4,5}; DP of 5: {1,3,5,7}; intra of 5: {4,5}; inter of 5: {5}.
//
// Pure functions of (world_size, local_world_size, sp_size, rank), so every rank computes every
// group the same way; create_process_groups turns this rank's groups into communicators.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace longtrain::parallel {

struct ParallelShape {
  int world_size = 1;
  int local_world_size = 1;  // ranks per node (LOCAL_WORLD_SIZE); every node has the same number
  int sp_size = 1;           // parallel.sp_size
  int ulysses_size = 1;      // parallel.ulysses_size: Ulysses groups of this many consecutive SP ranks
  int dp_size() const { return world_size / sp_size; }
  int nodes() const { return world_size / local_world_size; }
};

// Throws naming the value and what would fix it: sp_size must divide world_size, local_world_size
// must divide world_size, every size positive.
void check_parallel_shape(const ParallelShape& shape);

// A group: a name unique in the job and its global ranks in ring order (ascending).
struct RankGroup {
  std::string name;
  std::vector<int> ranks;
  int index_of(int global_rank) const;  // position of global_rank, -1 when absent
};

RankGroup world_group(const ParallelShape& shape);
RankGroup sp_group(const ParallelShape& shape, int rank);          // "sp<k>"
RankGroup dp_group(const ParallelShape& shape, int rank);          // "dp<j>"
RankGroup intra_node_ring(const ParallelShape& shape, int rank);   // "sp<k>.node<n>"
RankGroup inter_node_ring(const ParallelShape& shape, int rank);   // "sp<k>.local<l>"
// The 2D hybrid (attention/distributed/ulysses_attention.h), U = ulysses_size: SP rank p = g·U + u is
// member u of Ulysses group g, the U consecutive SP ranks [g·U, (g+1)·U); its ring across the groups
// is the SP ranks u, U + u, 2U + u, ... (one per group, in group order).
// sp 8, U 2:  Ulysses of SP rank 5: {4, 5} ("sp0.ulysses2"); ring of 5: {1, 3, 5, 7} ("sp0.across1").
RankGroup ulysses_group(const ParallelShape& shape, int rank);       // "sp<k>.ulysses<g>"
RankGroup ulysses_ring_group(const ParallelShape& shape, int rank);  // "sp<k>.across<u>"
// burst's double ring over the ring across the Ulysses groups, when that ring spans nodes: its members
// on this rank's node ("sp<k>.across<u>.node<n>") and its members at this rank's position among their
// node's members ("sp<k>.across<u>.local<j>").
// World 8 = 2 nodes x 4, sp 8, U 2: ring of 5 {1, 3, 5, 7}; intra of 5 {5, 7}; inter of 5 {1, 5}.
RankGroup ulysses_ring_intra_node(const ParallelShape& shape, int rank);
RankGroup ulysses_ring_inter_node(const ParallelShape& shape, int rank);
// The nodes those two rings tile the ring across the groups into (every node holding as many of its
// members): the SP group's nodes when whole Ulysses groups sit inside a node, R when each group spans
// whole nodes (one member per node); 1 when the SP group lies inside one node, the hybrid is off, or
// the shape is ragged (the single ring then).
int ulysses_ring_nodes(const ParallelShape& shape);

// True when the two rings tile every SP group as a grid (nodes x ranks of the group per node): the SP
// group lies inside one node (sp divides the ranks per node) or spans whole nodes (the ranks per node
// divide sp). Otherwise (say sp 3 with 2 ranks per node) the rings are ragged and the topology-aware
// double-ring schedule must not be used; the plain ring schedules work with any shape.
bool has_regular_rings(const ParallelShape& shape);

// Every group of one kind, for the whole world (a partition of the ranks).
std::vector<RankGroup> all_sp_groups(const ParallelShape& shape);
std::vector<RankGroup> all_dp_groups(const ParallelShape& shape);

// This rank's communicators over the groups above.
struct ProcessGroups {
  std::unique_ptr<Communicator> world, sp, dp, intra_node, inter_node;
  // Only when 1 < ulysses_size < sp_size (null otherwise); the ring's two rings only when
  // ulysses_ring_nodes > 1 as well.
  std::unique_ptr<Communicator> ulysses, ulysses_ring, ulysses_ring_intra, ulysses_ring_inter;
};

ProcessGroups create_process_groups(Backend backend, TcpStore& store, const ParallelShape& shape, int rank,
                                    CommOptions options = {});

}  // namespace longtrain::parallel
