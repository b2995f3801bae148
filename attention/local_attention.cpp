#include "attention/backends.h"
#include "runtime/dispatch.h"

#include <algorithm>
#include <cstdlib>

#include "runtime/error.h"
#ifdef LONGTRAIN_HAS_CUDA
#include "attention/cuda/kernel_choice.h"
#endif

namespace longtrain::attn {

void attention_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, BlockMask mask, double scale) {
  LT_DISPATCH(common_device("attention_block_forward", {&o, &lse, &q, &k, &v}), attention_block_forward, o, lse, q,
              k, v, mask, scale);
}
void attention_delta(Tensor delta, Tensor o, Tensor d_o) {
  LT_DISPATCH(common_device("attention_delta", {&delta, &o, &d_o}), attention_delta, delta, o, d_o);
}
void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                              Tensor lse, Tensor o, Tensor delta, BlockMask mask, double scale, GradMode mode) {
  LT_DISPATCH(common_device("attention_block_backward", {&dq, &dk, &dv, &q, &k, &v, &d_o, &lse, &o, &delta}),
              attention_block_backward, dq, dk, dv, q, k, v, d_o, lse, o, delta, mask, scale, mode);
}
void lse_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk) {
  LT_DISPATCH(common_device("lse_merge", {&o_acc, &lse_acc, &o_blk, &lse_blk}), lse_merge, o_acc, lse_acc, o_blk,
              lse_blk);
}

void attention_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q, Tensor k,
                                   Tensor v, BlockMask mask, double scale) {
#ifdef LONGTRAIN_HAS_CUDA
  if (common_device("attention_block_forward_merge", {&o_acc, &lse_acc, &o_blk, &lse_blk, &q, &k, &v}) ==
      Device::cuda) {
    cuda::block_forward_merge(o_acc, lse_acc, o_blk, lse_blk, q, k, v, mask, scale);
    return;
  }
#endif
  attention_block_forward(o_blk, lse_blk, q, k, v, mask, scale);
  lse_merge(o_acc, lse_acc, o_blk, lse_blk);
}

KernelPolicy parse_kernel_policy(std::string_view name, std::string_view where) {
  if (name == "cudnn") return KernelPolicy::cudnn;
  if (name == "hopper") return KernelPolicy::hopper;
  if (name == "auto") return KernelPolicy::autotune;
  throw Error(fmt::format("{}: the attention kernel must be cudnn, hopper or auto, got '{}'", where, name));
}

std::string_view kernel_policy_name(KernelPolicy policy) {
  switch (policy) {
    case KernelPolicy::cudnn: return "cudnn";
    case KernelPolicy::hopper: return "hopper";
    case KernelPolicy::autotune: return "auto";
  }
  return "?";
}

std::optional<KernelPolicy> kernel_policy_from_env() {
  const char* env = std::getenv("LONGTRAIN_ATTENTION_KERNEL");
  if (env == nullptr || *env == '\0') return std::nullopt;
  return parse_kernel_policy(env, "LONGTRAIN_ATTENTION_KERNEL");
}

KernelPolicy set_kernel_policy_unless_overridden(KernelPolicy requested) {
  set_kernel_policy(kernel_policy_from_env().value_or(requested));
  return kernel_policy();
}

#ifdef LONGTRAIN_HAS_CUDA
KernelPolicy kernel_policy() { return cuda::current_policy(); }
void set_kernel_policy(KernelPolicy policy) { cuda::set_policy(policy); }
std::vector<KernelChoice> kernel_choices() { return cuda::choices(); }
int64_t kernel_trial_calls() { return cuda::trial_calls(); }
#else
namespace {
KernelPolicy& cpu_build_policy() {
  static KernelPolicy policy = kernel_policy_from_env().value_or(KernelPolicy::cudnn);
  return policy;
}
}  // namespace
KernelPolicy kernel_policy() { return cpu_build_policy(); }
void set_kernel_policy(KernelPolicy policy) { cpu_build_policy() = policy; }
std::vector<KernelChoice> kernel_choices() { return {}; }
int64_t kernel_trial_calls() { return 0; }
#endif

// ---- segmented calls --------------------------------------------------------------------------------

