// What the GPU benchmarks (attention_bench, llama_bench, comm_bench, cp_bench) share: the command
// line and its comma lists, the date and the machine recorded in a result, reading an anchor's JSON
// and writing ours, device buffers, the synthetic bf16 inputs, CUDA-event timing, the slowest rank's
// value, and the kernel choices a training run gets. Header-only: each benchmark is one
// program.
#pragma once

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention/local_attention.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "runtime/cuda_check.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/text.h"

namespace longtrain::bench {

using nlohmann::json;

// ---- command line and result file ----------------------------------------------------------------

// argv joined by spaces: the command a result records.
inline std::string command_line(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) command += ' ';
    command += argv[i];
  }
  return command;
}

// `text` as a whole number (runtime/text.h, as the config reads one), else an error naming the tool
// and `what`.
inline int64_t parse_integer(const std::string& tool, const std::string& what, const std::string& text) {
  int64_t v = 0;
  LT_CHECK(parse_int(text, v), "{}: {} takes a whole number, got '{}'", tool, what, text);
  return v;
}

// `text` as a finite number, else an error naming the tool and `what`.
inline double parse_number(const std::string& tool, const std::string& what, const std::string& text) {
  double v = 0;
  LT_CHECK(parse_double(text, v), "{}: {} takes a number, got '{}'", tool, what, text);
  return v;
}

// The value of the flag being handled: next() (or text()) is the next argument, an error naming the
// flag when there is none; integer(), number() and integers() ("4096,16384") parse it, an error naming
// the flag when it is not that.
class FlagValue {
 public:
  FlagValue(std::string tool, std::string flag, std::function<std::string()> take)
      : tool_(std::move(tool)), flag_(std::move(flag)), take_(std::move(take)) {}
  std::string operator()() const { return take_(); }
  std::string text() const { return take_(); }
  int64_t integer() const { return parse_integer(tool_, flag_, take_()); }
  int int32() const {
    const int64_t v = integer();
    LT_CHECK(v >= INT32_MIN && v <= INT32_MAX, "{}: {} is out of range: {}", tool_, flag_, v);
    return static_cast<int>(v);
  }
  double number() const { return parse_number(tool_, flag_, take_()); }
  std::vector<int64_t> integers() const;

 private:
  std::string tool_, flag_;
  std::function<std::string()> take_;
};

// A benchmark's main() on an exception: prints "<tool>: <what>" (the message as it is where it already
// names the tool, as the flag errors do) and returns the exit status 1.
inline int report_failure(const std::string& tool, const std::exception& e) {
  const std::string what = e.what(), prefix = tool + ": ";
  std::fprintf(stderr, "%s\n", (what.rfind(prefix, 0) == 0 ? what : prefix + what).c_str());
  return 1;
}

// Walks argv[1..]: handle(flag, value) takes each flag (and its value, if it has one) and returns
// false for one it does not know, which is an error naming it and the comment that lists them.
inline void for_each_flag(int argc, char** argv, const std::string& tool,
                          const std::function<bool(const std::string& flag, const FlagValue& value)>& handle) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const FlagValue value(tool, a, [&]() -> std::string {
      LT_CHECK(i + 1 < argc, "{}: {} needs a value", tool, a);
      return argv[++i];
    });
    if (!handle(a, value))
      LT_FAIL("{}: unknown argument '{}' (see the comment at the top of bench/{}.cpp)", tool, a, tool);
  }
}

// What every benchmark's result records about its run: the command line (command_line), and from
// its flags --anchor (the PyTorch anchor's result to put beside ours), --out (where ours goes) and
// --commit. A benchmark's Options derive from it.
struct RunRecord {
  std::string anchor, out, commit = "unknown", command;
};

// --anchor, --out or --commit into `record`; false for any other flag (for_each_flag's handler asks
// this first).
inline bool record_flag(const std::string& flag, const FlagValue& value, RunRecord& record) {
  if (flag == "--anchor") {
    record.anchor = value();
  } else if (flag == "--out") {
    record.out = value();
  } else if (flag == "--commit") {
    record.commit = value();
  } else {
    return false;
  }
  return true;
}

// "a,b,c" -> {"a", "b", "c"}.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> items;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) items.push_back(item);
  return items;
}

inline std::vector<int64_t> FlagValue::integers() const {
  std::vector<int64_t> v;
  for (const std::string& item : split_list(take_())) v.push_back(parse_integer(tool_, flag_, item));
  return v;
}

inline double round1(double x) { return std::round(x * 10.0) / 10.0; }
inline double round3(double x) { return std::round(x * 1000.0) / 1000.0; }
inline double round4(double x) { return std::round(x * 10000.0) / 10000.0; }

// Now, UTC, as "2026-11-30T02:15:37Z".
inline std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

// The calling thread's current GPU and this host, as a result's "machine" records them.
inline json machine_json() {
  int device = 0, count = 0, driver = 0, runtime = 0;
  LT_CUDA_CHECK(cudaGetDevice(&device));
  LT_CUDA_CHECK(cudaGetDeviceCount(&count));
  cudaDeviceProp prop{};
  LT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return {{"gpu", prop.name},
          {"gpus_visible", count},
          {"sms", prop.multiProcessorCount},
          {"gpu_memory_gib", round1(static_cast<double>(prop.totalGlobalMem) / double(1ull << 30))},
          {"cuda_driver_api", driver},
          {"cuda_runtime", runtime},
          {"host", host}};
}

