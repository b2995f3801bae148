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
#include "attention/distributed/cost_model.h"
#include "model/memory_plan.h"
#include "parallel/communicator.h"
#include "parallel/distributed.h"
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

// A model restored for eval and generate from a checkpoint directory (its config.yaml and
// model.safetensors; step from trainer_state.json) or from any Hugging Face Llama directory
// (config.json and safetensors, no MANIFEST.json; step 0, data.seq_len = its max_position_embeddings,
// data.train empty, data.tokenizer its tokenizer.model or tokenizer.json when there is one). Sized for `max_tokens`
// tokens per forward (0: data.seq_len), with RoPE computed for that length (rope_scaling dynamic).
// device cpu: f32; cuda: bf16 mixed precision.
//
// `overrides` ("section.key=value" as load_config takes them) change the config, e.g.
// attention.schedule or parallel.layout. Under longtrain-run (WORLD_SIZE > 1 in the environment)
// every process calls it: the job is split into sequence-parallel groups of `sp_size` ranks (0: all of
// them; the rest is data parallel; a single process is always sp_size 1), each rank's model holds
// max_tokens / sp_size tokens of a forward, and the attention runs the configured schedule over the
// group, as in training.
struct LoadedModel {
  TrainConfig config;
  // Declared before the model, whose attention uses its communicators: destroyed after it.
  std::shared_ptr<parallel::Distributed> dist;  // the job's communicators; null in a single process
  std::unique_ptr<model::LlamaModel> model;
  int64_t step = 0;
  int dp_rank = 0, dp_size = 1, sp_rank = 0, sp_size = 1;
  bool main = true;  // global rank 0: the one that prints and writes
  parallel::Communicator* world() const;  // null in a single process
};
LoadedModel load_model_from_checkpoint(const std::filesystem::path& dir, int64_t max_tokens = 0,
                                       Device device = Device::cpu, const std::vector<std::string>& overrides = {},
                                       int64_t sp_size = 0);

// The loader options eval uses for `loaded`'s validation data in `shard_dir`: the val split at
// data.seq_len, this rank's data- and sequence-parallel share in the config's layout.
data::LoaderOptions eval_loader_options(const LoadedModel& loaded, const std::string& shard_dir);

}  // namespace longtrain::trainer
