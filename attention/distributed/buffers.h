// Buffers of the distributed attention schedules: messages (the tensors one transfer carries, in a
// fixed order), persistent slots for them, and the few elementwise operations the schedules need on
// strided views (packing Q/K/V out of the fused QKV buffer, zeroing and adding accumulators).
//
// Dtypes: tensors (Q, K, V, O, dO) travel in their own dtype; partial O, LSE, D and the dQ/dK/dV
// accumulators in accumulator_dtype() — f32 when the tensors are bf16 (CUDA), the tensor dtype on
// CPU (f32, or f64 for the exactness tests). The elementwise operations run here for CPU tensors
// and through attention/cuda/distributed_buffers.cu for CUDA tensors (queued on the compute stream,
// f32 arithmetic with one rounding to the destination's dtype).
//
// Ordering on CUDA (NCCL): a batch's sends read their buffers on the communication stream after
// everything queued on the compute stream before its start_p2p, and the compute stream waits for
// the batch only at P2PWork::wait(), which does not block the host. So a buffer a batch sends or
// receives is written again (packed, zeroed, accumulated into) only by work queued after that
// batch's wait(): the schedules never write such a slot between the start_p2p and the wait().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "runtime/arena.h"

namespace longtrain::attn::dist {

// The dtype of partial results and accumulators for tensors of dtype t: f32 for bf16, else t.
DType accumulator_dtype(DType t);

// Elementwise over two views of one shape (up to 4 dims, unit-stride last dim), any float dtypes.
void fill_tensor(Tensor t, double value);  // t := value
void copy_tensor(Tensor dst, Tensor src);  // dst := src, converting the dtype
void add_tensor(Tensor dst, Tensor src);   // dst += src

// One part of a message: shape and dtype.
struct PartSpec {
  std::vector<int64_t> shape;
  DType dtype;
  bool operator==(const PartSpec&) const = default;
};
using MessageSpec = std::vector<PartSpec>;
using Message = std::vector<Tensor>;  // contiguous tensors, in the spec's order

int64_t message_bytes(const Message& m);
void copy_message(const Message& dst, const Message& src);
void add_message(const Message& dst, const Message& src);
void fill_message(const Message& m, double value);

// The point-to-point ops that send or receive every part of `m` (in order) to or from `peer`.
void append_sends(std::vector<parallel::P2POp>& ops, const Message& m, int peer);
void append_recvs(std::vector<parallel::P2POp>& ops, const Message& m, int peer);
// Bytes of the sends in `ops`.
int64_t send_bytes(const std::vector<parallel::P2POp>& ops);

// `count` messages of one spec in one arena, kept across calls: reallocated only when the spec, the
// count or the device changes (a model calls attention with the same shapes every layer and step).
class MessageSlots {
 public:
  explicit MessageSlots(std::string name) : name_(std::move(name)), arena_(name_, Device::cpu) {}
  void ensure(const MessageSpec& spec, int count, Device device);
  const Message& operator[](int i) const { return slots_.at(static_cast<size_t>(i)); }
  int count() const { return static_cast<int>(slots_.size()); }

 private:
  std::string name_;
  MessageSpec spec_;
  Device device_ = Device::cpu;
  Arena arena_;
  std::vector<Message> slots_;
};

}  // namespace longtrain::attn::dist
