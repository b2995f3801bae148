// The CUDA graphs of LlamaModel::forward_backward (LlamaModel::set_cuda_graphs): a small cache of
// captured calls, keyed by everything the captured kernels took from the host, with what a replay
// must redo on the host.
//
// A graph replays its capture's kernels with their captured arguments: the shard's and loss_sum's
// device pointers and the token count, which gradients were still discarded (overwrite or accumulate,
// the GEMMs' beta) and the kernel choices in force. All of them are the key. The gradient factor
// grad_scale (1 / the step's valid labels, which masked labels change every step) is not: the
// cross-entropy reads it from device memory, written before each call outside the graph. What the call also did on the host (the discarded
// flags it cleared, the attention's call counters) is recorded at capture and applied on each replay.
// RoPE's frequencies are kernel arguments too: set_rope_length drops every graph.
//
// When a graph is made: a key's first call runs eagerly (it makes what is made once: cuDNN and cuBLASLt
// plans, scratch buffers) and so does every call until one of them ran no attention or GEMM trial call
// (a trial reads its times on the host); the call after that clean eager call is captured. A graph is
// dropped when any device buffer was freed since its capture (runtime/cuda_graph.h); its key, known to
// run clean, is captured again at its next call.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "runtime/cuda_graph.h"

namespace longtrain::model {

struct StepGraphKey {
  int64_t tokens = 0;
  const void* ids = nullptr;
  const void* labels = nullptr;
  const void* positions = nullptr;
  int64_t ids_stride = 0, labels_stride = 0, positions_stride = 0;
  const void* loss_sum = nullptr;
  std::vector<bool> discarded;  // LlamaModel's discardable gradients, in order, as the call began
  int attention_kernel_policy = 0;
  int gemm_algo_policy = 0;
  bool operator==(const StepGraphKey&) const = default;
};

// What the call did on the host besides queuing kernels; a replay does it again.
struct StepGraphEffects {
  std::vector<bool> discarded_after;
  int64_t attention_forward_calls = 0, attention_backward_calls = 0, attention_bytes_sent = 0, attention_pairs = 0;
};

class StepGraphs {
 public:
  struct Stats {
    int64_t captures = 0;  // graphs made
    int64_t replays = 0;   // calls that launched a graph instead of their kernels
    int64_t dropped = 0;   // graphs dropped (a buffer freed, RoPE changed, the cache full)
    std::string off_reason;  // non-empty once graphs are off for good: why
  };

  struct Entry {
    StepGraphKey key;
    CudaGraph graph;
    StepGraphEffects effects;
  };

  // The graph of `key`, or nullptr. `frees` is AllocationStats::frees of the device now: every graph
  // is dropped first when a buffer was freed since the graphs were captured.
  const Entry* find(const StepGraphKey& key, int64_t frees);
  // Whether the last eager call of `key` ran clean (no trial call): then its next call is captured.
  bool ready_to_capture(const StepGraphKey& key) const;
  void record_eager_call(const StepGraphKey& key, bool clean);
  const Entry& add(StepGraphKey key, CudaGraph graph, StepGraphEffects effects, int64_t frees);
  void drop_all();
  // Off for good, with the reason (the trainer logs it): the model runs every call eagerly from then on.
  void turn_off(std::string reason);
  bool off() const { return !stats_.off_reason.empty(); }
  const Stats& stats() const { return stats_; }
  void count_replay() { ++stats_.replays; }

  // Graphs kept at once: the calls of one step (the first micro-batch and the next ones differ in
  // which gradients they overwrite) and a few more.
  static constexpr size_t kMaxGraphs = 4;
  // After this many captures with fewer than two replays per capture, the calls change too often to
  // gain from graphs (buffers that move every step, say): graphs turn off.
  static constexpr int64_t kMaxUnpaidCaptures = 8;

 private:
  std::deque<Entry> entries_;
  std::deque<std::pair<StepGraphKey, bool>> eager_calls_;  // key, whether its last eager call ran clean
  int64_t frees_at_capture_ = -1;
  Stats stats_;
};

}  // namespace longtrain::model
