// AdamW with decoupled weight decay and bias correction, the learning-rate schedule, and global-norm
// gradient clipping, over the model's flat parameter and gradient arenas.
//
// State: fp32 master weights (f64 when the model is f64; on CPU with f32 parameters the parameters
// are the master weights) and the first/second moments m, v, each one arena with the parameter
// table's layout, so a checkpoint writes them as named tensors and ZeRO-1 can shard flat ranges.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "runtime/arena.h"
#include "trainer/config.h"

namespace longtrain::trainer {

// Where a resume with a changed schedule (train.steps, lr, min_lr, warmup_steps or schedule) took
// over: after optimizer step `step` the run goes on from `lr`, the learning rate the schedule it
// had until then gave that step, so the rate never jumps at a resume.
struct LrRestart {
  int64_t step = 0;
  double lr = 0.0;
};

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
  std::optional<LrRestart> restart;  // set by a resume that changed the schedule, kept in checkpoints
};

// The learning rate of optimizer step `step` (1-based). Without a restart: linear warmup from 0 to
// lr over warmup_steps, then cosine or linear decay to min_lr at total_steps (or constant lr).
// With a restart (R, L), for steps after R (the rule `longtrain schema` and the README state):
//   while R < warmup_steps: linear from L at R to lr at warmup_steps, then the decay from lr;
//   cosine / linear: from L at max(R, warmup_steps) (lr there when warmup remained) to min_lr at
//                    total_steps, p = (s - start) / (total_steps - start);
//   constant: linear from L at R to lr at total_steps.
// Both are continuous at R: the value there is L.
double learning_rate(const AdamWConfig& c, int64_t step);

// sqrt(Σ g²) over the whole arena (NaN/Inf when any gradient is).
double global_norm(const Arena& grads);

// AdamW over a flat range of the parameter arena: the whole arena on one rank, or this rank's shard
// under ZeRO-1 (the ranks split the flat view into equal shards; each keeps optimizer state for its
// shard only, and the updated shards are all-gathered). The state is three flat arenas (one entry
// each): "master" (f32 master weights, only when the parameters are bf16), "m" and "v".
class AdamW {
 public:
  // Owns the flat elements [shard_begin, shard_end) of params.flat(); shard_end < 0 means the end.
  AdamW(const Arena& params, const AdamWConfig& config, int64_t shard_begin = 0, int64_t shard_end = -1);

  struct StepInfo {
    double lr = 0.0;
    double grad_norm = 0.0;  // before clipping
    double clip_scale = 1.0;
  };
  // One rank: the update from the whole gradient arena (already averaged over the global batch).
  StepInfo step(Arena& params, const Arena& grads);
  // The update of this rank's shard from its gradient shard (flat, shard-sized) and the norm of
  // the whole gradient (the caller sums the shards' squares over the ranks). Only the shard of
  // `params` changes; the caller all-gathers it. Non-finite norms must be caught before this.
  StepInfo step_shard(Arena& params, Tensor grad_shard, double grad_norm);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  const AdamWConfig& config() const { return config_; }
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }

  Arena& m() { return m_; }
  Arena& v() { return v_; }
  bool has_master() const { return master_.allocated(); }
  Arena& master() { return master_; }

 private:
  AdamWConfig config_;
  int64_t step_ = 0;
  int64_t begin_ = 0, end_ = 0;
  // The shard's elements that take no weight decay (parameter tensors matched by no_decay, adjacent
  // ones merged), relative to the shard: one update call covers the whole shard.
  std::vector<ops::ElementRange> no_decay_;
  Arena master_, m_, v_;
};

}  // namespace longtrain::trainer
