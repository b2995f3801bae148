// longtrain-run's arguments and environment, parsed by the launcher's own parse_args: the input is
// NUL-separated items; an item that starts with '=' sets an environment variable (=NAME=VALUE, e.g.
// =SLURM_NNODES=2), every other one is an argv element after "longtrain-run". When the parse gives
// settings, the launcher's derived values (world size, this node's ranks) are computed as main does.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "args.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> argv = {"longtrain-run"};
  std::map<std::string, std::string> env;
  std::string item;
  auto take = [&] {
    if (!item.empty() && item[0] == '=') {
      const size_t eq = item.find('=', 1);
      if (eq != std::string::npos) env[item.substr(1, eq - 1)] = item.substr(eq + 1);
    } else {
      argv.push_back(item);
    }
    item.clear();
  };
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      take();
    } else {
      item.push_back(static_cast<char>(data[i]));
    }
  }
  if (!item.empty()) take();
  std::vector<const char*> ptrs;
  for (const std::string& a : argv) ptrs.push_back(a.c_str());
  const auto lookup = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  longtrain::fuzz::expect_clean([&] {
    const longtrain::launcher::ParseResult r =
        longtrain::launcher::parse_args(static_cast<int>(ptrs.size()), ptrs.data(), lookup);
    if (!r.args) return;
    const longtrain::launcher::Args& a = *r.args;
    volatile int world = a.world_size();
    volatile int first = a.first_rank();
    volatile int last = (a.node_rank + 1) * a.nproc_per_node - 1;
    (void)world;
    (void)first;
    (void)last;
  });
  return 0;
}
