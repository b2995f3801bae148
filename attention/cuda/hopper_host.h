// Host-side helpers of our Hopper attention kernels: the TMA tensor maps over bf16 [tokens, heads,
// dim] views, the sm_90 device check, the TMA alignment checks of an input view and the launch
// order's section size, shared by the
// forward (hopper_attention.cu) and the backward (hopper_attention_bwd.cu).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encode function comes from the driver at run time

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "attention/cuda/hopper_attention.h"

namespace longtrain::attn::hopper::host {

// A value computed once per key and remembered, for the launch planning the host repeats on every call
// of a shape (section sizes, step directions, the SM count). Thread-safe; `compute` runs outside the
// lock, so two threads may both compute a new key and the first to finish is kept (the computations
// are pure, so both give the same value).
template <class Key, class Value>
class Memo {
 public:
  template <class Compute>
  Value get(const Key& key, Compute&& compute) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = values_.find(key);
      if (it != values_.end()) return it->second;
    }
    Value value = compute();
    const std::lock_guard<std::mutex> lock(mutex_);
    return values_.emplace(key, std::move(value)).first->second;
  }

 private:
  std::mutex mutex_;
  std::map<Key, Value> values_;
};

// A TMA map over the bf16 [tokens, heads, dim] view: dims (dim, heads, tokens) innermost first, byte
// strides of heads and tokens, box (64 of dim, 1 head, `rows` tokens), 128-byte swizzle, zero fill of
// rows past the end. Throws naming `name` where the driver rejects the view.
CUtensorMap tile_map(const View& v, int rows, const char* name);

// Whether the current device is sm_90 (H100/H200), the only one the sm_90a code runs on.
bool sm90_device();

// Empty when TMA can read the view: a base address and token/head strides that are multiples of 16
// bytes, positive strides; else why not, naming `name`.
std::string check_tma_input(const View& v, const char* name);

// The kv heads per launch-order section (hopper_attention.h, "The launch order") the environment
// variable `env` asks for (a positive integer, clamped to [1, kv_heads]; anything else throws naming
// it), or 0 when it is unset or empty.
int section_from_env(const char* env, int64_t kv_heads);

// The launch order's default section size, from a model of the GPU's block scheduler: CTAs start in
// launch order, each on the first SM that frees (one CTA per SM for both kernels), so a kernel's time
// is about the makespan of list scheduling its CTAs' work in that order. One kv head per section keeps
// the running CTAs on one kv head's data (the DRAM traffic the sections were made for), but where a kv
// head has few CTAs the last section's longest ones start late and finish alone: at 8K tokens the
// backward's makespan is 1.24x (head dim 128, 32/8 heads) and 1.49x (64, 32/4) of the ideal under
// sections of one kv head, within 1.5% under sections of two, and within 2% at 16K and longer. On the
// H200 the 8K backward ran 1.16x (head dim 128) and 1.41x (64) faster under the model's two than under
// one (bench/results/attention-launch-sections-h200-2026-12-06.json).
//
// tile_work[t]: the work of each CTA of launch-order tile t (t = 0 starts first; work in any unit
// proportional to time), the same for every kv head; units_per_kv CTAs per tile and kv head (the
// forward's query heads of one kv head, the backward's one), launched as launch_order_tile decodes:
// within a section tile by tile, the section's kv heads' units fastest. Returns the makespan in work
// units on `slots` SMs.
double launch_makespan(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads, int64_t section,
                       int64_t slots);

// Each CTA's start in the same model, in launch order (work units): the time the slot it takes frees.
std::vector<int64_t> launch_starts(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads,
                                   int64_t section, int64_t slots);

// Which CTAs start in a stream rather than in a burst, from launch_starts: a CTA starts in a burst
// when a launch-order neighbour starts within `tolerance` of it (the first wave; the CTAs that take the
// slots of CTAs that ended together), else in a stream (one after another as earlier CTAs end). In the
// causal backward, a burst's CTAs walking their query tiles from the last down share a tile at every
// step, and so do a stream's walking from their first tile up: key tile n + 1's CTA starts about one
// key tile's query tiles after key tile n's and its first query tile is that many tiles later.
std::vector<bool> streamed_ctas(const std::vector<int64_t>& starts, int64_t tolerance);

// The fewest kv heads per section whose launch_makespan is within `tolerance` of the ideal,
// max(total work / slots, the longest CTA); where none is, the size with the smallest makespan (the
// smallest of equals). In [1, kv_heads]. The default 7% weighs the tail against what the model leaves
// out, the DRAM traffic of larger sections: at head dim 128, 16K, sections of two ran 1-6% and of four
// 13% slower than of one (H100), and at 12K (H200) the model's 1.06x tail under two ran 10% faster
// than its 1.006x under four.
int section_for_tail(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads, int64_t slots,
                     double tolerance = 0.07);

// The current device's SM count (the slots of the model above), read once per device.
int sm_count();

// section_for_tail on this device, computed once per distinct (kernel, tile_work, units, kv heads)
// and remembered: `kernel` names the caller's launch (e.g. "fwd"), so equal work lists of different
// kernels do not share an entry.
int cached_section_for_tail(const char* kernel, const std::vector<int64_t>& tile_work, int64_t units_per_kv,
                            int64_t kv_heads);

}  // namespace longtrain::attn::hopper::host
