// A per-op profile of whatever runs between enable() and report(): each named region is timed with a
// pair of CUDA events on cuda_stream() (or the host clock on the CPU), and report() sums them by name.
// Off by default; when off a region costs one relaxed atomic load. Used by the benchmarks (llama_bench
// --profile) to say where a training step's time goes; never by timed runs, since recording events
// between kernels adds a few microseconds each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace longtrain::profile {

void enable(bool on);
bool enabled();

// Times the ops launched during its lifetime, under `name` (a string literal: kept by pointer).
class Region {
 public:
  Region(const char* name, Device device);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  int64_t index_ = -1;  // the region's slot in the current profile; -1 when profiling is off
};

struct Entry {
  std::string name;
  double ms = 0.0;  // summed over calls
  int64_t calls = 0;
};

// Waits for the device, sums the regions recorded since the last report (or enable) by name, largest
// first, and starts a new profile. Nested regions are each counted in full.
std::vector<Entry> report();

}  // namespace longtrain::profile
