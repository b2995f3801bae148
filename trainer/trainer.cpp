#include "trainer/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "attention/distributed/distributed_attention.h"
#include "kernels/ops.h"
#include "model/hf_export.h"
#include "parallel/distributed.h"
#include "runtime/device.h"
#include "trainer/checkpoint.h"
#include "trainer/metrics.h"
#include "trainer/run_checkpoint.h"
#include "trainer/run_setup.h"
#include "trainer/stop_signals.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

int64_t valid_labels(const data::Batch& b) {
  int64_t n = 0;
  for (int32_t l : b.labels) n += l != model::LlamaModel::kIgnoreIndex;
  return n;
}

std::string human_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// Global rank 0 logs to the console and to run_dir/train.log; the other ranks (empty log_file) only
// print warnings and errors, which longtrain-run prefixes with their rank.
std::shared_ptr<spdlog::logger> make_logger(const fs::path& log_file) {
  auto console = std::make_shared<spdlog::sinks::stdout_color_sink_mt>();
  std::shared_ptr<spdlog::logger> logger;
  if (log_file.empty()) {
    logger = std::make_shared<spdlog::logger>("longtrain", console);
    logger->set_level(spdlog::level::warn);
  } else {
    auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file.string());
    logger = std::make_shared<spdlog::logger>("longtrain", spdlog::sinks_init_list{console, file});
  }
  logger->set_pattern("[%H:%M:%S] %v");
  logger->flush_on(spdlog::level::info);
  return logger;
}

// Input tokens the world has taken from each mixture source so far, keyed by its path (a path
// listed twice gets "#i", its index, appended).
nlohmann::json tokens_by_source(const data::Loader& loader) {
  nlohmann::json out = nlohmann::json::object();
  const std::vector<int64_t> taken = loader.tokens_taken();
  for (int i = 0; i < loader.num_sources(); ++i) {
    std::string key = loader.source(i).path;
    if (out.contains(key)) key += fmt::format("#{}", i);
    out[key] = taken[static_cast<size_t>(i)];
  }
  return out;
}

