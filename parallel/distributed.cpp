#include "parallel/distributed.h"

#ifdef LONGTRAIN_HAS_CUDA
#include "parallel/nccl_communicator.h"
#endif

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>

#include "runtime/error.h"

namespace longtrain::parallel {

namespace {

int parse_int(const char* name, std::string_view value) {
  int v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  LT_CHECK(ec == std::errc() && end == value.data() + value.size(), "environment variable {}='{}' is not an integer",
           name, value);
  return v;
}

}  // namespace

std::string first_host_of_nodelist(std::string_view list) {
  LT_CHECK(!list.empty(), "the Slurm node list is empty");
  // The first entry ends at the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < list.size(); ++end) {
    if (list[end] == '[') ++depth;
    if (list[end] == ']') --depth;
    if (list[end] == ',' && depth == 0) break;
  }
  std::string_view first = list.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string_view::npos) return std::string(first);
  const size_t close = first.find(']', open);
  LT_CHECK(close != std::string_view::npos, "malformed Slurm node list '{}': '[' without ']'", list);
  // "node[03-05,9]" -> prefix "node", first range "03-05" -> "03" (zero padding kept).
  std::string_view ranges = first.substr(open + 1, close - open - 1);
  std::string_view first_range = ranges.substr(0, ranges.find(','));
  std::string_view first_number = first_range.substr(0, first_range.find('-'));
  LT_CHECK(!first_number.empty(), "malformed Slurm node list '{}'", list);
  return std::string(first.substr(0, open)) + std::string(first_number) + std::string(first.substr(close + 1));
}

int first_tasks_per_node(std::string_view s) {
  std::string_view head = s.substr(0, s.find_first_of("(,"));
  return parse_int("SLURM_NTASKS_PER_NODE", head);
}