// The JSON file `path`; throws "<tool>: cannot read <what> <path>" when it cannot be opened.
inline json read_json(const std::string& tool, const std::string& what, const std::string& path) {
  std::ifstream in(path);
  LT_CHECK(in.good(), "{}: cannot read {} {}", tool, what, path);
  return json::parse(in);
}

// Writes `result` to `path` (one-space indents), replacing the file.
inline void write_json(const std::string& tool, const std::string& path, const json& result) {
  std::ofstream out(path);
  LT_CHECK(out.good(), "{}: cannot write {}", tool, path);
  out << result.dump(1) << "\n";
}

// ---- kernel choices --------------------------------------------------------------------------------

// What a training run chooses by default: its config's attention.kernel and train.gemm_algorithm are
// both auto (trainer/config.cpp; config_test checks those defaults).
struct KernelPolicies {
  attn::KernelPolicy attention;
  ops::GemmAlgoPolicy gemm;
};

// Puts the process under the kernel choices a training run with the default config gets (trainer.cpp:
// set_kernel_choices): auto for attention and GEMMs, unless LONGTRAIN_ATTENTION_KERNEL or
// LONGTRAIN_GEMM_ALGO names another (the same developer's overrides the trainer honours). Without it a
// benchmark would run the libraries' own defaults (cudnn, heuristic) and time what no run uses.
// Returns the policies in force, for the result to record.
inline KernelPolicies use_training_kernel_policies() {
  return {attn::set_kernel_policy_unless_overridden(attn::KernelPolicy::autotune),
          ops::set_gemm_algo_policy_unless_overridden(ops::GemmAlgoPolicy::autotune)};
}

// A decision of the attention kernel trial (auto) as results record it.
inline json kernel_choice_json(const attn::KernelChoice& c) {
  return {{"shape", c.shape}, {"kernel", c.kernel}, {"cudnn_ms", c.cudnn_ms}, {"hopper_ms", c.hopper_ms}};
}

// ---- device memory and inputs --------------------------------------------------------------------

// A contiguous device tensor owning its memory.
struct CudaBuffer {
  Tensor t;
  CudaBuffer(DType dtype, std::initializer_list<int64_t> shape) : t(nullptr, dtype, shape, Device::cuda) {
    t.data = device_alloc(Device::cuda, t.nbytes());
  }
  // A copy of `host` on the device.
  template <class T>
  explicit CudaBuffer(const std::vector<T>& host) : CudaBuffer(dtype_of<T>(), {static_cast<int64_t>(host.size())}) {
    copy(t, Tensor(const_cast<T*>(host.data()), dtype_of<T>(), {static_cast<int64_t>(host.size())}));
  }
  ~CudaBuffer() { device_free(Device::cuda, t.data); }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
};

// n bf16 values ~ N(0, 1) (a sum of four uniforms, scaled to variance 1), from `seed`: the inputs,
// as torch.randn makes the anchors'.
inline std::vector<bf16> normal_bf16(size_t n, uint32_t seed) {
  std::vector<bf16> v(n);
  uint32_t s = seed * 2654435761u + 1u;
  for (auto& x : v) {
    float acc = 0.0f;
    for (int k = 0; k < 4; ++k) {
      s = s * 1664525u + 1013904223u;
      acc += static_cast<float>(s >> 8) / static_cast<float>(1u << 24) - 0.5f;
    }
    x = bf16(acc * 1.7320508f);  // variance 4/12 → 1
  }
  return v;
}

// Fills a contiguous bf16 device buffer with normal_bf16 values, generated on the host once.
inline void fill_normal_bf16(const Tensor& t, uint32_t seed) {
  std::vector<bf16> host = normal_bf16(static_cast<size_t>(t.numel()), seed);
  Tensor src = t;
  src.data = host.data();
  src.device = Device::cpu;
  copy(t, src);
}

// ---- timing ------------------------------------------------------------------------------------------

// `n` CUDA events (with timing), recorded on the compute stream; destroyed with the object.
class CudaEvents {
 public:
  explicit CudaEvents(size_t n) : events_(n) {
    for (cudaEvent_t& e : events_) LT_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~CudaEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  CudaEvents(const CudaEvents&) = delete;
  CudaEvents& operator=(const CudaEvents&) = delete;

  size_t size() const { return events_.size(); }
  void record(size_t i) const { LT_CUDA_CHECK(cudaEventRecord(events_[i], cuda_stream())); }
  void synchronize(size_t i) const { LT_CUDA_CHECK(cudaEventSynchronize(events_[i])); }
  // Milliseconds from event `from` to event `to`; both must have completed.
  float ms(size_t from, size_t to) const {
    float v = 0.0f;
    LT_CUDA_CHECK(cudaEventElapsedTime(&v, events_[from], events_[to]));
    return v;
  }

 private:
  std::vector<cudaEvent_t> events_;
};

// Median milliseconds of fn over `reps` timed runs (CUDA events on the compute stream, as the anchors
// time theirs) after `warmup` untimed ones.
inline double median_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  CudaEvents ev(2);  // start, stop
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    ev.record(0);
    fn();
    ev.record(1);
    ev.synchronize(1);
    ms.push_back(ev.ms(0, 1));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The maximum of x over the ranks of c (a CUDA communicator): the slowest rank's time, or a
// decision every rank takes alike.
inline double all_max(parallel::Communicator& c, double x) {
  CudaBuffer t(std::vector<double>{x});
  c.all_reduce(t.t, parallel::ReduceOp::max);
  copy(Tensor(&x, DType::f64, {1}), t.t);
  return x;
}

}  // namespace longtrain::bench
