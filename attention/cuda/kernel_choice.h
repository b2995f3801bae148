// Which kernel runs a block attention call on CUDA: cuDNN's fused SDPA or our Hopper kernels
// (hopper_attention.h). The policy (local_attention.h: set_kernel_policy, LONGTRAIN_ATTENTION_KERNEL):
// - cudnn: always cuDNN (the default);
// - hopper: ours wherever it supports the call, cuDNN elsewhere;
// - auto: each distinct call shape is measured both ways after its first calls and the faster kernel
//   runs it for the rest of the process. A trial is not a repeated call: the calls of a shape (a model
//   has one per layer, a schedule one per ring step) simply run the kernel the trial is at, each call
//   run once, whole, into the caller's outputs, so the results are right whichever kernel ran, merging
//   into partials and accumulating gradients included.
// The trial of a shape (trial_kernel): its first kWarmCalls calls (48: into a model's second step) run
// cuDNN untimed, so that the first step's transients are over; then one untimed call of each kernel
// (cuDNN builds its plan, both touch their code and caches), then kTimedRounds (4) timed calls of
// each, timed with CUDA events on the stream, in ABBA order (cuDNN, ours, ours, cuDNN, cuDNN, ours,
// ours, cuDNN); after the last one the host waits for its end event once, compares the kernels' mean
// times and logs the choice. The GPU's clock may still be falling towards its power-capped level: in
// plain alternation with each kernel's fastest call, the kernel timed first in every pair got the
// faster-clocked slot (cuDNN; a tie at head dim 128 and 64K went to it though ours ran 3% faster
// sustained). In ABBA order both kernels' mean positions are the same, so a clock that falls at a
// steady rate favours neither. Not bitwise reproducible across processes: two kernels within noise of
// each other may be chosen differently. A shape called at most 48 times (a short eval at a length of
// its own) runs cuDNN throughout; one called fewer than trial_length() times is never decided.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "attention/local_attention.h"

namespace longtrain::attn::cuda {

enum class Kernel { cudnn, hopper };

// What a decision depends on: the operation and everything that changes the kernels' speed.
struct CallShape {
  bool backward = false;
  int64_t head_dim = 0, q_heads = 0, kv_heads = 0, tq = 0, tk = 0;
  bool causal = false;
  bool f32_out = false;  // forward: f32 O; backward: f32 dq/dk/dv
  bool accumulates = false;  // forward: merged into a running partial; backward: added to dq/dk/dv
  bool operator<(const CallShape& o) const;
  std::string describe() const;
};

// The policy in force (set_kernel_policy, else LONGTRAIN_ATTENTION_KERNEL read once, else cudnn).
KernelPolicy current_policy();
void set_policy(KernelPolicy policy);

// Runs the call once, with the kernel the policy picks (the next trial kernel while `shape` is being
// measured). hopper_ok: our kernel supports this call; else cuDNN runs it and it is no trial. Returns
// the kernel that ran.
Kernel run_chosen(const CallShape& shape, bool hopper_ok, const std::function<void()>& run_cudnn,
                  const std::function<void()>& run_hopper);

// The decisions made under auto so far (for logs, benchmarks and tests).
std::vector<KernelChoice> choices();

// Calls run as trial calls so far, the warm calls before the timing included (never decreases).
int64_t trial_calls();

// The trial's schedule and decision, for the tests: how many calls a shape's trial takes, the first
// timed one, the kernel of its call number `call` (0-based), and the decision from the timed calls'
// (kernel, ms) in the order they ran: the kernel with the smaller mean (cuDNN on a tie), with both
// means.
int trial_length();
int trial_first_timed_call();
Kernel trial_kernel(int call);
struct TrialDecision {
  Kernel kernel = Kernel::cudnn;
  double cudnn_ms = 0.0, hopper_ms = 0.0;
};
TrialDecision decide_trial(const std::vector<std::pair<Kernel, double>>& timed_ms);

}  // namespace longtrain::attn::cuda
