// The training configuration: `longtrain train CONFIG.yaml [--set section.key=value ...]`.
//
// One table in config.cpp lists every key (section.key, type, default, allowed range or values,
// meaning). It drives everything here: parsing, validation, the schema printout (schema_text), the
// resolved config written into the run directory (resolved_yaml) and the config hash kept in
// checkpoints (config_hash) and what a resume may change (OnResume, config_changes). A default is
// written once, in that table; the model's shape defaults are LlamaConfig's own. A new key must say
// in its table entry whether a resume may change it (.resume = OnResume::refused or ::allowed): an
// entry without it does not compile, and tests/trainer/config_test.cpp lists every key's class.
//
// load_config reads and checks everything before any work is done: it never creates a file or a
// directory, so a caller that loads first and creates the run directory afterwards leaves nothing
// behind on a bad config. Every problem throws longtrain::Error whose message starts with where the
// value came from and names the key:
//   configs/tiny.yaml:12: optim.lr: expected a number, got 'fast'
//   configs/tiny.yaml:7: unknown key optim.learning_rate (did you mean optim.lr?)
//   --set optim.beta2=1: optim.beta2 must be in [0, 1), got 1
//   configs/tiny.yaml:4: data.seq_len (1000) must be a multiple of 2·parallel.sp_size = 8 ...
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "attention/local_attention.h"
#include "kernels/ops.h"
#include "model/llama.h"
#include "model/llama_config.h"
#include "parallel/layout.h"

namespace longtrain::trainer {

enum class DeviceChoice { auto_select, cpu, cuda };   // "auto": cuda when a GPU is present, else cpu
enum class DTypeChoice { auto_select, f32, f64, bf16 };  // "auto": bf16 on cuda, f32 on cpu
enum class NonFinitePolicy { skip, stop };
enum class LrSchedule { cosine, linear, constant };
enum class AttentionSchedule { ring, zigzag, distflash, burst, ulysses };
// train.cuda_graphs. auto: on wherever graphs can run (one rank on cuda, no data.document_mask),
// silently off elsewhere; true: the same, and the log warns where they cannot run.
enum class CudaGraphsChoice { off, on, auto_select };

// Whether `--resume` may continue a checkpoint with a different value of a key. Every key of the
// table has one (a key without it does not compile); `longtrain schema` shows it.
//   refused: the value is part of what the saved state means: the model's shape and numerics, the
//            tokenizer, the sequence length, the seed, the optimizer's hyperparameters that its
//            moments were accumulated with, and whether documents are masked (data.document_mask:
//            another function of the same windows). A resume that changes one is an error naming
//            each such key with its old and new value.
//   elastic: the parallel layout and the batch split: parallel.sp_size, parallel.layout,
//            train.batch_size and train.grad_accum. They may change, and so may the number of
//            ranks, when the global batch (batch_size × grad_accum × data-parallel ranks) stays the
//            same: the ZeRO-1 optimizer shards are re-sharded and the loader continues at the same
//            window (trainer/optimizer_state.h, data/loader.h; README "Elastic resume"). Another
//            global batch is an error that says which grad_accum keeps it.
//   allowed: train.steps and the learning-rate schedule (re-shaped without a jump, see
//            optimizer.h), checkpoint.*, eval.*, logging.*, what to do with non-finite steps,
//            threads, timeouts, the activation-checkpoint policy and attention schedule (the same
//            function), and data.train (new data: the loader starts it from its beginning). The
//            trainer logs each change as old -> new.
enum class OnResume { refused, allowed, elastic };

// The names used in YAML ("auto", "bf16", "cosine", "distflash", ...).
std::string_view enum_name(DeviceChoice v);
std::string_view enum_name(DTypeChoice v);
std::string_view enum_name(NonFinitePolicy v);
std::string_view enum_name(LrSchedule v);
std::string_view enum_name(AttentionSchedule v);
std::string_view enum_name(CudaGraphsChoice v);  // "false", "true", "auto"
std::string_view enum_name(OnResume v);  // "refused", "allowed", "elastic"

// The model section is a LlamaConfig (so it passes straight to LlamaModel) plus what the trainer
// decides about the model. head_dim is already resolved (0 in the file means dim / n_heads).
struct ModelSection : model::LlamaConfig {
  // Empty = auto: the trainer picks the fastest policy and offload whose memory plan fits
  // (model::choose_memory; model/memory_plan.h holds the measured order).
  std::optional<model::CheckpointPolicy> checkpoint;
  std::optional<model::Offload> offload;
  model::Tiling tiling;   // model.mlp_chunk_tokens, model.loss_chunk_tokens, model.attention_head_groups; 0 = auto
  double init_std{};      // std of the normal initialization of weight matrices
  std::string init_from;  // a Hugging Face Llama directory whose weights start the run; "" = random init
};

struct DataSection {
  std::string train;      // a data source spec (data/mixture.h): shard set, Megatron dataset or mixture
  std::string val;        // "" = the train shard set's validation split
  std::string tokenizer;  // SentencePiece .model or tokenizer.json; "" = none
  int64_t seq_len{};      // tokens per sequence S (the whole sequence, before sequence-parallel sharding)
  int64_t prefetch{};     // batches prepared ahead by the loader thread
  bool document_mask{};   // per-document attention, positions and labels (data/loader.h)
};

struct TrainSection {
  DeviceChoice device{};
  DTypeChoice dtype{};
  int64_t steps{};                // optimizer steps
  int64_t batch_size{};           // sequences per data-parallel rank per micro-step
  int64_t grad_accum{};           // micro-steps per optimizer step
  DTypeChoice grad_dtype{};       // gradients' dtype; auto: f32 on cuda when grad_accum > 1, else dtype's
  int64_t seed{};
  NonFinitePolicy on_nonfinite{};
  int64_t max_nonfinite_skips{};  // consecutive skipped steps before the run stops
  int64_t threads{};              // CPU threads; 0 = all cores
  ops::GemmAlgoPolicy gemm_algorithm{};  // cuBLASLt's algorithm per GEMM shape on CUDA: heuristic, auto
  CudaGraphsChoice cuda_graphs{};  // micro-batches replayed as CUDA graphs (model/step_graphs.h)
};

struct OptimSection {
  double lr{}, min_lr{}, weight_decay{}, beta1{}, beta2{}, eps{};
  int64_t warmup_steps{};
  LrSchedule schedule{};
  double grad_clip{};                 // max global gradient norm; 0 = no clipping
  std::vector<std::string> no_decay;  // a parameter whose name contains one of these gets no weight decay
};

struct ParallelSection {
  int64_t sp_size{};  // ranks sharing one sequence
  int64_t ulysses_size{};  // Ulysses groups of this many ranks inside the SP group, a ring across them (1: none)
  SeqLayout layout{};
  double timeout_s{};  // limit of every blocking collective
  double store_timeout_s{};  // how long the rendezvous store may stay silent before it counts as lost
};

struct AttentionSection {
  AttentionSchedule schedule{};
  bool causal{};
  attn::KernelPolicy kernel{};  // which kernel runs the block calls on CUDA: cudnn, hopper, auto
};

struct CheckpointSection {
  int64_t every{};      // steps between checkpoints; 0 = only at the end
  int64_t keep_last{};  // 0 = keep all
  std::string dir;      // resolved: <logging.run_dir>/checkpoints unless given
};

struct EvalSection {
  int64_t every{};             // steps between evaluations; 0 = only at the end
  int64_t batches{};           // validation batches per evaluation; 0 = no evaluation
  int64_t position_buckets{};  // loss reported per bucket of token positions
};

struct LoggingSection {
  std::string run_dir;  // resolved: runs/<config file stem> unless given
  int64_t log_every{};
  bool plot{};          // keep a loss-curve SVG in the run directory up to date
};

struct TrainConfig {
  std::string source;  // the config file path (or the name given to config_from_yaml_string)
  ModelSection model;
  DataSection data;
  TrainSection train;
  OptimSection optim;
  ParallelSection parallel;
  AttentionSection attention;
  CheckpointSection checkpoint;
  EvalSection eval;
  LoggingSection logging;
};

// Reads `path`, applies `overrides` ("section.key=value", the value parsed as a YAML scalar or flow
// list, e.g. "optim.no_decay=[norm]"), fills defaults and validates. Touches no file but `path` (and
// reads model.init_from's config.json: the shape comes from it, and a model key the config gives that
// contradicts it is an error naming both values; data.tokenizer defaults to its tokenizer.model or tokenizer.json).
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from YAML text; `source_name` stands for the file in messages and in the default run_dir.
TrainConfig config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides = {},
                                    const std::string& source_name = "<string>");

