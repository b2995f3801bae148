#include "runtime/cuda_graph.h"

#include <utility>

#include "runtime/error.h"

#ifdef LONGTRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "runtime/cuda_check.h"
#endif

namespace longtrain {

CudaGraph::~CudaGraph() { reset(); }

CudaGraph::CudaGraph(CudaGraph&& other) noexcept
    : graph_(std::exchange(other.graph_, nullptr)),
      exec_(std::exchange(other.exec_, nullptr)),
      nodes_(std::exchange(other.nodes_, 0)) {}

CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  if (this != &other) {
    reset();
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
    nodes_ = std::exchange(other.nodes_, 0);
  }
  return *this;
}

#ifdef LONGTRAIN_HAS_CUDA

void CudaGraph::reset() {
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_ != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = graph_ = nullptr;
  nodes_ = 0;
}

CudaGraph CudaGraph::capture(const std::function<void()>& body) {
  LT_CUDA_CHECK(cudaStreamBeginCapture(cuda_stream(), cudaStreamCaptureModeGlobal));
  // Ends the capture whatever happened, so the stream is usable again. After a failure the error that
  // invalidated the capture is cleared from the thread's last-error slot (a capture error is not
  // sticky); after a success the slot is left alone.
  auto end_capture = [](cudaGraph_t* graph, bool failed) {
    const cudaError_t err = cudaStreamEndCapture(cuda_stream(), graph);
    if (failed || err != cudaSuccess) (void)cudaGetLastError();
    return err;
  };
  try {
    body();
  } catch (const Error& e) {
    cudaGraph_t partial = nullptr;
    end_capture(&partial, /*failed=*/true);
    if (partial != nullptr) cudaGraphDestroy(partial);
    throw Error(fmt::format("capturing a CUDA graph failed: {}", e.what()), e.where());
  } catch (...) {
    cudaGraph_t partial = nullptr;
    end_capture(&partial, /*failed=*/true);
    if (partial != nullptr) cudaGraphDestroy(partial);
    throw;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t err = end_capture(&graph, /*failed=*/false);
  if (err != cudaSuccess || graph == nullptr) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    LT_FAIL("capturing a CUDA graph failed: {} (a call in the captured work synchronised with the device, "
            "allocated or freed memory, or used another stream)",
            cudaGetErrorString(err));
  }
  CudaGraph g;
  g.graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  LT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  g.exec_ = exec;
  size_t n = 0;
  LT_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  g.nodes_ = n;
  return g;
}

void CudaGraph::launch() const {
  LT_CHECK(exec_ != nullptr, "launching an empty CUDA graph");
  LT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), cuda_stream()));
}

#else

void CudaGraph::reset() {}

CudaGraph CudaGraph::capture(const std::function<void()>&) {
  LT_FAIL("CUDA graphs need a CUDA build of longtrain (-DLONGTRAIN_CUDA=ON)");
}

void CudaGraph::launch() const { LT_FAIL("CUDA graphs need a CUDA build of longtrain (-DLONGTRAIN_CUDA=ON)"); }

#endif

}  // namespace longtrain
