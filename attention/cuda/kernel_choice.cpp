#include "attention/cuda/kernel_choice.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "runtime/cuda_check.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace longtrain::attn::cuda {

bool CallShape::operator<(const CallShape& o) const {
  return std::tie(backward, head_dim, q_heads, kv_heads, tq, tk, causal, f32_out, accumulates) <
         std::tie(o.backward, o.head_dim, o.q_heads, o.kv_heads, o.tq, o.tk, o.causal, o.f32_out, o.accumulates);
}

std::string CallShape::describe() const {
  return fmt::format("{} {} Tq={} Tk={} heads {}/{} head_dim {}{}{}", backward ? "backward" : "forward",
                     causal ? "causal" : "no-mask", tq, tk, q_heads, kv_heads, head_dim,
                     f32_out ? (backward ? ", f32 grads" : ", f32 O") : "",
                     accumulates ? (backward ? ", accumulated" : ", merged") : "");
}

namespace {

constexpr int kTimedRounds = 2;

// One CUDA event pair around a timed call.
struct Timing {
  cudaEvent_t start = nullptr, end = nullptr;
  Kernel kernel = Kernel::cudnn;
};

struct Trial {
  int calls = 0;  // trial calls issued: 2 untimed, then 2·kTimedRounds timed
  std::vector<Timing> timings;
  std::optional<Kernel> decided;
};

struct State {
  std::mutex mu;
  std::optional<KernelPolicy> policy;
  std::map<CallShape, Trial> trials;
  std::vector<KernelChoice> choices;
  int64_t trial_calls = 0;
};

State& state() {
  static State s;
  return s;
}

KernelPolicy policy_locked(State& s) {
  if (!s.policy) {
    const char* env = std::getenv("LONGTRAIN_ATTENTION_KERNEL");
    s.policy = env && *env ? parse_kernel_policy(env, "LONGTRAIN_ATTENTION_KERNEL") : KernelPolicy::cudnn;
  }
  return *s.policy;
}

// After the last timed call of a shape: wait for it, take each kernel's fastest call, decide.
void decide(State& s, const CallShape& shape, Trial& t) {
  LT_CUDA_CHECK(cudaEventSynchronize(t.timings.back().end));
  double best[2] = {1e300, 1e300};
  for (const Timing& tm : t.timings) {
    float ms = 0.0f;
    LT_CUDA_CHECK(cudaEventElapsedTime(&ms, tm.start, tm.end));
    double& b = best[tm.kernel == Kernel::hopper ? 1 : 0];
    b = std::min(b, static_cast<double>(ms));
    LT_CUDA_CHECK(cudaEventDestroy(tm.start));
    LT_CUDA_CHECK(cudaEventDestroy(tm.end));
  }
  t.timings.clear();
  t.decided = best[1] < best[0] ? Kernel::hopper : Kernel::cudnn;
  KernelChoice c{shape.describe(), *t.decided == Kernel::hopper ? "hopper" : "cudnn", best[0], best[1]};
  std::fprintf(stderr, "longtrain: attention kernel for %s: %s (cuDNN %.3f ms, hopper %.3f ms)\n", c.shape.c_str(),
               c.kernel.c_str(), c.cudnn_ms, c.hopper_ms);
  s.choices.push_back(std::move(c));
}

}  // namespace

KernelPolicy current_policy() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return policy_locked(s);
}

void set_policy(KernelPolicy policy) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.policy = policy;
}

std::vector<KernelChoice> choices() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.choices;
}

int64_t trial_calls() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.trial_calls;
}

Kernel run_chosen(const CallShape& shape, bool hopper_ok, const std::function<void()>& run_cudnn,
                  const std::function<void()>& run_hopper) {
  auto run = [&](Kernel k) {
    (k == Kernel::hopper ? run_hopper : run_cudnn)();
    return k;
  };
  if (!hopper_ok) return run(Kernel::cudnn);
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  const KernelPolicy policy = policy_locked(s);
  if (policy != KernelPolicy::autotune) {
    lock.unlock();
    return run(policy == KernelPolicy::hopper ? Kernel::hopper : Kernel::cudnn);
  }
  Trial& t = s.trials[shape];
  if (t.decided) {
    const Kernel k = *t.decided;
    lock.unlock();
    return run(k);
  }
  // Trial calls alternate cuDNN, hopper; the first pair is untimed.
  const int call = t.calls++;
  ++s.trial_calls;
  const Kernel k = call % 2 == 0 ? Kernel::cudnn : Kernel::hopper;
  if (call < 2) {
    run(k);
    return k;
  }
  Timing tm;
  tm.kernel = k;
  LT_CUDA_CHECK(cudaEventCreate(&tm.start));
  LT_CUDA_CHECK(cudaEventCreate(&tm.end));
  LT_CUDA_CHECK(cudaEventRecord(tm.start, cuda_stream()));
  run(k);
  LT_CUDA_CHECK(cudaEventRecord(tm.end, cuda_stream()));
  t.timings.push_back(tm);
  if (t.calls == 2 + 2 * kTimedRounds) decide(s, shape, t);
  return k;
}

}  // namespace longtrain::attn::cuda
