// SIGTERM and SIGINT as a request to stop cleanly: the training loop finishes the step it is in,
// writes a checkpoint and exits with parallel::kExitPreempted, so a preempted job (Slurm sends
// SIGTERM first) or a Ctrl-C loses no work. A second signal of either kind ends the process at once,
// as it would without this handler.
#pragma once

namespace longtrain::trainer {

// While an instance lives, SIGTERM and SIGINT are caught; its destructor puts back the handlers that
// were there before. One instance at a time (a process trains once at a time).
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal that asked to stop (SIGTERM or SIGINT), or 0 while none did.
  int requested() const;
};

// The name of a signal number for logs ("SIGTERM").
const char* signal_name(int signal);

}  // namespace longtrain::trainer
