// What a training run and a model loaded for eval both set up from a TrainConfig: this process's
// ranks and communicators, the attention every layer runs, the loader's options, the precision, and
// host copies of device arenas for file I/O. Used inside trainer/ (trainer.cpp, run_checkpoint.cpp,
// eval.cpp); the CLI and the tests go through trainer.h and eval.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "attention/distributed/distributed_attention.h"
#include "data/loader.h"
#include "model/llama.h"
#include "parallel/communicator.h"
#include "parallel/distributed.h"
#include "runtime/arena.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"

namespace longtrain::trainer {

// resolve_device has settled "auto": cuda trains in bf16 with f32 statistics and master weights, and
// gradients in bf16 or f32 (train.grad_dtype).
model::Precision precision_for(const TrainConfig& c);

// A host arena with the same table as `a` (for checkpoint I/O of device arenas); `copy_in` fills it.
Arena host_mirror(const Arena& a, bool copy_in);
void copy_arena(const Arena& dst, const Arena& src);

// The optimizer's settings from the config's optim section and train.steps.
AdamWConfig adamw_config(const TrainConfig& c);

// This process's place in the job: the world from the environment (longtrain-run or Slurm), its
// data- and sequence-parallel ranks, and the communicators. A plain `longtrain train` is rank 0 of 1.
struct Ranks {
  std::unique_ptr<parallel::Distributed> dist;
  int world_size = 1, global_rank = 0, dp_rank = 0, dp_size = 1, sp_rank = 0, sp_size = 1;
  bool main = true;  // global rank 0: writes the run directory, logs and checkpoints

  parallel::Communicator* world_comm() const { return dist ? &dist->world() : nullptr; }
  // In place Σ over every rank of the world of a tensor on the communicator's device.
  void sum(Tensor t) const {
    if (dist) dist->world().all_reduce(t);
  }
  // Σ over every rank of a few host values (losses, counts); NCCL reduces device memory, so they
  // travel through a small device buffer there.
  void sum(double* values, int64_t n) const {
    if (dist) parallel::all_reduce_host_values(dist->world(), values, n);
  }
};

// Joins the world the environment describes (a single process is rank 0 of 1; parallel.sp_size > 1
// there is an error naming the launcher) and selects this rank's GPU before any allocation.
Ranks join_world(const TrainConfig& c);

// The kernel choices are process-wide: the config's attention.kernel and train.gemm_algorithm, unless
// LONGTRAIN_ATTENTION_KERNEL or LONGTRAIN_GEMM_ALGO names one (a developer's override).
void set_kernel_choices(const TrainConfig& c);

// The attention every layer runs: one block on a single rank, else the configured distributed
// schedule over this rank's sequence-parallel group.
std::unique_ptr<attn::SequenceAttention> make_attention(const TrainConfig& c, const Ranks& r);

// The loader of `split` ("train" or "val") for this rank's data- and sequence-parallel share. "val"
// reads data.val, or data.train's own validation split when data.val is empty (an error naming the
// keys where data.train has none: a mixture or a Megatron dataset).
data::LoaderOptions loader_options(const TrainConfig& c, const std::string& split, const Ranks& r);

// A batch as the model's shard: on the CPU views of the batch's vectors, on a GPU copies of them in
// `staging` (three i32 [T] entries: tokens, labels, positions; shard_staging). Its ids and labels are
// checked here on the host against `vocab` (model::check_token_ids), so the model's step reads nothing
// back for them. With document masking the shard also carries the window's documents (global offsets).
model::TokenShard shard_of(data::Batch& b, int64_t vocab, const Arena* staging = nullptr);
Arena shard_staging(Device device, int64_t T);

// A f32 or f64 tensor's values as doubles on the host.
std::vector<double> host_values(const Tensor& t);

// The whole of a text file; an error naming it when it cannot be read.
std::string read_text(const std::filesystem::path& p);

}  // namespace longtrain::trainer
