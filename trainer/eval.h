// Evaluation behind `longtrain eval` and the trainer's periodic eval: the validation loss, its
// perplexity and its loss by position bucket over a loader's windows; the unigram baseline a trained
// model should beat; and a model loaded for eval and generate from a checkpoint or a Hugging Face
// Llama directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "data/shards.h"
#include "model/llama.h"
#include "parallel/communicator.h"
#include "parallel/distributed.h"
#include "trainer/config.h"

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