namespace {

// A row range [start, end).
struct Rows {
  int64_t start, end;
};

// Checks the segments against the tensors and returns their query runs (and, if `keys`, their key
// runs) sorted, having checked that they do not overlap.
std::vector<Rows> checked_runs(const char* op, const std::vector<Segment>& segments, int64_t tq, int64_t tk,
                               BlockMask mask, bool query_side) {
  std::vector<Rows> runs;
  for (const Segment& s : segments) {
    LT_CHECK(s.q_start >= 0 && s.q_len >= 0 && s.q_start + s.q_len <= tq && s.k_start >= 0 && s.k_len >= 0 &&
                 s.k_start + s.k_len <= tk,
             "{}: segment q [{}, +{}) k [{}, +{}) lies outside the {} query and {} key rows", op, s.q_start, s.q_len,
             s.k_start, s.k_len, tq, tk);
    LT_CHECK(mask != BlockMask::causal_diagonal || s.q_len == s.k_len,
             "{}: a causal_diagonal segment needs as many queries as keys, got {} and {}", op, s.q_len, s.k_len);
    if (query_side ? s.q_len > 0 : s.k_len > 0)
      runs.push_back(query_side ? Rows{s.q_start, s.q_start + s.q_len} : Rows{s.k_start, s.k_start + s.k_len});
  }
  std::sort(runs.begin(), runs.end(), [](const Rows& a, const Rows& b) { return a.start < b.start; });
  for (size_t i = 1; i < runs.size(); ++i)
    LT_CHECK(runs[i].start >= runs[i - 1].end, "{}: segments overlap in their {} rows ([{}, {}) and [{}, {}))", op,
             query_side ? "query" : "key", runs[i - 1].start, runs[i - 1].end, runs[i].start, runs[i].end);
  return runs;
}

// The row ranges of [0, n) outside the sorted, disjoint `runs`.
std::vector<Rows> gaps(const std::vector<Rows>& runs, int64_t n) {
  std::vector<Rows> out;
  int64_t at = 0;
  for (const Rows& r : runs) {
    if (r.start > at) out.push_back({at, r.start});
    at = r.end;
  }
  if (at < n) out.push_back({at, n});
  return out;
}

}  // namespace

void attention_segments_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v,
                                const std::vector<Segment>& segments, BlockMask mask, double scale) {
  const char* op = "attention_segments_forward";
  const Device device = common_device(op, {&o, &lse, &q, &k, &v});
  LT_CHECK(q.ndim == 3 && k.ndim == 3, "{}: q {} and k {} must be [tokens, heads, dim]", op, q.describe(),
           k.describe());
  const int64_t tq = q.size(0), tk = k.size(0);
  const std::vector<Rows> q_runs = checked_runs(op, segments, tq, tk, mask, /*query_side=*/true);
  // Rows that meet no key of this call: empty partials (a block without keys).
  for (const Rows& g : gaps(q_runs, tq))
    attention_block_forward(o.narrow(0, g.start, g.end - g.start), lse.narrow(0, g.start, g.end - g.start),
                            q.narrow(0, g.start, g.end - g.start), k.narrow(0, 0, 0), v.narrow(0, 0, 0),
                            BlockMask::none, scale);
  std::vector<Segment> real;
  for (const Segment& s : segments) {
    if (s.q_len == 0) continue;
    if (s.k_len == 0) {  // queries without keys: an empty partial too
      attention_block_forward(o.narrow(0, s.q_start, s.q_len), lse.narrow(0, s.q_start, s.q_len),
                              q.narrow(0, s.q_start, s.q_len), k.narrow(0, 0, 0), v.narrow(0, 0, 0), BlockMask::none,
                              scale);
      continue;
    }
    real.push_back(s);
  }
#ifdef LONGTRAIN_HAS_CUDA
  if (device == Device::cuda && real.size() > 1) {
    cuda::segments_forward(o, lse, q, k, v, real, mask, scale);
    return;
  }
#else
  (void)device;
#endif
  for (const Segment& s : real)
    attention_block_forward(o.narrow(0, s.q_start, s.q_len), lse.narrow(0, s.q_start, s.q_len),
                            q.narrow(0, s.q_start, s.q_len), k.narrow(0, s.k_start, s.k_len),
                            v.narrow(0, s.k_start, s.k_len), mask, scale);
}

