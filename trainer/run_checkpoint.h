// What a training run's checkpoint holds and how a run resumes from one. checkpoint.h makes the
// directory appear atomically and finds the newest whole one; this file fills it and reads it back:
//   model.safetensors (and config.json)  the parameters as a Hugging Face Llama directory
//   optimizer.rankR.safetensors           each rank's ZeRO-1 shard of the Adam state (optimizer_state.h)
//   trainer_state.json                    step, optimizer steps, skip counters, tokens seen, seed,
//                                         world size, loader position, config hash, lr restart
//   config.yaml                           the resolved config the run trained with
//   tokenizer.json / tokenizer.model      the run's tokenizer (and tokenizer_config.json), if any
// A resume is planned (plan_resume) before anything is created on disk, so a refused config change or
// a global batch that an elastic resume cannot keep is an error that names the checkpoint and the keys.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "data/loader.h"
#include "model/llama.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"
#include "trainer/run_setup.h"

namespace longtrain::trainer {

inline constexpr const char* kTrainerState = "trainer_state.json";
inline constexpr const char* kConfigFile = "config.yaml";

// The run's counters that a checkpoint carries besides the model, optimizer and loader.
struct RunState {
  int64_t step = 0;
  int64_t consecutive_skips = 0;
  int64_t skipped_total = 0;
  int64_t tokens_seen = 0;
};

// Collective: every rank writes its optimizer shard into the temporary directory rank 0 opened,
// then rank 0 writes the model, the trainer state and the config and commits the directory; `last`
// becomes its path on rank 0. A failure leaves no checkpoint of this step and the earlier ones intact,
// and says so.
void save_checkpoint(const TrainConfig& c, const model::LlamaModel& model, AdamW& opt, const data::Loader& loader,
                     const RunState& rs, const Ranks& ranks, std::optional<std::filesystem::path>& last);

// What resuming from a checkpoint with this run's config means, settled before anything is
// created on disk: the checkpoint's config, what changed (refused keys are an error here), the
// learning-rate restart and whether the loader keeps its position.
struct ResumePlan {
  std::filesystem::path dir;
  nlohmann::json state;               // trainer_state.json
  TrainConfig saved;                  // the checkpoint's config.yaml
  std::vector<ConfigChange> changes;  // every one allowed
  std::optional<LrRestart> restart;   // the one this run's optimizer uses
  bool schedule_changed = false;
  bool new_data = false;              // data.train changed: the loader starts the new data afresh
  int64_t step = 0, optimizer_steps = 0;
  // The world the checkpoint was written by; an elastic resume when it differs from this run's.
  int saved_world = 1, saved_dp = 1, saved_sp = 1;
  int64_t global_batch = 0;  // sequences per optimizer step, the same before and after
  bool elastic() const { return saved_world != world || saved_dp != dp; }
  int world = 1, dp = 1, sp = 1;
};

ResumePlan plan_resume(const std::filesystem::path& dir, const TrainConfig& c, const Ranks& ranks);

// Restores model, optimizer, loader (unless the data is new) and counters from the plan's checkpoint.
RunState restore_checkpoint(const ResumePlan& plan, model::LlamaModel& model, AdamW& opt, data::Loader& loader,
                            const Ranks& ranks);

// The log lines of a resume: each allowed change, the re-shaped schedule, the restarted loader.
void log_resume(spdlog::logger& log, const ResumePlan& plan, const TrainConfig& c, const AdamWConfig& a);

}  // namespace longtrain::trainer
