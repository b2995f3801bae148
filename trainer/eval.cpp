#include "trainer/eval.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <span>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/hf_export.h"
#include "model/safetensors.h"
#include "trainer/checkpoint.h"
#include "trainer/run_checkpoint.h"
#include "trainer/run_setup.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

EvalResult evaluate(model::LlamaModel& model, data::Loader& loader, int64_t batches, int64_t buckets,
                    parallel::Communicator* world) {
  const int64_t total = loader.steps_per_epoch();
  const int64_t n = batches <= 0 || batches > total ? total : batches;
  LT_CHECK(n > 0, "evaluation: the validation split of {} has no complete window of {} tokens",
           loader.options().shard_dir, loader.options().seq_len + 1);
  const int64_t S = loader.options().seq_len, B = std::max<int64_t>(1, buckets);
  // sums[0] = Σ loss, sums[1] = tokens, then per bucket: Σ loss, tokens (f64: exact counts, one
  // all-reduce for everything).
  std::vector<double> sums(static_cast<size_t>(2 + 2 * B), 0.0);
  const int64_t T = loader.local_len();
  Arena losses("eval losses", model.precision().device);
  losses.add("losses", {T}, model.precision().stat);
  losses.allocate();
  const Arena staging = shard_staging(model.precision().device, T);
  for (int64_t i = 0; i < n; ++i) {
    data::Batch b = loader.next();
    model.forward(shard_of(b, model.config().vocab_size, &staging), losses.get("losses"));
    std::vector<double> per_token = host_values(losses.get("losses"));
    for (size_t t = 0; t < per_token.size(); ++t) {
      if (b.labels[t] == model::LlamaModel::kIgnoreIndex) continue;
      const size_t bucket = static_cast<size_t>(static_cast<int64_t>(b.positions[t]) * B / S);
      sums[0] += per_token[t];
      sums[1] += 1;
      sums[2 + 2 * bucket] += per_token[t];
      sums[3 + 2 * bucket] += 1;
    }
  }
  if (world) parallel::all_reduce_host_values(*world, sums.data(), static_cast<int64_t>(sums.size()));
  EvalResult r;
  r.tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.tokens ? sums[0] / sums[1] : NAN;
  r.perplexity = std::exp(r.loss);
  for (int64_t k = 0; k < B; ++k) {
    const double cnt = sums[static_cast<size_t>(3 + 2 * k)];
    r.bucket_loss.push_back(cnt > 0 ? sums[static_cast<size_t>(2 + 2 * k)] / cnt : NAN);
    r.bucket_tokens.push_back(static_cast<int64_t>(cnt));
  }
  return r;
}

UnigramBaseline unigram_baseline(const data::TokenCorpus& train, const data::TokenCorpus& val) {
  const int64_t V = train.vocab_size();
  auto count = [V](const data::TokenCorpus& corpus) {
    std::vector<int64_t> counts(static_cast<size_t>(V), 0);
    std::vector<int32_t> chunk(1 << 20);
    for (int64_t start = 0; start < corpus.num_tokens(); start += static_cast<int64_t>(chunk.size())) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), corpus.num_tokens() - start);
      corpus.read(start, std::span<int32_t>(chunk.data(), static_cast<size_t>(n)));
      for (int64_t i = 0; i < n; ++i) counts[static_cast<size_t>(chunk[static_cast<size_t>(i)])]++;
    }
    return counts;
  };
  const std::vector<int64_t> tc = count(train), vc = count(val);
  const double n = static_cast<double>(train.num_tokens());
  UnigramBaseline b;
  double val_total = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    const double c = static_cast<double>(tc[static_cast<size_t>(v)]);
    if (c > 0) b.train_entropy -= c / n * std::log(c / n);
    const double p = (c + 1.0) / (n + static_cast<double>(V));
    b.val_cross_entropy -= static_cast<double>(vc[static_cast<size_t>(v)]) * std::log(p);
    val_total += static_cast<double>(vc[static_cast<size_t>(v)]);
  }
  b.val_cross_entropy /= std::max(1.0, val_total);
  return b;
}

parallel::Communicator* LoadedModel::world() const { return dist ? &dist->world() : nullptr; }

data::LoaderOptions eval_loader_options(const LoadedModel& m, const std::string& shard_dir) {
  Ranks r;
  r.dp_rank = m.dp_rank, r.dp_size = m.dp_size, r.sp_rank = m.sp_rank, r.sp_size = m.sp_size;
  TrainConfig c = m.config;
  c.data.val = shard_dir;  // the data to evaluate, whatever the run trained on (a plain HF directory: none)
  return loader_options(c, "val", r);
}

