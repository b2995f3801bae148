#include "runtime/arena.h"

#include <utility>

#include "runtime/device.h"

namespace longtrain {

Arena::~Arena() { device_free(device_, base_); }

Arena::Arena(Arena&& o) noexcept
    : kind_(std::move(o.kind_)), device_(o.device_), entries_(std::move(o.entries_)),
      index_(std::move(o.index_)), bytes_(o.bytes_), base_(std::exchange(o.base_, nullptr)) {}

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    device_free(device_, base_);
    kind_ = std::move(o.kind_);
    device_ = o.device_;
    entries_ = std::move(o.entries_);
    index_ = std::move(o.index_);
    bytes_ = o.bytes_;
    base_ = std::exchange(o.base_, nullptr);
  }
  return *this;
}

size_t Arena::add(const std::string& name, std::vector<int64_t> shape, DType dtype, bool align) {
  LT_CHECK(base_ == nullptr, "arena '{}': entry '{}' added after allocation", kind_, name);
  LT_CHECK(!contains(name), "arena '{}': entry '{}' added twice", kind_, name);
  LT_CHECK(!shape.empty() && shape.size() <= kMaxDims, "arena '{}': entry '{}' has {} dims", kind_, name,
           shape.size());
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  size_t offset = align ? (bytes_ + 255) / 256 * 256 : bytes_;
  LT_CHECK(offset % dtype_size(dtype) == 0, "arena '{}': entry '{}' would be misaligned", kind_, name);
  entries_.push_back({name, std::move(shape), dtype, offset, numel});
  index_[name] = entries_.size() - 1;
  bytes_ = offset + static_cast<size_t>(numel) * dtype_size(dtype);
  return entries_.size() - 1;
}

void Arena::add_mirror(const Arena& layout, DType dtype) {
  LT_CHECK(base_ == nullptr && entries_.empty(), "arena '{}': add_mirror needs an empty arena", kind_);
  LT_CHECK(!layout.entries_.empty(), "arena '{}': add_mirror of the empty arena '{}'", kind_, layout.kind_);
  const size_t from = dtype_size(layout.entries_.front().dtype), to = dtype_size(dtype);
  for (const ArenaEntry& e : layout.entries_) {
    LT_CHECK(dtype_size(e.dtype) == from, "arena '{}': add_mirror needs one dtype in '{}', entry '{}' differs", kind_,
             layout.kind_, e.name);
    entries_.push_back({e.name, e.shape, dtype, e.offset / from * to, e.numel});
    index_[e.name] = entries_.size() - 1;
  }
  LT_CHECK(layout.bytes_ % from == 0, "arena '{}': '{}' ends inside an element", kind_, layout.kind_);
  bytes_ = layout.bytes_ / from * to;
}

void Arena::pad_to_multiple(size_t bytes) {
  LT_CHECK(base_ == nullptr, "arena '{}': padded after allocation", kind_);
  LT_CHECK(bytes > 0, "arena '{}': padding to a multiple of 0 bytes", kind_);
  bytes_ = (bytes_ + bytes - 1) / bytes * bytes;
}

void Arena::allocate() {
  LT_CHECK(base_ == nullptr, "arena '{}' allocated twice", kind_);
  // Whole 256-byte blocks, so the zeroing view below covers the allocation exactly.
  const size_t padded = allocation_bytes();
  base_ = device_alloc(device_, padded);
  zero(Tensor(base_, DType::i32, {static_cast<int64_t>(padded / 4)}, device_));
}

Tensor Arena::at(size_t i) const {
  LT_CHECK(base_ != nullptr, "arena '{}' used before allocation", kind_);
  const ArenaEntry& e = entries_.at(i);
  Tensor t(static_cast<char*>(base_) + e.offset, e.dtype, {e.numel}, device_);
  t.ndim = static_cast<int>(e.shape.size());
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = e.shape[d];
    t.stride[d] = st;
    st *= e.shape[d];
  }
  return t;
}

Tensor Arena::get(const std::string& name) const {
  auto it = index_.find(name);
  LT_CHECK(it != index_.end(), "arena '{}' has no entry '{}'", kind_, name);
  return at(it->second);
}

Tensor Arena::flat() const {
  LT_CHECK(base_ != nullptr, "arena '{}' used before allocation", kind_);
  LT_CHECK(!entries_.empty(), "arena '{}' is empty", kind_);
  DType dt = entries_.front().dtype;
  for (const auto& e : entries_)
    LT_CHECK(e.dtype == dt, "arena '{}' mixes dtypes ({} is {}); no flat view", kind_, e.name, dtype_name(e.dtype));
  return Tensor(base_, dt, {static_cast<int64_t>(bytes_ / dtype_size(dt))}, device_);
}

}  // namespace longtrain
