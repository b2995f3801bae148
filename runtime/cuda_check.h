// CUDA error checks and the stream every CUDA op runs on. Included only by CUDA code (kernels/cuda,
// attention/cuda, GPU tests and benchmarks); the CPU build never sees it.
#pragma once

#include <cuda_runtime_api.h>

#include "runtime/error.h"

// LT_CUDA_CHECK(expr): throws longtrain::Error naming the failed call and CUDA's reason.
#ifndef LT_CUDA_CHECK
#define LT_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    cudaError_t err_ = (expr);                                                                 \
    LT_CHECK(err_ == cudaSuccess, "{} failed: {}", #expr, cudaGetErrorString(err_));          \
  } while (0)
#endif

// LT_CUDA_LAUNCH_CHECK(name): reports a failed kernel launch (bad configuration, no device).
#define LT_CUDA_LAUNCH_CHECK(name)                                                                    \
  do {                                                                                                \
    cudaError_t err_ = cudaGetLastError();                                                            \
    LT_CHECK(err_ == cudaSuccess, "launching {} failed: {}", name, cudaGetErrorString(err_));        \
  } while (0)

namespace longtrain {

// One stream for every op for now (runtime/device.cpp copies and zeroes on it too). Stream order
// is what makes reusing the ops' scratch buffers safe.
inline cudaStream_t cuda_stream() { return cudaStreamPerThread; }

}  // namespace longtrain
