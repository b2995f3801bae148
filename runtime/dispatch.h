// Device dispatch shared by the op tables (kernels/ops.cpp, attention/local_attention.cpp).
#pragma once

#include <initializer_list>

#include "runtime/tensor.h"

namespace longtrain {

// The device of the first non-empty tensor; every other non-empty tensor must be on it.
Device common_device(const char* op, std::initializer_list<const Tensor*> tensors);

}  // namespace longtrain

// Calls backend::cuda::NAME or backend::cpu::NAME with the arguments, by the tensors' device.
#ifdef LONGTRAIN_HAS_CUDA
#define LT_DISPATCH(device, NAME, ...)                                                  \
  ((device) == ::longtrain::Device::cuda ? cuda::NAME(__VA_ARGS__) : cpu::NAME(__VA_ARGS__))
#else
#define LT_DISPATCH(device, NAME, ...)                                                                  \
  ((device) == ::longtrain::Device::cuda                                                                \
       ? ::longtrain::raise_error(__FILE__, __LINE__, #NAME " on a CUDA tensor, but longtrain was built " \
                                                          "without CUDA")                                \
       : cpu::NAME(__VA_ARGS__))
#endif
