// A cost model of the sequence-parallel attention schedules: the bytes each rank sends per layer (exact:
// the same volumes the schedules send, checked against the CPU counters in
// tests/attention/distributed_attention_test.cpp) and a time per layer from a topology of two link
// kinds (intra-node, inter-node: bandwidth and latency) and a compute rate, to predict which schedule
// (ring, zigzag, distflash, burst, ulysses, or a Ulysses x ring hybrid) is fastest for a shape.
//
// Time per layer, forward and backward, on the worst rank:
//   compute    attention FLOPs of the rank's query-key pairs: 4·D per pair and query head forward,
//              2.5x that backward; ring/burst over the contiguous layout do (P - 1/2)·T² causal pairs on
//              the last rank, the balanced schedules S²/(2P).
//   ring kinds each of the steps moves one block to a neighbour, overlapped with the step's compute:
//              step time = max(compute / steps, latency + block bytes / link bandwidth); the link is the
//              inter-node one when the ring spans nodes (burst's double ring: the inter-node hop carries
//              one block per intra-node cycle, so it needs 1/ranks_per_node of the inter bandwidth).
//   ulysses    four all-to-alls (Q/K/V, O/LSE; the backward's inputs, dQ/dK/dV), not overlapped: each
//              latency + max(bytes to peers in the node / intra bw, bytes to other nodes / inter bw);
//              then the local (or, in a hybrid, the ring schedule's) attention on the gathered tokens.
// A model, not a measurement: it ignores kernel efficiency differences between block sizes, NCCL's
// protocol choices and contention; it is meant to rank the candidates, and its bytes are exact.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention/distributed/distributed_attention.h"

namespace longtrain::attn {

// The tensors of one layer's attention on one rank.
struct AttentionTraffic {
  int64_t tokens = 0;    // T = S / P, this rank's tokens
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv
  int64_t head_dim = 0;  // D
  int64_t elem_bytes = 2;   // Q, K, V, O, dO (bf16 on CUDA; 4 or 8 on CPU)
  int64_t acc_bytes = 4;    // LSE, D and the accumulators that travel (f32 on CUDA; the tensor dtype on CPU)
  int64_t grad_bytes = 2;   // the model's dQ/dK/dV (Ulysses returns them in that dtype)
  // Ulysses under keep_forward (the model's policy keeps O and LSE): the backward sends dO alone out.
  bool ulysses_keeps_forward = false;
};

struct TrafficBytes {
  int64_t forward = 0, backward = 0;
};

// Bytes rank `rank` of P sends in one forward and one backward of `schedule` (not ulysses).
TrafficBytes ring_schedule_bytes(Schedule schedule, bool causal, int sp_size, int rank, const AttentionTraffic& t);
// Bytes one member of a Ulysses group of `group_size` sends (both all-to-alls of each direction).
TrafficBytes ulysses_bytes(int group_size, const AttentionTraffic& t);
// Ulysses over groups of U with `schedule` across the R = P / U groups (U = P, or schedule ulysses:
// pure Ulysses), rank `rank` of the SP group: the all-to-alls plus the ring over U·T tokens and the
// member's heads.
TrafficBytes hybrid_bytes(Schedule schedule, bool causal, int sp_size, int ulysses_size, int rank,
                          const AttentionTraffic& t);

struct Link {
  double bytes_per_second = 0;
  double latency_seconds = 0;
};
struct Topology {
  int ranks_per_node = 8;
  Link intra{200e9, 5e-6};  // NVLink-class
  Link inter{25e9, 10e-6};  // one 200 Gb/s NIC per GPU
  double flops_per_second = 400e12;  // attention kernels' sustained rate
};

struct AttentionShape {
  int64_t seq_len = 0;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t elem_bytes = 2, acc_bytes = 4, grad_bytes = 2;
  bool causal = true;
  bool ulysses_keeps_forward = true;  // the model's none and remat_aware policies (full: false)
  SeqLayout layout = SeqLayout::zigzag;  // for ring and burst (zigzag and distflash pick their own)
};

struct ScheduleEstimate {
  Schedule schedule = Schedule::zigzag;
  int ulysses_size = 1;  // > 1 with a ring schedule: the hybrid; P with schedule ulysses
  SeqLayout layout = SeqLayout::zigzag;
  std::string name;      // "zigzag", "ulysses", "ulysses 4 x zigzag 2", ...
  int64_t bytes_per_layer = 0;  // forward + backward, the worst rank
  double comm_seconds = 0;      // exposed or overlapped: the time the transfers themselves take
  double compute_seconds = 0;
  double seconds = 0;           // predicted forward + backward per layer
};

// Every candidate for P ranks whose constraints hold (Ulysses needs heads that split), fastest first
// (equal times: fewer bytes first).
std::vector<ScheduleEstimate> estimate_schedules(const AttentionShape& shape, int sp_size, const Topology& topo);
// One candidate.
ScheduleEstimate estimate_schedule(Schedule schedule, int ulysses_size, SeqLayout layout, const AttentionShape& shape,
                                   int sp_size, const Topology& topo);

}  // namespace longtrain::attn
