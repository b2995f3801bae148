#include "trainer/optimizer_state.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "model/safetensors.h"
#include "runtime/device.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;

namespace {

// m, v and (under bf16 parameters) the master weights: one flat entry each, shard-sized.
std::vector<Arena*> state_arenas(AdamW& opt) {
  std::vector<Arena*> out = {&opt.m(), &opt.v()};
  if (opt.has_master()) out.push_back(&opt.master());
  return out;
}

// The shard's elements of a state arena, on the host: the arena itself on the CPU, else a copy.
struct HostShard {
  Tensor view;
  std::vector<std::byte> storage;  // when the arena is on a device
};
HostShard host_shard(const Arena& a, int64_t n, bool copy_in) {
  HostShard h;
  const Tensor t = a.at(0).narrow(0, n);
  if (a.device() == Device::cpu) {
    h.view = t;
    return h;
  }
  h.storage.resize(t.nbytes());
  h.view = Tensor(h.storage.data(), t.dtype, {n});
  if (copy_in && n > 0) copy(h.view, t);
  return h;
}

int64_t metadata_int(const model::SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  LT_CHECK(it != f.metadata().end(), "{}: metadata '{}' is missing (not an optimizer shard written by longtrain)",
           f.path(), key);
  try {
    size_t used = 0;
    const int64_t v = std::stoll(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  LT_FAIL("{}: metadata '{}' is '{}', not an integer", f.path(), key, it->second);
}

}  // namespace

std::string optimizer_state_file(int rank) { return fmt::format("optimizer.rank{}.safetensors", rank); }

void save_optimizer_state(const fs::path& path, AdamW& opt, int world_size, int rank) {
  const int64_t n = opt.shard_end() - opt.shard_begin();
  std::vector<HostShard> host;
  std::vector<model::NamedTensor> tensors;
  for (Arena* a : state_arenas(opt)) {
    host.push_back(host_shard(*a, n, true));
    tensors.push_back({a->table()[0].name, host.back().view});
  }
  model::SafetensorsSaveOptions so;
  so.metadata = {{"world_size", std::to_string(world_size)},
                 {"rank", std::to_string(rank)},
                 {"shard_begin", std::to_string(opt.shard_begin())},
                 {"shard_end", std::to_string(opt.shard_end())}};
  model::save_safetensors(path.string(), tensors, so);
}

SavedOptimizerLayout load_optimizer_state(const fs::path& dir, AdamW& opt, int64_t buffer_numel) {
  SavedOptimizerLayout out;
  const fs::path first = dir / optimizer_state_file(0);
  LT_CHECK(fs::exists(first), "cannot resume from {}: it has no optimizer state ({} is missing)", dir.string(),
           first.filename().string());
  std::map<int, std::unique_ptr<model::SafetensorsFile>> open;
  auto file = [&](int k) -> const model::SafetensorsFile& {
    auto it = open.find(k);
    if (it != open.end()) return *it->second;
    const fs::path p = dir / optimizer_state_file(k);
    LT_CHECK(fs::exists(p),
             "cannot resume from {}: it was written by {} ranks but its optimizer shard of rank {} ({}) is missing",
             dir.string(), out.world_size, k, p.filename().string());
    auto f = std::make_unique<model::SafetensorsFile>(p.string());
    LT_CHECK(metadata_int(*f, "world_size") == out.world_size && metadata_int(*f, "rank") == k &&
                 metadata_int(*f, "shard_begin") == k * out.shard_numel &&
                 metadata_int(*f, "shard_end") == (k + 1) * out.shard_numel,
             "cannot resume from {}: {} does not hold shard {} of {} equal shards of {} elements (its metadata: "
             "world_size {}, rank {}, [{}, {}))",
             dir.string(), p.filename().string(), k, out.world_size, out.shard_numel,
             metadata_int(*f, "world_size"), metadata_int(*f, "rank"), metadata_int(*f, "shard_begin"),
             metadata_int(*f, "shard_end"));
    return *open.emplace(k, std::move(f)).first->second;
  };
  {
    model::SafetensorsFile f0(first.string());
    out.world_size = static_cast<int>(metadata_int(f0, "world_size"));
    out.shard_numel = metadata_int(f0, "shard_end") - metadata_int(f0, "shard_begin");
    LT_CHECK(out.world_size >= 1 && out.shard_numel >= 0, "cannot resume from {}: {} records world_size {} and a "
             "shard of {} elements", dir.string(), first.filename().string(), out.world_size, out.shard_numel);
  }
  const int64_t saved_total = out.shard_numel * out.world_size;
  const int64_t begin = opt.shard_begin(), end = opt.shard_end(), n = end - begin;
  std::vector<Arena*> arenas = state_arenas(opt);
  std::vector<HostShard> host;
  for (Arena* a : arenas) {
    host.push_back(host_shard(*a, n, false));
    // Positions past the saved buffer are padding: zero state.
    std::memset(host.back().view.data, 0, host.back().view.nbytes());
  }
  // The saved shards that overlap [begin, end): a byte copy of each overlap.
  const int64_t s = std::max<int64_t>(out.shard_numel, 1);
  for (int64_t k = begin / s; out.shard_numel > 0 && k < out.world_size && k * s < end; ++k) {
    const model::SafetensorsFile& f = file(static_cast<int>(k));
    const int64_t lo = std::max(begin, k * s), hi = std::min(end, (k + 1) * s);
    if (lo >= hi) continue;
    ++out.files_read;
    for (size_t i = 0; i < arenas.size(); ++i) {
      const std::string& name = arenas[i]->table()[0].name;
      const model::SafetensorsTensor* t = f.find(name);
      LT_CHECK(t, "cannot resume from {}: {} has no tensor '{}' (it was trained with another precision: resume "
               "with its train.dtype and train.device)", dir.string(), fs::path(f.path()).filename().string(), name);
      const DType dt = host[i].view.dtype;
      LT_CHECK(t->dtype == model::safetensors_dtype_name(dt) && t->numel == out.shard_numel,
               "cannot resume from {}: tensor '{}' of {} is {} with {} elements; this run keeps {} with {} per saved "
               "shard (another precision: resume with its train.dtype)", dir.string(), name,
               fs::path(f.path()).filename().string(), t->dtype, t->numel, model::safetensors_dtype_name(dt),
               out.shard_numel);
      const size_t elem = dtype_size(dt);
      std::memcpy(static_cast<std::byte*>(host[i].view.data) + static_cast<size_t>(lo - begin) * elem,
                  t->data + static_cast<size_t>(lo - k * s) * elem, static_cast<size_t>(hi - lo) * elem);
    }
  }
  // Saved state past this run's buffer must be padding (zero): otherwise the checkpoint is another
  // model's. The rank whose shard ends the buffer checks the saved tail.
  if (end == buffer_numel && saved_total > buffer_numel) {
    for (int64_t k = buffer_numel / s; k < out.world_size; ++k) {
      const model::SafetensorsFile& f = file(static_cast<int>(k));
      for (Arena* a : arenas) {
        const model::SafetensorsTensor* t = f.find(a->table()[0].name);
        LT_CHECK(t, "cannot resume from {}: {} has no tensor '{}'", dir.string(),
                 fs::path(f.path()).filename().string(), a->table()[0].name);
        const size_t elem = dtype_size(a->at(0).dtype);
        const int64_t lo = std::max(buffer_numel, k * s) - k * s;
        for (size_t b = static_cast<size_t>(lo) * elem; b < static_cast<size_t>(out.shard_numel) * elem; ++b)
          LT_CHECK(t->data[b] == std::byte{0},
                   "cannot resume from {}: its optimizer state has {} elements, this run's parameters {}, and the "
                   "state beyond them is not padding: it is another model's",
                   dir.string(), saved_total, buffer_numel);
      }
    }
  }
  for (size_t i = 0; i < arenas.size(); ++i)
    if (arenas[i]->device() != Device::cpu && n > 0) copy(arenas[i]->at(0).narrow(0, n), host[i].view);
  return out;
}

}  // namespace longtrain::trainer
