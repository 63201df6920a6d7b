// Faults a long run meets, each injected for real on four local ranks through the binary: a
// disk that fills up during a save (a small tmpfs mounted for the test), a weight that is NaN, a
// rank stuck outside the collectives (in a write that never returns).

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "moeplan/core/exit_codes.h"

#include "moeplan/core/checksum.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "run_fixture.h"
#include "sockets.h"

namespace moeplan::test {
namespace {

namespace fs = std::filesystem;

class Faults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    FourRankPlans plans;
    write_four_rank_plans(*dir_, plans);
    plan_ = plans.four_ranks;
    one_rank_plan_ = plans.one_rank;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (plan_.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  }
  static std::string run_args(const std::string& out, const std::string& extra) {
    return "run " + plan_ + " --data " + dir_->file("data") + " --out " + out + " --threads 1 " + extra;
  }

  static TempDir* dir_;
  static std::string plan_, one_rank_plan_;
};

TempDir* Faults::dir_ = nullptr;
std::string Faults::plan_, Faults::one_rank_plan_;

int64_t used_bytes(const std::string& path) {
  struct statvfs s {};
  ::statvfs(path.c_str(), &s);
  return static_cast<int64_t>((s.f_blocks - s.f_bfree) * s.f_frsize);
}

// A tmpfs of `bytes` mounted at `path` for the life of the object.
class SmallDisk {
 public:
  SmallDisk(const std::string& path, int64_t bytes) : path_(path) {
    fs::create_directories(path);
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", path.c_str(), "tmpfs", 0, options.c_str()) == 0)
      mounted_ = true;
    else
      why_not_ = std::strerror(errno);
  }
  ~SmallDisk() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_not_; }

 private:
  std::string path_, why_not_;
  bool mounted_ = false;
};

// The disk fills during the second save: every rank removes what that save wrote, the error
// names the file that could not be written, the first checkpoint still loads, and a resume on
// the same disk goes on from it.
TEST_F(Faults, ADiskFullDuringASaveRemovesItAndKeepsThePreviousCheckpoint) {
  // How much a checkpoint of this plan takes, measured on the ordinary disk.
  const std::string sized = dir_->file("sized");
  Command r = run_moeplan(run_args(sized, "--steps 1 --checkpoint-every 1"));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  int64_t checkpoint_bytes = 0;
  for (const auto& e : fs::recursive_directory_iterator(sized + "/checkpoints"))
    if (e.is_regular_file()) checkpoint_bytes += static_cast<int64_t>(e.file_size());
  ASSERT_GT(checkpoint_bytes, 0);

  // Room for one and a half checkpoints, the run's small files aside.
  const std::string mount = dir_->file("small-disk");
  const SmallDisk disk(mount, checkpoint_bytes * 3 / 2 + (1 << 20));
  if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root): " << disk.why_not();
  const std::string out = mount + "/run";
  r = run_moeplan(run_args(out, "--steps 3 --checkpoint-every 1"));
  EXPECT_NE(r.exit_code, 0) << show(r);
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << show(r);
  EXPECT_NE(r.err.find("step-00000002/rank-"), std::string::npos) << "the failed file is named\n" << show(r);
  EXPECT_NE(r.err.find("not saved: the save failed on rank"), std::string::npos) << show(r);
  EXPECT_FALSE(fs::exists(out + "/checkpoints/step-00000002")) << "the failed save is removed";
  for (const auto& e : fs::recursive_directory_iterator(out))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  const std::string first = out + "/checkpoints/step-00000001";
  EXPECT_EQ(executor::latest_checkpoint(out + "/checkpoints"), first);
  EXPECT_NO_THROW(executor::open_checkpoint(first));
  EXPECT_LT(used_bytes(mount), checkpoint_bytes + (1 << 20)) << "the disk holds the first checkpoint and little else";
  EXPECT_EQ(read_metrics(out).size(), 2u);

  r = run_moeplan(run_args(out, "--steps 3 --resume"));
  EXPECT_EQ(r.exit_code, 0) << show(r);
  EXPECT_NE(r.out.find("resumed from " + first + " at step 1"), std::string::npos) << show(r);
  EXPECT_EQ(read_metrics(out).size(), 3u);
}

// A NaN in one weight of layer 1: every step from there on is skipped (no update applied), and
// the third in a row stops the run, naming layer 1's parameters. The same checkpoint resumed on
// one rank (the reference trainer) says the same.
TEST_F(Faults, ANanWeightSkipsStepsThenStopsNamingTheLayer) {
  const std::string out = dir_->file("nan");
  Command r = run_moeplan(run_args(out, "--steps 2 --checkpoint-every 2"));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const std::string one_rank_out = dir_->file("nan-one-rank");
  fs::copy(out, one_rank_out, fs::copy_options::recursive);
  ASSERT_GT(plant_nan(out + "/checkpoints/step-00000002", "model.layers.1.self_attn.q_proj.weight"), 0);
  ASSERT_GT(plant_nan(one_rank_out + "/checkpoints/step-00000002", "model.layers.1.self_attn.q_proj.weight"), 0);

  for (const auto& [folder, plan] : {std::pair{out, plan_}, std::pair{one_rank_out, one_rank_plan_}}) {
    r = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + folder +
                    " --threads 1 --steps 10 --resume --max-nonfinite-steps 3");
    EXPECT_EQ(r.exit_code, 1) << show(r);
    EXPECT_NE(r.err.find("steps 3..5 had a NaN or an Inf in the loss or the gradients, 3 in a row"), std::string::npos)
        << show(r);
    EXPECT_NE(r.err.find("first appeared in the parameters of layer 1"), std::string::npos) << show(r);
    EXPECT_NE(r.err.find("the newest checkpoint is " + folder + "/checkpoints/step-00000002"), std::string::npos)
        << show(r);
    const std::vector<Json> m = read_metrics(folder);
    ASSERT_EQ(m.size(), 5u) << show(r);
    for (size_t i = 2; i < 5; ++i) {
      EXPECT_EQ(m[i].value("skipped", false), true) << m[i].dump();
      EXPECT_EQ(m[i].value("nonfinite", ""), "the parameters of layer 1") << m[i].dump();
    }
    EXPECT_FALSE(m[1].contains("skipped"));
  }
}

