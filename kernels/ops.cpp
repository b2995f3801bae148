// The public ops: pick the backend by the tensors' device (argument checks live in the backends,
// next to the code that relies on them).
#include <cstdlib>
#include <mutex>
#include <optional>

#include "kernels/backends.h"
#include "runtime/dispatch.h"
#include "runtime/error.h"
#include "runtime/profile.h"
#ifdef LONGTRAIN_HAS_CUDA
#include "kernels/cuda/gemm.h"
#endif

namespace longtrain::ops {

void embedding_forward(Tensor out, Tensor tokens, Tensor table, bool ids_checked) {
  const Device device = common_device("embedding_forward", {&out, &tokens, &table});
  const profile::Region region("embedding_forward", device);
  LT_DISPATCH(device, embedding_forward, out, tokens, table, ids_checked);
}
void embedding_backward(Tensor d_table, Tensor tokens, Tensor d_out) {
  const Device device = common_device("embedding_backward", {&d_table, &tokens, &d_out});
  const profile::Region region("embedding_backward", device);
  LT_DISPATCH(device, embedding_backward, d_table,
              tokens, d_out);
}
size_t embedding_backward_scratch_bytes(Device device, int64_t tokens, int64_t vocab) {
  if (device != Device::cuda) return 0;
#ifdef LONGTRAIN_HAS_CUDA
  return cuda::embedding_backward_scratch_bytes(tokens, vocab);
#else
  // Planned without the CUDA backend: the four [T] arrays and the radix sort's double buffer and
  // histograms, which take less than another two arrays and 1 MiB.
  return static_cast<size_t>(tokens) * 4 * 6 + (size_t{1} << 20);
#endif
}
void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) {
  const Device device = common_device("rmsnorm_forward", {&y, &rstd, &x, &w});
  const profile::Region region("rmsnorm_forward", device);
  LT_DISPATCH(device, rmsnorm_forward, y, rstd, x, w, eps);
}
void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd, GradWrite dw_write) {
  const Device device = common_device("rmsnorm_backward", {&dx, &dw, &dy, &x, &w, &rstd});
  const profile::Region region("rmsnorm_backward", device);
  LT_DISPATCH(device, rmsnorm_backward, dx, dw, dy, x, w, rstd, dw_write);
}
void rope_forward(Tensor x, Tensor positions, const RopeParams& p) {
  const Device device = common_device("rope_forward", {&x, &positions});
  const profile::Region region("rope_forward", device);
  LT_DISPATCH(device, rope_forward, x, positions, p);
}
void rope_backward(Tensor dx, Tensor positions, const RopeParams& p) {
  const Device device = common_device("rope_backward", {&dx, &positions});
  const profile::Region region("rope_backward", device);
  LT_DISPATCH(device, rope_backward, dx, positions, p);
}
void rope_table(Tensor table, Tensor positions, const RopeParams& p) {
  const Device device = common_device("rope_table", {&table, &positions});
  const profile::Region region("rope_table", device);
  LT_DISPATCH(device, rope_table, table, positions, p);
}
void rope_apply(Tensor x, Tensor table, bool inverse) {
  const Device device = common_device("rope_apply", {&x, &table});
  const profile::Region region("rope_apply", device);
  LT_DISPATCH(device, rope_apply, x, table, inverse);
}
void swiglu_forward(Tensor out, Tensor gate_up) {
  const Device device = common_device("swiglu_forward", {&out, &gate_up});
  const profile::Region region("swiglu_forward", device);
  LT_DISPATCH(device, swiglu_forward, out, gate_up);
}
void swiglu_backward(Tensor d_gate_up, Tensor d_out, Tensor gate_up, Tensor out) {
  const Device device = common_device("swiglu_backward", {&d_gate_up, &d_out, &gate_up, &out});
  const profile::Region region("swiglu_backward", device);
  LT_DISPATCH(device, swiglu_backward, d_gate_up, d_out, gate_up, out);
}
GemmAlgoPolicy parse_gemm_algo_policy(std::string_view name, std::string_view where) {
  if (name == "heuristic") return GemmAlgoPolicy::heuristic;
  if (name == "auto") return GemmAlgoPolicy::autotune;
  throw Error(fmt::format("{}: the GEMM algorithm policy must be heuristic or auto, got '{}'", where, name));
}
std::string_view gemm_algo_policy_name(GemmAlgoPolicy policy) {
  return policy == GemmAlgoPolicy::autotune ? "auto" : "heuristic";
}
namespace {
// The policy, one store for both builds (the CUDA GEMMs read it when they plan a shape; the CPU has
// one GEMM and only keeps it): set_gemm_algo_policy, else LONGTRAIN_GEMM_ALGO at the first read.
struct GemmPolicyStore {
  std::mutex mutex;
  std::optional<GemmAlgoPolicy> policy;
};
GemmPolicyStore& gemm_policy_store() {
  static GemmPolicyStore s;
  return s;
}
// The policy LONGTRAIN_GEMM_ALGO names, if it is set and not empty (a bad name throws, naming it).
std::optional<GemmAlgoPolicy> gemm_algo_policy_from_env() {
  const char* env = std::getenv("LONGTRAIN_GEMM_ALGO");
  if (env == nullptr || *env == '\0') return std::nullopt;
  return parse_gemm_algo_policy(env, "LONGTRAIN_GEMM_ALGO");
}
}  // namespace
GemmAlgoPolicy gemm_algo_policy() {
  GemmPolicyStore& s = gemm_policy_store();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.policy) s.policy = gemm_algo_policy_from_env().value_or(GemmAlgoPolicy::heuristic);
  return *s.policy;
}
void set_gemm_algo_policy(GemmAlgoPolicy policy) {
  GemmPolicyStore& s = gemm_policy_store();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.policy = policy;
}
GemmAlgoPolicy set_gemm_algo_policy_unless_overridden(GemmAlgoPolicy requested) {
  set_gemm_algo_policy(gemm_algo_policy_from_env().value_or(requested));
  return gemm_algo_policy();
}
#ifdef LONGTRAIN_HAS_CUDA
std::vector<GemmChoice> gemm_choices() { return cuda_util::gemm_choices(); }
int gemm_trials_pending() { return cuda_util::gemm_trials_pending(); }
int64_t gemm_trial_calls() { return cuda_util::gemm_trial_calls(); }
#else
std::vector<GemmChoice> gemm_choices() { return {}; }
int gemm_trials_pending() { return 0; }
int64_t gemm_trial_calls() { return 0; }
#endif
void linear_forward(Tensor y, Tensor x, Tensor w) {
  const Device device = common_device("linear_forward", {&y, &x, &w});
  const profile::Region region("linear_forward", device);
  LT_DISPATCH(device, linear_forward, y, x, w);
}
void linear_residual_forward(Tensor y, Tensor x, Tensor w, Tensor residual) {
  const Device device = common_device("linear_residual_forward", {&y, &x, &w, &residual});
  const profile::Region region("linear_residual_forward", device);
  LT_DISPATCH(device, linear_residual_forward, y, x, w, residual);
}
void linear_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, GradWrite dw_write) {
  const Device device = common_device("linear_backward", {&dx, &dw, &dy, &x, &w});
  const profile::Region region("linear_backward", device);
  LT_DISPATCH(device, linear_backward, dx, dw, dy, x, w, dw_write);
}
void add_inplace(Tensor y, Tensor x) {
  const Device device = common_device("add_inplace", {&y, &x});
  const profile::Region region("add_inplace", device);
  LT_DISPATCH(device, add_inplace, y, x);
}
void lm_head_cross_entropy(Tensor losses, Tensor dx, Tensor dw, Tensor x, Tensor w, Tensor labels,
                           const CrossEntropyParams& p) {
  const Device device =
      common_device("lm_head_cross_entropy", {&losses, &dx, &dw, &x, &w, &labels, &p.grad_scale_from});
  LT_CHECK(p.grad_scale_from.empty() || p.grad_scale_from.numel() == 1,
           "lm_head_cross_entropy: grad_scale_from must be one element, got {}", p.grad_scale_from.describe());
  const profile::Region region("lm_head_cross_entropy", device);
  LT_DISPATCH(device, lm_head_cross_entropy,
              losses, dx, dw, x, w, labels, p);
}

