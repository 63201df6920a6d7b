#pragma once
// Starting other programs (POSIX): the one place moeplan forks, execs and reads how a child
// ended. Everything a child needs is built before the fork: in a process with threads, a forked
// child may only make async-signal-safe calls until it runs its program.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace moeplan {

// A program to start as a child of this process.
struct ChildProgram {
  std::string path;               // the file run, as execve takes it (no PATH search)
  std::vector<std::string> argv;  // argv[0] included
  // Its environment, "NAME=value" each; nothing: this process's own.
  std::optional<std::vector<std::string>> environment;
  // "": its standard output and error are this process's; else both go to this file, created
  // or truncated (mode 0644).
  std::string output_path;
  // Blocked in the child before its program starts (a signal mask survives exec), so that one
  // sent while the program starts up waits until the program catches or unblocks it.
  std::vector<int> blocked_signals;
};

// Starts `program`: the child's pid, or -1 with errno set when no child could be made. A child
// that cannot open its output file or run its program exits with 127.
pid_t start_child(const ChildProgram& program);

// Whether this process runs one thread only (/proc/self/task); false when that cannot be read.
bool one_thread_runs();

// Ends this process with `code` once what its streams hold is written: without the exit handlers
// and static destructors, which have nothing left to write by then (LibTorch's alone unregister
// some thousand operators; in a copy of start_copy they are the copied process's and would run a
// second time). Under LeakSanitizer its leaks are looked for first, as at a normal exit. For the
// end of main and of a copy's body, when every object that writes a file has been destroyed.
[[noreturn]] void end_process(int code);

// Starts a copy of this process (fork without exec): a child that runs `body` and exits with the
// code it returns (an exception out of `body` is printed and exits 1; it never returns into the
// caller's code). It ends through end_process. The copy shares the program
// this process has loaded instead of loading it again. Only a process that runs one thread may
// copy itself (one_thread_runs()): a lock that another thread held would stay held in the copy.
// What stdout and std::cout hold is written out first, so that the copy does not write it again;
// `blocked_signals` are blocked in the copy as in ChildProgram. Returns the child's pid, or -1
// with errno set when no child could be made.
pid_t start_copy(const std::function<int()>& body, const std::vector<int>& blocked_signals = {});

// How a child ended: by exit() with `code`, or killed by `signal`.
struct ChildExit {
  pid_t pid = 0;
  bool exited = false;
  int code = 0;
  int signal = 0;  // 0 when it exited
};

// Waits until child `pid` ends (a wait that a signal cuts short is taken up again).
ChildExit wait_for_child(pid_t pid);

// A look at this process's children that does not wait.
struct ChildPoll {
  enum class State : uint8_t {
    kEnded,       // `ended` is a child that ended (and is reaped)
    kNoneEnded,   // the children run on (or a signal cut the look short)
    kNoChildren,  // there is no child to wait for
  };
  State state = State::kNoneEnded;
  ChildExit ended;
};
ChildPoll poll_children();

// Runs `path` with `argv` (argv[0] included) in this process's place, once what stdout holds is
// written out. Returns only when it could not, with errno saying why.
void replace_this_process(const std::string& path, const std::vector<std::string>& argv);

// The path of this program (/proc/self/exe resolved); nothing when it cannot be read.
std::optional<std::string> this_program_path();

}  // namespace moeplan
