#include "attention/distributed/workspace.h"

#include <algorithm>

#include <string>

#include <fmt/format.h>

#include "attention/distributed/buffers.h"
#include "runtime/arena.h"

namespace longtrain::attn {

namespace {

using dist::MessageSpec;

// What MessageSlots::ensure(spec, count, device) allocates: one arena of count × parts entries.
size_t slots_bytes(const MessageSpec& spec, int count, Device device) {
  if (count == 0 || spec.empty()) return 0;
  Arena table("slots", device);  // only the table: never allocated
  for (int s = 0; s < count; ++s)
    for (size_t p = 0; p < spec.size(); ++p) table.add(fmt::format("slot{}.part{}", s, p), spec[p].shape, spec[p].dtype);
  return table.allocation_bytes();
}

}  // namespace

size_t schedule_workspace_bytes(Schedule schedule, bool causal, int sp_size, int nodes,
                                const ScheduleWorkspaceShape& s) {
  if (sp_size <= 1) return 0;
  const int64_t T = s.tokens, Hq = s.q_heads, Hkv = s.kv_heads, D = s.head_dim;
  const DType x = s.dtype, acc = s.stat;
  const bool separate = x != acc;  // bf16 tensors: f32 accumulators apart from the caller's outputs
  const Device dev = s.device;

  // prepare_forward / prepare_backward (schedules.cpp): one slot each, in every schedule.
  MessageSpec fwd_scratch = {{{T, Hq, D}, x}, {{T, Hq}, acc}};
  if (separate) fwd_scratch.push_back({{T, Hq, D}, acc});
  MessageSpec bwd_scratch = {{{T, Hq}, acc}};
  if (separate) {
    bwd_scratch.push_back({{T, Hq, D}, acc});
    bwd_scratch.push_back({{T, Hkv, D}, acc});
    bwd_scratch.push_back({{T, Hkv, D}, acc});
  }
  size_t bytes = slots_bytes(fwd_scratch, 1, dev) + slots_bytes(bwd_scratch, 1, dev);

  const MessageSpec kv = {{{T, Hkv, D}, x}, {{T, Hkv, D}, x}};
  const MessageSpec dkv = {{{T, Hkv, D}, acc}, {{T, Hkv, D}, acc}};
  const MessageSpec dq = {{{T, Hq, D}, acc}};
  // The Q side that travels in a backward: Q, dO, LSE and D.
  const MessageSpec q_side_bwd = {{{T, Hq, D}, x}, {{T, Hq, D}, x}, {{T, Hq}, acc}, {{T, Hq}, acc}};
  // RingRotation::run: 3 block slots on a single ring (4 on a double ring); 3 accumulators (8).
  const bool two_rings = schedule == Schedule::burst && nodes > 1;
  const int block_slots = two_rings ? 4 : 3, acc_slots = two_rings ? 8 : 3;
  switch (schedule) {
    case Schedule::ring:
    case Schedule::zigzag:
      bytes += slots_bytes(kv, block_slots, dev);                                    // forward rotation
      bytes += slots_bytes(kv, block_slots, dev) + slots_bytes(dkv, acc_slots, dev);  // backward rotation
      break;
    case Schedule::burst:
      bytes += slots_bytes(kv, block_slots, dev);
      bytes += slots_bytes(q_side_bwd, block_slots, dev) + slots_bytes(dq, acc_slots, dev);
      break;
    case Schedule::ulysses: {
      // ulysses_attention.cpp: per member a send and a receive slot for each direction, and one
      // slot of gathered head-layout tensors per direction (G = U·T tokens, h and g heads). The
      // scratch of the other schedules is not allocated (the inner attention is the local one).
      const int U = sp_size;
      const int64_t h = Hq / U, g = std::max<int64_t>(Hkv / U, 1), G = T * U;
      const MessageSpec qkv = {{{T, h, D}, x}, {{T, g, D}, x}, {{T, g, D}, x}};
      const MessageSpec ret = {{{T, h, D}, x}, {{T, h}, acc}};
      const MessageSpec grads = {{{T, h, D}, x}, {{T, g, D}, x}, {{T, g, D}, x}};
      if (s.ulysses_keeps_forward) {
        const MessageSpec d_o = {{{T, h, D}, x}};
        const MessageSpec bwd_gathered = {{{G, h, D}, x}, {{G, h, D}, x}, {{G, g, D}, x}, {{G, g, D}, x}};
        return 2 * slots_bytes(qkv, U, dev) + 2 * slots_bytes(ret, U, dev) + 2 * slots_bytes(d_o, U, dev) +
               2 * slots_bytes(grads, U, dev) + slots_bytes(bwd_gathered, 1, dev);
      }
      const MessageSpec bwd_in = {{{T, h, D}, x}, {{T, g, D}, x}, {{T, g, D}, x},
                                  {{T, h, D}, x}, {{T, h, D}, x}, {{T, h}, acc}};
      const MessageSpec fwd_gathered = {{{G, h, D}, x}, {{G, g, D}, x}, {{G, g, D}, x}, {{G, h, D}, x}, {{G, h}, acc}};
      const MessageSpec bwd_gathered = {{{G, h, D}, x}, {{G, g, D}, x}, {{G, g, D}, x}, {{G, h, D}, x}, {{G, h, D}, x},
                                        {{G, h}, acc},   {{G, h, D}, x}, {{G, g, D}, x}, {{G, g, D}, x}};
      return 2 * slots_bytes(qkv, U, dev) + 2 * slots_bytes(ret, U, dev) + 2 * slots_bytes(bwd_in, U, dev) +
             2 * slots_bytes(grads, U, dev) + slots_bytes(fwd_gathered, 1, dev) + slots_bytes(bwd_gathered, 1, dev);
    }
    case Schedule::distflash: {
      // distflash_attention.cpp: own K/V (1), inbound K/V (2); with helpers (causal, P >= 3) own Q side
      // (1), inbound Q sides (2), outbound results (2), inbound result (1).
      const int helpers = causal && sp_size >= 3 ? 1 : 0;
      const MessageSpec q_fwd = {{{T, Hq, D}, x}};
      const MessageSpec partial = {{{T, Hq, D}, acc}, {{T, Hq}, acc}};
      bytes += slots_bytes(kv, 1, dev) + slots_bytes(kv, 2, dev);
      bytes += slots_bytes(q_fwd, helpers, dev) + slots_bytes(q_fwd, 2 * helpers, dev);
      bytes += slots_bytes(partial, 2 * helpers, dev) + slots_bytes(partial, helpers, dev);
      bytes += slots_bytes(kv, 1, dev) + slots_bytes(kv, 2, dev);
      bytes += slots_bytes(dkv, 2, dev) + slots_bytes(dkv, 1, dev);
      bytes += slots_bytes(q_side_bwd, helpers, dev) + slots_bytes(q_side_bwd, 2 * helpers, dev);
      bytes += slots_bytes(dq, 2 * helpers, dev) + slots_bytes(dq, helpers, dev);
      break;
    }
  }
  return bytes;
}

}  // namespace longtrain::attn
