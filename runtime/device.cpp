#include "runtime/device.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#ifdef LONGTRAIN_HAS_CUDA
#include <cuda_runtime.h>
#define LT_CUDA_CHECK(expr)                                                                    \
  do {                                                                                         \
    cudaError_t err_ = (expr);                                                                 \
    LT_CHECK(err_ == cudaSuccess, "{} failed: {}", #expr, cudaGetErrorString(err_));          \
  } while (0)
#endif

namespace longtrain {

bool cuda_available() {
#ifdef LONGTRAIN_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef LONGTRAIN_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

void select_cuda_device(int index) {
  const int n = cuda_device_count();
  LT_CHECK(index >= 0 && index < n, "GPU {} requested but {} {} visible (CUDA_VISIBLE_DEVICES, --nproc-per-node)",
           index, n, n == 1 ? "is" : "are");
#ifdef LONGTRAIN_HAS_CUDA
  LT_CUDA_CHECK(cudaSetDevice(index));
#endif
}

namespace {

// Live allocations per device (allocations are few and large: arenas, grow-only scratch).
struct AllocationTracker {
  std::mutex mutex;
  std::unordered_map<void*, size_t> sizes[2];
  AllocationStats stats[2];

  static size_t index(Device d) { return d == Device::cpu ? 0 : 1; }
  void add(Device d, void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t i = index(d);
    sizes[i][p] = bytes;
    stats[i].live += bytes;
    if (stats[i].live > stats[i].peak) stats[i].peak = stats[i].live;
  }
  void remove(Device d, void* p) {
    std::lock_guard<std::mutex> lock(mutex);
    const size_t i = index(d);
    auto it = sizes[i].find(p);
    if (it == sizes[i].end()) return;
    stats[i].live -= it->second;
    stats[i].frees += 1;
    sizes[i].erase(it);
  }
};

AllocationTracker& tracker() {
  static AllocationTracker* t = new AllocationTracker;  // never destroyed: frees may run at exit
  return *t;
}

}  // namespace

AllocationStats allocation_stats(Device device) {
  AllocationTracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  return t.stats[AllocationTracker::index(device)];
}

void reset_allocation_peak(Device device) {
  AllocationTracker& t = tracker();
  std::lock_guard<std::mutex> lock(t.mutex);
  AllocationStats& s = t.stats[AllocationTracker::index(device)];
  s.peak = s.live;
}

void* device_alloc(Device device, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (device == Device::cpu) {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    LT_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
    tracker().add(device, p, bytes);
    return p;
  }
#ifdef LONGTRAIN_HAS_CUDA
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  LT_CHECK(err == cudaSuccess, "out of GPU memory allocating {:.2f} GiB: {}", bytes / double(1 << 30),
           cudaGetErrorString(err));
  tracker().add(device, p, bytes);
  return p;
#else
  LT_FAIL("CUDA memory requested but longtrain was built without CUDA (-DLONGTRAIN_CUDA=ON)");
#endif
}

void device_free(Device device, void* ptr) {
  if (ptr == nullptr) return;
  tracker().remove(device, ptr);
  if (device == Device::cpu) {
    std::free(ptr);
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  cudaFree(ptr);
#endif
}

void zero(const Tensor& t) {
  LT_CHECK(t.is_contiguous(), "zero: non-contiguous {}", t.describe());
  if (t.device == Device::cpu) {
    std::memset(t.data, 0, t.nbytes());
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  LT_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), cudaStreamPerThread));
#endif
}

void copy(const Tensor& dst, const Tensor& src) {
  LT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: {} from {}", dst.describe(),
           src.describe());
  LT_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy: non-contiguous {} or {}", dst.describe(),
           src.describe());
  if (dst.device == Device::cpu && src.device == Device::cpu) {
    std::memmove(dst.data, src.data, dst.nbytes());
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  LT_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDefault, cudaStreamPerThread));
  if (dst.device == Device::cpu) LT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
#else
  LT_FAIL("copy involving CUDA memory but longtrain was built without CUDA");
#endif
}

}  // namespace longtrain
