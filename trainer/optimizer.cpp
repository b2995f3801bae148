#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/ops.h"

namespace longtrain::trainer {

namespace {

double decay_factor(LrSchedule schedule, double progress) {
  return schedule == LrSchedule::cosine ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) : 1.0 - progress;
}

double restarted_learning_rate(const AdamWConfig& c, const LrRestart& r, int64_t step) {
  if (step <= r.step) return r.lr;
  if (r.step < c.warmup_steps && step <= c.warmup_steps)
    return r.lr + (c.lr - r.lr) * static_cast<double>(step - r.step) / static_cast<double>(c.warmup_steps - r.step);
  // The decay starts where warmup ended (at lr) or, past warmup, at the restart (at L).
  const bool warmed = r.step < c.warmup_steps;
  const int64_t start = warmed ? c.warmup_steps : r.step;
  const double from = warmed ? c.lr : r.lr;
  const double to = c.schedule == LrSchedule::constant ? c.lr : c.min_lr;
  const double progress = std::clamp(static_cast<double>(step - start) /
                                         static_cast<double>(std::max<int64_t>(1, c.total_steps - start)),
                                     0.0, 1.0);
  // constant glides linearly to lr (a no-op when lr did not change, or when warmup remained).
  return to + (from - to) * decay_factor(c.schedule == LrSchedule::constant ? LrSchedule::linear : c.schedule,
                                         progress);
}

}  // namespace

double learning_rate(const AdamWConfig& c, int64_t step) {
  if (c.restart) return restarted_learning_rate(c, *c.restart, step);
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


AdamW::AdamW(const Arena& params, const AdamWConfig& config, int64_t shard_begin, int64_t shard_end)
    : config_(config), master_("master weights", params.device()), m_("adam m", params.device()),
      v_("adam v", params.device()) {
  LT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "optim.beta1 and optim.beta2 must lie in [0, 1) (got {}, {})", config.beta1, config.beta2);
  const Tensor flat = params.flat();
  begin_ = shard_begin;
  end_ = shard_end < 0 ? flat.numel() : shard_end;
  LT_CHECK(0 <= begin_ && begin_ <= end_ && end_ <= flat.numel(), "optimizer shard [{}, {}) outside the {} parameters",
           begin_, end_, flat.numel());
  // Which elements do not decay, by tensor name. Padding between tensors is zero and stays zero
  // under the update (zero gradient, zero moments, zero weight) whether it decays or not.
  const size_t elem = dtype_size(flat.dtype);
  for (const ArenaEntry& e : params.table()) {
    bool decay = true;
    for (const std::string& pattern : config_.no_decay)
      if (e.name.find(pattern) != std::string::npos) decay = false;
    const int64_t b = std::max(begin_, static_cast<int64_t>(e.offset / elem)) - begin_;
    const int64_t en = std::min(end_, static_cast<int64_t>(e.offset / elem) + e.numel) - begin_;
    if (decay || b >= en) continue;
    if (!no_decay_.empty() && no_decay_.back().end == b)
      no_decay_.back().end = en;
    else
      no_decay_.push_back({b, en});
  }
  // Moments (and master weights for bf16 parameters) in f32; f64 when the model itself is f64.
  const DType sdt = flat.dtype == DType::f64 ? DType::f64 : DType::f32;
  const int64_t n = end_ - begin_;
  m_.add("m", {std::max<int64_t>(n, 1)}, sdt);
  v_.add("v", {std::max<int64_t>(n, 1)}, sdt);
  m_.allocate();
  v_.allocate();
  if (flat.dtype != sdt) {
    master_.add("master", {std::max<int64_t>(n, 1)}, sdt);
    master_.allocate();
    if (n > 0) ops::convert(master_.flat().narrow(0, n), flat.narrow(0, begin_, n));
  }
}

AdamW::StepInfo AdamW::step(Arena& params, const Arena& grads) {
  LT_CHECK(begin_ == 0 && end_ == params.flat().numel(), "AdamW::step on a sharded optimizer; use step_shard");
  Tensor g = grads.flat();
  return step_shard(params, g, std::sqrt(ops::sum_squares(g)));
}

AdamW::StepInfo AdamW::step_shard(Arena& params, Tensor grad_shard, double grad_norm) {
  LT_CHECK(std::isfinite(grad_norm), "AdamW step {} with a non-finite gradient norm", step_ + 1);
  LT_CHECK(grad_shard.numel() == end_ - begin_, "AdamW: a gradient shard of {} elements for a shard of {}",
           grad_shard.numel(), end_ - begin_);
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
  p.weight_decay = config_.weight_decay;
  p.no_decay = no_decay_;
  const int64_t n = end_ - begin_;
  if (n == 0) return info;
  ops::adamw_update(params.flat().narrow(0, begin_, n), has_master() ? master_.flat().narrow(0, 0, n) : Tensor{},
                    m_.flat().narrow(0, 0, n), v_.flat().narrow(0, 0, n), grad_shard, p);
  return info;
}

}  // namespace longtrain::trainer
