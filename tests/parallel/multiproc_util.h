// Helpers for the multi-process tests: run a function as N real processes (fork), spawn programs
// with output captured to files, wait with deadlines, and check whether a pid is still alive.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/error.h"
#include "test_util.h"

namespace longtrain::test {

using Clock = std::chrono::steady_clock;

// What one forked rank produced: its exit status (raw waitpid status; -1 when the parent had to kill
// it at the deadline) and the text it returned (or the exception it threw).
struct RankOutcome {
  int status = -1;
  std::string text;
  bool exited(int code) const { return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == code; }
};

// Forks `n` processes; process r runs fn(r) and exits 0 with the returned text, or 1 with the text of
// an exception. The parent collects everything, killing processes still alive at `limit`.
inline std::vector<RankOutcome> run_ranks(int n, const std::function<std::string(int rank)>& fn,
                                          std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  std::fflush(nullptr);
  std::vector<pid_t> pids(n);
  std::vector<int> fds(n);
  for (int r = 0; r < n; ++r) {
    int p[2];
    LT_CHECK(::pipe(p) == 0, "pipe failed");
    pid_t pid = ::fork();
    LT_CHECK(pid >= 0, "fork failed");
    if (pid == 0) {
      ::close(p[0]);
      for (int q = 0; q < r; ++q) ::close(fds[q]);
      std::string text;
      int code = 0;
      try {
        text = fn(r);
      } catch (const std::exception& e) {
        text = e.what();
        code = 1;
      }
      size_t off = 0;
      while (off < text.size()) {
        ssize_t w = ::write(p[1], text.data() + off, text.size() - off);
        if (w <= 0) break;
        off += static_cast<size_t>(w);
      }
      ::_exit(code);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
  }
  std::vector<RankOutcome> out(n);
  const auto deadline = Clock::now() + limit;
  std::vector<bool> open(n, true);
  for (;;) {
    std::vector<pollfd> pf;
    std::vector<int> who;
    for (int r = 0; r < n; ++r) {
      if (open[r]) {
        pf.push_back({fds[r], POLLIN, 0});
        who.push_back(r);
      }
    }
    if (pf.empty()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    if (::poll(pf.data(), pf.size(), static_cast<int>(left)) <= 0) continue;
    for (size_t i = 0; i < pf.size(); ++i) {
      if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      ssize_t k = ::read(fds[who[i]], buf, sizeof(buf));
      if (k > 0) {
        out[who[i]].text.append(buf, static_cast<size_t>(k));
      } else {
        open[who[i]] = false;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    ::close(fds[r]);
    int status = 0;
    // The pipe closes at exit; give the process a moment to be reapable, then kill it if it lingers.
    const auto reap_deadline = std::max(deadline, Clock::now() + std::chrono::milliseconds(500));
    pid_t got = 0;
    while ((got = ::waitpid(pids[r], &status, WNOHANG)) == 0 && Clock::now() < reap_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (got == pids[r]) {
      out[r].status = status;
    } else {
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], &status, 0);
      out[r].status = -1;
      out[r].text += "\n[killed by the test at its deadline]";
    }
  }
  return out;
}

// A fresh empty directory under the system temp directory, removed by the destructor.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "longtrain-parallel-XXXXXX").string();
    LT_CHECK(::mkdtemp(tmpl.data()) != nullptr, "mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str(const std::string& name = "") const { return (name.empty() ? path : path / name).string(); }
};


// Starts argv[0] with `env` added to this process's environment, stdout and stderr to files.
inline pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                   const std::string& stdout_path, const std::string& stderr_path) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  LT_CHECK(pid >= 0, "fork failed");
  if (pid == 0) {
    int out = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror("execv");
    ::_exit(127);
  }
  return pid;
}

// Waits for a child up to `limit`; the raw status, or nothing if it is still running.
inline std::optional<int> wait_for_exit(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    int status = 0;
    pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == pid) return status;
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Kills and reaps a child that is still running (cleanup after a failed expectation).
inline void kill_and_reap(pid_t pid) {
  if (::kill(pid, SIGKILL) == 0) ::waitpid(pid, nullptr, 0);
}

// True while `pid` exists and is not a zombie (an orphaned rank may sit unreaped as a zombie when
// PID 1 of a container does not reap; it is dead all the same).
inline bool pid_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

// Waits until none of `pids` is alive; returns the ones still alive at the deadline.
inline std::vector<pid_t> wait_until_dead(const std::vector<pid_t>& pids, Clock::time_point deadline) {
  for (;;) {
    std::vector<pid_t> alive;
    for (pid_t p : pids) {
      if (pid_alive(p)) alive.push_back(p);
    }
    if (alive.empty() || Clock::now() >= deadline) return alive;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace longtrain::test
