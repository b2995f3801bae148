#include "trainer/run_setup.h"

#include <cmath>
#include <fstream>
#include <iterator>

#include "data/mixture.h"
#include "parallel/process_group.h"
#include "runtime/device.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;

model::Precision precision_for(const TrainConfig& c) {
  if (c.train.device == DeviceChoice::cuda) return model::Precision::cuda_mixed(c.train.grad_dtype == DTypeChoice::f32);
  return model::Precision::cpu(c.train.dtype == DTypeChoice::f64 ? DType::f64 : DType::f32);
}

Arena host_mirror(const Arena& a, bool copy_in) {
  Arena h(a.kind() + " (host)", Device::cpu);
  for (const ArenaEntry& e : a.table()) h.add(e.name, e.shape, e.dtype);
  h.allocate();
  if (copy_in)
    for (size_t i = 0; i < a.table().size(); ++i) copy(h.at(i), a.at(i));
  return h;
}

void copy_arena(const Arena& dst, const Arena& src) {
  for (size_t i = 0; i < src.table().size(); ++i) copy(dst.at(i), src.at(i));
}

AdamWConfig adamw_config(const TrainConfig& c) {
  AdamWConfig a;
  a.lr = c.optim.lr;
  a.min_lr = c.optim.min_lr;
  a.beta1 = c.optim.beta1;
  a.beta2 = c.optim.beta2;
  a.eps = c.optim.eps;
  a.weight_decay = c.optim.weight_decay;
  a.warmup_steps = c.optim.warmup_steps;
  a.total_steps = c.train.steps;
  a.schedule = c.optim.schedule;
  a.grad_clip = c.optim.grad_clip;
  a.no_decay = c.optim.no_decay;
  return a;
}

Ranks join_world(const TrainConfig& c) {
  Ranks r;
  const parallel::WorldInfo w = parallel::world_from_env();
  r.sp_size = static_cast<int>(c.parallel.sp_size);
  const bool gpu = c.train.device == DeviceChoice::cuda;
  if (gpu) select_cuda_device(w.local_rank);  // one GPU per rank, before any allocation
  if (w.world_size == 1) {
    LT_CHECK(r.sp_size == 1,
             "parallel.sp_size is {} but this is a single process: launch {} processes per sequence-parallel group "
             "with `longtrain-run --nproc-per-node {} longtrain train ...`",
             r.sp_size, r.sp_size, r.sp_size);
    return r;
  }
  parallel::DistributedOptions o;
  o.sp_size = r.sp_size;
  o.ulysses_size = static_cast<int>(c.parallel.ulysses_size);
  o.backend = gpu ? parallel::Backend::nccl : parallel::Backend::gloo;
  o.timeout = parallel::Millis(static_cast<int64_t>(c.parallel.timeout_s * 1000));
  o.store_timeout = parallel::Millis(static_cast<int64_t>(c.parallel.store_timeout_s * 1000));
  r.dist = std::make_unique<parallel::Distributed>(w, parallel::options_from_env(o));
  r.world_size = w.world_size;
  r.global_rank = w.rank;
  r.main = w.rank == 0;
  r.sp_rank = r.dist->sp().rank();
  r.dp_rank = r.dist->dp().rank();
  r.dp_size = r.dist->dp().size();
  return r;
}

void set_kernel_choices(const TrainConfig& c) {
  attn::set_kernel_policy_unless_overridden(c.attention.kernel);
  ops::set_gemm_algo_policy_unless_overridden(c.train.gemm_algorithm);
}

