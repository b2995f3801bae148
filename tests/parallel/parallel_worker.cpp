// The program the launcher tests run under longtrain-run. One mode per scenario:
//
//   parallel_worker env OUTDIR           write OUTDIR/rank_R.txt with the launcher's variables and pid,
//                                        then check collectives on every process group (sp from
//                                        LONGTRAIN_TEST_SP, default 1); exit 0 when all sums match
//   parallel_worker fail CODE RANK PIDDIR [ignore-term]
//                                        no store: rank RANK exits CODE after 300 ms, the others
//                                        sleep (optionally ignoring SIGTERM, so only SIGKILL stops them)
//   parallel_worker fail-store CODE RANK PIDDIR
//                                        like fail, with the ranks joined through the store first
//   parallel_worker timeout RANK MS      rank RANK skips an all_reduce; the others time out after MS
//                                        milliseconds and exit 1 with the message
//   parallel_worker loop PIDDIR          barrier + all_reduce every 50 ms, forever
//
// PIDDIR/rank_R.pid holds each rank's pid, so a test can check that none survives.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "parallel/distributed.h"

namespace {

using namespace longtrain;
using namespace longtrain::parallel;
using namespace std::chrono_literals;

void write_pid(const std::string& dir, int rank) {
  const std::string tmp = fmt::format("{}/rank_{}.pid.tmp", dir, rank);
  std::ofstream(tmp) << ::getpid() << "\n";
  std::rename(tmp.c_str(), fmt::format("{}/rank_{}.pid", dir, rank).c_str());
}

int32_t reduce_rank_sum(Communicator& c, int rank) {
  int32_t x = rank + 1;
  c.all_reduce(Tensor(&x, DType::i32, {1}));
  return x;
}

int run_env(const std::string& outdir) {
  const WorldInfo w = world_from_env();
  {
    std::ofstream f(fmt::format("{}/rank_{}.txt", outdir, w.rank));
    f << std::getenv("RANK") << " " << std::getenv("LOCAL_RANK") << " " << std::getenv("WORLD_SIZE") << " "
      << std::getenv("LOCAL_WORLD_SIZE") << " " << std::getenv("GROUP_RANK") << " " << ::getpid() << "\n";
  }
  const char* sp = std::getenv("LONGTRAIN_TEST_SP");
  DistributedOptions o;
  o.sp_size = sp ? std::atoi(sp) : 1;
  Distributed d(w, options_from_env(o));
  const ParallelShape s = d.shape();
  int bad = 0;
  auto check = [&](const char* name, Communicator& c, const RankGroup& g) {
    int32_t expect = 0;
    for (int q : g.ranks) expect += q + 1;
    const int32_t got = reduce_rank_sum(c, w.rank);
    std::printf("rank %d: %s %s sum %d (expected %d)\n", w.rank, name, g.name.c_str(), got, expect);
    bad += got != expect || c.ranks() != g.ranks;
  };
  check("world", d.world(), world_group(s));
  check("sp", d.sp(), sp_group(s, w.rank));
  check("dp", d.dp(), dp_group(s, w.rank));
  check("intra-node", d.intra_node(), intra_node_ring(s, w.rank));
  check("inter-node", d.inter_node(), inter_node_ring(s, w.rank));
  std::vector<float> v(1031, 1.0f);
  d.world().all_reduce(Tensor(v.data(), DType::f32, {1031}));
  bad += v[1030] != static_cast<float>(w.world_size);
  std::printf("rank %d: %s\n", w.rank, bad ? "MISMATCH" : "all collectives ok");
  return bad ? 1 : 0;
}

int run_fail(int code, int failing, const std::string& piddir, bool ignore_term, bool with_store) {
  const WorldInfo w = world_from_env();
  std::unique_ptr<Distributed> d;
  if (with_store) {
    d = std::make_unique<Distributed>(w, options_from_env({}));
    d->world().barrier();
  }
  write_pid(piddir, w.rank);
  if (ignore_term) std::signal(SIGTERM, SIG_IGN);
  std::printf("rank %d started\n", w.rank);
  std::fflush(stdout);
  if (w.rank == failing) {
    std::this_thread::sleep_for(300ms);
    std::fprintf(stderr, "rank %d fails on purpose with exit code %d\n", w.rank, code);
    std::exit(code);
  }
  std::this_thread::sleep_for(60s);
  return 0;
}

int run_timeout(int missing, int timeout_ms) {
  const WorldInfo w = world_from_env();
  Distributed d(w, options_from_env({}));
  d.world().barrier();
  d.world().set_timeout(Millis(timeout_ms));
  if (w.rank == missing) {
    std::this_thread::sleep_for(60s);
    return 0;
  }
  std::vector<float> v(64, 1.0f);
  d.world().all_reduce(Tensor(v.data(), DType::f32, {64}));
  return 0;
}

int run_loop(const std::string& piddir) {
  const WorldInfo w = world_from_env();
  Distributed d(w, options_from_env({}));
  d.world().barrier();
  write_pid(piddir, w.rank);
  std::vector<float> v(256, 1.0f);
  for (;;) {
    d.world().barrier();
    d.world().all_reduce(Tensor(v.data(), DType::f32, {256}));
    std::this_thread::sleep_for(50ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv + 1, argv + argc);
    if (a.size() == 2 && a[0] == "env") return run_env(a[1]);
    if (a.size() >= 4 && a[0] == "fail") {
      return run_fail(std::stoi(a[1]), std::stoi(a[2]), a[3], a.size() > 4 && a[4] == "ignore-term", false);
    }
    if (a.size() == 4 && a[0] == "fail-store") return run_fail(std::stoi(a[1]), std::stoi(a[2]), a[3], false, true);
    if (a.size() == 3 && a[0] == "timeout") return run_timeout(std::stoi(a[1]), std::stoi(a[2]));
    if (a.size() == 2 && a[0] == "loop") return run_loop(a[1]);
    std::fprintf(stderr, "usage: parallel_worker env|fail|fail-store|timeout|loop ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