// Rank 0 hangs opening its metrics file (a named pipe nobody reads: a write to a hung network
// filesystem looks the same), alive and beating but outside any collective. The other ranks wait
// in the first collective of the step loop, time out, and name rank 0 and where it is.
TEST_F(Faults, ARankStuckOutsideTheCollectivesIsNamedByTheOthers) {
  const std::string out = dir_->file("stuck"), err = dir_->file("stuck.err");
  fs::create_directories(out);
  ASSERT_EQ(::mkfifo((out + "/metrics.jsonl").c_str(), 0644), 0) << std::strerror(errno);
  constexpr int kTimeout = 8;
  const auto start = std::chrono::steady_clock::now();
  const pid_t launcher = spawn_moeplan({"run", plan_, "--data", dir_->file("data"), "--out", out, "--threads", "1",
                                        "--steps", "2", "--timeout", std::to_string(kTimeout)},
                                       {}, "/dev/null", err);
  // The others time out and say so; then rank 0 is let go (a reader opens the pipe), meets the
  // peers gone at its first collective, and the run ends.
  std::string said;
  while ((said = read_text(err)).find("outside any collective") == std::string::npos &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int reader = ::open((out + "/metrics.jsonl").c_str(), O_RDONLY | O_NONBLOCK);
  const int code = wait_moeplan(launcher, 120);
  if (reader >= 0) ::close(reader);
  said = read_text(err);
  EXPECT_NE(code, 0) << said;
  EXPECT_NE(said.find("rank 0 is outside any collective for"), std::string::npos) << said;
  EXPECT_NE(said.find("all-reduce on world"), std::string::npos) << "the collective the others waited in\n" << said;
  EXPECT_LT(seconds, kTimeout + 30) << "named within the timeout and the heartbeat check\n" << said;
  std::printf("a rank stuck outside the collectives: named %.1f s after the start\n", seconds);
}

// The listening TCP sockets ("address:port" as /proc/net/tcp{,6} write them, in hex) of the
// processes `pids`.
std::vector<std::string> listening_sockets(const std::vector<pid_t>& pids) {
  std::set<std::string> inodes;
  for (const pid_t pid : pids)
    for (const auto& fd : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", fs::directory_options::skip_permission_denied)) {
      std::error_code ec;
      const std::string target = fs::read_symlink(fd.path(), ec).string();
      if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
    }
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the heading
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode) != 0) found.push_back(local);
    }
  }
  return found;
}

// A run on this machine listens on loopback only: the rendezvous store of the launcher and the
// gloo pairs of every rank. Nothing listens on every interface (0.0.0.0 or ::).
TEST_F(Faults, ALocalRunListensOnLoopbackOnly) {
  const std::string out = dir_->file("listen"), err = dir_->file("listen.err");
  const pid_t launcher = spawn_moeplan({"run", plan_, "--data", dir_->file("data"), "--out", out, "--threads", "1",
                                        "--steps", "40"},
                                       {}, "/dev/null", err);
  const auto start = std::chrono::steady_clock::now();
  while (read_metrics(out).size() < 2 && std::chrono::steady_clock::now() - start < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::vector<pid_t> processes{launcher};
  for (int r = 0; r < 4; ++r)
    for (const pid_t p : rank_processes(launcher, r)) processes.push_back(p);
  const std::vector<std::string> sockets = listening_sockets(processes);
  // The launcher's one listener is the store: this machine's other loopback addresses (all of
  // 127/8) are not let in, 127.0.0.1 is.
  const std::vector<std::string> store = listening_sockets({launcher});
  ASSERT_EQ(store.size(), 1u);
  const int port = std::stoi(store[0].substr(store[0].find(':') + 1), nullptr, 16);
  EXPECT_FALSE(connects_from("127.0.0.2", port)) << "the store took a connection from another address";
  EXPECT_TRUE(connects_from("127.0.0.1", port));
  ::kill(launcher, SIGTERM);
  EXPECT_EQ(wait_moeplan(launcher, 90), kExitStopped) << read_text(err);
  EXPECT_EQ(processes.size(), 5u);
  EXPECT_GE(sockets.size(), 5u) << "the store and a gloo listener per rank";
  for (const std::string& s : sockets)
    EXPECT_EQ(s.substr(0, 9), "0100007F:") << s << ": not 127.0.0.1";
}

}  // namespace
}  // namespace moeplan::test
