#include "model/offload.h"

#include <cstring>

#include "runtime/device.h"
#include "runtime/error.h"

#ifdef LONGTRAIN_HAS_CUDA
#include "runtime/cuda_check.h"
#endif

namespace longtrain::model {

Offload parse_offload(const std::string& name) {
  if (name == "none") return Offload::none;
  if (name == "checkpoints") return Offload::checkpoints;
  LT_FAIL("model.offload is '{}'; expected one of none, checkpoints", name);
}

const char* offload_name(Offload o) { return o == Offload::none ? "none" : "checkpoints"; }

CheckpointOffloader::CheckpointOffloader(const Arena& host_table, Device device, int64_t n_layers)
    : device_(device), table_(host_table.table()), bytes_(host_table.allocation_bytes()) {
  if (device_ == Device::cpu) {
    base_ = device_alloc(Device::cpu, bytes_);
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  cudaError_t err = cudaMallocHost(&base_, bytes_);
  LT_CHECK(err == cudaSuccess,
           "model.offload: checkpoints could not pin {:.2f} GiB of host memory for the offloaded checkpoints: {} "
           "(free host memory, or use model.offload: none)",
           static_cast<double>(bytes_) / (1u << 30), cudaGetErrorString(err));
  cudaStream_t s = nullptr;
  LT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  for (int64_t l = 0; l < n_layers; ++l) {
    cudaEvent_t o = nullptr, i = nullptr;
    LT_CUDA_CHECK(cudaEventCreateWithFlags(&o, cudaEventDisableTiming));
    LT_CUDA_CHECK(cudaEventCreateWithFlags(&i, cudaEventDisableTiming));
    out_.push_back(o);
    in_.push_back(i);
  }
#else
  (void)n_layers;
  LT_FAIL("model.offload on a CUDA model, but longtrain was built without CUDA");
#endif
}

CheckpointOffloader::~CheckpointOffloader() {
  if (device_ == Device::cpu) {
    device_free(Device::cpu, base_);
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  if (stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  for (void* e : out_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  for (void* e : in_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (base_) cudaFreeHost(base_);
#endif
}

Tensor CheckpointOffloader::host(const std::string& name) const {
  for (const ArenaEntry& e : table_) {
    if (e.name != name) continue;
    Tensor t;  // row-major view of the entry, on the host
    t.data = static_cast<char*>(base_) + e.offset;
    t.dtype = e.dtype;
    t.device = Device::cpu;
    t.ndim = static_cast<int>(e.shape.size());
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = e.shape[d];
      t.stride[d] = stride;
      stride *= e.shape[d];
    }
    return t;
  }
  LT_FAIL("offloaded checkpoints: no host tensor '{}'", name);
}

void CheckpointOffloader::run(const std::vector<Copy>& copies, void* event) {
  if (device_ == Device::cpu) {
    for (const Copy& c : copies) copy(c.dst, c.src);
    return;
  }
#ifdef LONGTRAIN_HAS_CUDA
  const auto s = static_cast<cudaStream_t>(stream_);
  // The copy stream starts behind what the compute stream has queued so far (the slot was written,
  // or its last reader ran).
  cudaEvent_t ready = static_cast<cudaEvent_t>(event);
  LT_CUDA_CHECK(cudaEventRecord(ready, cuda_stream()));
  LT_CUDA_CHECK(cudaStreamWaitEvent(s, ready, 0));
  for (const Copy& c : copies) {
    LT_CHECK(c.dst.is_contiguous() && c.src.is_contiguous() && c.dst.numel() == c.src.numel() &&
                 c.dst.dtype == c.src.dtype,
             "offloaded checkpoints: copy {} <- {} (contiguous, same size and dtype expected)", c.dst.describe(),
             c.src.describe());
    LT_CUDA_CHECK(cudaMemcpyAsync(c.dst.data, c.src.data, static_cast<size_t>(c.src.numel()) * dtype_size(c.src.dtype),
                                  cudaMemcpyDefault, s));
  }
  LT_CUDA_CHECK(cudaEventRecord(ready, s));  // the same event, re-recorded: now it marks the copies' end
#else
  (void)copies;
  (void)event;
#endif
}

void CheckpointOffloader::out(int64_t layer, const std::vector<Copy>& copies) {
  run(copies, device_ == Device::cpu ? nullptr : out_.at(static_cast<size_t>(layer)));
}
void CheckpointOffloader::in(int64_t layer, const std::vector<Copy>& copies) {
  run(copies, device_ == Device::cpu ? nullptr : in_.at(static_cast<size_t>(layer)));
}

void CheckpointOffloader::wait_out(int64_t layer) {
#ifdef LONGTRAIN_HAS_CUDA
  if (device_ != Device::cpu)
    LT_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(), static_cast<cudaEvent_t>(out_.at(static_cast<size_t>(layer))), 0));
#else
  (void)layer;
#endif
}
void CheckpointOffloader::wait_in(int64_t layer) {
#ifdef LONGTRAIN_HAS_CUDA
  if (device_ != Device::cpu)
    LT_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(), static_cast<cudaEvent_t>(in_.at(static_cast<size_t>(layer))), 0));
#else
  (void)layer;
#endif
}
void CheckpointOffloader::wait_all() {
#ifdef LONGTRAIN_HAS_CUDA
  if (device_ == Device::cpu || out_.empty()) return;
  // Record a fresh marker at the copy stream's tail and make the compute stream wait for it.
  cudaEvent_t tail = static_cast<cudaEvent_t>(in_.front());
  LT_CUDA_CHECK(cudaEventRecord(tail, static_cast<cudaStream_t>(stream_)));
  LT_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(), tail, 0));
#endif
}

}  // namespace longtrain::model