void attention_segments_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                                 Tensor lse, Tensor o, Tensor delta, const std::vector<Segment>& segments,
                                 BlockMask mask, double scale, GradMode mode) {
  const char* op = "attention_segments_backward";
  const Device device = common_device(op, {&dq, &dk, &dv, &q, &k, &v, &d_o, &lse, &o, &delta});
  LT_CHECK(q.ndim == 3 && k.ndim == 3, "{}: q {} and k {} must be [tokens, heads, dim]", op, q.describe(),
           k.describe());
  const int64_t tq = q.size(0), tk = k.size(0);
  const std::vector<Rows> q_runs = checked_runs(op, segments, tq, tk, mask, /*query_side=*/true);
  const std::vector<Rows> k_runs = checked_runs(op, segments, tq, tk, mask, /*query_side=*/false);
  auto rows = [](const Tensor& t, int64_t start, int64_t len) { return t.ndim == 0 ? t : t.narrow(0, start, len); };
  if (mode == GradMode::overwrite) {
    // Rows outside every segment get no gradient: zeroed by empty block calls (one side empty).
    for (const Rows& g : gaps(q_runs, tq)) {
      const int64_t n = g.end - g.start;
      attention_block_backward(dq.narrow(0, g.start, n), dk.narrow(0, 0, 0), dv.narrow(0, 0, 0), q.narrow(0, g.start, n),
                               k.narrow(0, 0, 0), v.narrow(0, 0, 0), d_o.narrow(0, g.start, n),
                               lse.narrow(0, g.start, n), rows(o, g.start, n), rows(delta, g.start, n), BlockMask::none,
                               scale, GradMode::overwrite);
    }
    for (const Rows& g : gaps(k_runs, tk)) {
      const int64_t n = g.end - g.start;
      attention_block_backward(dq.narrow(0, 0, 0), dk.narrow(0, g.start, n), dv.narrow(0, g.start, n),
                               q.narrow(0, 0, 0), k.narrow(0, g.start, n), v.narrow(0, g.start, n), d_o.narrow(0, 0, 0),
                               lse.narrow(0, 0, 0), rows(o, 0, 0), rows(delta, 0, 0), BlockMask::none, scale,
                               GradMode::overwrite);
    }
  }
  std::vector<Segment> real;
  for (const Segment& s : segments) {
    if (s.q_len > 0 && s.k_len > 0) {
      real.push_back(s);
    } else if (mode == GradMode::overwrite) {  // a one-sided segment: its rows get zero gradients
      attention_block_backward(dq.narrow(0, s.q_start, s.q_len), dk.narrow(0, s.k_start, s.k_len),
                               dv.narrow(0, s.k_start, s.k_len), q.narrow(0, s.q_start, s.q_len),
                               k.narrow(0, s.k_start, s.k_len), v.narrow(0, s.k_start, s.k_len),
                               d_o.narrow(0, s.q_start, s.q_len), lse.narrow(0, s.q_start, s.q_len),
                               rows(o, s.q_start, s.q_len), rows(delta, s.q_start, s.q_len), BlockMask::none, scale,
                               GradMode::overwrite);
    }
  }
#ifdef LONGTRAIN_HAS_CUDA
  if (device == Device::cuda && real.size() > 1) {
    cuda::segments_backward(dq, dk, dv, q, k, v, d_o, lse, o, delta, real, mask, scale, mode);
    return;
  }
#else
  (void)device;
#endif
  for (const Segment& s : real)
    attention_block_backward(dq.narrow(0, s.q_start, s.q_len), dk.narrow(0, s.k_start, s.k_len),
                             dv.narrow(0, s.k_start, s.k_len), q.narrow(0, s.q_start, s.q_len),
                             k.narrow(0, s.k_start, s.k_len), v.narrow(0, s.k_start, s.k_len),
                             d_o.narrow(0, s.q_start, s.q_len), lse.narrow(0, s.q_start, s.q_len),
                             rows(o, s.q_start, s.q_len), rows(delta, s.q_start, s.q_len), mask, scale, mode);
}

}  // namespace longtrain::attn