LoadedModel load_model_from_checkpoint(const fs::path& dir, int64_t max_tokens, Device device,
                                       const std::vector<std::string>& overrides, int64_t sp_size) {
  LT_CHECK(fs::is_directory(dir), "checkpoint {} is not a directory", dir.string());
  LoadedModel out;
  const bool ours = fs::exists(dir / kCheckpointManifest) || fs::exists(dir / kConfigFile);
  // The config with `extra` overrides on top of the caller's.
  std::function<TrainConfig(const std::vector<std::string>&)> load;
  if (ours) {
    std::string problem = verify_checkpoint(dir);
    LT_CHECK(problem.empty(), "checkpoint {} is incomplete or damaged: {}", dir.string(), problem);
    // The resolved config names every shape key; its model.init_from is history, not read again
    // (the directory may be gone).
    load = [&](const std::vector<std::string>& extra) {
      std::vector<std::string> o = {"model.init_from="};
      o.insert(o.end(), overrides.begin(), overrides.end());
      o.insert(o.end(), extra.begin(), extra.end());
      return load_config((dir / kConfigFile).string(), o);
    };
    json state = json::parse(read_text(dir / kTrainerState));
    out.step = state.at("step").get<int64_t>();
  } else {
    // A plain Hugging Face Llama directory (config.json + safetensors): the config is the defaults with
    // the directory's model, evaluated at its max_position_embeddings unless the caller says otherwise.
    LT_CHECK(fs::is_regular_file(dir / "config.json"),
             "{} is neither a longtrain checkpoint (no {}) nor a Hugging Face directory (no config.json)",
             dir.string(), kCheckpointManifest);
    const model::HfLlamaConfig hf = model::read_hf_config((dir / "config.json").string());
    const std::string yaml =
        fmt::format("model:\n  init_from: {}\ndata:\n  train: {}\n  seq_len: {}\neval:\n  position_buckets: {}\n",
                    json(dir.string()).dump(), json(dir.string()).dump(), hf.model.max_seq_len,
                    std::min<int64_t>(8, hf.model.max_seq_len));
    load = [&, yaml](const std::vector<std::string>& extra) {
      std::vector<std::string> o = overrides;
      o.insert(o.end(), extra.begin(), extra.end());
      TrainConfig c = config_from_yaml_string(yaml, o, (dir / "config.json").string());
      c.data.train.clear();  // no data of its own: eval needs --data
      return c;
    };
  }
  out.config = load({});
  const int64_t T = max_tokens > 0 ? max_tokens : out.config.data.seq_len;
  // The job: one process is one rank whatever the checkpoint was trained on. Under longtrain-run the
  // ranks form groups of sp_size (0: all of them), and the config is validated again for the run as it
  // will happen (T tokens over the group, which may exceed the trained length: extrapolation); the
  // trained max_seq_len is kept for the caller.
  const int world_size = parallel::world_from_env().world_size;
  if (world_size == 1) {
    LT_CHECK(sp_size <= 1, "sequence parallelism over {} ranks needs that many processes: run under longtrain-run",
             sp_size);
    out.config.parallel.sp_size = 1;
  } else {
    const int64_t trained_max = out.config.model.max_seq_len;
    out.config = load({fmt::format("parallel.sp_size={}", sp_size > 0 ? sp_size : world_size),
                       fmt::format("data.seq_len={}", T), fmt::format("model.max_seq_len={}", std::max(trained_max, T)),
                       fmt::format("eval.position_buckets={}", std::min(out.config.eval.position_buckets, T))});
    out.config.model.max_seq_len = trained_max;
  }
  out.config.train.device = device == Device::cuda ? DeviceChoice::cuda : DeviceChoice::cpu;
  out.config.train.dtype = device == Device::cuda ? DTypeChoice::bf16 : DTypeChoice::f32;
  Ranks ranks = join_world(out.config);
  if (ranks.sp_size > 1) check_layout(out.config.parallel.layout, T, ranks.sp_size);
  set_kernel_choices(out.config);
  out.model = std::make_unique<model::LlamaModel>(out.config.model, precision_for(out.config),
                                                  model::CheckpointPolicy::none, T / ranks.sp_size,
                                                  make_attention(out.config, ranks), 1, out.config.model.tiling);
  out.model->set_rope_length(T);
  out.dp_rank = ranks.dp_rank, out.dp_size = ranks.dp_size, out.sp_rank = ranks.sp_rank, out.sp_size = ranks.sp_size;
  out.main = ranks.main;
  out.dist = std::move(ranks.dist);
  const Arena& params = out.model->params();
  std::optional<Arena> host;
  if (params.device() != Device::cpu) host.emplace(host_mirror(params, false));
  if (ours)
    model::load_safetensors((dir / "model.safetensors").string(), host ? *host : params, model::ExtraTensors::error,
                            device == Device::cuda ? model::DTypeConversion::rounding : model::DTypeConversion::exact);
  else
    model::init_from_hf_directory(dir.string(), out.config.model, host ? *host : params);
  if (host) copy_arena(params, *host);
  return out;
}

}  // namespace longtrain::trainer
