// longtrain-run end to end: it starts parallel_worker ranks on this machine and the tests check the
// environment they got, the exit code the launcher returns, that no rank survives a failure, that a
// missing rank is named, that two launchers (--nnodes 2) form one world, and that killing one
// launcher stops the other's ranks.
#include <gtest/gtest.h>

#include <sys/prctl.h>

#include <csignal>
#include <iostream>
#include <sstream>

#include "multiproc_util.h"
#include "parallel/net.h"
#include "parallel/store.h"

namespace longtrain::parallel {
namespace {

using namespace std::chrono_literals;
using test::Clock;

const std::string kLauncher = LONGTRAIN_RUN_PATH;
const std::string kWorker = PARALLEL_WORKER_PATH;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct Launch {
  pid_t pid;
  std::string out, err;  // paths of its stdout and stderr
};

Launch launch(const test::TempDir& dir, const std::string& tag, std::vector<std::string> flags,
              const std::vector<std::string>& worker_args, std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv{kLauncher};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back("--");
  argv.push_back(kWorker);
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  env.emplace("LONGTRAIN_CONNECT_TIMEOUT_S", "10");
  env.emplace("LONGTRAIN_TIMEOUT_S", "20");
  Launch l{0, dir.str(tag + ".out"), dir.str(tag + ".err")};
  l.pid = test::spawn(argv, env, l.out, l.err);
  return l;
}

// Waits for the launcher; on a timeout kills it (the test then fails).
int finish(const Launch& l, std::chrono::milliseconds limit) {
  auto status = test::wait_for_exit(l.pid, limit);
  if (!status) {
    test::kill_and_reap(l.pid);
    ADD_FAILURE() << "the launcher did not exit within " << limit.count() << " ms\nstderr:\n"
                  << test::read_file(l.err);
    return -1;
  }
  EXPECT_TRUE(WIFEXITED(*status)) << "the launcher died of a signal";
  return WIFEXITED(*status) ? WEXITSTATUS(*status) : 128 + WTERMSIG(*status);
}

std::vector<pid_t> read_pids(const test::TempDir& dir, int n, std::chrono::milliseconds wait = 10s) {
  const auto deadline = Clock::now() + wait;
  std::vector<pid_t> pids(n, 0);
  for (;;) {
    int found = 0;
    for (int r = 0; r < n; ++r) {
      const std::optional<std::string> text = test::read_file_if_exists(dir.str("rank_" + std::to_string(r) + ".pid"));
      if (text && !text->empty()) {
        pids[r] = std::stoi(*text);
        ++found;
      }
    }
    if (found == n || Clock::now() >= deadline) return pids;
    std::this_thread::sleep_for(20ms);
  }
}

std::string flags_port(int port) { return std::to_string(port); }

TEST(Launcher, RanksGetTorchrunsEnvironmentPrefixedLinesAndLogFiles) {
  test::TempDir dir;
  const int port = net::pick_free_port();
  Launch l = launch(dir, "launcher",
                    {"--nproc-per-node", "3", "--master-port", flags_port(port), "--log-dir", dir.str("logs")},
                    {"env", dir.str()});
  ASSERT_EQ(finish(l, 30s), 0) << test::read_file(l.err);
  const std::string console = test::read_file(l.out);
  for (int r = 0; r < 3; ++r) {
    std::istringstream in(test::read_file(dir.str("rank_" + std::to_string(r) + ".txt")));
    int rank = -1, local = -1, world = -1, local_world = -1, group = -1;
    in >> rank >> local >> world >> local_world >> group;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(local, r);
    EXPECT_EQ(world, 3);
    EXPECT_EQ(local_world, 3);
    EXPECT_EQ(group, 0);
    EXPECT_TRUE(contains(console, "[rank " + std::to_string(r) + "]: rank " + std::to_string(r) + ": all collectives ok"))
        << console;
    const std::string log = test::read_file(dir.str("logs/rank_" + std::to_string(r) + ".log"));
    EXPECT_TRUE(contains(log, "rank " + std::to_string(r) + ": world world sum 6")) << log;
    EXPECT_FALSE(contains(log, "[rank")) << "log files hold the rank's own lines, unprefixed";
  }
}

// Rank 1 exits with 3 while the others ignore SIGTERM: the launcher SIGKILLs them after the grace
// period, returns 3, and no rank is left within 10 s.
TEST(Launcher, AFailingRanksExitCodeIsReturnedAndNoRankSurvives) {
  test::TempDir dir;
  const auto start = Clock::now();
  Launch l = launch(dir, "launcher", {"--nproc-per-node", "3", "--master-port", flags_port(net::pick_free_port()),
                                      "--grace-period", "1"},
                    {"fail", "3", "1", dir.str(), "ignore-term"});
  const auto pids = read_pids(dir, 3);
  EXPECT_EQ(finish(l, 10s), 3) << test::read_file(l.err);
  const auto alive = test::wait_until_dead(pids, start + 10s);
  EXPECT_TRUE(alive.empty()) << alive.size() << " rank(s) still alive 10 s after the start";
  const std::string err = test::read_file(l.err);
  EXPECT_TRUE(contains(err, "rank 1 (pid " + std::to_string(pids[1]) + ") failed with exit code 3")) << err;
  EXPECT_TRUE(contains(err, "[rank 1]: rank 1 fails on purpose with exit code 3")) << err;
  EXPECT_TRUE(contains(err, "root cause")) << err;
  std::cout << "  stopped in " << std::chrono::duration<double>(Clock::now() - start).count() << " s\n";
}

// Same with ranks joined through the store: the others are stopped by the store's report (exit 75)
// or the launcher's SIGTERM, and 3 (the root cause) is still what the launcher returns.
TEST(Launcher, AFailingRankWithTheStoreKeepsItsExitCode) {
  test::TempDir dir;
  const auto start = Clock::now();
  Launch l = launch(dir, "launcher", {"--nproc-per-node", "3", "--master-port", flags_port(net::pick_free_port())},
                    {"fail-store", "3", "2", dir.str()});
  const auto pids = read_pids(dir, 3);
  EXPECT_EQ(finish(l, 10s), 3) << test::read_file(l.err);
  EXPECT_TRUE(test::wait_until_dead(pids, start + 10s).empty());
}

// Rank 2 never calls the all_reduce: the others fail after its 1 s timeout with a message naming
// it, and the launcher returns their exit code 1 (not rank 2's kExitPeerFailure).
TEST(Launcher, AMissingRankTimesOutWithItsName) {
  test::TempDir dir;
  const auto start = Clock::now();
  Launch l = launch(dir, "launcher",
                    {"--nproc-per-node", "3", "--master-port", flags_port(net::pick_free_port()), "--log-dir", dir.str()},
                    {"timeout", "2", "1000"});
  EXPECT_EQ(finish(l, 15s), 1) << test::read_file(l.err);
  EXPECT_LT(Clock::now() - start, 10s);
  const std::string logs = test::read_file(dir.str("rank_0.log")) + test::read_file(dir.str("rank_1.log"));
  EXPECT_TRUE(contains(logs, "all_reduce #2")) << logs;
  EXPECT_TRUE(contains(logs, "rank 2 did not arrive")) << logs;
}

// Two launchers on this machine, --nnodes 2, form one world of 2 x 2 ranks: the variables are right
// and collectives over every group (sp 4: intra-node rings {0,1},{2,3}, inter-node {0,2},{1,3}) work.
TEST(Launcher, TwoLaunchersFormOneWorld) {
  test::TempDir dir;
  const std::string port = flags_port(net::pick_free_port());
  std::vector<Launch> nodes;
  for (int node : {1, 0}) {  // node 1 first: its ranks wait for the store
    nodes.push_back(launch(dir, "node" + std::to_string(node),
                           {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", port},
                           {"env", dir.str()}, {{"LONGTRAIN_TEST_SP", "4"}}));
  }
  for (auto& l : nodes) EXPECT_EQ(finish(l, 30s), 0) << test::read_file(l.err);
  for (int r = 0; r < 4; ++r) {
    std::istringstream in(test::read_file(dir.str("rank_" + std::to_string(r) + ".txt")));
    int rank = -1, local = -1, world = -1, local_world = -1, group = -1;
    in >> rank >> local >> world >> local_world >> group;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(local, r % 2);
    EXPECT_EQ(world, 4);
    EXPECT_EQ(local_world, 2);
    EXPECT_EQ(group, r / 2);
  }
  const std::string node0 = test::read_file(nodes[1].out);
  EXPECT_TRUE(contains(node0, "[rank 0]: rank 0: inter-node sp0.local0 sum 4 (expected 4)")) << node0;
  EXPECT_TRUE(contains(node0, "[rank 1]: rank 1: intra-node sp0.node0 sum 3 (expected 3)")) << node0;
  const std::string node1 = test::read_file(nodes[0].out);
  EXPECT_TRUE(contains(node1, "[rank 3]: rank 3: all collectives ok")) << node1;
}

// The same world under srun (one launcher task per node): --nnodes, --node-rank and --master-addr
// come from Slurm's variables.
TEST(Launcher, SlurmVariablesDescribeTheNodes) {
  test::TempDir dir;
  const std::string port = flags_port(net::pick_free_port());
  std::vector<Launch> nodes;
  for (int node : {1, 0}) {
    nodes.push_back(launch(dir, "node" + std::to_string(node), {"--nproc-per-node", "2", "--master-port", port},
                           {"env", dir.str()},
                           {{"SLURM_STEP_ID", "0"},
                            {"SLURM_NTASKS", "2"},
                            {"SLURM_NNODES", "2"},
                            {"SLURM_NODEID", std::to_string(node)},
                            {"SLURM_JOB_NODELIST", "localhost,otherhost"}}));
  }
  for (auto& l : nodes) EXPECT_EQ(finish(l, 30s), 0) << test::read_file(l.err);
  for (int r = 0; r < 4; ++r) {
    std::istringstream in(test::read_file(dir.str("rank_" + std::to_string(r) + ".txt")));
    int rank = -1, local = -1, world = -1;
    in >> rank >> local >> world;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(local, r % 2);
    EXPECT_EQ(world, 4);
  }
  EXPECT_TRUE(contains(test::read_file(nodes[0].err), "store at localhost:" + port));
}

// Killing one launcher stops the other's ranks too, within seconds: its ranks die with it
// (PR_SET_PDEATHSIG), the store tells the other node's ranks, and that launcher exits non-zero.
void kill_one_launcher(int victim_node, int signal) {
  // The killed launcher's ranks are orphaned; adopt them, so they are reaped here rather than left
  // as zombies under a PID 1 that may not reap.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  test::TempDir dir;
  const std::string port = flags_port(net::pick_free_port());
  std::vector<Launch> nodes(2);
  for (int node : {0, 1}) {
    nodes[node] = launch(dir, "node" + std::to_string(node),
                         {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                          "--master-port", port, "--grace-period", "2"},
                         {"loop", dir.str()});
  }
  const auto pids = read_pids(dir, 4);
  for (pid_t p : pids) ASSERT_GT(p, 0) << "a rank never started";
  const auto killed_at = Clock::now();
  ::kill(nodes[victim_node].pid, signal);
  const int survivor = 1 - victim_node;
  const int code = finish(nodes[survivor], 10s);
  EXPECT_NE(code, 0) << test::read_file(nodes[survivor].err);
  auto victim_status = test::wait_for_exit(nodes[victim_node].pid, 10s);
  ASSERT_TRUE(victim_status.has_value());
  const auto alive = test::wait_until_dead(pids, killed_at + 10s);
  EXPECT_TRUE(alive.empty()) << alive.size() << " rank(s) still alive 10 s after the launcher was killed";
  for (pid_t p : pids) ::waitpid(p, nullptr, WNOHANG);
  std::cout << "  the other launcher exited with " << code << " after "
            << std::chrono::duration<double>(Clock::now() - killed_at).count() << " s\n";
}

TEST(Launcher, KillingTheSecondLauncherStopsTheFirstOnesRanks) {
  kill_one_launcher(1, SIGKILL);
}

TEST(Launcher, TerminatingTheStoreHostingLauncherStopsTheOtherOnesRanks) {
  kill_one_launcher(0, SIGTERM);
}

TEST(Launcher, ABusyPortIsReportedBeforeAnyRankStarts) {
  test::TempDir dir;
  net::Fd busy = net::listen_on(0);
  const int port = net::local_port(busy.get());
  Launch l = launch(dir, "launcher", {"--nproc-per-node", "2", "--master-port", flags_port(port)}, {"env", dir.str()});
  EXPECT_EQ(finish(l, 10s), 1);
  const std::string err = test::read_file(l.err);
  EXPECT_TRUE(contains(err, "--master-port " + std::to_string(port) + " is already in use")) << err;
  EXPECT_FALSE(std::filesystem::exists(dir.str("rank_0.txt"))) << "no rank may start";
}

TEST(Launcher, AnUnreachableMasterIsNamed) {
  test::TempDir dir;
  const int port = net::pick_free_port();  // nobody serves it
  const auto start = Clock::now();
  Launch l = launch(dir, "launcher",
                    {"--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                     "--master-port", flags_port(port)},
                    {"env", dir.str()}, {{"LONGTRAIN_CONNECT_TIMEOUT_S", "1"}});
  EXPECT_EQ(finish(l, 15s), 1);
  EXPECT_LT(Clock::now() - start, 8s);
  const std::string err = test::read_file(l.err);
  EXPECT_TRUE(contains(err, "could not connect to 127.0.0.1:" + std::to_string(port))) << err;
}

// Bad flags and environment are named before any rank starts (tools/longtrain-run/args.cpp, which the
// launcher_args fuzz target runs too).
TEST(Launcher, BadFlagsAndEnvironmentAreNamed) {
  test::TempDir dir;
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> cases = {
      {{{"MASTER_PORT", "29500x"}}, "environment variable MASTER_PORT='29500x' is not an integer"},
      {{{"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "1"},
        {"SLURM_JOB_NODELIST", "gpu[3-"}},
       "cannot read the Slurm node list 'gpu[3-'"},
      {{{"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "9"},
        {"SLURM_JOB_NODELIST", "a,b"}},
       "--node-rank 9 is outside [0, --nnodes 2)"},
  };
  int i = 0;
  for (const auto& [env, message] : cases) {
    Launch l = launch(dir, "bad" + std::to_string(i++), {"--nproc-per-node", "1"}, {"env", dir.str()}, env);
    EXPECT_EQ(finish(l, 10s), 1) << message;
    const std::string err = test::read_file(l.err);
    EXPECT_TRUE(contains(err, "[longtrain-run] error: " + message)) << err;
  }
  Launch zero = launch(dir, "zero", {"--nnodes", "0"}, {"env", dir.str()});
  EXPECT_EQ(finish(zero, 10s), 1);
  EXPECT_TRUE(contains(test::read_file(zero.err), "--nnodes 0 must be at least 1")) << test::read_file(zero.err);
  EXPECT_FALSE(std::filesystem::exists(dir.str("rank_0.txt"))) << "no rank may start";
}

}  // namespace
}  // namespace longtrain::parallel
