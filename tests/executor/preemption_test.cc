// A run stopped by SIGTERM or SIGINT (SLURM, a spot interruption, SageMaker's stop, Ctrl-C) or by
// its time limit saves the step it was training and exits with kExitStopped; --resume then goes
// on bit for bit as if the run had never stopped. Four local ranks through the real binary.

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>

#include "moeplan/core/exit_codes.h"
#include "moeplan/executor/io/checkpoint.h"
#include "run_fixture.h"

namespace moeplan::test {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

class Preemption : public ::testing::Test {
 protected:
  // Two checkpoints in the run: a signal lands in a step, in a save or between them, as in a
  // longer run.
  static constexpr int64_t kSteps = 8, kEvery = 4;
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    FourRankPlans plans;
    write_four_rank_plans(*dir_, plans, [](Json& plan) { plan["training"]["steps"] = 40; });
    if (plans.four_ranks.empty()) return;
    plan_ = plans.four_ranks;
    one_rank_plan_ = plans.one_rank;
    // The run that is never stopped, timed from its first step to its last (not to its exit,
    // which writes the report): the signals are aimed inside that.
    const pid_t ref = spawn_moeplan(argv("reference", {"--steps", std::to_string(kSteps)}), {}, "/dev/null",
                                    dir_->file("reference.err"));
    ASSERT_GE(wait_for_steps("reference", 1, 120), 1u) << read_text(dir_->file("reference.err"));
    const auto t0 = Clock::now();
    ASSERT_EQ(wait_for_steps("reference", kSteps, 120), static_cast<size_t>(kSteps))
        << read_text(dir_->file("reference.err"));
    steps_seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
    ASSERT_EQ(wait_moeplan(ref, 120), 0) << read_text(dir_->file("reference.err"));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (plan_.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  }

  // The arguments of a run of the 4-rank plan into folder `out`, checkpoints every kEvery steps.
  static std::vector<std::string> argv(const std::string& out, std::vector<std::string> extra,
                                       const std::string& plan = "") {
    std::vector<std::string> a{"run", plan.empty() ? plan_ : plan, "--data", dir_->file("data"), "--out",
                               dir_->file(out), "--checkpoint-every", std::to_string(kEvery), "--threads", "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  static std::string args(const std::string& out, std::vector<std::string> extra) {
    std::string line;
    for (const std::string& a : argv(out, std::move(extra))) line += (line.empty() ? "" : " ") + a;
    return line;
  }

  // Waits until the run in `out` has logged `steps` steps (or `seconds` pass); the count.
  static size_t wait_for_steps(const std::string& out, size_t steps, double seconds) {
    const auto until = Clock::now() + std::chrono::duration<double>(seconds);
    size_t n = 0;
    while ((n = read_metrics(dir_->file(out)).size()) < steps && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return n;
  }

  // The run in `out` against the reference: every step's numbers and every saved shard of the
  // last checkpoint equal bit for bit.
  static void expect_same_as_reference(const std::string& out, const std::string& what) {
    const std::vector<Json> a = read_metrics(dir_->file("reference")), b = read_metrics(dir_->file(out));
    ASSERT_EQ(b.size(), a.size()) << what;
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* key : {"step", "loss", "aux_loss", "total_loss", "grad_norm", "lr", "tokens_per_expert"})
        EXPECT_EQ(b[i][key], a[i][key]) << what << ": step " << i + 1 << " " << key;
    const auto last = [](const std::string& run) {
      return executor::open_checkpoint(executor::latest_checkpoint(run + "/checkpoints"));
    };
    const executor::LoadedCheckpoint x = last(dir_->file("reference")), y = last(dir_->file(out));
    EXPECT_EQ(y.step, x.step) << what;
    ASSERT_EQ(y.files.size(), x.files.size()) << what;
    for (size_t i = 0; i < x.files.size(); ++i)
      EXPECT_EQ(y.files[i].crc32, x.files[i].crc32) << what << ": " << x.files[i].name;
  }

  static TempDir* dir_;
  static std::string one_rank_plan_, plan_;
  static double steps_seconds_;
};

TempDir* Preemption::dir_ = nullptr;
std::string Preemption::one_rank_plan_, Preemption::plan_;
double Preemption::steps_seconds_ = 0;

// Leftovers of a save that did not finish: none may stay.
int64_t temporary_files(const std::string& run) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(run))
    if (e.path().extension() == ".tmp") ++n;
  return n;
}

