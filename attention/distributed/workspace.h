// The device memory a sequence-parallel attention schedule keeps across calls on one rank, for the
// memory plan (model/memory_plan.h): its message slots (rotation blocks and accumulators, distflash's
// inbound and outbound messages) and its forward and backward scratch (block partials, the f32 O and
// dQ/dK/dV accumulators, D). Computed from the very message specs and slot counts the schedules ask
// MessageSlots::ensure for (schedules.cpp, ring_rotation.cpp, distflash_attention.cpp), laid out by the
// same Arena tables, so the bytes match what they allocate; the worst rank of the group is planned
// (distflash's helper buffers exist on every rank once P >= 3).
//
// Not included: the per-block workspace of the local attention (cuDNN's fp32 dQ accumulator, the
// block's bf16 dQ/dK/dV), which the plan already counts for a block of T rows, and NCCL's own buffers
// (left to the plan's headroom).
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/distributed/distributed_attention.h"
#include "runtime/tensor.h"

namespace longtrain::attn {

struct ScheduleWorkspaceShape {
  int64_t tokens = 0;    // T: this rank's tokens (S / P)
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv
  int64_t head_dim = 0;  // D
  DType dtype = DType::bf16;  // Q/K/V/O/dO and the model's dQ/dK/dV (bf16 on CUDA; f32/f64 on CPU)
  DType stat = DType::f32;    // LSE (the accumulator dtype: f32 for bf16 tensors)
  Device device = Device::cuda;
  // Ulysses under SequenceAttention::keep_forward: the gathered forward tensors live in the per-layer
  // slots (ulysses_kept_bytes, not counted here) and the backward's buffers carry dO alone.
  bool ulysses_keeps_forward = false;
};

// Bytes the schedule's slots hold after one forward and one backward call with `sp_size` ranks
// (`nodes` > 1: burst's double ring over that many nodes). 0 when sp_size == 1 (the local attention).
size_t schedule_workspace_bytes(Schedule schedule, bool causal, int sp_size, int nodes,
                                const ScheduleWorkspaceShape& shape);

}  // namespace longtrain::attn
