// CUDA graphs: the ops a piece of host code queues on cuda_stream(), captured once and then replayed
// with one launch, without the host work of queuing each of them again (argument checks, descriptor
// encoding, cuBLASLt and cuDNN calls) and with less of the device's gap between kernels.
//
// A graph replays what was captured exactly: the same kernels with the same arguments, raw device
// pointers and host scalars included. The caller decides when that is still the same work (its own
// key of shapes, pointers and scalars) and must also check that no device buffer was freed since the
// capture (AllocationStats::frees, runtime/device.h), since a pointer into a freed buffer would be
// replayed all the same.
//
// Capture runs in CUDA's global mode: a call that cannot be captured (a device-to-host copy, a
// stream or event wait, cudaMalloc or cudaFree, anything on the legacy stream) fails the capture
// instead of being left out of the graph; capture() then ends the capture, leaves the stream as it
// was and throws, naming the call. Nothing runs on the device during a capture.
#pragma once

#include <cstddef>
#include <functional>

namespace longtrain {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  CudaGraph(CudaGraph&& other) noexcept;
  CudaGraph& operator=(CudaGraph&& other) noexcept;

  // Captures what `body` queues on cuda_stream() and instantiates it. Throws Error when the build has
  // no CUDA, when the capture fails (body threw, or made a call that cannot be captured) or when the
  // graph cannot be instantiated.
  static CudaGraph capture(const std::function<void()>& body);

  void launch() const;  // queues the whole graph on cuda_stream()
  bool empty() const { return exec_ == nullptr; }
  size_t nodes() const { return nodes_; }

 private:
  void reset();
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  size_t nodes_ = 0;
};

}  // namespace longtrain
