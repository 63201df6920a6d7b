#include "moeplan/executor/ranks/stop.h"

#include <signal.h>

#include <atomic>
#include <cstring>
#include <ctime>

namespace moeplan::executor {

namespace {

// Written by the handler, which may run on any thread: lock-free atomics only.
std::atomic<int> g_signal{0};
std::atomic<int64_t> g_signal_nanoseconds{0};  // CLOCK_MONOTONIC, which steady_clock reads on Linux
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free);

void on_stop_signal(int signal) {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  int none = 0;
  if (g_signal.compare_exchange_strong(none, signal))
    g_signal_nanoseconds.store(int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec);
}

sigset_t stop_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (const int signal : stop_signals()) sigaddset(&set, signal);
  return set;
}

}  // namespace

void catch_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  const sigset_t set = stop_signal_set();
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

std::vector<int> stop_signals() { return {SIGTERM, SIGINT}; }

int stop_signal() { return g_signal.load(); }

std::chrono::steady_clock::time_point stop_signal_time() {
  return std::chrono::steady_clock::time_point(std::chrono::nanoseconds(g_signal_nanoseconds.load()));
}

std::string signal_name(int signal) {
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGINT) return "SIGINT";
  return "signal " + std::to_string(signal);
}

void reset_stop_signal() { g_signal.store(0); }

}  // namespace moeplan::executor
