// Arena: one allocation per kind of state (parameters, gradients, master weights, Adam moments,
// activations), described by a table of named entries (name, shape, dtype, byte offset). Sharding,
// all-reduce, norms and checkpoint I/O work on flat ranges of it; layers get views by name.
//
// Two phases: add() every entry (computing offsets), then allocate() once. Entries start on a
// 256-byte boundary unless added with align=false, which places an entry right after the previous
// one: that is how q/k/v and gate/up weights stay one fused GEMM operand.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/tensor.h"

namespace longtrain {

struct ArenaEntry {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  size_t offset;  // bytes from the arena base
  int64_t numel;
};

class Arena {
 public:
  Arena(std::string kind, Device device) : kind_(std::move(kind)), device_(device) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;

  // Adds an entry; returns its index. Only before allocate().
  size_t add(const std::string& name, std::vector<int64_t> shape, DType dtype, bool align = true);
  // Adds every entry of `layout` (whose entries share one dtype) in `dtype` instead, each at the
  // same ELEMENT offset as there, so that flat element ranges of the two arenas line up: gradients
  // in f32 beside bf16 parameters, indexed by the same ZeRO-1 shard bounds and gradient ranges.
  // Also copies its padded end. Only on an empty arena, before allocate().
  void add_mirror(const Arena& layout, DType dtype);
  // Grows the arena's end (zero padding after the last entry) to a multiple of `bytes`, so that its
  // flat view splits evenly into shards (ZeRO-1). Only before allocate().
  void pad_to_multiple(size_t bytes);
  // Allocates the whole arena once and zeroes it.
  void allocate();

  bool allocated() const { return base_ != nullptr; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  Tensor get(const std::string& name) const;  // throws naming the arena and the entry when absent
  Tensor at(size_t index) const;
  // The whole arena as one 1-d tensor of `dtype` (every entry must have that dtype); padding between
  // entries is included and stays zero.
  Tensor flat() const;

  const std::vector<ArenaEntry>& table() const { return entries_; }
  const std::string& kind() const { return kind_; }
  Device device() const { return device_; }
  size_t bytes() const { return bytes_; }
  // What allocate() asks device_alloc for: bytes() rounded up to whole 256-byte blocks (memory
  // plans count this, without allocating).
  size_t allocation_bytes() const { return (bytes_ + 255) / 256 * 256; }
  void* base() const { return base_; }

 private:
  std::string kind_;
  Device device_;
  std::vector<ArenaEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
  size_t bytes_ = 0;
  void* base_ = nullptr;
};

}  // namespace longtrain
