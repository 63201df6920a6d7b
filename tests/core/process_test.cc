#include "moeplan/core/process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace moeplan {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string temporary_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))).string();
}

TEST(Process, OutputAndErrorGoToTheFileAndTheExitCodeComesBack) {
  const std::string log = temporary_path("process-output");
  ChildProgram child{"/bin/sh", {"sh", "-c", "echo out; echo err >&2; exit 3"}, std::nullopt, log, {}};
  const pid_t pid = start_child(child);
  ASSERT_GT(pid, 0);
  const ChildExit ended = wait_for_child(pid);
  EXPECT_EQ(ended.pid, pid);
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 3);
  EXPECT_EQ(ended.signal, 0);
  EXPECT_EQ(read_file(log), "out\nerr\n");
  std::filesystem::remove(log);
}

TEST(Process, TheChildHasTheEnvironmentItIsGiven) {
  const std::string log = temporary_path("process-environment");
  ChildProgram child{"/usr/bin/env", {"env"}, std::vector<std::string>{"ONLY=this"}, log, {}};
  const ChildExit ended = wait_for_child(start_child(child));
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 0);
  EXPECT_EQ(read_file(log), "ONLY=this\n");
  std::filesystem::remove(log);
}

// SigBlk in /proc/<pid>/status: bit n - 1 for signal n, so SIGINT (2) and SIGTERM (15) are 0x4002.
TEST(Process, BlockedSignalsAreBlockedInTheProgramAndNotHere) {
  const std::string log = temporary_path("process-mask");
  ChildProgram child{"/bin/grep", {"grep", "SigBlk", "/proc/self/status"}, std::nullopt, log, {SIGTERM, SIGINT}};
  const ChildExit ended = wait_for_child(start_child(child));
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(read_file(log), "SigBlk:\t0000000000004002\n");
  sigset_t mine;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mine);
  EXPECT_FALSE(sigismember(&mine, SIGTERM));
  EXPECT_FALSE(sigismember(&mine, SIGINT));
  std::filesystem::remove(log);
}

TEST(Process, AKilledChildSaysBySignal) {
  ChildProgram child{"/bin/sh", {"sh", "-c", "kill -KILL $$"}, std::nullopt, "", {}};
  const ChildExit ended = wait_for_child(start_child(child));
  EXPECT_FALSE(ended.exited);
  EXPECT_EQ(ended.signal, SIGKILL);
}

TEST(Process, AProgramThatCannotRunExitsWith127) {
  ChildProgram child{"/nonexistent/program", {"program"}, std::nullopt, "", {}};
  const ChildExit ended = wait_for_child(start_child(child));
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 127);
}

TEST(Process, PollingFindsTheChildThatEndedThenNoChildren) {
  ChildProgram child{"/bin/sh", {"sh", "-c", "exit 5"}, std::nullopt, "", {}};
  const pid_t pid = start_child(child);
  ChildPoll poll;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((poll = poll_children()).state == ChildPoll::State::kNoneEnded && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(poll.state, ChildPoll::State::kEnded);
  EXPECT_EQ(poll.ended.pid, pid);
  EXPECT_TRUE(poll.ended.exited);
  EXPECT_EQ(poll.ended.code, 5);
  EXPECT_EQ(poll_children().state, ChildPoll::State::kNoChildren);
}

TEST(Process, OneThreadRunsUntilAnotherStarts) {
  ASSERT_TRUE(one_thread_runs()) << "the test process runs threads of its own";
  std::promise<void> go;
  std::thread other([done = go.get_future()]() mutable { done.wait(); });
  EXPECT_FALSE(one_thread_runs());
  go.set_value();
  other.join();
  EXPECT_TRUE(one_thread_runs());
}

TEST(Process, ACopyRunsItsBodyWithThisProcesssStateAndExitsWithItsCode) {
  const std::string log = temporary_path("process-copy");
  std::string state = "set before the copy";
  const pid_t pid = start_copy([&] {
    std::ofstream(log) << state << " in " << ::getpid();
    state = "changed in the copy";
    return 7;
  });
  ASSERT_GT(pid, 0);
  const ChildExit ended = wait_for_child(pid);
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 7);
  EXPECT_EQ(read_file(log), "set before the copy in " + std::to_string(pid));
  EXPECT_EQ(state, "set before the copy");
  std::filesystem::remove(log);
}

TEST(Process, ACopyDoesNotWriteAgainWhatStdoutHeld) {
  const std::string log = temporary_path("process-copy-stdout");
  std::fflush(stdout);
  const int saved = ::dup(1);
  ASSERT_GE(saved, 0);
  ASSERT_NE(std::freopen(log.c_str(), "w", stdout), nullptr);
  std::fputs("held;", stdout);  // a file: fully buffered, not yet written
  const ChildExit ended = wait_for_child(start_copy([] {
    std::fputs("copy;", stdout);
    return 0;
  }));
  std::fputs("here", stdout);
  std::fflush(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  EXPECT_EQ(ended.code, 0);
  EXPECT_EQ(read_file(log), "held;copy;here");
  std::filesystem::remove(log);
}

// Set while the test below runs: where an exit handler of this program writes that it ran.
std::string exit_handler_log;
void note_exit_handler() {
  if (!exit_handler_log.empty()) std::ofstream(exit_handler_log) << "ran in " << ::getpid();
}

TEST(Process, ACopyRunsNoneOfThisProcesssExitHandlers) {
  static const int registered = std::atexit(note_exit_handler);
  ASSERT_EQ(registered, 0);
  exit_handler_log = temporary_path("process-copy-atexit");
  const ChildExit ended = wait_for_child(start_copy([] { return 0; }));
  const std::string log = exit_handler_log;
  exit_handler_log.clear();
  EXPECT_EQ(ended.code, 0);
  EXPECT_FALSE(std::filesystem::exists(log)) << read_file(log);
  std::filesystem::remove(log);
}

TEST(Process, ACopyStartsWithTheSignalsBlockedAndThisProcessKeepsItsMask) {
  const ChildExit ended = wait_for_child(start_copy(
      [] {
        sigset_t mask;
        ::pthread_sigmask(SIG_SETMASK, nullptr, &mask);
        return sigismember(&mask, SIGTERM) && sigismember(&mask, SIGINT) ? 0 : 1;
      },
      {SIGTERM, SIGINT}));
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 0);
  sigset_t mine;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mine);
  EXPECT_FALSE(sigismember(&mine, SIGTERM));
  EXPECT_FALSE(sigismember(&mine, SIGINT));
}

TEST(Process, AnExceptionOutOfACopysBodyExitsOne) {
  const ChildExit ended = wait_for_child(start_copy([]() -> int { throw std::runtime_error("lost"); }));
  EXPECT_TRUE(ended.exited);
  EXPECT_EQ(ended.code, 1);
}

TEST(Process, ThisProgramIsTheTestBinary) {
  const std::optional<std::string> self = this_program_path();
  ASSERT_TRUE(self.has_value());
  EXPECT_EQ(std::filesystem::path(*self).filename(), "test_core");
}

}  // namespace
}  // namespace moeplan