void convert(Tensor dst, Tensor src) {
  const Device device = common_device("convert", {&dst, &src});
  const profile::Region region("convert", device);
  LT_DISPATCH(device, convert, dst, src);
}
void fill(Tensor t, double value) {
  const Device device = common_device("fill", {&t});
  const profile::Region region("fill", device);
  LT_DISPATCH(device, fill, t, value);
}
void adamw_update(Tensor param, Tensor master, Tensor m, Tensor v, Tensor grad, const AdamWParams& p) {
  const Device device = common_device("adamw_update", {&param, &master, &m, &v, &grad});
  const profile::Region region("adamw_update", device);
  int64_t last = 0;
  for (const ElementRange& r : p.no_decay) {
    LT_CHECK(last <= r.begin && r.begin <= r.end && r.end <= param.numel(),
             "adamw_update: no-decay range [{}, {}) is out of order or outside the {} elements updated", r.begin,
             r.end, param.numel());
    last = r.end;
  }
  LT_DISPATCH(device, adamw_update, param, master, m, v, grad, p);
}
double sum_squares(Tensor x) {
  const Device device = common_device("sum_squares", {&x});
  const profile::Region region("sum_squares", device);
  LT_DISPATCH(device, sum_squares, x);
}
void sum_into(Tensor out, Tensor x, SumOf what, bool accumulate) {
  const Device device = common_device("sum_into", {&out, &x});
  const profile::Region region("sum_into", device);
  LT_CHECK(out.dtype == DType::f64 && out.numel() == 1, "sum_into: out must be one f64 element, got {}",
           out.describe());
  LT_CHECK(x.is_contiguous(), "sum_into: non-contiguous {}", x.describe());
  LT_DISPATCH(device, sum_into, out, x, what, accumulate);
}

}  // namespace longtrain::ops
