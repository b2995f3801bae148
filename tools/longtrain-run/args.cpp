#include "args.h"

#include <climits>
#include <cstdint>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "parallel/distributed.h"

namespace longtrain::launcher {

namespace {

ParseResult error(const std::string& line) {
  ParseResult r;
  r.exit_code = 1;
  r.err = "error: " + line;
  return r;
}

// A whole decimal int from the environment, or an error naming the variable.
std::optional<int> env_int(const char* name, const char* value, std::string& problem) {
  try {
    size_t used = 0;
    const int v = std::stoi(value, &used);
    if (used == std::string(value).size()) return v;
  } catch (const std::exception&) {
  }
  problem = fmt::format("environment variable {}='{}' is not an integer", name, value);
  return std::nullopt;
}

}  // namespace

ParseResult parse_args(int argc, const char* const* argv, const EnvLookup& env_raw) {
  const auto env = [&](const char* name) -> const char* {
    const char* v = env_raw(name);
    return v && *v ? v : nullptr;
  };
  Args a;
  CLI::App app{"longtrain-run: start the ranks of a longtrain job on this node (torchrun's flags)"};
  app.prefix_command();
  auto* o_nnodes = app.add_option("--nnodes", a.nnodes, "number of nodes (launchers)");
  app.add_option("--nproc-per-node,--nproc_per_node", a.nproc_per_node, "ranks on this node");
  auto* o_node_rank = app.add_option("--node-rank,--node_rank", a.node_rank, "this node's rank in [0, nnodes)");
  auto* o_addr =
      app.add_option("--master-addr,--master_addr", a.master_addr, "address of node 0 (rank 0 serves the store)");
  auto* o_port = app.add_option("--master-port,--master_port", a.master_port, "port of the rendezvous store");
  app.add_option("--log-dir,--log_dir", a.log_dir, "write DIR/rank_N.log for every rank");
  app.add_option("--grace-period", a.grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks (default 5)");
  app.add_option("--preempt-grace", a.preempt_grace_s,
                 "seconds the ranks get, after a forwarded SIGTERM or SIGINT, to finish their step and write a "
                 "checkpoint before SIGKILL (default 120)");
  app.footer("Usage: longtrain-run [flags] [--] PROGRAM [ARGS...]\n");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    ParseResult r;
    std::ostringstream out, err;
    r.exit_code = app.exit(e, out, err);
    r.out = out.str();
    r.err = err.str();
    return r;
  }
  a.command = app.remaining();
  if (!a.command.empty() && a.command.front() == "--") a.command.erase(a.command.begin());
  if (a.command.empty()) return error("no program to run; usage: longtrain-run [flags] [--] PROGRAM [ARGS...]");

  // Defaults from the environment: MASTER_ADDR/MASTER_PORT, then Slurm when srun started one
  // launcher per node (SLURM_NTASKS == SLURM_NNODES inside a job step).
  std::string problem;
  const char* ntasks = env("SLURM_NTASKS");
  const char* nnodes = env("SLURM_NNODES") ? env("SLURM_NNODES") : env("SLURM_JOB_NUM_NODES");
  const bool slurm_per_node = env("SLURM_STEP_ID") && ntasks && nnodes && std::string(ntasks) == nnodes;
  if (o_nnodes->count() == 0 && slurm_per_node) {
    if (auto v = env_int("SLURM_NNODES", nnodes, problem)) a.nnodes = *v;
  }
  if (o_node_rank->count() == 0 && slurm_per_node && env("SLURM_NODEID")) {
    if (auto v = env_int("SLURM_NODEID", env("SLURM_NODEID"), problem)) a.node_rank = *v;
  }
  if (o_addr->count() == 0) {
    if (env("MASTER_ADDR")) {
      a.master_addr = env("MASTER_ADDR");
    } else if (slurm_per_node && (env("SLURM_JOB_NODELIST") || env("SLURM_NODELIST"))) {
      const char* list = env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST") : env("SLURM_NODELIST");
      try {
        a.master_addr = parallel::first_host_of_nodelist(list);
      } catch (const std::exception& e) {
        problem = fmt::format("cannot read the Slurm node list '{}': {}", list, e.what());
      }
    }
  }
  if (o_port->count() == 0 && env("MASTER_PORT")) {
    if (auto v = env_int("MASTER_PORT", env("MASTER_PORT"), problem)) a.master_port = *v;
  }
  if (!problem.empty()) return error(problem);

  if (a.nnodes < 1) return error(fmt::format("--nnodes {} must be at least 1", a.nnodes));
  if (a.nproc_per_node < 1) return error(fmt::format("--nproc-per-node {} must be at least 1", a.nproc_per_node));
  if (static_cast<int64_t>(a.nnodes) * a.nproc_per_node > INT_MAX)
    return error(fmt::format("--nnodes {} × --nproc-per-node {} ranks is more than {}", a.nnodes, a.nproc_per_node,
                             INT_MAX));
  if (a.node_rank < 0 || a.node_rank >= a.nnodes)
    return error(fmt::format("--node-rank {} is outside [0, --nnodes {})", a.node_rank, a.nnodes));
  if (a.master_port < 1 || a.master_port > 65535)
    return error(fmt::format("--master-port {} is outside [1, 65535]", a.master_port));
  if (!(a.grace_s >= 0)) return error(fmt::format("--grace-period {} must be >= 0", a.grace_s));
  if (!(a.preempt_grace_s >= 0)) return error(fmt::format("--preempt-grace {} must be >= 0", a.preempt_grace_s));
  ParseResult r;
  r.args = std::move(a);
  return r;
}

}  // namespace longtrain::launcher
