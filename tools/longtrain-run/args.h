// longtrain-run's command line and environment (torchrun's flags, MASTER_*, Slurm's per-node
// variables) turned into the launcher's settings, with every check that needs no system call. Kept
// apart from main.cpp so that its fuzz target (tests/fuzz/fuzz_launcher_args.cpp) calls exactly what
// the launcher runs.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace longtrain::launcher {

struct Args {
  int nnodes = 1;
  int nproc_per_node = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string log_dir;
  double grace_s = 5.0;
  double preempt_grace_s = 120.0;
  std::vector<std::string> command;

  int world_size() const { return nnodes * nproc_per_node; }  // checked to fit an int
  int first_rank() const { return node_rank * nproc_per_node; }
};

// What parsing gave: the settings, or the text to print and the exit code (--help: the help on
// stdout and 0; a bad flag or value: the error on stderr and non-zero).
struct ParseResult {
  std::optional<Args> args;
  int exit_code = 0;
  std::string out;  // for stdout
  std::string err;  // for stderr, without the "[longtrain-run] " prefix
};

// A variable's value, or nullptr when unset. Empty values count as unset.
using EnvLookup = std::function<const char*(const char* name)>;

ParseResult parse_args(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace longtrain::launcher
