#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "runtime/device.h"

namespace longtrain::trainer {

double learning_rate(const AdamWConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps)
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  if (c.schedule == LrSchedule::constant) return c.lr;
  const int64_t decay_steps = std::max<int64_t>(1, c.total_steps - c.warmup_steps);
  const double progress =
      std::clamp(static_cast<double>(step - c.warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  const double factor = c.schedule == LrSchedule::linear ? 1.0 - progress
                                                         : 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return c.min_lr + (c.lr - c.min_lr) * factor;
}

namespace {

// The CPU loops, templated on the parameter and state types. (The CUDA twin lives with the other
// CUDA kernels; this file dispatches by device.)
template <class P, class S>
void adamw_entry(P* param, S* master, S* m, S* v, const P* grad, int64_t n, double lr, double b1, double b2,
                 double eps, double wd, double bias1, double bias2, double grad_scale) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(grad[i]) * grad_scale;
    const double mi = b1 * static_cast<double>(m[i]) + (1.0 - b1) * g;
    const double vi = b2 * static_cast<double>(v[i]) + (1.0 - b2) * g * g;
    m[i] = static_cast<S>(mi);
    v[i] = static_cast<S>(vi);
    double w = master ? static_cast<double>(master[i]) : static_cast<double>(param[i]);
    w -= lr * (wd * w + (mi / bias1) / (std::sqrt(vi / bias2) + eps));
    if (master) master[i] = static_cast<S>(w);
    param[i] = static_cast<P>(w);
  }
}

template <class T>
double sum_squares(const T* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

DType state_dtype(DType param) { return param == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace

double global_norm(const Arena& grads) {
  LT_CHECK(grads.device() == Device::cpu, "global_norm on {} memory is not built yet", "CUDA");
  Tensor f = grads.flat();
  switch (f.dtype) {
    case DType::f32: return std::sqrt(sum_squares(f.ptr<float>(), f.numel()));
    case DType::f64: return std::sqrt(sum_squares(f.ptr<double>(), f.numel()));
    default: LT_FAIL("global_norm of {} gradients", dtype_name(f.dtype));
  }
}

AdamW::AdamW(const Arena& params, const AdamWConfig& config)
    : config_(config), master_("master weights", params.device()), m_("adam m", params.device()),
      v_("adam v", params.device()) {
  LT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "optim.beta1 and optim.beta2 must lie in [0, 1) (got {}, {})", config.beta1, config.beta2);
  LT_CHECK(params.device() == Device::cpu, "AdamW on {} memory is not built yet", "CUDA");
  const DType pdt = params.table().front().dtype;
  const DType sdt = state_dtype(pdt);
  for (const ArenaEntry& e : params.table()) {
    m_.add(e.name, e.shape, sdt);
    v_.add(e.name, e.shape, sdt);
    if (pdt != sdt) master_.add(e.name, e.shape, sdt);
  }
  m_.allocate();
  v_.allocate();
  if (pdt != sdt) {
    master_.allocate();
    LT_FAIL("master weights for {} parameters on CPU are not built yet", dtype_name(pdt));
  }
}

bool AdamW::decays(const std::string& name) const {
  for (const std::string& pattern : config_.no_decay)
    if (name.find(pattern) != std::string::npos) return false;
  return true;
}

AdamW::StepInfo AdamW::step(Arena& params, const Arena& grads) {
  return step_with_norm(params, grads, global_norm(grads));
}

AdamW::StepInfo AdamW::step_with_norm(Arena& params, const Arena& grads, double grad_norm) {
  LT_CHECK(std::isfinite(grad_norm), "AdamW step {} with a non-finite gradient norm", step_ + 1);
  ++step_;
  StepInfo info;
  info.lr = learning_rate(config_, step_);
  info.grad_norm = grad_norm;
  if (config_.grad_clip > 0 && grad_norm > config_.grad_clip) info.clip_scale = config_.grad_clip / grad_norm;
  const double bias1 = 1.0 - std::pow(config_.beta1, static_cast<double>(step_));
  const double bias2 = 1.0 - std::pow(config_.beta2, static_cast<double>(step_));
  for (size_t i = 0; i < params.table().size(); ++i) {
    const ArenaEntry& e = params.table()[i];
    Tensor p = params.at(i), g = grads.at(i), m = m_.at(i), v = v_.at(i);
    const double wd = decays(e.name) ? config_.weight_decay : 0.0;
    if (p.dtype == DType::f32)
      adamw_entry<float, float>(p.ptr<float>(), nullptr, m.ptr<float>(), v.ptr<float>(), g.ptr<float>(), e.numel,
                                info.lr, config_.beta1, config_.beta2, config_.eps, wd, bias1, bias2,
                                info.clip_scale);
    else
      adamw_entry<double, double>(p.ptr<double>(), nullptr, m.ptr<double>(), v.ptr<double>(), g.ptr<double>(),
                                  e.numel, info.lr, config_.beta1, config_.beta2, config_.eps, wd, bias1, bias2,
                                  info.clip_scale);
  }
  return info;
}

}  // namespace longtrain::trainer
