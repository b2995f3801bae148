#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/ops.h"

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

double global_norm(const Arena& grads) { return std::sqrt(ops::sum_squares(grads.flat())); }

AdamW::AdamW(const Arena& params, const AdamWConfig& config)
    : config_(config), master_("master weights", params.device()), m_("adam m", params.device()),
      v_("adam v", params.device()) {
  LT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "optim.beta1 and optim.beta2 must lie in [0, 1) (got {}, {})", config.beta1, config.beta2);
  // Moments (and master weights for bf16 parameters) in f32; f64 when the model itself is f64.
  const DType pdt = params.table().front().dtype;
  const DType sdt = pdt == DType::f64 ? DType::f64 : DType::f32;
  for (const ArenaEntry& e : params.table()) {
    m_.add(e.name, e.shape, sdt);
    v_.add(e.name, e.shape, sdt);
    if (pdt != sdt) master_.add(e.name, e.shape, sdt);
  }
  m_.allocate();
  v_.allocate();
  if (pdt != sdt) {
    master_.allocate();
    for (size_t i = 0; i < params.table().size(); ++i) ops::convert(master_.at(i), params.at(i));
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
  ops::AdamWParams p;
  p.lr = info.lr;
  p.beta1 = config_.beta1;
  p.beta2 = config_.beta2;
  p.eps = config_.eps;
  p.bias_correction1 = 1.0 - std::pow(config_.beta1, static_cast<double>(step_));
  p.bias_correction2 = 1.0 - std::pow(config_.beta2, static_cast<double>(step_));
  p.grad_scale = info.clip_scale;
  for (size_t i = 0; i < params.table().size(); ++i) {
    const ArenaEntry& e = params.table()[i];
    p.weight_decay = decays(e.name) ? config_.weight_decay : 0.0;
    auto flat = [](Tensor t) { return t.reshape({t.numel()}); };
    ops::adamw_update(flat(params.at(i)), has_master() ? flat(master_.at(i)) : Tensor{}, flat(m_.at(i)),
                      flat(v_.at(i)), flat(grads.at(i)), p);
  }
  return info;
}

}  // namespace longtrain::trainer
