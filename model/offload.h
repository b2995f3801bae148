// Checkpoint offload (model.offload: checkpoints): what the checkpoint policy keeps per layer (the
// layer input x, and O and LSE under remat_aware) lives in host memory, pinned on CUDA, instead of
// the device. The device keeps kOffloadSlots layers' worth, used round-robin (layer l in slot
// l % kOffloadSlots). During forward, layer l's slot is copied to the host on a copy stream right
// after layer l is queued, overlapping layer l + 1; during backward, layer l - 1 comes back into its
// slot while layer l computes. Events, not host syncs, order the two streams. On CPU the copies are
// plain memcpys in the same places, so every index and wait of the schedule runs (and is tested) there.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/arena.h"
#include "runtime/tensor.h"

namespace longtrain::model {

enum class Offload { none, checkpoints };
Offload parse_offload(const std::string& name);  // error names model.offload
const char* offload_name(Offload o);

// Three slots: while layer l computes in slot l % 3, layer l - 1's slot is on its way to the host
// (forward) and layer l - 1 is coming back into its own (backward); the third holds the layer whose
// input layer l writes (forward: x_{l+1}).
constexpr int64_t kOffloadSlots = 3;

// The host half: one buffer (pinned on CUDA) holding every layer's kept tensors, and the copy stream
// with one "out" and one "in" event per layer.
class CheckpointOffloader {
 public:
  // `host_table` is an unallocated arena table (add_offload_host_entries) giving every host tensor's
  // name, shape and offset; `device` the model's device.
  CheckpointOffloader(const Arena& host_table, Device device, int64_t n_layers);
  ~CheckpointOffloader();
  CheckpointOffloader(const CheckpointOffloader&) = delete;
  CheckpointOffloader& operator=(const CheckpointOffloader&) = delete;

  Tensor host(const std::string& name) const;  // a view into the host buffer
  size_t host_bytes() const { return bytes_; }

  // Queues dst := src (the first `tokens` rows of both) on the copy stream, behind everything queued
  // on the compute stream so far (CPU: copies now).
  struct Copy {
    Tensor dst, src;
  };
  void out(int64_t layer, const std::vector<Copy>& copies);  // device -> host; then records out[layer]
  void in(int64_t layer, const std::vector<Copy>& copies);   // host -> device; then records in[layer]
  void wait_out(int64_t layer);  // the compute stream waits for out[layer]
  void wait_in(int64_t layer);   // the compute stream waits for in[layer]
  void wait_all();               // the compute stream waits for everything queued on the copy stream

 private:
  void run(const std::vector<Copy>& copies, void* event);

  Device device_;
  std::vector<ArenaEntry> table_;
  size_t bytes_ = 0;
  void* base_ = nullptr;
  [[maybe_unused]] void* stream_ = nullptr;  // cudaStream_t (CUDA builds only)
  std::vector<void*> out_, in_;       // cudaEvent_t per layer
};

}  // namespace longtrain::model
