#include "runtime/profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

#include "runtime/error.h"
#ifdef LONGTRAIN_HAS_CUDA
#include "runtime/cuda_check.h"
#endif

namespace longtrain::profile {

namespace {

struct Record {
  const char* name = nullptr;
  Device device = Device::cpu;
#ifdef LONGTRAIN_HAS_CUDA
  cudaEvent_t start = nullptr, stop = nullptr;
#endif
  std::chrono::steady_clock::time_point host_start, host_stop;
};

struct State {
  std::atomic<bool> on{false};
  std::mutex mutex;
  std::vector<Record> records;
#ifdef LONGTRAIN_HAS_CUDA
  std::vector<cudaEvent_t> spare;  // events of earlier profiles, reused
  cudaEvent_t event() {
    if (!spare.empty()) {
      cudaEvent_t e = spare.back();
      spare.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    LT_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
#endif
};

State& state() {
  static State* s = new State;  // never destroyed: events outlive static teardown of the runtime
  return *s;
}

}  // namespace

void enable(bool on) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
#ifdef LONGTRAIN_HAS_CUDA
  for (Record& r : s.records)
    if (r.device == Device::cuda) s.spare.insert(s.spare.end(), {r.start, r.stop});
#endif
  s.records.clear();
  s.on.store(on, std::memory_order_relaxed);
}

bool enabled() { return state().on.load(std::memory_order_relaxed); }

Region::Region(const char* name, Device device) {
  State& s = state();
  if (!s.on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(s.mutex);
  Record r;
  r.name = name;
  r.device = device;
#ifdef LONGTRAIN_HAS_CUDA
  if (device == Device::cuda) {
    r.start = s.event();
    r.stop = s.event();
    LT_CUDA_CHECK(cudaEventRecord(r.start, cuda_stream()));
  }
#endif
  r.host_start = std::chrono::steady_clock::now();
  index_ = static_cast<int64_t>(s.records.size());
  s.records.push_back(r);
}

Region::~Region() {
  if (index_ < 0) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (index_ >= static_cast<int64_t>(s.records.size())) return;  // report() ran inside the region
  Record& r = s.records[static_cast<size_t>(index_)];
#ifdef LONGTRAIN_HAS_CUDA
  if (r.device == Device::cuda) cudaEventRecord(r.stop, cuda_stream());  // no throw from a destructor
#endif
  r.host_stop = std::chrono::steady_clock::now();
}

std::vector<Entry> report() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::map<std::string, Entry> by_name;
#ifdef LONGTRAIN_HAS_CUDA
  bool synced = false;
#endif
  for (Record& r : s.records) {
    double ms = std::chrono::duration<double, std::milli>(r.host_stop - r.host_start).count();
#ifdef LONGTRAIN_HAS_CUDA
    if (r.device == Device::cuda) {
      if (!synced) {
        LT_CUDA_CHECK(cudaDeviceSynchronize());
        synced = true;
      }
      float v = 0.0f;
      LT_CUDA_CHECK(cudaEventElapsedTime(&v, r.start, r.stop));
      ms = v;
      s.spare.insert(s.spare.end(), {r.start, r.stop});
    }
#endif
    Entry& e = by_name[r.name];
    e.name = r.name;
    e.ms += ms;
    ++e.calls;
  }
  s.records.clear();
  std::vector<Entry> out;
  for (auto& [name, e] : by_name) out.push_back(e);
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace longtrain::profile
