#include "runtime/tensor.h"

#include <fmt/format.h>

namespace longtrain {

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_), ndim(static_cast<int>(shape_.size())) {
  LT_CHECK(ndim <= kMaxDims, "tensor with {} dims; at most {} are supported", ndim, kMaxDims);
  int d = 0;
  for (int64_t s : shape_) {
    LT_CHECK(s >= 0, "negative tensor extent {}", s);
    shape[d++] = s;
  }
  int64_t st = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    stride[i] = st;
    st *= shape[i];
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t st = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != st) return false;
    st *= shape[i];
  }
  return true;
}

Tensor Tensor::narrow(int dim, int64_t start, int64_t length) const {
  LT_CHECK(dim >= 0 && dim < ndim, "narrow: dim {} of a {}-d tensor", dim, ndim);
  LT_CHECK(start >= 0 && length >= 0 && start + length <= shape[dim],
           "narrow: [{}, {}) outside extent {} of {}", start, start + length, shape[dim], describe());
  Tensor v = *this;
  v.data = static_cast<char*>(data) + start * stride[dim] * static_cast<int64_t>(dtype_size(dtype));
  v.shape[dim] = length;
  return v;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> new_shape) const {
  LT_CHECK(is_contiguous(), "reshape of a non-contiguous view {}", describe());
  Tensor v(data, dtype, new_shape, device);
  LT_CHECK(v.numel() == numel(), "reshape of {} to {} elements", describe(), v.numel());
  return v;
}

std::string Tensor::describe() const {
  std::string s = fmt::format("{}[", dtype_name(dtype));
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (device == Device::cpu ? "] cpu" : "] cuda");
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* what) {
  bool same = a.ndim == b.ndim;
  for (int i = 0; same && i < a.ndim; ++i) same = a.shape[i] == b.shape[i];
  LT_CHECK(same, "{}: shapes differ: {} vs {}", what, a.describe(), b.describe());
}

}  // namespace longtrain

#include "runtime/dispatch.h"

namespace longtrain {

Device common_device(const char* op, std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (t->empty()) continue;
    if (first == nullptr) first = t;
    LT_CHECK(t->device == first->device, "{}: tensors on different devices ({} and {})", op,
             first->describe(), t->describe());
  }
  LT_CHECK(first != nullptr, "{}: every tensor is empty", op);
  return first->device;
}

}  // namespace longtrain
