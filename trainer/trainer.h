// The training loop behind `longtrain train`, evaluation behind `longtrain eval`, and loading a
// checkpoint for `longtrain generate`.
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
#include "model/memory_plan.h"
#include "parallel/communicator.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"

namespace longtrain::trainer {

struct EvalResult {
  double loss = 0.0;        // mean loss per valid label
  double perplexity = 0.0;  // exp(loss)
  int64_t tokens = 0;       // valid labels evaluated
  // Mean loss of the labels whose position falls in bucket b = position·B / seq_len.
  std::vector<double> bucket_loss;
  std::vector<int64_t> bucket_tokens;
};

// Evaluates `batches` windows of `loader` (all of them when batches is 0 or exceeds the split). With
// several ranks, each evaluates its own share (the loader's DP/SP rank) and `world` sums the results.
EvalResult evaluate(model::LlamaModel& model, data::Loader& loader, int64_t batches, int64_t buckets,
                    parallel::Communicator* world = nullptr);

// What a model that ignores context achieves: the entropy of the training split's token
// frequencies, and the cross-entropy of the validation split under them (add-one smoothed), in nats
// per token. A trained model's validation loss should be clearly below both.
struct UnigramBaseline {
  double train_entropy = 0.0;
  double val_cross_entropy = 0.0;
};
UnigramBaseline unigram_baseline(const data::TokenCorpus& train, const data::TokenCorpus& val);

// What training `config` on `world_size` ranks will allocate per rank, before allocating anything
// (`longtrain train --plan`; train() checks it against free memory first).
model::MemoryPlan plan_training_memory(const TrainConfig& config, int world_size);

// Test hooks: called after each micro-step's backward, before the non-finite check and the update.
// With several ranks, the last micro-step's gradients have already been reduced over the ranks when
// it runs (the reduction overlaps backward; the trainer waits for it first), so a change it makes to
// them stays on this rank.
struct TrainHooks {
  std::function<void(int64_t step, model::LlamaModel& model)> after_backward;
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
};

// Runs training. `resume` is "" (start fresh), "auto" (the newest complete checkpoint under
// checkpoint.dir, or fresh when there is none) or a checkpoint directory. The config must come from
// load_config and resolve_device; nothing is created on disk before every input has been checked.
TrainSummary train(TrainConfig config, const std::string& resume = "", const TrainHooks& hooks = {});

// A model restored for eval and generate from a checkpoint directory (its config.yaml and
// model.safetensors; step from trainer_state.json) or from any Hugging Face Llama directory
// (config.json and safetensors, no MANIFEST.json; step 0, data.seq_len = its max_position_embeddings,
// data.train empty, data.tokenizer its tokenizer.model or tokenizer.json when there is one). Sized for `max_tokens`
// tokens per forward (0: data.seq_len), with RoPE computed for that length (rope_scaling dynamic).
// device cpu: f32; cuda: bf16 mixed precision.
struct LoadedModel {
  TrainConfig config;
  std::unique_ptr<model::LlamaModel> model;
  int64_t step = 0;
};
LoadedModel load_model_from_checkpoint(const std::filesystem::path& dir, int64_t max_tokens = 0,
                                       Device device = Device::cpu);

}  // namespace longtrain::trainer
