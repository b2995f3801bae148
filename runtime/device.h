// Device memory: allocation, zeroing and copies for CPU and (when built) CUDA memory.
#pragma once

#include <cstddef>

#include "runtime/tensor.h"

namespace longtrain {

bool cuda_available();  // built with CUDA and at least one device visible
int cuda_device_count();  // 0 without CUDA
// Makes GPU `index` current for this process (a rank uses its LOCAL_RANK); errors name the index and
// how many GPUs are visible.
void select_cuda_device(int index);

void* device_alloc(Device device, size_t bytes);  // 256-byte aligned; throws on failure
void device_free(Device device, void* ptr);

// What device_alloc has handed out on `device` in this process and not yet freed (the bytes asked
// for), and the most that was ever live at once since the last reset. Memory plans are checked
// against it: every arena and grow-only scratch buffer of longtrain comes from device_alloc, so
// this is longtrain's own footprint, without the CUDA context, cuBLAS/cuDNN or NCCL internals.
struct AllocationStats {
  size_t live = 0;
  size_t peak = 0;
  // Buffers freed since the process started. A captured CUDA graph (runtime/cuda_graph.h) holds raw
  // device pointers: it can be trusted only while no buffer was freed after its capture.
  int64_t frees = 0;
};
AllocationStats allocation_stats(Device device);
void reset_allocation_peak(Device device);  // peak := live

void zero(const Tensor& t);                     // contiguous t := 0
void copy(const Tensor& dst, const Tensor& src);  // contiguous, same dtype and element count, any devices

}  // namespace longtrain
