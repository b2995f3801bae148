// Scratch buffers and the bad-index flag shared by the CUDA ops (see cuda_common.cuh).
#include <array>
#include <mutex>

#include "kernels/cuda/cuda_common.cuh"
#include "runtime/device.h"

namespace longtrain::cuda_util {

namespace {

struct ScratchBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
};

std::mutex g_scratch_mutex;
std::array<ScratchBuffer, static_cast<size_t>(Scratch::count)> g_scratch;

__global__ void find_bad_index_kernel(const int32_t* values, int64_t stride, int64_t n, int64_t limit,
                                      int32_t allowed, int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int32_t v = values[i * stride];
    if (v != allowed && (v < 0 || v >= limit)) atomicMin(flag, static_cast<int>(i));
  }
}

}  // namespace

void* scratch(Scratch which, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_scratch_mutex);
  ScratchBuffer& b = g_scratch[static_cast<size_t>(which)];
  if (bytes > b.bytes) {
    // A graph being captured (runtime/cuda_graph.h) would keep the old pointer: fail its capture
    // here, by name, rather than inside cudaFree/cudaMalloc (which a capture forbids).
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    LT_CUDA_CHECK(cudaStreamIsCapturing(cuda_stream(), &capturing));
    LT_CHECK(capturing == cudaStreamCaptureStatusNone,
             "the CUDA ops' scratch buffer {} would grow from {} to {} bytes inside a CUDA graph capture",
             static_cast<int>(which), b.bytes, bytes);
    // Through device_alloc, so that allocation_stats() sees the scratch too. The old buffer may
    // still be read by queued kernels: cudaFree waits for the device first.
    device_free(Device::cuda, b.ptr);
    b.ptr = nullptr;
    b.bytes = 0;
    size_t rounded = (bytes + (1u << 20) - 1) & ~size_t((1u << 20) - 1);  // whole MiB: fewer regrowths
    try {
      b.ptr = device_alloc(Device::cuda, rounded);
    } catch (const Error& e) {
      LT_FAIL("{} (the CUDA ops' scratch buffer {}, kernels/cuda/cuda_host.h)", e.what(), static_cast<int>(which));
    }
    b.bytes = rounded;
  }
  return b.ptr;
}

int* reset_bad_index_flag() {
  int* flag = static_cast<int*>(scratch(Scratch::flag, sizeof(int)));
  LT_CUDA_CHECK(cudaMemsetAsync(flag, 0x7f, sizeof(int), cuda_stream()));
  return flag;
}

int read_bad_index_flag() {
  int* flag = static_cast<int*>(scratch(Scratch::flag, sizeof(int)));
  int v = 0;
  LT_CUDA_CHECK(cudaMemcpyAsync(&v, flag, sizeof(int), cudaMemcpyDeviceToHost, cuda_stream()));
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  return v;
}

void find_bad_index(const int32_t* values, int64_t stride, int64_t n, int64_t limit, int32_t allowed, int* flag) {
  if (n == 0) return;
  find_bad_index_kernel<<<blocks_for(n, 256, 1024), 256, 0, cuda_stream()>>>(values, stride, n, limit, allowed,
                                                                            flag);
  LT_CUDA_LAUNCH_CHECK("find_bad_index_kernel");
}

int32_t read_device_int(const int32_t* p) {
  int32_t v = 0;
  LT_CUDA_CHECK(cudaMemcpyAsync(&v, p, sizeof(v), cudaMemcpyDeviceToHost, cuda_stream()));
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  return v;
}

}  // namespace longtrain::cuda_util
