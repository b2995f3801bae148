// AdamW with decoupled weight decay and bias correction, the learning-rate schedule, and global-norm
// gradient clipping, over the model's flat parameter and gradient arenas.
//
// State: fp32 master weights (f64 when the model is f64; on CPU with f32 parameters the parameters
// are the master weights) and the first/second moments m, v, each one arena with the parameter
// table's layout, so a checkpoint writes them as named tensors and ZeRO-1 can shard flat ranges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/arena.h"
#include "trainer/config.h"

namespace longtrain::trainer {

struct AdamWConfig {
  double lr = 3e-4;
  double min_lr = 3e-5;        // reached at the last step by linear / cosine
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  int64_t warmup_steps = 0;    // linear warm-up from lr/warmup to lr over the first steps
  int64_t total_steps = 1;
  LrSchedule schedule = LrSchedule::cosine;
  double grad_clip = 1.0;      // max global L2 norm; 0 = no clipping
  std::vector<std::string> no_decay = {"norm", "embed_tokens"};  // name substrings without decay
};

// The learning rate of optimizer step `step` (1-based).
double learning_rate(const AdamWConfig& c, int64_t step);

// sqrt(Σ g²) over the whole arena (NaN/Inf when any gradient is).
double global_norm(const Arena& grads);

class AdamW {
 public:
  AdamW(const Arena& params, const AdamWConfig& config);

  struct StepInfo {
    double lr = 0.0;
    double grad_norm = 0.0;  // before clipping
    double clip_scale = 1.0;
  };
  // One update from `grads` (already averaged over the global batch). Non-finite gradients must be
  // caught by the caller before this (see global_norm).
  StepInfo step(Arena& params, const Arena& grads);
  // Applies an update with a known grad norm (the caller may have all-reduced it).
  StepInfo step_with_norm(Arena& params, const Arena& grads, double grad_norm);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  const AdamWConfig& config() const { return config_; }
  void set_total_steps(int64_t n) { config_.total_steps = n; }

  // Optimizer state as arenas with the parameter table's names (m, v and, when separate, master).
  Arena& m() { return m_; }
  Arena& v() { return v_; }
  bool has_master() const { return master_.allocated(); }
  Arena& master() { return master_; }

 private:
  bool decays(const std::string& name) const;

  AdamWConfig config_;
  int64_t step_ = 0;
  Arena master_, m_, v_;
};

}  // namespace longtrain::trainer
