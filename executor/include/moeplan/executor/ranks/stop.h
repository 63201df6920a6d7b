#pragma once
// Stopping a run before its last step without losing work. SLURM at a job's end, SageMaker's
// stop, a spot interruption and Ctrl-C all send SIGTERM or SIGINT, then kill the process after a
// grace period (SLURM's KillWait, 30 s by default). A rank that catches one finishes the step in
// flight; before the next step the ranks agree to stop together, save a checkpoint of the step
// they all finished, and exit with kExitStopped. A time limit (--stop-after) ends a run the same
// way. The signal is the one piece of process-wide state: a signal reaches a process, not an
// object.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace moeplan::executor {

// Catches SIGTERM and SIGINT from now on (the handler only records the signal, so no system call
// of another thread is cut short: SA_RESTART) and unblocks them, in case the launcher started
// this process with them blocked.
void catch_stop_signals();

// SIGTERM and SIGINT: a launcher starts a rank with them blocked (ChildProgram::blocked_signals),
// so that one sent while the rank starts waits until the rank catches it.
std::vector<int> stop_signals();

// The first stop signal caught (SIGTERM, SIGINT), or 0.
int stop_signal();
// When it was caught, on the steady clock; meaningless while stop_signal() is 0.
std::chrono::steady_clock::time_point stop_signal_time();
// "SIGTERM", "SIGINT", or "signal N".
std::string signal_name(int signal);

// Forgets a caught signal (tests that run several runs in one process).
void reset_stop_signal();

}  // namespace moeplan::executor
