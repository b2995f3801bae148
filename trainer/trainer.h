// The training loop behind `longtrain train` (evaluation and loading a checkpoint for eval and
// generate: eval.h; what a checkpoint holds and how a run resumes: run_checkpoint.h).
//
// A step: take batch_size × grad_accum windows from the loader, count their valid labels, run
// forward+backward on each with grad_scale = 1 / count (so the loss is the mean over every label of
// the step, whatever the micro-batching), check the loss and the gradient norm for NaN/Inf, then
// clip and apply AdamW. Checkpoints hold everything that makes resume bit-exact: parameters in their
// training dtype, Adam moments (and master weights when separate), the optimizer step, the loader
// state and the config hash.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/loader.h"
#include "model/llama.h"
#include "attention/distributed/cost_model.h"
#include "model/memory_plan.h"
#include "parallel/communicator.h"
#include "parallel/distributed.h"
#include "trainer/config.h"
#include "trainer/eval.h"
#include "trainer/optimizer.h"

namespace longtrain::trainer {

// What training `config` on `world_size` ranks will allocate per rank, before allocating anything
// (`longtrain train --plan`; train() checks it against free memory first), with model.checkpoint and
// model.offload resolved for a device with `device` memory free and a host with `host` (auto: the
// fastest combination that fits, model::choose_memory; the choice's reason says which and why).
model::MemoryChoice plan_training_memory(const TrainConfig& config, int world_size, const model::DeviceMemory& device,
                                         const model::DeviceMemory& host);

// `train --plan`'s attention block (sequence parallelism only; empty for sp_size 1): the configured
// schedule's bytes per rank and layer and its predicted time under `topology`, and the candidates the
// cost model ranks fastest (attention/distributed/cost_model.h).
std::string attention_plan_text(const TrainConfig& config, const attn::Topology& topology);

// Test hooks: called after each micro-step's backward, before the non-finite check and the update.
// With several ranks, the last micro-step's gradients have already been reduced over the ranks when
// it runs (the reduction overlaps backward; the trainer waits for it first), so a change it makes to
// them stays on this rank.
struct TrainHooks {
  std::function<void(int64_t step, model::LlamaModel& model)> after_backward;
  // The free memory train() plans for instead of the device's (a fake budget, to test
  // model.checkpoint: auto on any machine).
  std::optional<model::DeviceMemory> device_memory;
};

struct TrainSummary {
  std::filesystem::path run_dir;
  int64_t first_step = 0;  // the first step this call ran (1, or the resumed step + 1)
  int64_t last_step = 0;
  std::vector<double> losses;  // training loss of each step this call ran (NaN for skipped steps)
  int64_t skipped_steps = 0;
  std::optional<EvalResult> final_eval;
  std::optional<std::filesystem::path> last_checkpoint;
  // SIGTERM or SIGINT when a signal stopped the run early (after a checkpoint of last_step), else 0.
  int stopped_by_signal = 0;
  // train.cuda_graphs: graphs captured and micro-batches replayed from them, and why graphs went off
  // mid-run ("" if they did not).
  int64_t graph_captures = 0, graph_replays = 0;
  std::string graph_off_reason;
};

// Runs training. `resume` is "" (start fresh), "auto" (the newest complete checkpoint under
// checkpoint.dir, or fresh when there is none) or a checkpoint directory. The config must come from
// load_config and resolve_device; nothing is created on disk before every input has been checked.
TrainSummary train(TrainConfig config, const std::string& resume = "", const TrainHooks& hooks = {});

}  // namespace longtrain::trainer
