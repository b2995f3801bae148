#include "attention/distributed/ring_rotation.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace longtrain::attn::dist {

using parallel::Communicator;
using parallel::P2POp;
using parallel::P2PWork;

namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

int RingTopology::partition_at(int round) const {
  const int c = round / L, i = round % L;
  return mod(node - c, I) * L + mod(local - i, L);
}

RingTopology RingTopology::single(Communicator& sp) {
  RingTopology t;
  t.intra = &sp;
  t.L = sp.size();
  t.local = sp.rank();
  return t;
}

RingTopology RingTopology::double_ring(Communicator& sp, Communicator& intra, Communicator& inter) {
  const int L = intra.size(), I = inter.size();
  LT_CHECK(L * I == sp.size(),
           "burst double ring: the intra-node ring {} ({} ranks) and the inter-node ring {} ({} ranks) do not tile "
           "the sequence-parallel group {} ({} ranks) as nodes x ranks per node",
           intra.name(), L, inter.name(), I, sp.name(), sp.size());
  // SP rank node·L + local must be the rank at position `local` of this node's ring and at position
  // `node` of this local index's ring, for every member (what parallel/process_group.h builds).
  const int node = inter.rank(), local = intra.rank();
  bool grid = sp.rank() == node * L + local;
  for (int l = 0; l < L && grid; ++l) grid = intra.ranks()[l] == sp.ranks()[node * L + l];
  for (int n = 0; n < I && grid; ++n) grid = inter.ranks()[n] == sp.ranks()[n * L + local];
  LT_CHECK(grid,
           "burst double ring: global ranks {} (intra-node ring {}) and {} (inter-node ring {}) are not the rows "
           "and columns of the sequence-parallel group {} (global ranks {}) laid out as {} nodes x {} ranks",
           fmt::join(intra.ranks(), ","), intra.name(), fmt::join(inter.ranks(), ","), inter.name(), sp.name(),
           fmt::join(sp.ranks(), ","), I, L);
  RingTopology t;
  t.intra = &intra;
  t.inter = &inter;
  t.L = L;
  t.I = I;
  t.local = local;
  t.node = node;
  return t;
}

RingRotation::RingRotation(const std::string& name) : blocks_(name + " blocks"), accs_(name + " accumulators") {}

