// The NCCL communicator on 2 GPUs: longtrain-run starts parallel_nccl_worker as 2 ranks, one GPU
// each. The worker checks every collective (f32, bf16, i32, f64; sum and max) against a
// single-process computation, with inputs written late on the compute stream and results read
// straight back through it (so the event ordering between the compute and communication streams is
// exercised), the bucketed reduce_scatter_range against reduce_scatter (bit for bit) and its overlap
// with compute (the compute stream is not held by a bucket a late peer has not joined), grouped
// send/recv both ways, the traffic counters, the barrier and every process
// group; it prints "CASE <name> <error> <tolerance>" lines that this test asserts. Then the
// failures: a rank that never arrives at an all_reduce, and a send that is never posted, are named
// in the other rank's error within seconds (timeout 1 s), never a hang.
//
// Labels gpu;multiproc. Skipped (GTEST_SKIP) without CUDA or with fewer than 2 GPUs.
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <sstream>

#include "multiproc_util.h"
#include "parallel/net.h"
#include "runtime/device.h"

#ifdef LONGTRAIN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace longtrain::parallel {
namespace {

using namespace std::chrono_literals;
using test::Clock;

int visible_gpus() {
#ifdef LONGTRAIN_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

#define LT_REQUIRE_TWO_GPUS()                                                                   \
  do {                                                                                          \
    if (!::longtrain::cuda_available()) GTEST_SKIP() << "no CUDA device available";             \
    if (visible_gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, " << visible_gpus() << " visible"; \
  } while (0)

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

#ifdef LONGTRAIN_HAS_CUDA
const std::string kLauncher = LONGTRAIN_RUN_PATH;
const std::string kWorker = PARALLEL_NCCL_WORKER_PATH;
#else
const std::string kLauncher, kWorker;
#endif

struct LaunchResult {
  int code = -1;       // the launcher's exit code
  double seconds = 0;  // how long it took
  std::string err;     // the launcher's stderr (its own lines and the ranks' prefixed ones)
  std::vector<std::string> logs;  // each rank's own output (--log-dir)
};

// Runs `longtrain-run --nproc-per-node 2 -- parallel_nccl_worker ARGS` and waits up to `limit`.
LaunchResult launch_2_ranks(const std::vector<std::string>& worker_args, std::chrono::milliseconds limit) {
  test::TempDir dir;
  std::vector<std::string> argv{kLauncher, "--nproc-per-node", "2", "--master-port",
                                std::to_string(net::pick_free_port()), "--log-dir", dir.str(), "--", kWorker};
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  const std::map<std::string, std::string> env{{"LONGTRAIN_CONNECT_TIMEOUT_S", "30"}, {"LONGTRAIN_TIMEOUT_S", "60"}};
  const auto start = Clock::now();
  const pid_t pid = test::spawn(argv, env, dir.str("launcher.out"), dir.str("launcher.err"));
  LaunchResult run;
  auto status = test::wait_for_exit(pid, limit);
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!status) {
    test::kill_and_reap(pid);
    ADD_FAILURE() << "the launcher did not exit within " << limit.count() << " ms";
  } else if (WIFEXITED(*status)) {
    run.code = WEXITSTATUS(*status);
  } else {
    run.code = 128 + WTERMSIG(*status);
  }
  run.err = test::read_file(dir.str("launcher.err"));
  for (int r = 0; r < 2; ++r) run.logs.push_back(test::read_file(dir.str("rank_" + std::to_string(r) + ".log")));
  return run;
}

TEST(NcclCommunicator, EveryCollectiveMatchesASingleProcessComputation) {
  LT_REQUIRE_TWO_GPUS();
  const LaunchResult run = launch_2_ranks({"collectives"}, 180s);
  ASSERT_EQ(run.code, 0) << run.err;
  std::map<std::string, double> worst;
  for (int r = 0; r < 2; ++r) {
    std::istringstream in(run.logs[r]);
    std::string line;
    int cases = 0;
    while (std::getline(in, line)) {
      if (line.rfind("NOTE ", 0) == 0 || line.rfind("rank ", 0) == 0) std::cout << "  " << line << "\n";
      if (line.rfind("CASE ", 0) != 0) continue;
      std::istringstream fields(line.substr(5));
      std::string name;
      double err = 0, tol = 0;
      ASSERT_TRUE(static_cast<bool>(fields >> name) && test::read_fields(fields, err, tol))
          << "rank " << r << ": bad line " << line;
      ++cases;
      EXPECT_LE(err, tol) << "rank " << r << ": " << name;
      const std::string kind = name.substr(0, name.find('/', name.find('/') + 1));
      worst[kind] = std::max(worst[kind], err);
    }
    EXPECT_GE(cases, 150) << "rank " << r << " reported too few cases:\n" << run.logs[r];
  }
  for (const auto& [kind, err] : worst) std::cout << "  worst " << kind << ": " << err << "\n";
  std::cout << "  2 ranks took " << run.seconds << " s, NCCL setup included\n";
}

// Rank 1 never calls the all_reduce: rank 0 fails about 1 s after it could start, naming rank 1 and
// what it was doing; rank 1 is stopped through the store. No hang.
TEST(NcclCommunicatorFailure, AMissingRankTimesOutWithItsName) {
  LT_REQUIRE_TWO_GPUS();
  const LaunchResult run = launch_2_ranks({"timeout", "1", "1000"}, 60s);
  EXPECT_NE(run.code, 0) << run.err;
  EXPECT_LT(run.seconds, 40.0) << "the job took too long to fail";
  const std::string& msg = run.logs[0];
  EXPECT_TRUE(contains(msg, "all_reduce #2 (sum, f32[1031] cuda) on communicator 'world' (global ranks 0, 1)")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 did not arrive")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 is still at collective #1 (barrier, completed)")) << msg;
  EXPECT_TRUE(contains(msg, "timeout 1000 ms")) << msg;
  std::cout << "  launcher exit code " << run.code << " after " << run.seconds << " s; rank 0 said:\n" << msg << "\n";
}

// Rank 0 expects two sends from rank 1, which posts one: the error names rank 1 and how far it got.
TEST(NcclCommunicatorFailure, AMissingSendIsNamed) {
  LT_REQUIRE_TWO_GPUS();
  const LaunchResult run = launch_2_ranks({"missing-send", "1000"}, 60s);
  EXPECT_NE(run.code, 0) << run.err;
  const std::string& msg = run.logs[0];
  EXPECT_TRUE(contains(msg, "send/recv batch #2 (recv #2 from rank 1: f32[64] cuda) on communicator 'world'")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 did not arrive: it has posted 1 send(s) to rank 0, not send #2")) << msg;
  EXPECT_TRUE(contains(msg, "timeout 1000 ms")) << msg;
  std::cout << "  launcher exit code " << run.code << " after " << run.seconds << " s; rank 0 said:\n" << msg << "\n";
}

}  // namespace
}  // namespace longtrain::parallel
