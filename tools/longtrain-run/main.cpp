// longtrain-run: the torchrun-style launcher. Starts --nproc-per-node ranks of a program on this node
// and watches them:
//
//   longtrain-run --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500
//                 [--log-dir logs] [--grace-period 5] -- longtrain train config.yaml
//
// - Each rank gets torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK
//   (the node rank), MASTER_ADDR, MASTER_PORT (and OMP_NUM_THREADS=1 unless set, like torchrun).
//   Global rank 0, the node-rank-0 launcher's first rank, serves the rendezvous store.
// - Under srun with one launcher task per node, --nnodes, --node-rank and --master-addr default to
//   SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST. MASTER_ADDR/MASTER_PORT in
//   the environment are the defaults of --master-addr/--master-port.
// - Console lines are prefixed "[rank N]: "; --log-dir DIR also writes DIR/rank_N.log per rank.
// - When a rank exits non-zero or dies of a signal, the others get SIGTERM (their whole process
//   group), then SIGKILL after --grace-period seconds, and the launcher exits with that rank's code
//   (128 + signal for a signal death). A rank stopped because another rank failed exits with
//   kExitPeerFailure (75); that is never taken as the root cause when a real failure is known, and
//   after such an exit the launcher waits 1 s for the real failure before it stops the others.
// - SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to every rank and stop the job (grace, then
//   SIGKILL); SIGUSR1/SIGUSR2 are forwarded only. After SIGTERM or SIGINT (what Slurm sends before it
//   preempts or cancels a job) `longtrain train` finishes its step, writes a checkpoint and exits
//   with kExitPreempted (76): the ranks get --preempt-grace seconds (default 120) for that, and when
//   every rank ended so, the launcher exits with 76 too (continue with --resume auto).
// - Every rank has PR_SET_PDEATHSIG=SIGKILL: if this launcher is killed, its ranks die with it; the
//   store then tells the other nodes' ranks (see parallel/store.h), so their launchers stop too.
// - On node 0 a busy --master-port is reported before anything starts; on other nodes an
//   unresolvable --master-addr is. An unreachable master makes the ranks fail once their connect
//   timeout (LONGTRAIN_CONNECT_TIMEOUT_S) passes, with a message naming the address.
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "args.h"
#include "parallel/distributed.h"
#include "parallel/net.h"
#include "parallel/store.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace par = longtrain::parallel;

// After a rank exits with kExitPeerFailure, how long the launcher waits for the failing rank's own
// exit code before it stops the others.
constexpr std::chrono::seconds kSettle{1};

using longtrain::launcher::Args;

void say(const std::string& line) {
  std::string s = "[longtrain-run] " + line + "\n";
  [[maybe_unused]] ssize_t w = ::write(2, s.data(), s.size());
}

