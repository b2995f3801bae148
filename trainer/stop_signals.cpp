#include "trainer/stop_signals.h"

#include <signal.h>

#include <atomic>

#include "runtime/error.h"

namespace longtrain::trainer {

namespace {

// Written by the handler, read by the training loop: a lock-free atomic is async-signal-safe.
std::atomic<int> g_requested{0};
std::atomic<bool> g_installed{false};
struct sigaction g_old_term, g_old_int;

void on_stop_signal(int sig) {
  int none = 0;
  if (!g_requested.compare_exchange_strong(none, sig)) {
    // The second signal: the user means it. Default action, raised again (the process ends).
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

}  // namespace

StopSignals::StopSignals() {
  LT_CHECK(!g_installed.exchange(true), "StopSignals: already installed in this process");
  g_requested = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and writes resume; the loop looks at the flag per step
  ::sigaction(SIGTERM, &sa, &g_old_term);
  ::sigaction(SIGINT, &sa, &g_old_int);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::sigaction(SIGINT, &g_old_int, nullptr);
  g_installed = false;
}

int StopSignals::requested() const { return g_requested.load(); }

const char* signal_name(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "a signal";
  }
}

}  // namespace longtrain::trainer