// "data/code 1200 (30.1%, weight 30.0%), ..." for the step log.
std::string source_shares(const data::Loader& loader) {
  const std::vector<int64_t> taken = loader.tokens_taken();
  double total = 0, weights = 0;
  for (int i = 0; i < loader.num_sources(); ++i) {
    total += static_cast<double>(taken[static_cast<size_t>(i)]);
    weights += loader.source(i).weight;
  }
  std::vector<std::string> parts;
  for (int i = 0; i < loader.num_sources(); ++i)
    parts.push_back(fmt::format("{} {} ({:.1f}%, weight {:.1f}%)", loader.source(i).path, taken[static_cast<size_t>(i)],
                                total > 0 ? 100.0 * static_cast<double>(taken[static_cast<size_t>(i)]) / total : 0.0,
                                100.0 * loader.source(i).weight / weights));
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

model::MemoryChoice plan_training_memory(const TrainConfig& c, int world_size, const model::DeviceMemory& device,
                                         const model::DeviceMemory& host) {
  const int64_t tokens = c.data.seq_len / c.parallel.sp_size;
  model::SequenceParallelPlan sp;
  sp.sp_size = static_cast<int>(c.parallel.sp_size);
  sp.schedule = attn::parse_schedule(enum_name(c.attention.schedule));
  sp.causal = c.attention.causal;
  sp.ulysses_size = static_cast<int>(c.parallel.ulysses_size);
  if (sp.ulysses_size == sp.sp_size && sp.sp_size > 1) sp.schedule = attn::Schedule::ulysses;  // as make_attention
  // burst runs its double ring when the group spans nodes (make_attention passes both rings); outside
  // a launcher (`train --plan` alone) the group is taken to be on one node.
  const parallel::WorldInfo w = parallel::world_from_env();
  const int per_node = w.source == "default" ? sp.sp_size : w.local_world_size;
  if (per_node > 0 && sp.sp_size > per_node && sp.sp_size % per_node == 0) sp.nodes = sp.sp_size / per_node;
  return model::choose_memory(c.model, precision_for(c), c.model.checkpoint, c.model.offload, tokens, world_size, sp,
                              c.model.tiling, device, host);
}

std::string attention_plan_text(const TrainConfig& c, const attn::Topology& topo) {
  const int P = static_cast<int>(c.parallel.sp_size);
  if (P <= 1) return "";
  const model::Precision prec = precision_for(c);
  attn::AttentionShape a;
  a.seq_len = c.data.seq_len;
  a.q_heads = c.model.n_heads;
  a.kv_heads = c.model.n_kv_heads;
  a.head_dim = c.model.head_dim;
  a.elem_bytes = static_cast<int64_t>(dtype_size(prec.act));
  a.acc_bytes = static_cast<int64_t>(dtype_size(prec.stat));
  a.grad_bytes = a.elem_bytes;
  a.causal = c.attention.causal;
  a.layout = c.parallel.layout;
  // Ulysses keeps its forward for the backward unless the policy is full or checkpoints are offloaded
  // (model.checkpoint auto, unset here, usually picks a policy that keeps it).
  a.ulysses_keeps_forward =
      model::attention_keeps_forward(c.model.checkpoint.value_or(model::CheckpointPolicy::remat_aware),
                                     c.model.offload.value_or(model::Offload::none));
  const attn::Schedule configured = attn::parse_schedule(enum_name(c.attention.schedule));
  const int U = configured == attn::Schedule::ulysses ? P : static_cast<int>(c.parallel.ulysses_size);
  const attn::ScheduleEstimate mine = attn::estimate_schedule(configured, U, c.parallel.layout, a, P, topo);
  const std::vector<attn::ScheduleEstimate> all = attn::estimate_schedules(a, P, topo);
  std::string out = fmt::format(
      "attention per layer, forward + backward (cost model: {} ranks per node, links {:.0f} GB/s {:.0f} us inside a "
      "node and {:.0f} GB/s {:.0f} us across, {:.0f} TFLOP/s):\n",
      topo.ranks_per_node, topo.intra.bytes_per_second / 1e9, topo.intra.latency_seconds * 1e6,
      topo.inter.bytes_per_second / 1e9, topo.inter.latency_seconds * 1e6, topo.flops_per_second / 1e12);
  auto row = [&](const char* tag, const attn::ScheduleEstimate& e) {
    return fmt::format("  {:<10} {:<30} sent {:10.3f} MiB per rank, predicted {:10.3f} ms (transfers {:.3f} ms, "
                       "compute {:.3f} ms)\n",
                       tag, e.name, static_cast<double>(e.bytes_per_layer) / 1048576.0, e.seconds * 1e3,
                       e.comm_seconds * 1e3, e.compute_seconds * 1e3);
  };
  out += row("configured", mine);
  for (size_t i = 0; i < std::min<size_t>(3, all.size()); ++i) out += row(i == 0 ? "fastest" : "", all[i]);
  return out;
}

// model.init_from's weights into the model, converted to its precision, with progress on the log.
static void load_init_from(const TrainConfig& c, model::LlamaModel& model, bool log_progress) {
  const auto start = std::chrono::steady_clock::now();
  int last_tenth = -1;
  auto progress = [&](uint64_t done, uint64_t total) {
    const int tenth = total ? static_cast<int>(10 * done / total) : 10;
    if (!log_progress || tenth == last_tenth) return;
    last_tenth = tenth;
    spdlog::info("model.init_from: {:.0f}% of {:.2f} GiB read", 10.0 * tenth, static_cast<double>(total) / 1073741824.0);
  };
  const Arena& params = model.params();
  std::optional<Arena> host;
  if (params.device() != Device::cpu) host.emplace(host_mirror(params, false));
  const int threads = params.device() == Device::cpu && c.train.threads > 0 ? static_cast<int>(c.train.threads) : 0;
  model::SafetensorsLoadReport report =
      model::init_from_hf_directory(c.model.init_from, c.model, host ? *host : params, threads, progress);
  if (host) copy_arena(params, *host);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (log_progress)
    spdlog::info("model.init_from: loaded {} ({} parameters) in {:.2f} s{}", c.model.init_from,
                 c.model.num_parameters(), seconds,
                 report.ignored.empty() ? "" : fmt::format("; ignored {} tensor(s) the model does not use: {}",
                                                           report.ignored.size(), fmt::join(report.ignored, ", ")));
}

TrainSummary train(TrainConfig c, const std::string& resume, const TrainHooks& hooks) {
  // 1. Everything that can be wrong is checked before anything is created on disk.
  const model::Precision precision = precision_for(c);
  LT_CHECK(!c.data.train.empty(), "{}: data.train is empty: point it at a directory made by `longtrain prepare`",
           c.source);
  Ranks ranks = join_world(c);
  if (precision.device == Device::cpu) ops::set_cpu_threads(static_cast<int>(c.train.threads));
  // A resume that changes a refused key is an error before the data is opened (another vocabulary
  // or seq_len would otherwise fail there first, without naming what changed).
  std::optional<CheckpointRef> resume_from;
  if (!resume.empty()) resume_from = resolve_resume(c.checkpoint.dir, resume);
  std::optional<ResumePlan> resume_plan;
  if (resume_from) resume_plan = plan_resume(resume_from->path, c, ranks);
  data::Loader loader(loader_options(c, "train", ranks));
  if (c.eval.batches > 0) data::Loader probe_val(loader_options(c, "val", ranks));
  if (!c.model.init_from.empty() && !resume_from) {
    try {
      model::hf_weight_files(c.model.init_from);  // the weights are there (headers validated)
    } catch (const Error& e) {
      LT_FAIL("model.init_from '{}': {}", c.model.init_from, e.what());
    }
  }
  // Too little memory is an error now, naming the knobs, not an allocation failure mid-setup.
  const model::DeviceMemory device_free =
      hooks.device_memory ? *hooks.device_memory : model::device_memory(precision.device);
  const model::DeviceMemory host_free = precision.device == Device::cpu ? device_free : model::device_memory(Device::cpu);
  const model::MemoryChoice memory = plan_training_memory(c, ranks.world_size, device_free, host_free);
  const model::MemoryPlan& plan = memory.plan;
  // What the step log compares its allocated peak with: on a CPU run the offloaded copies (if any)
  // come out of the same memory the peak counts.
  const double plan_gib =
      static_cast<double>(plan.total() + (precision.device == Device::cpu ? plan.host_offload : 0)) / 1073741824.0;
  if (!memory.fits) {
    std::string detail = "the fit checks disagree (bug)";
    try {
      model::check_memory_fits(plan, device_free, &host_free);
    } catch (const Error& e) {
      detail = e.what();
    }
    LT_FAIL("{} [model.checkpoint {}, model.offload {}: {}]", detail,
            c.model.checkpoint ? model::checkpoint_policy_name(*c.model.checkpoint) : "auto",
            c.model.offload ? model::offload_name(*c.model.offload) : "auto", memory.reason);
  }
  reset_allocation_peak(precision.device);  // the step log's peak is this run's (a process may train twice)

  // 2. The run directory, its log and the resolved config: written by global rank 0 only.
  const fs::path run_dir = c.logging.run_dir;
  if (ranks.main) {
    fs::create_directories(run_dir);
    write_file_atomically(run_dir / "config.yaml", resolved_yaml(c));
  }
  auto log = make_logger(ranks.main ? run_dir / "train.log" : fs::path());
  spdlog::set_default_logger(log);
  std::optional<MetricsLog> metrics;
  if (ranks.main) metrics.emplace(run_dir / "metrics.jsonl");
  auto record = [&](const json& j) {
    if (metrics) metrics->write(j);
  };

  // Parameters are replicated; the optimizer state is sharded over every rank (ZeRO-1): rank r
  // updates the r-th equal slice of the flat parameter buffer and the slices are all-gathered.
  set_kernel_choices(c);
  model::LlamaModel model(c.model, precision, memory.policy, loader.local_len(), make_attention(c, ranks),
                          ranks.world_size, c.model.tiling, memory.offload);
  model.initialize(static_cast<uint64_t>(c.train.seed), c.model.init_std);
  model.set_rope_length(c.data.seq_len);  // what rope_scaling dynamic is computed for
  // model.init_from starts a new run from a Hugging Face directory's weights (step 0, fresh
  // optimizer). A resumed run continues from its own checkpoint and never reads them again.
  // Every rank reads the directory itself (memory-mapped, converted by all cores); no broadcast.
  if (!c.model.init_from.empty() && !resume_from) load_init_from(c, model, ranks.main);
  const int64_t shard = model.params().flat().numel() / ranks.world_size;
  AdamWConfig adamw = adamw_config(c);
  if (resume_plan) adamw.restart = resume_plan->restart;
  AdamW opt(model.params(), adamw, ranks.global_rank * shard, (ranks.global_rank + 1) * shard);
  RunState rs;
  if (resume_plan) {
    rs = restore_checkpoint(*resume_plan, model, opt, loader, ranks);
    log_resume(*log, *resume_plan, c, adamw);
  }

  const int64_t micro = c.train.batch_size * c.train.grad_accum;
  const int64_t tokens_per_step = micro * c.data.seq_len * ranks.dp_size;  // the whole world's
  const double flops_per_token = c.model.train_flops_per_token(c.data.seq_len);
  const size_t state_bytes = model.params().bytes() + model.grads().bytes() + opt.m().bytes() + opt.v().bytes() +
                             (opt.has_master() ? opt.master().bytes() : 0) + model.activation_bytes();
  log->info("longtrain: {} parameters ({:.2f} M), {} layers, dim {}, {} heads / {} kv heads, vocab {}",
            c.model.num_parameters(), c.model.num_parameters() / 1e6, c.model.n_layers, c.model.dim,
            c.model.n_heads, c.model.n_kv_heads, c.model.vocab_size);
  log->info("  device {} {}, checkpoint policy {}, seq_len {}, {} sequences per step ({} tokens), {} steps",
            enum_name(c.train.device), enum_name(c.train.dtype), model::checkpoint_policy_name(memory.policy),
            c.data.seq_len, micro * ranks.dp_size, tokens_per_step, c.train.steps);
  log->info("  memory: {}; {}{}; plan {:.2f} GiB per rank of {:.2f} GiB free", memory.reason,
            model::tiling_summary(model.tiling(), ranks.sp_size),
            model.offload_host_bytes() > 0
                ? fmt::format("; {:.2f} GiB of {}host memory for the offloaded checkpoints",
                              static_cast<double>(model.offload_host_bytes()) / 1073741824.0,
                              precision.device == Device::cuda ? "pinned " : "")
                : std::string(),
            static_cast<double>(plan.total()) / 1073741824.0, static_cast<double>(device_free.free) / 1073741824.0);
  log->info("  {} ranks (data parallel {} × sequence parallel {}, layout {}, attention {}, kernel {}, GEMM algorithm {}); {} training windows "
            "per epoch; model state {:.1f} MiB per rank; run directory {}",
            ranks.world_size, ranks.dp_size, ranks.sp_size, layout_name(c.parallel.layout),
            c.parallel.ulysses_size > 1 && c.parallel.ulysses_size < ranks.sp_size &&
                    c.attention.schedule != AttentionSchedule::ulysses
                ? fmt::format("ulysses {} x {} {}", c.parallel.ulysses_size, ranks.sp_size / c.parallel.ulysses_size,
                              enum_name(c.attention.schedule))
                : std::string(enum_name(c.attention.schedule)),
            precision.device == Device::cuda ? attn::kernel_policy_name(attn::kernel_policy()) : "cpu reference",
            precision.device == Device::cuda ? ops::gemm_algo_policy_name(ops::gemm_algo_policy()) : "cpu reference",
            loader.num_windows(), state_bytes / 1048576.0, run_dir.string());
  // train.cuda_graphs: only where every kernel of a micro-batch can be replayed as captured (one rank:
  // the gradient reduction's per-layer hooks and the schedules' transfers are host calls between them).
  // `auto` says nothing where graphs cannot run (every CPU run), `true` warns.
  const bool graphs_set = c.train.cuda_graphs == CudaGraphsChoice::on;
  const spdlog::level::level_enum graphs_off_level = graphs_set ? spdlog::level::warn : spdlog::level::info;
  bool graphs_used = false;
  if (c.train.cuda_graphs != CudaGraphsChoice::off) {
    std::string why_not;
    if (ranks.world_size > 1) why_not = fmt::format("{} ranks (CUDA graphs run on one rank for now)", ranks.world_size);
    else if (c.data.document_mask) why_not = "data.document_mask (the block pairs follow each batch's documents)";
    else why_not = model.set_cuda_graphs(true);
    graphs_used = why_not.empty();
    if (graphs_used) log->info("  CUDA graphs: each micro-batch's forward and backward replayed as one graph");
    else if (graphs_set) log->warn("  train.cuda_graphs is set but not used: {}", why_not);
  }
  for (int i = 0; loader.num_sources() > 1 && i < loader.num_sources(); ++i)
    log->info("  mixture source {}: {} (weight {:g}{}), {} windows per epoch", i, loader.source(i).path,
              loader.source(i).weight, loader.corpus(i).is_megatron() ? ", Megatron dataset" : "",
              loader.num_windows(i));

  TrainSummary summary;
  summary.run_dir = run_dir;
  summary.first_step = rs.step + 1;
  LossPlot plot;
  const bool tty = ranks.main && isatty(STDOUT_FILENO);
  const std::string title = fmt::format("{} — training loss", run_dir.filename().string());
  auto clear_bar = [&] {
    if (tty) fmt::print("\r\033[K");
  };

  auto run_eval = [&](int64_t step) {
    data::Loader val(loader_options(c, "val", ranks));
    // eval.batches counts windows of the whole job: the data-parallel replicas split them.
    const int64_t per_rank = std::max<int64_t>(1, c.eval.batches / ranks.dp_size);
    EvalResult e = evaluate(model, val, per_rank, c.eval.position_buckets, ranks.world_comm());
    std::string buckets;
    for (double b : e.bucket_loss) buckets += fmt::format(" {:.3f}", b);
    log->info("eval step {}: val loss {:.4f}, perplexity {:.2f} over {} tokens; by position bucket:{}", step, e.loss,
              e.perplexity, e.tokens, buckets);
    record({{"step", step}, {"val_loss", e.loss}, {"val_perplexity", e.perplexity}, {"val_tokens", e.tokens},
            {"val_loss_by_position", e.bucket_loss}});
    plot.add_val(step, e.loss);
    return e;
  };
  auto checkpoint = [&] {
    save_checkpoint(c, model, opt, loader, rs, ranks, summary.last_checkpoint);
  };

  // SIGTERM/SIGINT from here on: finish the step, checkpoint, return (the CLI exits kExitPreempted).
  const StopSignals stop_signals;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int64_t steps_timed = 0;
  std::vector<data::Batch> batches(static_cast<size_t>(micro));
  const Arena staging = shard_staging(precision.device, loader.local_len());
  // The step's sums stay on the device until its one host read: the loss (added by each micro-batch),
  // the squared gradient norm and the stop flag, reduced over the ranks in place.
  Arena step_sums("step sums", precision.device);
  step_sums.add("sums", {3}, DType::f64);
  step_sums.allocate();
  const Tensor sums_dev = step_sums.get("sums");
  bool graphs_off_logged = false;
  while (rs.step < c.train.steps) {
    const auto t0 = clock::now();
    // Attention forwards per layer and micro-batch this step: 1 under remat_aware and none, 2 under
    // full (the recomputation re-runs attention and its communication).
    const int64_t attention_forwards_before = model.attention().counters.forward_calls;
    const int64_t attention_bytes_before = model.attention().counters.bytes_sent;
    const attn::AttentionCounters attention_before = model.attention().counters;
    const int64_t step = rs.step + 1;
    // The loss is the mean over every valid label of the step on every rank: count them first.
    double count = 0;
    for (auto& b : batches) {
      b = loader.next();
      count += static_cast<double>(valid_labels(b));
    }
    ranks.sum(&count, 1);
    LT_CHECK(count > 0, "step {}: no valid label in the step's {} sequences", step, micro * ranks.dp_size);
    model.discard_grads();  // the first micro-batch's backward overwrites them
    zero(sums_dev);
    // Each rank's gradient is its share of the global one (its tokens, its data). They are summed
    // into the owners of the ZeRO-1 shards (rank r gets the sum over ranks of its shard, all the
    // optimizer needs) bucket by bucket during the last micro-batch's backward: each layer's range
    // is reduced as soon as its backward is done (the model's gradients-ready hook), on NCCL's
    // communication stream while the next layers' backward computes. Earlier micro-batches only
    // accumulate. The buckets together are one reduce_scatter of the flat buffer (communicator.h).
    const Tensor grads = model.grads().flat();
    const Tensor grad_shard = grads.narrow(0, opt.shard_begin(), shard);
    std::vector<std::unique_ptr<parallel::CollectiveWork>> reductions;
    // The hook refers to `reductions`: never left set past this step, even when backward throws.
    struct ClearGradientsReady {
      model::LlamaModel& m;
      ~ClearGradientsReady() { m.set_gradients_ready(nullptr); }
    } clear_hook{model};
    for (size_t i = 0; i < batches.size(); ++i) {
      if (ranks.dist && i + 1 == batches.size()) {
        model.set_gradients_ready([&](int64_t begin, int64_t end) {
          reductions.push_back(ranks.dist->world().start_reduce_scatter_range(grads, begin, end));
        });
      }
      model.forward_backward(shard_of(batches[i], model.config().vocab_size, &staging), 1.0 / count,
                             sums_dev.narrow(0, 0, 1));
      model.set_gradients_ready(nullptr);
      if (hooks.after_backward) {
        // What the test hook does to the gradients must come after the in-place reduction (NCCL runs
        // it on its own stream): wait first.
        for (auto& r : reductions) r->wait();
        hooks.after_backward(step, model);
      }
    }
    for (auto& r : reductions) r->wait();  // NCCL: the compute stream waits before reading the shard
    if (graphs_used) {
      const model::LlamaModel::GraphStats g = model.graph_stats();
      summary.graph_captures = g.captures;
      summary.graph_replays = g.replays;
      summary.graph_off_reason = g.off_reason;
      if (!graphs_off_logged && !g.off_reason.empty()) {
        log->log(graphs_off_level, "step {}: CUDA graphs are off from here on: {}", step, g.off_reason);
        graphs_off_logged = true;
      }
    }
    // A stop request rides on the step's one reduction, so every rank stops after the same step even
    // when the signal reached them on either side of it; then the step's one host read.
    ops::sum_into(sums_dev.narrow(0, 1, 1), grad_shard, ops::SumOf::squares, /*accumulate=*/false);
    double sums[3] = {0.0, 0.0, stop_signals.requested() ? 1.0 : 0.0};
    if (ranks.dist) {
      copy(sums_dev.narrow(0, 2, 1), Tensor(&sums[2], DType::f64, {1}));
      ranks.sum(sums_dev);
    }
    copy(Tensor(sums, DType::f64, {ranks.dist ? 3 : 2}), sums_dev.narrow(0, 0, ranks.dist ? 3 : 2));
    const bool stop_requested = sums[2] > 0;
    // With documents the attention work per rank follows where the documents fall: every rank's
    // pairs computed this step, and its measured idle fraction (host time inside attention not spent
    // in block calls: waiting for a busier rank's blocks), gathered for the log (one small reduction).
    std::vector<double> work;
    if (c.data.document_mask) {
      const attn::AttentionCounters& now = model.attention().counters;
      work.assign(static_cast<size_t>(3 * ranks.world_size), 0.0);
      const size_t me = static_cast<size_t>(3 * ranks.global_rank);
      work[me] = static_cast<double>(now.pairs - attention_before.pairs);
      work[me + 1] = now.compute_seconds - attention_before.compute_seconds;
      work[me + 2] = now.wall_seconds - attention_before.wall_seconds;
      ranks.sum(work.data(), static_cast<int64_t>(work.size()));
    }
    const double loss = sums[0] / count;
    const double norm = std::sqrt(sums[1]);
    rs.step = step;
    rs.tokens_seen += tokens_per_step;

    if (!std::isfinite(loss) || !std::isfinite(norm)) {
      rs.consecutive_skips += 1;
      rs.skipped_total += 1;
      summary.skipped_steps += 1;
      summary.losses.push_back(NAN);
      LT_CHECK(c.train.on_nonfinite == NonFinitePolicy::skip,
               "step {}: the {} is {} (train.on_nonfinite: stop); the update was not applied. Lower optim.lr, "
               "set optim.grad_clip, or resume from the last checkpoint",
               step, std::isfinite(loss) ? "gradient norm" : "loss", std::isfinite(loss) ? norm : loss);
      LT_CHECK(rs.consecutive_skips <= c.train.max_nonfinite_skips,
               "step {}: {} steps in a row had a non-finite loss or gradient (train.max_nonfinite_skips = {}); "
               "stopping",
               step, rs.consecutive_skips, c.train.max_nonfinite_skips);
      clear_bar();
      log->warn("step {}: non-finite {} ({}); update skipped ({} in a row)", step,
                std::isfinite(loss) ? "gradient norm" : "loss", std::isfinite(loss) ? norm : loss,
                rs.consecutive_skips);
      record({{"step", step}, {"skipped", true}});
    } else {
      rs.consecutive_skips = 0;
      AdamW::StepInfo info = opt.step_shard(model.params(), grad_shard, norm);
      if (ranks.dist) {  // every rank gets every updated shard: the replicas stay bit-identical
        const Tensor params = model.params().flat();
        ranks.dist->world().all_gather(params, params.narrow(0, opt.shard_begin(), shard));
      }
      summary.losses.push_back(loss);
      const double dt = std::chrono::duration<double>(clock::now() - t0).count();
      ++steps_timed;
      const double elapsed = std::chrono::duration<double>(clock::now() - start).count();
      const double tok_s = static_cast<double>(tokens_per_step) / dt;
      const double eta = elapsed / static_cast<double>(steps_timed) * static_cast<double>(c.train.steps - step);
      plot.add_train(step, loss);
      const double per_layer = static_cast<double>(c.model.n_layers * micro);
      const double attn_fwd =
          static_cast<double>(model.attention().counters.forward_calls - attention_forwards_before) / per_layer;
      // What this rank's attention sent per layer (sequence parallelism): full re-sends its forward
      // traffic in the recomputation, remat_aware does not.
      const double attn_mib =
          static_cast<double>(model.attention().counters.bytes_sent - attention_bytes_before) / per_layer / 1048576.0;
      // Everything longtrain has allocated on the training device at its most (runtime/device.h), against
      // the memory plan that was checked before the start.
      const double peak_gib = static_cast<double>(allocation_stats(precision.device).peak) / 1073741824.0;
      json attention_work;  // per global rank, with document masking
      std::string work_text;
      if (!work.empty()) {
        std::vector<double> pairs, idle;
        double max_pairs = 0, sum_pairs = 0;
        for (size_t r = 0; r < work.size() / 3; ++r) {
          pairs.push_back(work[3 * r]);
          idle.push_back(work[3 * r + 2] > 0 ? std::clamp(1.0 - work[3 * r + 1] / work[3 * r + 2], 0.0, 1.0) : 0.0);
          max_pairs = std::max(max_pairs, pairs.back());
          sum_pairs += pairs.back();
          work_text += fmt::format("{}{:.3g}M ({:.0f}% idle)", r ? ", " : "", pairs.back() / 1e6, 100 * idle.back());
        }
        // max / mean: 1 is perfect balance; the step waits for the busiest rank.
        const double imbalance = sum_pairs > 0 ? max_pairs * static_cast<double>(pairs.size()) / sum_pairs : 1.0;
        attention_work = {{"attention_pairs_per_rank", pairs},
                          {"attention_idle_fraction_per_rank", idle},
                          {"attention_imbalance", imbalance}};
        work_text = fmt::format("query-key pairs computed per rank {} (max/mean {:.2f})", work_text, imbalance);
      }
      json metrics = {{"step", step}, {"loss", loss}, {"lr", info.lr}, {"grad_norm", norm}, {"tokens_per_s", tok_s},
              {"attention_forwards_per_layer", attn_fwd}, {"attention_sent_mib_per_layer", attn_mib},
              {"allocated_peak_gib", peak_gib}, {"plan_gib", plan_gib},
              {"checkpoint", model::checkpoint_policy_name(memory.policy)}, {"offload", model::offload_name(memory.offload)},
              {"tflops", tok_s * flops_per_token / 1e12},
              {"tflops_per_gpu", tok_s * flops_per_token / 1e12 / ranks.world_size}, {"tokens_seen", rs.tokens_seen},
              {"elapsed_s", elapsed}};
      if (!attention_work.is_null()) metrics.update(attention_work);
      if (loader.num_sources() > 1) metrics["tokens_by_source"] = tokens_by_source(loader);
      record(metrics);
      if (step % c.logging.log_every == 0 || step == c.train.steps || step == summary.first_step) {
        clear_bar();
        // tok/s of the whole world; model TFLOP/s per rank (one GPU each on CUDA).
        log->info("step {:>5}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:.0f} tok/s | {:.3f} TFLOP/s per rank | "
                  "peak {:.2f} GiB (plan {:.2f}) | attn fwd/layer {:g}{} | ETA {}",
                  step, c.train.steps, loss, info.lr, norm, tok_s, tok_s * flops_per_token / 1e12 / ranks.world_size,
                  peak_gib,
                  plan_gib, attn_fwd,
                  ranks.sp_size > 1 ? fmt::format(", sent {:.1f} MiB/layer", attn_mib) : std::string(),
                  human_duration(eta));
        if (!work_text.empty()) log->info("step {:>5} document-masked attention: {}", step, work_text);
        if (loader.num_sources() > 1) log->info("  tokens by source: {}", source_shares(loader));
        if (ranks.main && c.logging.plot) plot.save(run_dir / "loss.svg", title);
      }
      if (tty) {
        const int width = 30, filled = static_cast<int>(width * step / c.train.steps);
        fmt::print("\r[{}{}] {}/{} loss {:.4f} ETA {}", std::string(static_cast<size_t>(filled), '#'),
                   std::string(static_cast<size_t>(width - filled), ' '), step, c.train.steps, loss,
                   human_duration(eta));
        std::fflush(stdout);
      }
    }
    if (c.eval.batches > 0 && c.eval.every > 0 && step % c.eval.every == 0 && step < c.train.steps) {
      clear_bar();
      run_eval(step);
    }
    const bool checkpointed = c.checkpoint.every > 0 && step % c.checkpoint.every == 0 && step < c.train.steps;
    if (checkpointed) {
      clear_bar();
      checkpoint();
    }
    if (stop_requested && step < c.train.steps) {
      clear_bar();
      const int sig = stop_signals.requested();
      if (!checkpointed) checkpoint();
      summary.stopped_by_signal = sig != 0 ? sig : SIGTERM;  // another rank's signal: SIGTERM by default
      summary.last_step = rs.step;
      log->warn("stopped by {} after step {} of {}: checkpoint {} written; continue with --resume auto (exit code "
                "{})",
                sig != 0 ? signal_name(sig) : "a signal another rank received", rs.step, c.train.steps,
                summary.last_checkpoint ? summary.last_checkpoint->string() : std::string("(on rank 0)"),
                parallel::kExitPreempted);
      record({{"step", rs.step}, {"stopped_by_signal", summary.stopped_by_signal}});
      return summary;
    }
  }
  clear_bar();
  summary.last_step = rs.step;
  if (c.eval.batches > 0) {
    summary.final_eval = run_eval(rs.step);
    // The baseline's train counts are of one corpus; a mixture has no single one.
    if (loader.num_sources() == 1) {
      data::Loader val(loader_options(c, "val", ranks));
      UnigramBaseline u = unigram_baseline(loader.corpus(), val.corpus());
      log->info("unigram baseline: train entropy {:.4f} nats, validation cross-entropy {:.4f} nats; model: {:.4f}",
                u.train_entropy, u.val_cross_entropy, summary.final_eval->loss);
    }
  }
  if (summary.first_step <= rs.step || !resume_from) checkpoint();
  if (ranks.main && c.logging.plot) plot.save(run_dir / "loss.svg", title);
  if (const model::LlamaModel::GraphStats g = model.graph_stats(); g.captures > 0)
    log->info("CUDA graphs: {} captured, {} micro-batches replayed, {} dropped (a buffer was freed, RoPE changed or "
              "the cache was full)",
              g.captures, g.replays, g.dropped);
  log->info("done: {} steps, {} skipped; run directory {}", rs.step, rs.skipped_total, run_dir.string());
  return summary;
}

}  // namespace longtrain::trainer