#include "parallel/process_group.h"

#include <algorithm>

#include <fmt/format.h>

#include "runtime/error.h"

namespace longtrain::parallel {

void check_parallel_shape(const ParallelShape& s) {
  LT_CHECK(s.world_size >= 1, "world size {} must be at least 1", s.world_size);
  LT_CHECK(s.local_world_size >= 1 && s.local_world_size <= s.world_size,
           "ranks per node (LOCAL_WORLD_SIZE / --nproc-per-node) {} must be in [1, world size {}]",
           s.local_world_size, s.world_size);
  LT_CHECK(s.world_size % s.local_world_size == 0,
           "world size {} is not a multiple of the ranks per node {}: every node must run the same number of ranks",
           s.world_size, s.local_world_size);
  LT_CHECK(s.sp_size >= 1, "parallel.sp_size {} must be at least 1", s.sp_size);
  LT_CHECK(s.world_size % s.sp_size == 0,
           "parallel.sp_size {} does not divide the world size {}: the world is split into data-parallel replicas "
           "of sp_size ranks each; use a divisor of {} or change the number of ranks",
           s.sp_size, s.world_size, s.world_size);
  LT_CHECK(s.ulysses_size >= 1 && s.sp_size % s.ulysses_size == 0,
           "parallel.ulysses_size {} must divide parallel.sp_size {} (sp_size = ulysses_size x the ring across the "
           "Ulysses groups)",
           s.ulysses_size, s.sp_size);
}

int RankGroup::index_of(int global_rank) const {
  auto it = std::find(ranks.begin(), ranks.end(), global_rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

namespace {

void check_rank(const ParallelShape& s, int rank) {
  check_parallel_shape(s);
  LT_CHECK(rank >= 0 && rank < s.world_size, "rank {} is outside [0, world size {})", rank, s.world_size);
}

}  // namespace

RankGroup world_group(const ParallelShape& s) {
  check_parallel_shape(s);
  RankGroup g{"world", {}};
  for (int r = 0; r < s.world_size; ++r) g.ranks.push_back(r);
  return g;
}

RankGroup sp_group(const ParallelShape& s, int rank) {
  check_rank(s, rank);
  const int k = rank / s.sp_size;
  RankGroup g{fmt::format("sp{}", k), {}};
  for (int i = 0; i < s.sp_size; ++i) g.ranks.push_back(k * s.sp_size + i);
  return g;
}

RankGroup dp_group(const ParallelShape& s, int rank) {
  check_rank(s, rank);
  const int j = rank % s.sp_size;
  RankGroup g{fmt::format("dp{}", j), {}};
  for (int r = j; r < s.world_size; r += s.sp_size) g.ranks.push_back(r);
  return g;
}

RankGroup intra_node_ring(const ParallelShape& s, int rank) {
  const RankGroup sp = sp_group(s, rank);
  const int node = rank / s.local_world_size;
  RankGroup g{fmt::format("{}.node{}", sp.name, node), {}};
  for (int r : sp.ranks) {
    if (r / s.local_world_size == node) g.ranks.push_back(r);
  }
  return g;
}

RankGroup inter_node_ring(const ParallelShape& s, int rank) {
  const RankGroup sp = sp_group(s, rank);
  const int local = rank % s.local_world_size;
  RankGroup g{fmt::format("{}.local{}", sp.name, local), {}};
  for (int r : sp.ranks) {
    if (r % s.local_world_size == local) g.ranks.push_back(r);
  }
  return g;
}

RankGroup ulysses_group(const ParallelShape& s, int rank) {
  const RankGroup sp = sp_group(s, rank);
  const int p = sp.index_of(rank), U = s.ulysses_size;
  RankGroup g{fmt::format("{}.ulysses{}", sp.name, p / U), {}};
  for (int i = 0; i < U; ++i) g.ranks.push_back(sp.ranks[static_cast<size_t>((p / U) * U + i)]);
  return g;
}

RankGroup ulysses_ring_group(const ParallelShape& s, int rank) {
  const RankGroup sp = sp_group(s, rank);
  const int p = sp.index_of(rank), U = s.ulysses_size;
  RankGroup g{fmt::format("{}.across{}", sp.name, p % U), {}};
  for (int q = p % U; q < s.sp_size; q += U) g.ranks.push_back(sp.ranks[static_cast<size_t>(q)]);
  return g;
}

int ulysses_ring_nodes(const ParallelShape& s) {
  check_parallel_shape(s);
  const int U = s.ulysses_size, L = s.local_world_size, nodes = s.sp_size / L;
  if (U <= 1 || U >= s.sp_size || s.sp_size <= L || s.sp_size % L != 0) return 1;
  if (L % U == 0) return nodes;             // whole groups inside each node: L / U members per node
  if (U % L == 0) return s.sp_size / U;     // each group spans U / L whole nodes: one member per node
  return 1;
}

RankGroup ulysses_ring_intra_node(const ParallelShape& s, int rank) {
  const RankGroup ring = ulysses_ring_group(s, rank);
  const int node = rank / s.local_world_size;
  RankGroup g{fmt::format("{}.node{}", ring.name, node), {}};
  for (int r : ring.ranks)
    if (r / s.local_world_size == node) g.ranks.push_back(r);
  return g;
}

RankGroup ulysses_ring_inter_node(const ParallelShape& s, int rank) {
  const RankGroup ring = ulysses_ring_group(s, rank);
  const int j = ulysses_ring_intra_node(s, rank).index_of(rank);
  RankGroup g{fmt::format("{}.local{}", ring.name, j), {}};
  for (int r : ring.ranks) {
    // r's position among the members on its node
    const int node = r / s.local_world_size;
    int position = 0;
    for (int other : ring.ranks)
      if (other < r && other / s.local_world_size == node) ++position;
    if (position == j) g.ranks.push_back(r);
  }
  return g;
}

bool has_regular_rings(const ParallelShape& s) {
  check_parallel_shape(s);
  return s.local_world_size % s.sp_size == 0 || s.sp_size % s.local_world_size == 0;
}

std::vector<RankGroup> all_sp_groups(const ParallelShape& s) {
  check_parallel_shape(s);
  std::vector<RankGroup> groups;
  for (int r = 0; r < s.world_size; r += s.sp_size) groups.push_back(sp_group(s, r));
  return groups;
}

std::vector<RankGroup> all_dp_groups(const ParallelShape& s) {
  check_parallel_shape(s);
  std::vector<RankGroup> groups;
  for (int j = 0; j < s.sp_size; ++j) groups.push_back(dp_group(s, j));
  return groups;
}

ProcessGroups create_process_groups(Backend backend, TcpStore& store, const ParallelShape& shape, int rank,
                                    CommOptions options) {
  check_rank(shape, rank);
  // Every rank creates its groups in this one order; each creation waits only for that group's
  // members, who are creating the same groups in the same order, so no rank waits on a cycle.
  ProcessGroups pg;
  auto make = [&](const RankGroup& g) { return make_communicator(backend, store, g.name, g.ranks, rank, options); };
  pg.world = make(world_group(shape));
  pg.sp = make(sp_group(shape, rank));
  pg.dp = make(dp_group(shape, rank));
  pg.intra_node = make(intra_node_ring(shape, rank));
  pg.inter_node = make(inter_node_ring(shape, rank));
  if (shape.ulysses_size > 1 && shape.ulysses_size < shape.sp_size) {
    pg.ulysses = make(ulysses_group(shape, rank));
    pg.ulysses_ring = make(ulysses_ring_group(shape, rank));
    if (ulysses_ring_nodes(shape) > 1) {
      pg.ulysses_ring_intra = make(ulysses_ring_intra_node(shape, rank));
      pg.ulysses_ring_inter = make(ulysses_ring_inter_node(shape, rank));
    }
  }
  return pg;
}

}  // namespace longtrain::parallel
