// A checkpoint save killed with SIGKILL at random moments never leaves a checkpoint that loads,
// and the previous one still loads and resumes.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "moeplan/executor/io/checkpoint.h"
#include "run_fixture.h"

namespace moeplan::test {
namespace {

namespace fs = std::filesystem;

TEST(Crash, SaveKilledAtRandomMomentsNeverLeavesALoadableBrokenCheckpoint) {
  TempDir dir;
  const auto files = fortune_files({"fortunes", "wisdom", "science"});
  if (files.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  ASSERT_EQ(prepare_data(files, dir.file("data"), 4096, 64).exit_code, 0);
  const std::string plan = dir.file("plan.json");
  ASSERT_EQ(make_plan(profile_path("models/mixtral-tiny.json"), plan, 64, 128, "fp32", 2).exit_code, 0);
  const std::string out = dir.file("run");
  const std::vector<std::string> base{"run", plan, "--data", dir.file("data"), "--out", out, "--threads", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto wait_exit = [](pid_t pid) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };

  // Step 1 with a complete checkpoint: the one every killed save must leave intact.
  ASSERT_EQ(wait_exit(spawn_moeplan(with({"--steps", "1", "--checkpoint-every", "1"}))), 0);
  const std::string checkpoints = out + "/checkpoints", step1 = checkpoints + "/step-00000001",
                    step2 = checkpoints + "/step-00000002";
  ASSERT_EQ(executor::latest_checkpoint(checkpoints), step1);

  // How long a resume + one step + a save takes, to aim the kills at the save.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(wait_exit(spawn_moeplan(with({"--resume", "--steps", "2", "--checkpoint-every", "1"}))), 0);
  const double full_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(executor::latest_checkpoint(checkpoints), step2);

  std::mt19937_64 rng(20261122);
  int attempts = 0, during_save = 0, before_save = 0, after_commit = 0;
  // The kill moment is drawn from [lo, hi] (fractions of the run), a window that closes in on
  // the save: a kill after the commit lowers hi, one before the save raises lo. The run's time
  // varies from one start to the next, so a window grown too narrow opens again.
  double lo = 0.5, hi = 1.0;
  while (during_save < 20 && attempts < 200) {
    ++attempts;
    fs::remove_all(step2);
    const double fraction = std::uniform_real_distribution<double>(lo, hi)(rng);
    const double at_s = fraction * full_s;
    const pid_t pid = spawn_moeplan(with({"--resume", "--steps", "2", "--checkpoint-every", "1"}));
    std::this_thread::sleep_for(std::chrono::duration<double>(at_s));
    ::kill(pid, SIGKILL);
    wait_exit(pid);
    const bool has_dir = fs::exists(step2), has_manifest = fs::exists(step2 + "/manifest.json");
    if (!has_dir) {
      ++before_save;
      lo = fraction;
    } else if (has_manifest) {
      ++after_commit;
      hi = fraction;
    } else {
      ++during_save;
    }
    if (hi - lo < 0.01) {
      lo = std::max(0.3, lo - 0.1);
      hi = std::min(1.2, hi + 0.1);
    }
    if (has_manifest) {
      // Committed: it must be whole.
      EXPECT_NO_THROW(executor::open_checkpoint(step2)) << "attempt " << attempts;
    } else {
      if (has_dir) {
        EXPECT_THROW(executor::open_checkpoint(step2), InputError) << "attempt " << attempts;
      }
      EXPECT_EQ(executor::latest_checkpoint(checkpoints), step1) << "attempt " << attempts;
    }
    // Whatever happened, the newest complete checkpoint loads.
    EXPECT_NO_THROW(executor::open_checkpoint(executor::latest_checkpoint(checkpoints))) << "attempt " << attempts;
  }
  std::printf("kills: %d attempts, %d during the save, %d before it, %d after the commit (run %.2f s)\n", attempts,
              during_save, before_save, after_commit, full_s);
  EXPECT_GE(during_save, 20) << "the kills did not land inside the save often enough";

  // And training goes on from what is there.
  fs::remove_all(step2);
  const Command resumed = run_moeplan(("run " + plan + " --data " + dir.file("data") + " --out " +
                                                            out + " --threads 1 --resume --steps 3"));
  EXPECT_EQ(resumed.exit_code, 0) << show(resumed);
  EXPECT_NE(resumed.all().find("step-00000001"), std::string::npos) << show(resumed);
  EXPECT_EQ(read_metrics(out).size(), 3u);
}

}  // namespace
}  // namespace moeplan::test