TEST_F(Preemption, SigtermAtRandomMomentsSavesTheStepInFlightAndResumesBitForBit) {
  // Signals that land after the last step (while the report is written; a trial may run
  // faster than the reference) end a finished run: the trials go on until 20 landed inside the
  // steps (7 of 27 trials landed after the last step on a 2-vCPU VM).
  constexpr int kStops = 20, kMaxTrials = 50;
  std::mt19937_64 rng(20261127);
  int stopped = 0, finished = 0;
  for (int trial = 0; trial < kMaxTrials && stopped < kStops; ++trial) {
    const std::string out = "sigterm-" + std::to_string(trial), err = dir_->file(out + ".err");
    const pid_t launcher = spawn_moeplan(argv(out, {"--steps", std::to_string(kSteps)}), {}, dir_->file(out + ".out"), err);
    // A moment inside the training steps: after the first, up to the reference run's length.
    ASSERT_GE(wait_for_steps(out, 1, 120), 1u) << read_text(err);
    std::this_thread::sleep_for(std::chrono::duration<double>(
        std::uniform_real_distribution<double>(0, steps_seconds_)(rng)));
    const size_t logged = read_metrics(dir_->file(out)).size();
    ASSERT_EQ(::kill(launcher, SIGTERM), 0);
    const int code = wait_moeplan(launcher, 90);
    const std::string said = read_text(err) + read_text(dir_->file(out + ".out"));
    const std::vector<Json> m = read_metrics(dir_->file(out));
    const std::string checkpoint = executor::latest_checkpoint(dir_->file(out) + "/checkpoints");
    if (code == kExitOk) {
      ++finished;  // the signal came after the last step
      EXPECT_EQ(m.size(), static_cast<size_t>(kSteps)) << said;
    } else {
      ASSERT_EQ(code, kExitStopped) << "trial " << trial << "\n" << said;
      ++stopped;
      // Nothing trained is lost: the checkpoint is the last step logged, the step in flight or a
      // later one.
      ASSERT_FALSE(checkpoint.empty()) << said;
      const executor::LoadedCheckpoint c = executor::open_checkpoint(checkpoint);
      EXPECT_EQ(c.step, static_cast<int64_t>(m.size())) << said;
      EXPECT_GE(c.step, static_cast<int64_t>(logged)) << said;
      // Every rank is sent the signal; one already inside the vote when it lands votes before
      // it has caught it, so one to four ranks count it.
      bool named = false;
      for (int ranks = 1; ranks <= 4; ++ranks)
        named = named || said.find("stopped before step " + std::to_string(c.step + 1) + " (SIGTERM on " +
                                   std::to_string(ranks) + " of 4 ranks): saved") != std::string::npos;
      EXPECT_TRUE(named) << said;
      EXPECT_EQ(temporary_files(dir_->file(out)), 0);
      const Command resumed = run_moeplan(args(out, {"--steps", std::to_string(kSteps), "--resume"}));
      ASSERT_EQ(resumed.exit_code, 0) << show(resumed);
    }
    expect_same_as_reference(out, "trial " + std::to_string(trial));
    fs::remove_all(dir_->file(out));
  }
  std::printf("SIGTERM trials: %d stopped and resumed, %d after the last step (steps took %.2f s unstopped)\n",
              stopped, finished, steps_seconds_);
  EXPECT_EQ(stopped, kStops) << "too few signals landed inside the run";
}