std::unique_ptr<attn::SequenceAttention> make_attention(const TrainConfig& c, const Ranks& r) {
  attn::SequenceAttentionSpec spec;
  spec.schedule = attn::parse_schedule(enum_name(c.attention.schedule));
  spec.causal = c.attention.causal;
  spec.scale = 1.0 / std::sqrt(static_cast<double>(c.model.head_dim));
  spec.layout = c.parallel.layout;
  if (r.dist && r.sp_size > 1) {
    spec.sp = &r.dist->sp();
    spec.intra_node = &r.dist->intra_node();
    spec.inter_node = &r.dist->inter_node();
    spec.ulysses = r.dist->ulysses();  // null unless 1 < parallel.ulysses_size < sp_size
    spec.ulysses_ring = r.dist->ulysses_ring();
    spec.ulysses_ring_intra_node = r.dist->ulysses_ring_intra_node();  // null unless that ring spans nodes
    spec.ulysses_ring_inter_node = r.dist->ulysses_ring_inter_node();
    if (c.parallel.ulysses_size == r.sp_size && c.attention.schedule != AttentionSchedule::ulysses) {
      // Ulysses over the whole group and no ring across groups: the ulysses schedule.
      spec.schedule = attn::Schedule::ulysses;
    }
  }
  return attn::make_sequence_attention(spec);
}

data::LoaderOptions loader_options(const TrainConfig& c, const std::string& split, const Ranks& r) {
  data::LoaderOptions o;
  o.shard_dir = split == "val" && !c.data.val.empty() ? c.data.val : c.data.train;
  if (split == "val" && c.data.val.empty()) {
    // Only a shard set has a validation split of its own.
    const std::vector<data::DataSource> sources = data::parse_data_sources(c.data.train);
    LT_CHECK(sources.size() == 1, "{}: data.train is a mixture of {} sources and data.val is empty: set data.val to "
             "a validation shard directory or Megatron dataset (or eval.batches: 0)", c.source, sources.size());
    LT_CHECK(data::megatron_prefix(sources[0].path).empty(),
             "{}: data.train '{}' is a Megatron dataset, which has no validation split, and data.val is empty: set "
             "data.val (or eval.batches: 0)", c.source, sources[0].path);
  }
  o.split = split;
  o.seq_len = c.data.seq_len;
  o.seed = static_cast<uint64_t>(c.train.seed);
  o.dp_rank = r.dp_rank;
  o.dp_size = r.dp_size;
  o.sp_rank = r.sp_rank;
  o.sp_size = r.sp_size;
  o.layout = c.parallel.layout;
  o.prefetch = split == "train" ? static_cast<int>(c.data.prefetch) : 0;
  o.vocab_size = c.model.vocab_size;
  o.document_mask = c.data.document_mask;  // training and eval alike
  return o;
}

static_assert(data::kIgnoreLabel == model::LlamaModel::kIgnoreIndex, "the loader's ignored label is the model's");
model::TokenShard shard_of(data::Batch& b, int64_t vocab, const Arena* staging) {
  const int64_t n = static_cast<int64_t>(b.tokens.size());
  attn::Documents docs = b.document_mask ? attn::documents_from_starts(b.doc_starts, b.seq_len) : attn::Documents{};
  model::TokenShard host{Tensor(b.tokens.data(), DType::i32, {n}), Tensor(b.labels.data(), DType::i32, {n}),
                         Tensor(b.positions.data(), DType::i32, {n}), docs};
  host.valid_labels = model::check_token_ids(host.tokens, host.labels, vocab, model::LlamaModel::kIgnoreIndex);
  if (!staging || staging->device() == Device::cpu) return host;
  model::TokenShard dev{staging->get("tokens").narrow(0, n), staging->get("labels").narrow(0, n),
                        staging->get("positions").narrow(0, n), std::move(docs), host.valid_labels};
  copy(dev.tokens, host.tokens);
  copy(dev.labels, host.labels);
  copy(dev.positions, host.positions);
  return dev;
}

Arena shard_staging(Device device, int64_t T) {
  Arena a("token staging", device);
  for (const char* name : {"tokens", "labels", "positions"}) a.add(name, {T}, DType::i32);
  a.allocate();
  return a;
}

std::vector<double> host_values(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f64) {
    copy(Tensor(out.data(), DType::f64, {t.numel()}), t);
  } else {
    std::vector<float> tmp(out.size());
    copy(Tensor(tmp.data(), DType::f32, {t.numel()}), t);
    std::copy(tmp.begin(), tmp.end(), out.begin());
  }
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  LT_CHECK(in.good(), "cannot read {}", p.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace longtrain::trainer
