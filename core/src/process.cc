#include "moeplan/core/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>

#if defined(__SANITIZE_ADDRESS__)
#define MOEPLAN_LEAK_CHECK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOEPLAN_LEAK_CHECK 1
#endif
#endif
#ifndef MOEPLAN_LEAK_CHECK
#define MOEPLAN_LEAK_CHECK 0
#endif
#if MOEPLAN_LEAK_CHECK
#include <sanitizer/lsan_interface.h>
#endif

extern char** environ;

namespace moeplan {

namespace {

// The pointers execve takes, into `strings`, which must outlive them.
std::vector<char*> null_terminated(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (const std::string& s : strings) pointers.push_back(const_cast<char*>(s.c_str()));
  pointers.push_back(nullptr);
  return pointers;
}

ChildExit child_exit(pid_t pid, int status) {
  ChildExit e;
  e.pid = pid;
  e.exited = WIFEXITED(status);
  e.code = e.exited ? WEXITSTATUS(status) : 0;
  e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return e;
}

// In the forked child: async-signal-safe calls only.
[[noreturn]] void become(const char* path, char* const* argv, char* const* envp, const char* output_path) {
  if (output_path != nullptr) {
    const int fd = ::open(output_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) ::_exit(127);
    if (fd != 1) {
      ::dup2(fd, 1);
      ::close(fd);
    }
    ::dup2(1, 2);
  }
  ::execve(path, argv, envp);
  ::_exit(127);
}

// Blocks `signals` in this thread until the object ends, when the mask before is put back.
class BlockedSignals {
 public:
  explicit BlockedSignals(const std::vector<int>& signals) : masks_(!signals.empty()) {
    if (!masks_) return;
    sigset_t blocked;
    sigemptyset(&blocked);
    for (const int s : signals) sigaddset(&blocked, s);
    ::pthread_sigmask(SIG_SETMASK, nullptr, &before_);
    ::pthread_sigmask(SIG_BLOCK, &blocked, nullptr);
  }
  ~BlockedSignals() {
    if (masks_) ::pthread_sigmask(SIG_SETMASK, &before_, nullptr);
  }
  // Leaves the signals blocked (in a forked child, which starts with them blocked).
  void keep() { masks_ = false; }
  BlockedSignals(const BlockedSignals&) = delete;
  BlockedSignals& operator=(const BlockedSignals&) = delete;

 private:
  bool masks_;
  sigset_t before_{};
};

}  // namespace

pid_t start_child(const ChildProgram& program) {
  pid_t pid = -1;
  int fork_errno = 0;
  {
    const std::vector<char*> argv = null_terminated(program.argv);
    const std::vector<char*> envp =
        program.environment ? null_terminated(*program.environment) : std::vector<char*>{};
    char* const* env = program.environment ? envp.data() : environ;
    const char* output_path = program.output_path.empty() ? nullptr : program.output_path.c_str();
    // The signals are blocked in this thread across the fork, so that the child starts with them
    // blocked; this thread's own mask is put back right after.
    const BlockedSignals blocked(program.blocked_signals);
    pid = ::fork();
    if (pid == 0) become(program.path.c_str(), argv.data(), env, output_path);
    fork_errno = errno;
  }
  errno = fork_errno;  // past the destructors, for the caller's message
  return pid;
}

bool one_thread_runs() {
  std::error_code error;
  std::filesystem::directory_iterator tasks("/proc/self/task", error);
  if (error) return false;
  int64_t threads = 0;
  for (; tasks != std::filesystem::directory_iterator() && !error; tasks.increment(error)) ++threads;
  return !error && threads == 1;
}

void end_process(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#if MOEPLAN_LEAK_CHECK
  __lsan_do_leak_check();
#endif
  ::_exit(code);
}

pid_t start_copy(const std::function<int()>& body, const std::vector<int>& blocked_signals) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  pid_t pid = -1;
  {
    BlockedSignals blocked(blocked_signals);
    pid = ::fork();
    if (pid != 0) return pid;  // errno stays fork's
    blocked.keep();
  }
  int code = 1;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "moeplan: error: an unknown error\n");
  }
  end_process(code);
}

ChildExit wait_for_child(pid_t pid) {
  // Stays 0 (exited with 0) when `pid` is no child of this process.
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return child_exit(pid, status);
}

ChildPoll poll_children() {
  int status = 0;
  const pid_t pid = ::waitpid(-1, &status, WNOHANG);
  ChildPoll poll;
  if (pid > 0) {
    poll.state = ChildPoll::State::kEnded;
    poll.ended = child_exit(pid, status);
  } else if (pid < 0 && errno != EINTR) {
    poll.state = ChildPoll::State::kNoChildren;
  }
  return poll;
}

void replace_this_process(const std::string& path, const std::vector<std::string>& argv) {
  int exec_errno = 0;
  {
    const std::vector<char*> args = null_terminated(argv);
    std::fflush(stdout);
    ::execv(path.c_str(), args.data());
    exec_errno = errno;
  }
  errno = exec_errno;  // past the destructors, for the caller's message
}

std::optional<std::string> this_program_path() {
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n <= 0) return std::nullopt;
  self.resize(static_cast<size_t>(n));
  return self;
}

}  // namespace moeplan