[[noreturn]] void die(const std::string& line) {
  say("error: " + line);
  std::exit(1);
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// One output stream of one rank: a pipe read end and the unterminated tail of its last read.
struct Stream {
  int fd = -1;
  int console_fd = 1;
  std::string partial;
};

struct Rank {
  int local = 0;
  int global = 0;
  pid_t pid = -1;
  bool running = false;
  bool signalled = false;  // the launcher sent it a stopping signal
  int status = 0;
  double ended_s = 0;
  Stream out, err;
  FILE* log = nullptr;
  std::deque<std::string> last_err;  // its last stderr lines, for the failure summary
};

struct RootCause {
  int rank_index;
  int code;
  bool peer_failure;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "unknown status";
}

int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

class Launcher {
 public:
  explicit Launcher(Args a) : args_(std::move(a)), start_(Clock::now()) {}

  int run() {
    setup_signals();
    if (!args_.log_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(args_.log_dir, ec);
      if (ec) die(fmt::format("cannot create --log-dir '{}': {}", args_.log_dir, ec.message()));
    }
    const int world = args_.nnodes * args_.nproc_per_node;
    say(fmt::format("node {} of {}: starting ranks {}-{} of {} (store at {}:{}{})", args_.node_rank, args_.nnodes,
                    args_.node_rank * args_.nproc_per_node, (args_.node_rank + 1) * args_.nproc_per_node - 1, world,
                    args_.master_addr, args_.master_port, args_.node_rank == 0 ? ", served by rank 0 here" : ""));
    ranks_.resize(args_.nproc_per_node);
    for (int i = 0; i < args_.nproc_per_node; ++i) spawn(i, world);
    loop();
    return finish();
  }

 private:
  void setup_signals() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) sigaddset(&set, s);
    ::sigprocmask(SIG_BLOCK, &set, &old_mask_);
    sigfd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd_ < 0) die(fmt::format("signalfd failed: {}", par::net::errno_text(errno)));
    std::signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the launcher and orphan the job
  }

  void spawn(int local, int world) {
    Rank& r = ranks_[local];
    r.local = local;
    r.global = args_.node_rank * args_.nproc_per_node + local;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      die(fmt::format("pipe failed: {}", par::net::errno_text(errno)));
    }
    if (!args_.log_dir.empty()) {
      const std::string path = fmt::format("{}/rank_{}.log", args_.log_dir, r.global);
      r.log = std::fopen(path.c_str(), "w");
      if (r.log == nullptr) die(fmt::format("cannot write the log file {}: {}", path, std::strerror(errno)));
    }
    const pid_t launcher = ::getpid();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) die(fmt::format("fork failed: {}", par::net::errno_text(errno)));
    if (pid == 0) {
      // Child: its own process group (so the launcher can signal the rank and everything it
      // started), dies with the launcher, and gets the rank's environment.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(1);  // the launcher died before prctl took effect
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      std::signal(SIGPIPE, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
      ::setenv("RANK", std::to_string(r.global).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      ::setenv("GROUP_RANK", std::to_string(args_.node_rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(args_.nproc_per_node).c_str(), 1);
      ::setenv("MASTER_ADDR", args_.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(args_.master_port).c_str(), 1);
      if (args_.nproc_per_node > 1) ::setenv("OMP_NUM_THREADS", "1", 0);
      std::vector<char*> argv;
      for (auto& a : args_.command) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "longtrain-run: cannot run '%s': %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so the group exists before the launcher may signal it
    ::close(out[1]);
    ::close(err[1]);
    r.pid = pid;
    r.running = true;
    r.out = Stream{out[0], 1, ""};
    r.err = Stream{err[0], 2, ""};
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
  }

  // ---------------------------------------------------------------------------------------------

  void loop() {
    std::optional<Clock::time_point> drain_until;
    for (;;) {
      const bool any_running = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
      const bool any_stream = std::any_of(ranks_.begin(), ranks_.end(),
                                          [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
      if (!any_running) {
        // Ranks are gone; their output may still sit in the pipes (or a leftover child of a rank
        // holds them open): drain for a moment, then stop.
        if (!any_stream) return;
        if (!drain_until) drain_until = Clock::now() + std::chrono::seconds(2);
        if (Clock::now() >= *drain_until) return;
      }
      std::vector<pollfd> fds{{sigfd_, POLLIN, 0}};
      std::vector<Stream*> streams{nullptr};
      std::vector<Rank*> owners{nullptr};
      for (Rank& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd < 0) continue;
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
          owners.push_back(&r);
        }
      }
      int timeout_ms = 100;  // also polls waitpid, in case a SIGCHLD was merged with another
      if (kill_deadline_) {
        timeout_ms = std::clamp<int>(
            static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(*kill_deadline_ - Clock::now()).count()),
            0, 100);
      }
      int n = ::poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) die(fmt::format("poll failed: {}", par::net::errno_text(errno)));
      if (n > 0 && (fds[0].revents & POLLIN)) handle_signals();
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) pump(*owners[i], *streams[i]);
      }
      reap();
      if (!stopping_ && settle_deadline_ && Clock::now() >= *settle_deadline_) {
        stop_all("no rank reported a failure of its own");
      }
      if (kill_deadline_ && Clock::now() >= *kill_deadline_) {
        for (Rank& r : ranks_) {
          if (r.running) {
            ::kill(-r.pid, SIGKILL);
            r.signalled = true;
          }
        }
        kill_deadline_ = Clock::time_point::max();
      }
    }
  }

  void handle_signals() {
    signalfd_siginfo info;
    while (::read(sigfd_, &info, sizeof(info)) == sizeof(info)) {
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) continue;  // reap() runs after every wake-up
      const bool stops = sig != SIGUSR1 && sig != SIGUSR2;
      const bool preempts = sig == SIGTERM || sig == SIGINT;
      say(fmt::format("received {}: forwarding it to the ranks{}", strsignal(sig), stops ? " and stopping" : ""));
      for (Rank& r : ranks_) {
        if (!r.running) continue;
        ::kill(-r.pid, sig);
        if (stops) r.signalled = true;
      }
      if (stops) {
        if (!received_signal_) received_signal_ = sig;
        start_kill_clock(preempts ? args_.preempt_grace_s : args_.grace_s);
      }
    }
  }

  void reap() {
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (size_t i = 0; i < ranks_.size(); ++i) {
        Rank& r = ranks_[i];
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        r.ended_s = seconds();
        const int code = exit_code_of(status);
        if (code == 0) continue;
        // Asked to stop by the signal we forwarded, the rank checkpointed and stopped: no failure.
        if (received_signal_ && WIFEXITED(status) && code == par::kExitPreempted) continue;
        // Deaths by the signals this launcher sent are consequences, not causes.
        const bool ours = r.signalled && WIFSIGNALED(status);
        const bool peer = WIFEXITED(status) && code == par::kExitPeerFailure;
        if (!ours && (!root_ || (root_->peer_failure && !peer))) {
          root_ = RootCause{static_cast<int>(i), code, peer};
        }
        const std::string what = fmt::format("rank {} (pid {}) failed with {} after {:.1f} s", r.global, r.pid,
                                             describe_status(status), r.ended_s);
        if (!stopping_ && peer && !(root_ && !root_->peer_failure)) {
          // Stopped because another rank failed. That rank is usually on this node, exiting with
          // its own code a moment later: give it kSettle before the SIGTERMs hide it.
          if (!settle_deadline_) {
            settle_deadline_ = Clock::now() + kSettle;
            say(what + " (stopped because another rank failed); stopping the others in 1 s");
          }
        } else if (!stopping_) {
          stop_all(what);
        }
        ::kill(-r.pid, SIGKILL);  // whatever the failed rank left behind in its process group
      }
    }
  }

  void stop_all(const std::string& why) {
    say(fmt::format("{}: stopping the other ranks (SIGTERM, then SIGKILL after {:.1f} s)", why, args_.grace_s));
    for (Rank& other : ranks_) {
      if (!other.running) continue;
      ::kill(-other.pid, SIGTERM);
      other.signalled = true;
    }
    start_kill_clock(args_.grace_s);
  }

  void start_kill_clock(double grace_s) {
    stopping_ = true;
    if (!kill_deadline_) {
      kill_deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
    }
  }

  // Moves whatever the pipe holds to the console (prefixed) and the rank's log file.
  void pump(Rank& r, Stream& s) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(s.fd, buf, sizeof(buf));
      if (n > 0) {
        s.partial.append(buf, static_cast<size_t>(n));
        size_t pos;
        while ((pos = s.partial.find('\n')) != std::string::npos) {
          emit(r, s, s.partial.substr(0, pos));
          s.partial.erase(0, pos + 1);
        }
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      // EOF (or an error): flush the unterminated tail and close.
      if (!s.partial.empty()) emit(r, s, s.partial);
      s.partial.clear();
      ::close(s.fd);
      s.fd = -1;
      return;
    }
  }

  void emit(Rank& r, Stream& s, const std::string& line) {
    std::string out = fmt::format("[rank {}]: {}\n", r.global, line);
    const char* p = out.data();
    size_t left = out.size();
    while (left > 0) {
      ssize_t w = ::write(s.console_fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;  // console gone: keep running, the log files still get everything
      p += w;
      left -= static_cast<size_t>(w);
    }
    if (r.log) {
      std::fwrite(line.data(), 1, line.size(), r.log);
      std::fputc('\n', r.log);
      std::fflush(r.log);
    }
    if (&s == &r.err) {
      r.last_err.push_back(line);
      if (r.last_err.size() > 5) r.last_err.pop_front();
    }
  }

  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

  int finish() {
    for (Rank& r : ranks_) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->fd >= 0) ::close(s->fd);
        s->fd = -1;
      }
      if (r.log) std::fclose(r.log);
    }
    int code = 0;
    int preempted = 0, finished = 0;
    for (const Rank& r : ranks_) {
      if (WIFEXITED(r.status) && exit_code_of(r.status) == par::kExitPreempted) ++preempted;
      if (WIFEXITED(r.status) && exit_code_of(r.status) == 0) ++finished;
    }
    if (root_) {
      code = root_->code;
    } else if (received_signal_ && preempted > 0 && preempted + finished == static_cast<int>(ranks_.size())) {
      say(fmt::format("stopped by {} after {:.1f} s: the ranks finished their step and wrote a checkpoint; continue "
                      "with --resume auto (exit code {})",
                      strsignal(received_signal_), seconds(), par::kExitPreempted));
      return par::kExitPreempted;
    } else if (received_signal_) {
      code = 128 + received_signal_;
    } else {
      for (const Rank& r : ranks_) {
        if (exit_code_of(r.status) != 0) code = exit_code_of(r.status);
      }
    }
    if (code == 0) {
      say(fmt::format("all {} ranks finished after {:.1f} s", ranks_.size(), seconds()));
      return 0;
    }
    say("failure summary:");
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const Rank& r = ranks_[i];
      const bool is_root = root_ && root_->rank_index == static_cast<int>(i);
      std::string note = is_root ? "root cause"
                         : exit_code_of(r.status) == 0 ? "finished"
                         : r.signalled ? "stopped by the launcher"
                         : exit_code_of(r.status) == par::kExitPeerFailure ? "stopped after another rank failed"
                                                                              : "failed";
      say(fmt::format("  rank {:>3}  pid {:>7}  {:<32}  at {:6.1f} s  {}", r.global, r.pid, describe_status(r.status),
                      r.ended_s, note));
    }
    if (root_) {
      const Rank& r = ranks_[root_->rank_index];
      if (!r.last_err.empty()) {
        say(fmt::format("last stderr lines of rank {}:", r.global));
        for (const auto& l : r.last_err) say("  " + l);
      }
    }
    say(fmt::format("exit code {}", code));
    return code;
  }

  Args args_;
  Clock::time_point start_;
  std::vector<Rank> ranks_;
  sigset_t old_mask_{};
  int sigfd_ = -1;
  bool stopping_ = false;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> settle_deadline_;
  std::optional<RootCause> root_;
  int received_signal_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  longtrain::launcher::ParseResult parsed = longtrain::launcher::parse_args(argc, argv, env);
  if (!parsed.out.empty()) std::fputs(parsed.out.c_str(), stdout);
  if (!parsed.args) {
    if (parsed.err.rfind("error: ", 0) == 0) {
      say(parsed.err);  // our own checks: "[longtrain-run] error: ..."
    } else {
      std::fputs(parsed.err.c_str(), stderr);  // CLI11's message (a bad flag)
    }
    return parsed.exit_code;
  }
  Args a = std::move(*parsed.args);

  if (a.node_rank == 0) {
    // Rank 0 will serve the store here; a busy port would only surface as a rank failure later.
    if (!par::net::port_is_free(a.master_port)) {
      die(fmt::format("--master-port {} is already in use on this machine (another job, or a leftover process of an "
                      "earlier one, is listening there); pick a free port",
                      a.master_port));
    }
  } else if (!par::net::host_resolves(a.master_addr)) {
    die(fmt::format("--master-addr '{}' does not resolve to an address; give node 0's hostname or IP", a.master_addr));
  }
  return Launcher(std::move(a)).run();
}
