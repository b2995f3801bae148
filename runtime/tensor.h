// Tensor: a non-owning view (pointer, dtype, device, shape, strides in elements). Memory is owned by
// arenas (arena.h); ops take views, so the same op reads a contiguous buffer or a strided slice of
// one (Q, K and V are strided views into the fused QKV output, never copied).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "runtime/dtype.h"
#include "runtime/error.h"

namespace longtrain {

enum class Device : uint8_t { cpu, cuda };

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // in elements

  Tensor() = default;
  // A contiguous (row-major) view of `shape` at `data`.
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu);

  bool empty() const { return data == nullptr; }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;

  // Typed pointer; throws if T does not match the dtype.
  template <class T> T* ptr() const {
    LT_CHECK(dtype_of<T>() == dtype, "tensor of dtype {} accessed as {}", dtype_name(dtype),
             dtype_name(dtype_of<T>()));
    return static_cast<T*>(data);
  }

  // Rows [start, start+length) of dimension 0, as a view.
  Tensor narrow(int64_t start, int64_t length) const { return narrow(0, start, length); }
  // Entries [start, start+length) of dimension `dim`, as a view.
  Tensor narrow(int dim, int64_t start, int64_t length) const;
  // A view of the same contiguous memory with another shape (same element count).
  Tensor reshape(std::initializer_list<int64_t> new_shape) const;

  std::string describe() const;  // "bf16[37, 3, 6] cpu", for error messages
};

// Throws unless a and b have the same shape.
void check_same_shape(const Tensor& a, const Tensor& b, const char* what);

}  // namespace longtrain
