#include "attention/distributed/cost_model.h"

#include <algorithm>

#include <fmt/format.h>

#include "attention/distributed/ulysses_attention.h"
#include "parallel/process_group.h"

namespace longtrain::attn {

TrafficBytes ring_schedule_bytes(Schedule s, bool causal, int P, int r, const AttentionTraffic& t) {
  LT_CHECK(s != Schedule::ulysses, "ring_schedule_bytes: ulysses is not a ring schedule (use ulysses_bytes)");
  const int64_t T = t.tokens, Hq = t.q_heads, Hkv = t.kv_heads, D = t.head_dim;
  const int64_t x = t.elem_bytes, a = t.acc_bytes;
  const int64_t kv = 2 * T * Hkv * D * x;              // K and V of one shard
  const int64_t dkv = 2 * T * Hkv * D * a;             // their accumulators
  const int64_t q = T * Hq * D * x;                    // Q of one shard
  const int64_t partial = T * Hq * D * a + T * Hq * a;  // (O, LSE) partial of one shard
  const int64_t q_side = 2 * T * Hq * D * x + 2 * T * Hq * a;  // Q, dO, LSE, D
  const int64_t dq = T * Hq * D * a;
  if (P <= 1) return {};
  switch (s) {
    case Schedule::ring:
    case Schedule::zigzag: return {(P - 1) * kv, (P - 1) * (kv + dkv)};
    case Schedule::burst: return {(P - 1) * kv, (P - 1) * (q_side + dq)};
    case Schedule::distflash: {
      if (!causal) return {(P - 1) * kv, (P - 1) * (kv + dkv)};
      // Owner steps t = 1..⌊P/2⌋ fetch K/V of rank r-t; helper steps t = 1..⌊(P-1)/2⌋ run on ranks r < t for
      // rank r-t+P (distflash_attention.cpp).
      const int owner_steps = P / 2, helper_steps = (P - 1) / 2;
      const int64_t kv_sends = std::min(owner_steps, P - 1 - r);
      const int64_t q_sends = std::max(0, helper_steps - std::max(1, P - r) + 1);
      const int64_t helper_results = std::max(0, helper_steps - r);
      const int64_t owner_results = std::min(r, owner_steps);
      return {kv_sends * kv + q_sends * q + helper_results * partial,
              kv_sends * kv + q_sends * q_side + owner_results * dkv + helper_results * dq};
    }
    case Schedule::ulysses: break;
  }
  return {};
}

namespace {

struct UlyssesParts {
  int64_t qkv, o, bwd_in, grads;  // bytes each member sends in each all-to-all
};

UlyssesParts ulysses_parts(int U, const AttentionTraffic& t) {
  const int64_t h = t.q_heads / U, g = std::max<int64_t>(t.kv_heads / U, 1);
  const int64_t T = t.tokens, D = t.head_dim, x = t.elem_bytes, a = t.acc_bytes;
  const int64_t backward_in = t.ulysses_keeps_forward ? h * D * x : (3 * h + 2 * g) * D * x + h * a;
  return {(U - 1) * T * (h + 2 * g) * D * x, (U - 1) * T * h * (D * x + a), (U - 1) * T * backward_in,
          (U - 1) * T * (h + 2 * g) * D * t.grad_bytes};
}

}  // namespace

TrafficBytes ulysses_bytes(int U, const AttentionTraffic& t) {
  const UlyssesParts p = ulysses_parts(U, t);
  return {p.qkv + p.o, p.bwd_in + p.grads};
}

TrafficBytes hybrid_bytes(Schedule s, bool causal, int P, int U, int rank, const AttentionTraffic& t) {
  if (s == Schedule::ulysses) U = P;
  LT_CHECK(U >= 1 && P % U == 0, "hybrid_bytes: {} Ulysses ranks do not divide {} ranks", U, P);
  if (U == 1) return ring_schedule_bytes(s, causal, P, rank, t);
  TrafficBytes b = ulysses_bytes(U, t);
  const int R = P / U;
  if (R > 1) {
    AttentionTraffic across = t;
    across.tokens = U * t.tokens;
    across.q_heads = t.q_heads / U;
    across.kv_heads = std::max<int64_t>(t.kv_heads / U, 1);
    const TrafficBytes ring = ring_schedule_bytes(s, causal, R, rank / U, across);
    b.forward += ring.forward;
    b.backward += ring.backward;
  }
  return b;
}

namespace {

constexpr double kBackwardFlopsFactor = 2.5;  // dQ, dK, dV, dP, recomputed S: 5 matmuls against 2

// Query-key pairs of the worst rank of a ring schedule over n ranks of T tokens each.
double worst_pairs(Schedule s, SeqLayout layout, bool causal, int n, int64_t T) {
  const double t = static_cast<double>(T), S = t * n;
  if (!causal) return S * t;
  const bool unbalanced = (s == Schedule::ring || s == Schedule::burst) && layout == SeqLayout::contiguous;
  if (unbalanced) return (n - 1) * t * t + t * (t + 1) / 2;
  return S * (S + 1) / 2 / n;
}

// A ring-kind schedule over n ranks (one node, or spanning nodes): time for forward + backward given
// the compute and the bytes of each direction. double_ring_per_node > 0: burst's double ring with that
// many of the n ranks on each node.
double ring_seconds(Schedule s, bool causal, int n, bool spans_nodes, int double_ring_per_node, const Topology& topo,
                    double compute_fwd, double compute_bwd, const TrafficBytes& bytes, double& comm) {
  if (n <= 1) return compute_fwd + compute_bwd;
  const int steps = s == Schedule::distflash && causal ? n / 2 + 1 : n;  // compute steps
  const int transfers = std::max(1, steps - 1);
  double bw = topo.intra.bytes_per_second, lat = topo.intra.latency_seconds;
  if (spans_nodes) {
    if (double_ring_per_node > 0) {
      // One inter-node hop per intra-node cycle of double_ring_per_node steps (one rank per node: every
      // hop crosses nodes, at their latency).
      bw = std::min(topo.intra.bytes_per_second, double_ring_per_node * topo.inter.bytes_per_second);
      if (double_ring_per_node == 1) lat = topo.inter.latency_seconds;
    } else {
      bw = topo.inter.bytes_per_second;
      lat = topo.inter.latency_seconds;
    }
  }
  double total = 0;
  for (const auto& [compute, b] : {std::pair{compute_fwd, bytes.forward}, std::pair{compute_bwd, bytes.backward}}) {
    const double step_compute = compute / steps;
    const double step_comm = lat + static_cast<double>(b) / transfers / bw;
    comm += transfers * step_comm;
    total += step_compute + transfers * std::max(step_compute, step_comm);
  }
  return total;
}

// One all-to-all of `bytes` (to U-1 peers) by member u of a group of U consecutive ranks starting at
// rank `first` of the SP group.
double all_to_all_seconds(int64_t bytes, int U, int first, int u, const Topology& topo) {
  if (U <= 1 || bytes == 0) return 0;
  const int me = first + u, node = me / topo.ranks_per_node;
  int remote = 0;
  for (int v = 0; v < U; ++v)
    if (v != u && (first + v) / topo.ranks_per_node != node) ++remote;
  const double per_peer = static_cast<double>(bytes) / (U - 1);
  const double intra = per_peer * (U - 1 - remote) / topo.intra.bytes_per_second;
  const double inter = per_peer * remote / topo.inter.bytes_per_second;
  return (remote > 0 ? topo.inter.latency_seconds : topo.intra.latency_seconds) + std::max(intra, inter);
}

AttentionTraffic traffic_of(const AttentionShape& a, int P) {
  AttentionTraffic t;
  t.tokens = a.seq_len / P;
  t.q_heads = a.q_heads;
  t.kv_heads = a.kv_heads;
  t.head_dim = a.head_dim;
  t.elem_bytes = a.elem_bytes;
  t.acc_bytes = a.acc_bytes;
  t.grad_bytes = a.grad_bytes;
  t.ulysses_keeps_forward = a.ulysses_keeps_forward;
  return t;
}

}  // namespace

ScheduleEstimate estimate_schedule(Schedule s, int U, SeqLayout layout, const AttentionShape& a, int P,
                                   const Topology& topo) {
  if (s == Schedule::ulysses) U = P;
  if (s == Schedule::zigzag) layout = SeqLayout::zigzag;
  if (s == Schedule::distflash) layout = SeqLayout::contiguous;
  ScheduleEstimate e;
  e.schedule = s;
  e.ulysses_size = U;
  e.layout = layout;
  const bool hybrid = U > 1 && U < P;
  e.name = s == Schedule::ulysses || U == P ? "ulysses"
           : hybrid                         ? fmt::format("ulysses {} x {} {}", U, P / U, schedule_name(s))
                                            : std::string(schedule_name(s));
  if (s == Schedule::ring || s == Schedule::burst) e.name += fmt::format(" ({})", layout_name(layout));
  const AttentionTraffic t = traffic_of(a, P);
  for (int r = 0; r < P; ++r) {
    const TrafficBytes b = hybrid_bytes(s, a.causal, P, U, r, t);
    e.bytes_per_layer = std::max(e.bytes_per_layer, b.forward + b.backward);
  }
  const double flops_per_pair_head = 4.0 * static_cast<double>(a.head_dim);
  if (U <= 1) {
    const double fwd = worst_pairs(s, layout, a.causal, P, t.tokens) * a.q_heads * flops_per_pair_head /
                       topo.flops_per_second;
    e.compute_seconds = fwd * (1 + kBackwardFlopsFactor);
    double worst_comm = 0;
    e.seconds = 0;
    for (int r = 0; r < P; ++r) {
      double comm = 0;
      const int double_ring_per_node =
          s == Schedule::burst && P > topo.ranks_per_node && P % topo.ranks_per_node == 0 ? topo.ranks_per_node : 0;
      const double sec = ring_seconds(s, a.causal, P, P > topo.ranks_per_node, double_ring_per_node, topo, fwd,
                                      fwd * kBackwardFlopsFactor, ring_schedule_bytes(s, a.causal, P, r, t), comm);
      e.seconds = std::max(e.seconds, sec);
      worst_comm = std::max(worst_comm, comm);
    }
    e.comm_seconds = worst_comm;
    return e;
  }
  const int R = P / U;
  const int64_t h = a.q_heads / U, g = std::max<int64_t>(a.kv_heads / U, 1);
  const int64_t gathered = U * t.tokens;
  const double fwd = worst_pairs(s == Schedule::ulysses ? Schedule::zigzag : s, layout, a.causal, R, gathered) * h *
                     flops_per_pair_head / topo.flops_per_second;
  e.compute_seconds = fwd * (1 + kBackwardFlopsFactor);
  const UlyssesParts parts = ulysses_parts(U, t);
  double a2a = 0;
  for (int u = 0; u < U; ++u) {
    double mine = 0;
    for (int64_t bytes : {parts.qkv, parts.o, parts.bwd_in, parts.grads}) mine += all_to_all_seconds(bytes, U, 0, u, topo);
    a2a = std::max(a2a, mine);
  }
  double ring_comm = 0, ring_time = e.compute_seconds;
  if (R > 1) {
    AttentionTraffic across = t;
    across.tokens = gathered;
    across.q_heads = h;
    across.kv_heads = g;
    ring_time = 0;
    // burst across the groups: the double ring when that ring tiles the nodes (process_group.h).
    const int across_nodes =
        s == Schedule::burst && P % topo.ranks_per_node == 0
            ? parallel::ulysses_ring_nodes(parallel::ParallelShape{P, topo.ranks_per_node, P, U})
            : 1;
    const int double_ring_per_node = across_nodes > 1 ? R / across_nodes : 0;
    for (int r = 0; r < R; ++r) {
      double comm = 0;
      ring_time = std::max(ring_time, ring_seconds(s, a.causal, R, P > topo.ranks_per_node, double_ring_per_node, topo, fwd,
                                                   fwd * kBackwardFlopsFactor,
                                                   ring_schedule_bytes(s, a.causal, R, r, across), comm));
      ring_comm = std::max(ring_comm, comm);
    }
  }
  e.comm_seconds = a2a + ring_comm;
  e.seconds = a2a + ring_time;
  return e;
}

std::vector<ScheduleEstimate> estimate_schedules(const AttentionShape& a, int P, const Topology& topo) {
  LT_CHECK(P >= 1 && a.seq_len > 0 && a.seq_len % (2 * P) == 0,
           "attention cost model: a sequence of {} tokens does not split over {} ranks (a multiple of 2 x ranks)",
           a.seq_len, P);
  std::vector<ScheduleEstimate> out;
  const std::vector<std::pair<Schedule, SeqLayout>> rings = {{Schedule::ring, SeqLayout::contiguous},
                                                             {Schedule::zigzag, SeqLayout::zigzag},
                                                             {Schedule::distflash, SeqLayout::contiguous},
                                                             {Schedule::burst, SeqLayout::zigzag}};
  auto heads_split = [&](int U) {
    return a.q_heads % U == 0 && (a.kv_heads % U == 0 || U % a.kv_heads == 0);
  };
  for (const auto& [s, layout] : rings) out.push_back(estimate_schedule(s, 1, layout, a, P, topo));
  if (P > 1 && heads_split(P)) out.push_back(estimate_schedule(Schedule::ulysses, P, SeqLayout::zigzag, a, P, topo));
  for (int U = 2; U < P; ++U) {
    if (P % U != 0 || !heads_split(U)) continue;
    for (const auto& [s, layout] : rings) out.push_back(estimate_schedule(s, U, layout, a, P, topo));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const ScheduleEstimate& x, const ScheduleEstimate& y) {
                     // Equal times (compute-bound, transfers hidden): fewer bytes first, less to contend for.
                     if (x.seconds != y.seconds) return x.seconds < y.seconds;
                     return x.bytes_per_layer < y.bytes_per_layer;
                   });
  return out;
}

}  // namespace longtrain::attn
