// The rotation engine of the ring schedules (ring, zigzag, burst): every rank's block (K/V, or in
// burst's backward the Q-side bundle) visits every rank once, each rank computing on the block it
// holds while the next one arrives; in a backward, the gradient accumulator of the visiting block
// follows it around and comes home summed.
//
// Topology: L ranks per node on an intra-node ring, I nodes on an inter-node ring (ranks with the
// same local index); SP rank = node·L + local. The single ring is L = P, I = 1. Round k = c·L + i
// (cycle c, position i) holds the block of SP rank
//   partition_at(k) = ((node - c) mod I)·L + (local - i) mod L        (BurstAttention's double ring)
// Blocks move one intra hop per round (none after the last round of a cycle); at the first round of
// every cycle but the last, each rank also sends its current block to the next node, waited for at
// the end of the cycle, so that transfer hides behind L rounds of compute. P - 1 block hops in all.
//
// Accumulators (backward): a rank's contributions to the block it holds at the first round of a
// cycle stay with it (for cycle 0, its own block: straight into its own gradient). Contributions of
// the other rounds of a cycle travel in an accumulator that starts at the second rank of the cycle,
// follows the block around the node and makes one closing hop back to the cycle's first rank, which
// adds what it kept: that is the node's partial sum for the block. Node partials then travel the
// inter-node ring as a running sum (nodes after the owner's, in ring order) to the owner, which adds
// its own node's partial. P - 1 accumulator hops in all (I·(L - 1) intra, I - 1 inter), the last
// intra hops and the last inter hop after the final round.
//
// Every hop is posted before the round's compute and waited for after it; buffers are persistent
// slots (buffers.h), reused across calls.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "attention/distributed/buffers.h"
#include "attention/distributed/distributed_attention.h"

namespace longtrain::attn::dist {

struct RingTopology {
  parallel::Communicator* intra = nullptr;  // the L ranks of this node (the whole SP group for a single ring)
  parallel::Communicator* inter = nullptr;  // the I ranks with this local index (null when I == 1)
  int L = 1, I = 1;                         // ranks per node, nodes
  int local = 0, node = 0;                  // this rank's position on each ring

  int size() const { return L * I; }
  int sp_rank() const { return node * L + local; }
  int partition_at(int round) const;
  bool is_double() const { return I > 1; }

  static RingTopology single(parallel::Communicator& sp);
  // Checks that intra × inter tile `sp` as nodes × ranks per node, naming the ranks when not.
  static RingTopology double_ring(parallel::Communicator& sp, parallel::Communicator& intra,
                                  parallel::Communicator& inter);
};

// What a schedule computes at each round.
struct RotationHooks {
  // Round `round` on the block of SP rank `partition`: `block` is its message, or nullptr for this
  // rank's own block (read from the caller's tensors); `acc` (backward) the accumulator the traveling
  // gradients go to (zeroed), or nullptr for this rank's own gradients. Returns the query-key pairs
  // computed.
  std::function<int64_t(int round, int partition, const Message* block, const Message* acc)> compute;
  // Backward: adds the gradients the other ranks accumulated for this rank's own block.
  std::function<void(const Message& acc)> add_to_own;
};

class RingRotation {
 public:
  explicit RingRotation(const std::string& name);

  // Runs the L·I rounds. `own` is this rank's block (packed into a send buffer when other ranks
  // need it); `acc_spec` empty = forward (no accumulator). Fills `trace` (one step per round, plus a
  // final one for the accumulators' last hops).
  void run(const RingTopology& topo, const MessageSpec& block_spec, const MessageSpec& acc_spec, Device device,
           const std::function<void(const Message& send_buffer)>& pack_own, const RotationHooks& hooks,
           ScheduleTrace& trace);

 private:
  MessageSlots blocks_;  // the cycle's home block, two intra buffers, the inter-node arrival
  MessageSlots accs_;    // three intra accumulators, two kept partials, two inter running sums, the final sum
};

}  // namespace longtrain::attn::dist