// Only rank 2 gets the signal (a node's agent stopped, say): the ranks still stop together.
TEST_F(Preemption, ASignalToOneRankStopsEveryRankAtTheSameStep) {
  const std::string out = "one-rank-signalled", err = dir_->file(out + ".err");
  const pid_t launcher = spawn_moeplan(argv(out, {"--steps", "40"}), {}, dir_->file(out + ".out"), err);
  ASSERT_GE(wait_for_steps(out, 2, 120), 2u) << read_text(err);
  const std::vector<pid_t> rank2 = rank_processes(launcher, 2);
  ASSERT_EQ(rank2.size(), 1u);
  ASSERT_EQ(::kill(rank2[0], SIGTERM), 0);
  const int code = wait_moeplan(launcher, 90);
  const std::string said = read_text(err) + read_text(dir_->file(out + ".out"));
  ASSERT_EQ(code, kExitStopped) << said;
  const size_t steps = read_metrics(dir_->file(out)).size();
  EXPECT_LT(steps, 40u);
  EXPECT_NE(said.find("(SIGTERM on 1 of 4 ranks): saved"), std::string::npos) << said;
  const executor::LoadedCheckpoint c =
      executor::open_checkpoint(executor::latest_checkpoint(dir_->file(out) + "/checkpoints"));
  EXPECT_EQ(c.step, static_cast<int64_t>(steps));
  EXPECT_EQ(c.files.size(), 4u) << "every rank wrote its shard";
}

// A signal while the ranks start: nothing was trained, nothing is saved, and the folder stays
// one that a fresh run (not --resume) takes.
TEST_F(Preemption, ASignalBeforeTheFirstStepLeavesAFreshFolder) {
  const std::string out = "before-first-step", err = dir_->file(out + ".err");
  const pid_t launcher = spawn_moeplan(argv(out, {"--steps", "2"}), {}, dir_->file(out + ".out"), err);
  // As soon as the last rank has started: the ranks hold the signal until they catch it, and
  // they vote on it before their first step.
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (rank_processes(launcher, 3).empty() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(::kill(launcher, SIGINT), 0);
  const int code = wait_moeplan(launcher, 90);
  const std::string said = read_text(err) + read_text(dir_->file(out + ".out"));
  if (code == kExitOk) GTEST_SKIP() << "the run's two steps were over before the signal";
  ASSERT_EQ(code, kExitStopped) << said;
  if (!read_metrics(dir_->file(out)).empty()) GTEST_SKIP() << "the signal came after the first step";
  EXPECT_NE(said.find("nothing trained, nothing saved"), std::string::npos) << said;
  const Command again = run_moeplan(args(out, {"--steps", "2"}));
  EXPECT_EQ(again.exit_code, 0) << show(again);
}

// One rank with a time limit shorter than its steps: it stops, saved, and exits 3; the limit
// is checked before each step with the longest step and the save in view.
TEST_F(Preemption, ATimeLimitStopsTheRunSavedBeforeIt) {
  Json plan = read_json_file(one_rank_plan_);
  plan["training"]["steps"] = 400;
  const std::string long_plan = dir_->write("plan-1-long.json", plan);
  const auto t0 = Clock::now();
  std::string line;
  for (const std::string& a : argv("time-limit-1", {"--stop-after", "3"}, long_plan)) line += a + " ";
  const Command limited = run_moeplan(line);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(limited.exit_code, kExitStopped) << show(limited);
  EXPECT_NE(limited.out.find("(--stop-after 3 s): saved"), std::string::npos) << show(limited);
  const size_t steps = read_metrics(dir_->file("time-limit-1")).size();
  EXPECT_GT(steps, 0u);
  EXPECT_LT(steps, 400u);
  const executor::LoadedCheckpoint c =
      executor::open_checkpoint(executor::latest_checkpoint(dir_->file("time-limit-1") + "/checkpoints"));
  EXPECT_EQ(c.step, static_cast<int64_t>(steps));
  EXPECT_LT(seconds, 60) << "the limit counts from the first step; the process start comes on top";
  std::printf("--stop-after 3: stopped after %zu steps, %.1f s with the process start\n", steps, seconds);

  const Command bad = run_moeplan(args("time-limit-bad", {"--stop-after", "4x"}));
  EXPECT_EQ(bad.exit_code, kExitBadInput) << show(bad);
  EXPECT_NE(bad.err.find("--stop-after"), std::string::npos) << show(bad);
}

}  // namespace
}  // namespace moeplan::test