// Settles train.device and train.dtype "auto" for this machine and checks that what was asked for
// can run here: device auto picks cuda when one is available, unless dtype is f32 or f64 (CPU only);
// dtype auto picks bf16 on cuda and f32 on cpu. Call it after load_config, before any work.
void resolve_device(TrainConfig& config, bool cuda_available);

// Every key with its final value, as YAML grouped by section, each line commented with its meaning.
// load_config of this text gives back the same values and the same config_hash.
std::string resolved_yaml(const TrainConfig& config);

// 16 hex digits: FNV-1a 64 of "section.key=value" lines of every key that changes what training
// computes (recorded in checkpoints; what a resume may change is OnResume's business, not the
// hash's). Excluded, because they do not change a single number of the training trajectory:
// logging.*, checkpoint.*, eval.*, data.val, data.tokenizer, data.prefetch, train.threads,
// train.on_nonfinite, train.max_nonfinite_skips, train.gemm_algorithm, train.cuda_graphs,
// parallel.timeout_s and parallel.store_timeout_s. train.steps
// is included:
// the cosine and linear schedules reach min_lr at train.steps.
std::string config_hash(const TrainConfig& config);

// One key whose value differs between two configs.
struct ConfigChange {
  std::string key;            // "section.key"
  std::string before, after;  // the values as YAML text ("0.001", "\"data/a\"", "[norm]")
  OnResume on_resume = OnResume::refused;
  std::string text() const;   // "optim.lr: 0.001 -> 0.002"
};

// Every key whose value differs, in table order: what a resume from a checkpoint trained with
// `before` must refuse or log. Keys that name a file or directory (data.*, checkpoint.dir,
// logging.run_dir) compare as paths from the current directory: "runs/x" and "./runs/x/" are the same.
std::vector<ConfigChange> config_changes(const TrainConfig& before, const TrainConfig& after);

// The class of "section.key"; an error for an unknown key.
OnResume on_resume(std::string_view key);

// Every key grouped by section: name, type with its range or allowed values, default, whether a
// resume may change it (OnResume) and meaning; then the rules for changes on resume.
std::string schema_text();

// "section.key" of every key in table order (for tests and shell completion).
std::vector<std::string> config_keys();

}  // namespace longtrain::trainer