void RingRotation::run(const RingTopology& topo, const MessageSpec& block_spec, const MessageSpec& acc_spec,
                       Device device, const std::function<void(const Message&)>& pack_own,
                       const RotationHooks& hooks, ScheduleTrace& trace) {
  const int L = topo.L, I = topo.I, G = topo.size();
  const bool backward = !acc_spec.empty();
  trace.steps.assign(static_cast<size_t>(G + (backward ? 1 : 0)), ScheduleStep{});
  blocks_.ensure(block_spec, G > 1 ? (I > 1 ? 4 : 3) : 0, device);
  // Accumulator slots: three on the intra-node ring; the kept partials, running sums and final sum
  // only with a second ring.
  accs_.ensure(acc_spec, backward && G > 1 ? (I > 1 ? 8 : 3) : 0, device);
  if (G > 1) pack_own(blocks_[0]);

  const int intra_next = mod(topo.local + 1, L), intra_prev = mod(topo.local - 1, L);
  const int inter_next = mod(topo.node + 1, I), inter_prev = mod(topo.node - 1, I);

  auto post = [&](Communicator* comm, std::vector<P2POp>& ops, size_t step) -> std::unique_ptr<P2PWork> {
    if (ops.empty()) return nullptr;
    trace.steps[step].bytes_sent += send_bytes(ops);
    return comm->start_p2p(ops);
  };

  // Block slots: `home` holds the block this rank starts the cycle with (its own, packed, in cycle
  // 0), `arrival` receives the next cycle's from the previous node, 1 and 2 alternate on the intra ring.
  int home = 0, arrival = 3;
  int cur = -1;  // the block computed this round: -1 = own (caller's tensors), else a slot
  std::unique_ptr<P2PWork> inter_blocks;

  // Accumulator slots: out (sent next round), in (being received), z (this round's contributions);
  // kept[c % 2] the first-round contributions of cycle c; sums[c % 2] the inter-node running sums.
  int out = 0, in = 1, z = 2;
  const int kept[2] = {3, 4}, sums[2] = {5, 6}, final_sum = 7;
  std::unique_ptr<P2PWork> inter_sums;

  // Cycle cc has ended and its closing hop (if any) has arrived: the node's partial sum for the block
  // this rank started cycle cc with goes onto the inter-node ring (or, for its own block, home).
  auto finish_node_partial = [&](int cc, const Message* closing, size_t step) {
    if (cc == 0) {
      if (closing) hooks.add_to_own(*closing);
      return;
    }
    const Message& partial = accs_[kept[cc % 2]];
    if (closing) add_message(partial, *closing);
    const Message& sum = accs_[sums[cc % 2]];
    if (cc >= 2) {
      inter_sums->wait();  // the running sum of the nodes before this one, posted one cycle ago
      inter_sums.reset();
      add_message(sum, partial);
    } else {
      copy_message(sum, partial);
    }
    std::vector<P2POp> ops;
    append_sends(ops, sum, inter_next);
    append_recvs(ops, cc < I - 1 ? accs_[sums[(cc + 1) % 2]] : accs_[final_sum], inter_prev);
    inter_sums = post(topo.inter, ops, step);
    if (cc == I - 1) {
      inter_sums->wait();
      inter_sums.reset();
      hooks.add_to_own(accs_[final_sum]);
    }
  };

  for (int k = 0; k < G; ++k) {
    const int c = k / L, i = k % L;
    const size_t step = static_cast<size_t>(k);
    const Message* block = cur < 0 ? nullptr : &blocks_[cur];
    const Message* sendable = cur < 0 ? (G > 1 ? &blocks_[home] : nullptr) : block;

    std::vector<P2POp> ops;
    int next_block = -1;
    if (i < L - 1) {  // the next round's block, from the previous rank of the node
      next_block = cur == 1 ? 2 : 1;
      append_sends(ops, *sendable, intra_next);
      append_recvs(ops, blocks_[next_block], intra_prev);
    }
    const bool closing_hop = backward && i == 0 && c >= 1 && L >= 2;
    if (backward && (i >= 2 || closing_hop)) {
      append_sends(ops, accs_[out], intra_next);
      append_recvs(ops, accs_[in], intra_prev);
    }
    std::unique_ptr<P2PWork> intra_work = post(topo.intra, ops, step);
    if (i == 0 && c < I - 1) {  // the next cycle's block, from the previous node, hidden behind this cycle
      std::vector<P2POp> inter_ops;
      append_sends(inter_ops, *sendable, inter_next);
      append_recvs(inter_ops, blocks_[arrival], inter_prev);
      inter_blocks = post(topo.inter, inter_ops, step);
    }

    const Message* target = nullptr;
    if (backward && (i > 0 || c > 0)) {
      target = i == 0 ? &accs_[kept[c % 2]] : &accs_[z];
      fill_message(*target, 0.0);
    }
    const int64_t pairs = hooks.compute(k, topo.partition_at(k), block, target);
    trace.steps[step].pairs += pairs;
    if (intra_work) intra_work->wait();

    if (backward) {
      if (i == 0 && c >= 1) finish_node_partial(c - 1, closing_hop ? &accs_[in] : nullptr, step);
      if (i == 1) std::swap(out, z);  // the accumulator starts here
      if (i >= 2) {
        if (pairs > 0) add_message(accs_[in], accs_[z]);
        std::swap(out, in);
      }
    }
    if (i < L - 1) {
      cur = next_block;
    } else if (c < I - 1) {
      inter_blocks->wait();
      inter_blocks.reset();
      std::swap(home, arrival);
      cur = home;
    }
  }

  if (backward) {
    const size_t step = static_cast<size_t>(G);
    const Message* closing = nullptr;
    if (L >= 2) {
      std::vector<P2POp> ops;
      append_sends(ops, accs_[out], intra_next);
      append_recvs(ops, accs_[in], intra_prev);
      post(topo.intra, ops, step)->wait();
      closing = &accs_[in];
    }
    finish_node_partial(I - 1, closing, step);
  }
}

}  // namespace longtrain::attn::dist
