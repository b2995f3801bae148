// Device dispatch shared by the op tables (kernels/ops.cpp, attention/local_attention.cpp).
#pragma once

#include <initializer_list>

#include "runtime/tensor.h"

namespace longtrain {

// The device of the first non-empty tensor; every other non-empty tensor must be on it.
Device common_device(const char* op, std::initializer_list<const Tensor*> tensors);

}  // namespace longtrain

// Returns backend cuda::NAME(...) or cpu::NAME(...) by the tensors' device (a statement).
#ifdef LONGTRAIN_HAS_CUDA
#define LT_DISPATCH(device, NAME, ...)                                       \
  do {                                                                       \
    if ((device) == ::longtrain::Device::cuda) return cuda::NAME(__VA_ARGS__); \
    return cpu::NAME(__VA_ARGS__);                                           \
  } while (0)
#else
#define LT_DISPATCH(device, NAME, ...)                                                        \
  do {                                                                                        \
    if ((device) == ::longtrain::Device::cuda)                                                \
      LT_FAIL("{} on a CUDA tensor, but longtrain was built without CUDA (-DLONGTRAIN_CUDA=ON)", #NAME); \
    return cpu::NAME(__VA_ARGS__);                                                            \
  } while (0)
#endif