WorldInfo world_from_env(const EnvLookup& env) {
  auto get = [&](const char* name) -> std::optional<std::string_view> {
    const char* v = env(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string_view(v);
  };
  auto require = [&](const char* name, const char* why) -> std::string_view {
    auto v = get(name);
    LT_CHECK(v.has_value(), "environment variable {} is not set, but {}; launch with longtrain-run (or torchrun), "
             "which sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT together",
             name, why);
    return *v;
  };

  WorldInfo w;
  if (get("RANK")) {
    w.source = "torchrun";
    w.rank = parse_int("RANK", *get("RANK"));
    w.world_size = parse_int("WORLD_SIZE", require("WORLD_SIZE", "RANK is"));
    w.local_rank = parse_int("LOCAL_RANK", require("LOCAL_RANK", "RANK is"));
    w.local_world_size = parse_int("LOCAL_WORLD_SIZE", require("LOCAL_WORLD_SIZE", "RANK is"));
    if (w.world_size > 1) {
      w.master_addr = std::string(require("MASTER_ADDR", "WORLD_SIZE > 1"));
      w.master_port = parse_int("MASTER_PORT", require("MASTER_PORT", "WORLD_SIZE > 1"));
    }
  } else if (get("SLURM_PROCID")) {
    w.source = "slurm";
    const char* why = "SLURM_PROCID is (srun without longtrain-run)";
    w.rank = parse_int("SLURM_PROCID", *get("SLURM_PROCID"));
    w.world_size = parse_int("SLURM_NTASKS", require("SLURM_NTASKS", why));
    w.local_rank = parse_int("SLURM_LOCALID", require("SLURM_LOCALID", why));
    auto per_node = get("SLURM_NTASKS_PER_NODE");
    if (!per_node) per_node = get("SLURM_TASKS_PER_NODE");
    LT_CHECK(per_node.has_value(),
             "under Slurm without longtrain-run, SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE) must say how many "
             "ranks each node runs; pass --ntasks-per-node to srun");
    w.local_world_size = first_tasks_per_node(*per_node);
    if (auto addr = get("MASTER_ADDR")) {
      w.master_addr = std::string(*addr);
    } else {
      auto nodes = get("SLURM_JOB_NODELIST");
      if (!nodes) nodes = get("SLURM_NODELIST");
      LT_CHECK(nodes.has_value(), "under Slurm, MASTER_ADDR or SLURM_JOB_NODELIST must name the node of rank 0");
      w.master_addr = first_host_of_nodelist(*nodes);
    }
    if (auto port = get("MASTER_PORT")) w.master_port = parse_int("MASTER_PORT", *port);
  }

  LT_CHECK(w.world_size >= 1, "WORLD_SIZE {} must be at least 1", w.world_size);
  LT_CHECK(w.rank >= 0 && w.rank < w.world_size, "RANK {} is outside [0, WORLD_SIZE {})", w.rank, w.world_size);
  LT_CHECK(w.local_world_size >= 1 && w.local_world_size <= w.world_size,
           "LOCAL_WORLD_SIZE {} must be in [1, WORLD_SIZE {}]", w.local_world_size, w.world_size);
  LT_CHECK(w.local_rank >= 0 && w.local_rank < w.local_world_size, "LOCAL_RANK {} is outside [0, LOCAL_WORLD_SIZE {})",
           w.local_rank, w.local_world_size);
  LT_CHECK(w.local_rank == w.rank % w.local_world_size,
           "LOCAL_RANK {} does not match RANK {} with {} ranks per node (expected {}): ranks must be numbered node by "
           "node, as longtrain-run and torchrun do",
           w.local_rank, w.rank, w.local_world_size, w.rank % w.local_world_size);
  LT_CHECK(w.master_port > 0 && w.master_port <= 65535, "MASTER_PORT {} is outside [1, 65535]", w.master_port);
  return w;
}

WorldInfo world_from_env() {
  return world_from_env([](const char* name) { return std::getenv(name); });
}

DistributedOptions options_from_env(DistributedOptions o) {
  auto seconds = [](const char* name, Millis fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    double s = std::strtod(v, &end);
    LT_CHECK(end != v && *end == '\0' && s > 0 && std::isfinite(s),
             "environment variable {}='{}' must be a positive number of seconds", name, v);
    return Millis(static_cast<int64_t>(s * 1000.0));
  };
  o.timeout = seconds("LONGTRAIN_TIMEOUT_S", o.timeout);
  o.connect_timeout = seconds("LONGTRAIN_CONNECT_TIMEOUT_S", o.connect_timeout);
  o.store_timeout = seconds("LONGTRAIN_STORE_TIMEOUT_S", o.store_timeout);
  return o;
}

namespace {

ParallelShape checked_shape(const WorldInfo& w, int sp_size, int ulysses_size) {
  ParallelShape s{w.world_size, w.local_world_size, sp_size, ulysses_size};
  check_parallel_shape(s);
  return s;
}

StoreOptions store_options(const WorldInfo& w, const DistributedOptions& o) {
  StoreOptions s;
  s.host = w.master_addr;
  // Nobody else connects to a single-process world: let the kernel pick a free port.
  s.port = w.world_size == 1 ? 0 : w.master_port;
  s.is_server = w.rank == 0;
  s.timeout = o.timeout;
  s.connect_timeout = o.connect_timeout;
  s.liveness_timeout = o.store_timeout;
  s.rank = w.rank;
  s.world_size = w.world_size;
  s.on_peer_failure = o.on_peer_failure;
  return s;
}

// NCCL communicators live on the calling thread's current GPU: make it this rank's first.
ProcessGroups create_groups(const WorldInfo& w, const DistributedOptions& o, TcpStore& store,
                            const ParallelShape& shape) {
#ifdef LONGTRAIN_HAS_CUDA
  if (o.backend == Backend::nccl) select_local_cuda_device(w.local_rank, w.local_world_size);
#endif
  return create_process_groups(o.backend, store, shape, w.rank, CommOptions{o.timeout});
}

}  // namespace

Distributed::Distributed(const WorldInfo& world, DistributedOptions options)
    : world_(world),
      shape_(checked_shape(world, options.sp_size, options.ulysses_size)),
      store_(store_options(world, options)),
      groups_(create_groups(world, options, store_, shape_)) {}

}  // namespace longtrain::parallel
