#include "trainer/run_checkpoint.h"

#include <exception>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"
#include "model/hf_export.h"
#include "model/safetensors.h"
#include "parallel/store.h"
#include "trainer/checkpoint.h"
#include "trainer/metrics.h"
#include "trainer/optimizer_state.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// "4 ranks (data parallel 2 × sequence parallel 2)".
std::string world_text(int world, int dp, int sp) {
  return fmt::format("{} rank{} (data parallel {} × sequence parallel {})", world, world == 1 ? "" : "s", dp, sp);
}

// The keys whose change re-shapes the learning-rate schedule (optimizer.h, learning_rate).
bool changes_lr_schedule(const std::string& key) {
  for (const char* k : {"train.steps", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.schedule"})
    if (key == k) return true;
  return false;
}

std::optional<LrRestart> restart_from_state(const json& state) {
  if (!state.contains("lr_restart")) return std::nullopt;
  const json& r = state.at("lr_restart");
  return LrRestart{r.at("step").get<int64_t>(), r.at("lr").get<double>()};
}

// Where an elastic resume's loader continues, for its log line.
std::string loader_place(const ResumePlan& plan) {
  const auto saved = plan.state.at("loader").get<data::LoaderState>();
  const data::LoaderState now = data::rescale_data_parallel(saved, plan.dp);
  return fmt::format("; the loader continues at position {} of epoch {}'s order (cursor {} of {} ranks, was {} of {})",
                     now.cursor * now.dp_size, now.epoch, now.cursor, now.dp_size, saved.cursor, saved.dp_size);
}

}  // namespace

void save_checkpoint(const TrainConfig& c, const model::LlamaModel& model, AdamW& opt, const data::Loader& loader,
                     const RunState& rs, const Ranks& ranks, std::optional<fs::path>& last) {
  CheckpointSaveOptions so;
  so.keep_last = static_cast<int>(c.checkpoint.keep_last);
  std::optional<PendingCheckpoint> pending;
  fs::path tmp;
  if (ranks.main) {
    pending = begin_checkpoint(c.checkpoint.dir, rs.step);
    tmp = pending->tmp_dir;
  }
  const std::string key = fmt::format("checkpoint/step_{}/tmp_dir", rs.step);
  if (ranks.dist) {
    if (ranks.main) ranks.dist->store().set(key, tmp.string());
    else tmp = ranks.dist->store().get(key);
  }
  try {
    save_optimizer_state(tmp / optimizer_state_file(ranks.global_rank), opt, ranks.world_size, ranks.global_rank);
    if (ranks.dist) ranks.dist->world().barrier();  // every shard is on disk
    if (!ranks.main) return;
    model::HfLlamaConfig hf;
    hf.model = c.model;
    const Arena& params = const_cast<model::LlamaModel&>(model).params();
    if (params.device() == Device::cpu) {
      model::export_hf_directory(tmp.string(), hf, params);
    } else {
      model::export_hf_directory(tmp.string(), hf, host_mirror(params, true));
    }
    json state = {{"step", rs.step},
                  {"optimizer_steps", opt.steps_taken()},
                  {"consecutive_skips", rs.consecutive_skips},
                  {"skipped_total", rs.skipped_total},
                  {"tokens_seen", rs.tokens_seen},
                  {"seed", c.train.seed},
                  {"world_size", ranks.world_size},
                  {"loader", loader.state()},
                  {"config_hash", config_hash(c)}};
    if (const std::optional<LrRestart>& r = opt.config().restart)
      state["lr_restart"] = {{"step", r->step}, {"lr", r->lr}};
    write_file_atomically(tmp / kTrainerState, state.dump(2) + "\n");
    write_file_atomically(tmp / kConfigFile, resolved_yaml(c));
    // The run's tokenizer travels with the checkpoint under its kind's name (tokenizer_config.json
    // with a tokenizer.json: it may name BOS/EOS).
    const std::string tokenizer = fs::is_directory(c.data.tokenizer) ? data::find_tokenizer_in(c.data.tokenizer)
                                                                     : c.data.tokenizer;
    if (!tokenizer.empty() && fs::is_regular_file(tokenizer)) {
      const bool hf = data::is_hf_tokenizer_file(tokenizer);
      fs::copy_file(tokenizer, tmp / (hf ? "tokenizer.json" : "tokenizer.model"), fs::copy_options::overwrite_existing);
      const fs::path config = fs::path(tokenizer).parent_path() / "tokenizer_config.json";
      if (hf && fs::is_regular_file(config))
        fs::copy_file(config, tmp / "tokenizer_config.json", fs::copy_options::overwrite_existing);
    }
    CheckpointRef ref = commit_checkpoint(*pending, so);
    last = ref.path;
    spdlog::info("checkpoint {} written", ref.path.string());
  } catch (const std::exception& e) {
    if (pending) abort_checkpoint(*pending);
    // Say what it means for the run: nothing of this step was published, the older ones are intact.
    LT_FAIL("the checkpoint of step {} could not be written under {} ({}); nothing of it was kept and the "
            "earlier checkpoints are intact: free space (or fix the error) and continue with --resume auto",
            rs.step, c.checkpoint.dir, e.what());
  } catch (...) {
    if (pending) abort_checkpoint(*pending);
    throw;
  }
}

ResumePlan plan_resume(const fs::path& dir, const TrainConfig& c, const Ranks& ranks) {
  ResumePlan p;
  p.dir = dir;
  p.state = json::parse(read_text(dir / kTrainerState));
  p.step = p.state.at("step").get<int64_t>();
  p.optimizer_steps = p.state.at("optimizer_steps").get<int64_t>();
  const fs::path saved_path = dir / kConfigFile;
  if (!fs::exists(saved_path))
    throw Error(fmt::format("cannot resume from {}: it has no {} (the config it was trained with)", dir.string(),
                            kConfigFile));
  p.saved = load_config(saved_path.string());
  std::string refused;
  for (ConfigChange& change : config_changes(p.saved, c)) {
    if (change.on_resume == OnResume::refused) {
      refused += "\n  " + change.text();
      continue;
    }
    p.schedule_changed = p.schedule_changed || changes_lr_schedule(change.key);
    p.new_data = p.new_data || change.key == "data.train";
    p.changes.push_back(std::move(change));
  }
  // User errors without a source location: they name the checkpoint, each key and what to do.
  if (!refused.empty())
    throw Error(fmt::format("cannot resume from {}: these keys are part of what the checkpoint means and a resume "
                            "cannot change them (`longtrain schema` shows which keys can):{}\nresume with the values "
                            "it was trained with, or start a new run directory",
                            dir.string(), refused));
  if (c.train.steps < p.step)
    throw Error(fmt::format("cannot resume from {}: train.steps ({}) is below its step {}: set train.steps to {} or "
                            "more",
                            dir.string(), c.train.steps, p.step, p.step));
  // Elastic: the world may change (data- and sequence-parallel sizes, and with them train.batch_size,
  // train.grad_accum, parallel.sp_size, parallel.layout) as long as a step takes as many sequences as
  // before, so that the loader's place and the learning-rate schedule mean what they meant.
  p.world = ranks.world_size;
  p.dp = ranks.dp_size;
  p.sp = ranks.sp_size;
  p.saved_world = p.state.contains("world_size") ? p.state.at("world_size").get<int>() : 1;
  p.saved_sp = static_cast<int>(p.saved.parallel.sp_size);
  if (p.saved_world < 1 || p.saved_sp < 1 || p.saved_world % p.saved_sp != 0)
    throw Error(fmt::format("cannot resume from {}: its {} records world_size {} and its {} parallel.sp_size {}, "
                            "which do not divide",
                            dir.string(), kTrainerState, p.saved_world, kConfigFile, p.saved_sp));
  p.saved_dp = p.saved_world / p.saved_sp;
  const int64_t saved_batch = p.saved.train.batch_size * p.saved.train.grad_accum * p.saved_dp;
  p.global_batch = c.train.batch_size * c.train.grad_accum * ranks.dp_size;
  if (p.global_batch != saved_batch) {
    const int64_t per_dp = c.train.batch_size * ranks.dp_size;
    const std::string hint =
        saved_batch % per_dp == 0
            ? fmt::format("set train.grad_accum to {} (with train.batch_size {} on {} data-parallel ranks)",
                          saved_batch / per_dp, c.train.batch_size, ranks.dp_size)
            : fmt::format("choose train.batch_size × train.grad_accum × data-parallel ranks = {}", saved_batch);
    throw Error(fmt::format("cannot resume from {}: it was trained with {} sequences per step (train.batch_size {} × "
                            "train.grad_accum {} × {} data-parallel ranks, {}) and this run takes {} (train.batch_size "
                            "{} × train.grad_accum {} × {} data-parallel ranks, {}); an elastic resume keeps the "
                            "global batch: {}",
                            dir.string(), saved_batch, p.saved.train.batch_size, p.saved.train.grad_accum, p.saved_dp,
                            world_text(p.saved_world, p.saved_dp, p.saved_sp), p.global_batch, c.train.batch_size,
                            c.train.grad_accum, ranks.dp_size, world_text(p.world, p.dp, p.sp), hint));
  }
  // The restart of the old schedule carries on unless the schedule changed now; then the new one
  // starts at the lr the old one (with its own restart, if any) gave the last step taken.
  AdamWConfig old = adamw_config(p.saved);
  old.restart = restart_from_state(p.state);
  p.restart = old.restart;
  if (p.schedule_changed) p.restart = LrRestart{p.optimizer_steps, learning_rate(old, p.optimizer_steps)};
  return p;
}

RunState restore_checkpoint(const ResumePlan& plan, model::LlamaModel& model, AdamW& opt, data::Loader& loader,
                            const Ranks& ranks) {
  const fs::path& dir = plan.dir;
  const SavedOptimizerLayout saved = load_optimizer_state(dir, opt, model.params().flat().numel());
  if (saved.world_size != plan.saved_world)
    throw Error(fmt::format("cannot resume from {}: its optimizer shards were written by {} ranks but its {} says {}",
                            dir.string(), saved.world_size, kTrainerState, plan.saved_world));
  if (model.params().device() == Device::cpu) {
    model::load_safetensors((dir / "model.safetensors").string(), model.params());
  } else {
    Arena params = host_mirror(model.params(), false);
    model::load_safetensors((dir / "model.safetensors").string(), params);
    copy_arena(model.params(), params);
  }
  opt.set_steps_taken(plan.optimizer_steps);
  if (!plan.new_data) {
    // Saved by dp ranks; this run's loader continues at the same place of the epoch's order.
    const auto state = plan.state.at("loader").get<data::LoaderState>();
    try {
      loader.restore(data::rescale_data_parallel(state, ranks.dp_size));
    } catch (const Error& e) {
      throw Error(fmt::format("cannot resume from {}: {}", dir.string(), e.what()));
    }
  }
  RunState rs;
  rs.step = plan.step;
  rs.consecutive_skips = plan.state.at("consecutive_skips").get<int64_t>();
  rs.skipped_total = plan.state.at("skipped_total").get<int64_t>();
  rs.tokens_seen = plan.state.at("tokens_seen").get<int64_t>();
  return rs;
}

void log_resume(spdlog::logger& log, const ResumePlan& plan, const TrainConfig& c, const AdamWConfig& a) {
  log.info("resumed from {} at step {}", plan.dir.string(), plan.step);
  for (const ConfigChange& change : plan.changes) log.info("  changed on resume: {}", change.text());
  if (plan.elastic())
    log.info("  elastic resume: {} -> {}; the ZeRO-1 optimizer state re-sharded from {} shard{} to {}; the global "
             "batch stays {} sequences per step{}",
             world_text(plan.saved_world, plan.saved_dp, plan.saved_sp), world_text(plan.world, plan.dp, plan.sp),
             plan.saved_world, plan.saved_world == 1 ? "" : "s", plan.world, plan.global_batch,
             plan.new_data ? "" : loader_place(plan));
  if (plan.schedule_changed) {
    const LrRestart& r = *a.restart;
    const bool warm = r.step < a.warmup_steps;
    const std::string end = a.schedule == LrSchedule::constant ? fmt::format("lr {:.6g}", a.lr)
                                                               : fmt::format("min_lr {:.6g}", a.min_lr);
    log.info("  lr schedule re-shaped at optimizer step {}: from {:.6g} (the lr of that step){} to {} at step {} "
             "({}); no jump",
             r.step, r.lr, warm ? fmt::format(", warmup to lr {:.6g} at step {}, then", a.lr, a.warmup_steps) : "",
             end, a.total_steps, enum_name(a.schedule));
  }
  if (plan.new_data)
    log.info("  new data: data.train changed from {} to {}; the loader starts it from its beginning (epoch 0, "
             "window 0 of its order) with the run's seed {}; the position reached in the old data is not used",
             plan.saved.data.train, c.data.train, c.train.seed);
}

}  // namespace longtrain::trainer
