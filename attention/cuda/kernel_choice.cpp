#include "attention/cuda/kernel_choice.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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

// A shape's first kWarmCalls calls run cuDNN untimed: the first step's transients (the GEMM trials'
// bursts, cuDNN's plan builds, the clock still falling towards the power cap) pass before the timing,
// so that the trial times the kernels as the run goes on to run them. (Timed in a 3B step's first
// layers on an H100, the backward trial chose ours by 4.4% in one process and cuDNN's by 3.2% in the
// next, while cuDNN's ran 2.2% faster in the steps that followed in both; timed after 48 calls, three
// of three processes chose cuDNN's, by 2.8-4.1%: bench/results/attention-trial-warm-2026-12-07.json.)
// 48 calls: the second step of a model of 22-28 layers.
constexpr int kWarmCalls = 48;
constexpr int kUntimedCalls = 2;  // then one of each kernel, cuDNN first
constexpr int kTimedRounds = 4;   // ABBA ABBA: both kernels' timed calls at the same mean position

// One CUDA event pair around a timed call.
struct Timing {
  cudaEvent_t start = nullptr, end = nullptr;
  Kernel kernel = Kernel::cudnn;
};

struct Trial {
  int calls = 0;  // trial calls issued: kWarmCalls + kUntimedCalls untimed, then 2·kTimedRounds timed
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
  if (!s.policy) s.policy = kernel_policy_from_env().value_or(KernelPolicy::cudnn);
  return *s.policy;
}

// After the last timed call of a shape: wait for it, compare the kernels' mean times, decide.
void decide(State& s, const CallShape& shape, Trial& t) {
  LT_CUDA_CHECK(cudaEventSynchronize(t.timings.back().end));
  std::vector<std::pair<Kernel, double>> timed_ms;
  for (const Timing& tm : t.timings) {
    float ms = 0.0f;
    LT_CUDA_CHECK(cudaEventElapsedTime(&ms, tm.start, tm.end));
    timed_ms.emplace_back(tm.kernel, static_cast<double>(ms));
    LT_CUDA_CHECK(cudaEventDestroy(tm.start));
    LT_CUDA_CHECK(cudaEventDestroy(tm.end));
  }
  t.timings.clear();
  const TrialDecision d = decide_trial(timed_ms);
  t.decided = d.kernel;
  KernelChoice c{shape.describe(), d.kernel == Kernel::hopper ? "hopper" : "cudnn", d.cudnn_ms, d.hopper_ms};
  std::fprintf(stderr, "longtrain: attention kernel for %s: %s (cuDNN %.3f ms, hopper %.3f ms)\n", c.shape.c_str(),
               c.kernel.c_str(), c.cudnn_ms, c.hopper_ms);
  s.choices.push_back(std::move(c));
}

}  // namespace

int trial_length() { return kWarmCalls + kUntimedCalls + 2 * kTimedRounds; }

int trial_first_timed_call() { return kWarmCalls + kUntimedCalls; }

Kernel trial_kernel(int call) {
  LT_CHECK(call >= 0 && call < trial_length(), "attention kernel trial: call {} is not in the trial's {} calls",
           call, trial_length());
  if (call < kWarmCalls) return Kernel::cudnn;
  if (call < trial_first_timed_call()) return call == kWarmCalls ? Kernel::cudnn : Kernel::hopper;
  // Timed calls in ABBA order: pairs alternate which kernel goes first.
  const int timed = call - trial_first_timed_call(), pair = timed / 2;
  const bool cudnn_first = pair % 2 == 0;
  return (timed % 2 == 0) == cudnn_first ? Kernel::cudnn : Kernel::hopper;
}

TrialDecision decide_trial(const std::vector<std::pair<Kernel, double>>& timed_ms) {
  double sum[2] = {0.0, 0.0};
  int n[2] = {0, 0};
  for (const auto& [kernel, ms] : timed_ms) {
    LT_CHECK(std::isfinite(ms) && ms >= 0.0, "attention kernel trial: a timed call took {} ms", ms);
    const int i = kernel == Kernel::hopper ? 1 : 0;
    sum[i] += ms;
    ++n[i];
  }
  LT_CHECK(n[0] > 0 && n[1] > 0, "attention kernel trial: {} cuDNN and {} hopper timed calls, both kernels need one",
           n[0], n[1]);
  TrialDecision d;
  d.cudnn_ms = sum[0] / n[0];
  d.hopper_ms = sum[1] / n[1];
  d.kernel = d.hopper_ms < d.cudnn_ms ? Kernel::hopper : Kernel::cudnn;
  return d;
}

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
  // The trial's calls (trial_kernel): the warm calls and an untimed pair, then the timed ones in ABBA
  // order. All count as trial calls: a CUDA graph captured before the timing would never time.
  const int call = t.calls++;
  ++s.trial_calls;
  const Kernel k = trial_kernel(call);
  if (call < trial_first_timed_call()) {
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
  if (t.calls == trial_length()) decide(s, shape, t);
  return k;
}

}  // namespace longtrain::attn::cuda
