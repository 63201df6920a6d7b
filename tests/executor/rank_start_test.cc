// How a rank reads its place in the run from its launcher's environment variables.

#include "moeplan/executor/ranks/rank_start.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/process.h"
#include "sockets.h"

namespace moeplan::executor {
namespace {

// Sets the given variables for one test after clearing every launcher's, and clears them again.
class Environment {
 public:
  explicit Environment(std::vector<std::pair<std::string, std::string>> vars) : vars_(std::move(vars)) {
    clear();
    for (const auto& [name, value] : vars_) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~Environment() { clear(); }

 private:
  static void clear() {
    for (const char* name : {"MOEPLAN_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE",
                             "SLURM_NTASKS", "SLURM_LOCALID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                             "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE",
                             "MOEPLAN_STORE_PEERS"})
      ::unsetenv(name);
  }
  std::vector<std::pair<std::string, std::string>> vars_;
};

TEST(RankEnvironment, NoLauncherMeansNoRank) {
  const Environment env({});
  EXPECT_FALSE(rank_env_from_environment().has_value());
}

TEST(RankEnvironment, SlurmTasks) {
  const Environment env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                         {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  const auto rank = rank_env_from_environment();
  ASSERT_TRUE(rank.has_value());
  EXPECT_EQ(rank->launcher, "slurm");
  EXPECT_EQ(rank->rank, 5);
  EXPECT_EQ(rank->world_size, 8);
  EXPECT_EQ(rank->local_rank, 1);
  EXPECT_EQ(rank->master_port, 29500);
  EXPECT_FALSE(rank->store_hosted_elsewhere);  // rank 0 hosts the store
  EXPECT_EQ(rank->bind_address, "127.0.0.1");  // the address that reaches MASTER_ADDR
}

TEST(RankEnvironment, OpenMpiProcesses) {
  const Environment env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "1234"}});
  const auto rank = rank_env_from_environment();
  ASSERT_TRUE(rank.has_value());
  EXPECT_EQ(rank->launcher, "mpirun");
  EXPECT_EQ(rank->rank, 0);
  EXPECT_EQ(rank->world_size, 2);
  EXPECT_EQ(rank->master_addr, "localhost");
}

// Each bad variable is named, all of them at once.
TEST(RankEnvironment, BadVariablesAreNamed) {
  const Environment env({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "8"}, {"MASTER_PORT", "http"}});
  try {
    rank_env_from_environment();
    FAIL() << "accepted a rank beyond the world";
  } catch (const InputError& e) {
    std::string message;
    for (const std::string& line : e.lines()) message += line + "\n";
    EXPECT_NE(message.find("SLURM_PROCID"), std::string::npos) << message;
    EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
    EXPECT_NE(message.find("MASTER_PORT"), std::string::npos) << message;
  }
}

// The lines of an InputError, one string.
std::string said(const InputError& e) {
  std::string message;
  for (const std::string& line : e.lines()) message += line + "\n";
  return message;
}

TEST(StorePeers, AddressesNetworksAndNames) {
  const std::vector<PeerRange> peers = parse_store_peers(" 10.0.0.7, 192.168.4.0/22,localhost ", "X");
  ASSERT_GE(peers.size(), 3u);
  EXPECT_EQ(peers[0].address, 0x0a000007u);
  EXPECT_EQ(peers[0].bits, 32);
  EXPECT_EQ(peers[1].address, 0xc0a80400u);
  EXPECT_EQ(peers[1].bits, 22);
  EXPECT_EQ(peers[2].address, 0x7f000001u);  // localhost
}

TEST(StorePeers, BadEntriesAreNamed) {
  try {
    parse_store_peers("10.0.0.256,10.0.0.0/33,10.0.0.0/x,no-such-host.invalid", "MOEPLAN_STORE_PEERS");
    FAIL() << "accepted bad entries";
  } catch (const InputError& e) {
    const std::string message = said(e);
    for (const char* entry : {"MOEPLAN_STORE_PEERS", "\"10.0.0.256\"", "\"10.0.0.0/33\"", "\"10.0.0.0/x\"",
                              "\"no-such-host.invalid\""})
      EXPECT_NE(message.find(entry), std::string::npos) << entry << " not in:\n" << message;
  }
  EXPECT_THROW(parse_store_peers(" , ", "MOEPLAN_STORE_PEERS"), InputError) << "names no host";
  std::string many;
  for (int i = 0; i < 65; ++i) many += "10.0.0." + std::to_string(i) + ",";
  EXPECT_THROW(parse_store_peers(many, "MOEPLAN_STORE_PEERS"), InputError) << "more than a filter holds";
}

// Loopback admits the address alone; another interface's address admits its network.
TEST(StorePeers, ByDefaultTheNetworkOfTheStoresAddress) {
  const std::vector<PeerRange> loopback = default_store_peers("127.0.0.1");
  ASSERT_EQ(loopback.size(), 1u);
  EXPECT_EQ(loopback[0].address, 0x7f000001u);
  EXPECT_EQ(loopback[0].bits, 32);
  ifaddrs* list = nullptr;
  ASSERT_EQ(::getifaddrs(&list), 0);
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_netmask == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    const uint32_t address = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
    if (address >> 24 == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
    const std::vector<PeerRange> peers = default_store_peers(text);
    ASSERT_EQ(peers.size(), 1u);
    EXPECT_EQ(peers[0].address, address);
    EXPECT_EQ(peers[0].bits,
              __builtin_popcount(ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr)))
        << a->ifa_name;
  }
  ::freeifaddrs(list);
}

int port_of_socket(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

// Hosts outside the store's peers never complete a handshake, so the store never sees them; its
// peers and its own address do. Without the filter every source below connects.
TEST(StoreSocket, AdmitsItsPeersOnly) {
  const int fd = store_listening_socket("127.0.0.1", 0, {PeerRange{0x7f000004, 30}, PeerRange{0x7f000009, 32}});
  const int port = port_of_socket(fd);
  EXPECT_TRUE(test::connects_from("127.0.0.1", port)) << "the store's own address";
  EXPECT_TRUE(test::connects_from("127.0.0.5", port)) << "in 127.0.0.4/30";
  EXPECT_TRUE(test::connects_from("127.0.0.9", port));
  EXPECT_FALSE(test::connects_from("127.0.0.2", port));
  EXPECT_FALSE(test::connects_from("127.0.0.8", port)) << "beside 127.0.0.4/30";
  // Only the admitted handshakes reached the queue.
  ::fcntl(fd, F_SETFL, O_NONBLOCK);
  int accepted = 0;
  for (int c; (c = ::accept(fd, nullptr, nullptr)) >= 0; ++accepted) ::close(c);
  EXPECT_EQ(accepted, 3);
  ::close(fd);
  const int open = store_listening_socket("127.0.0.1", 0, {PeerRange{0, 0}});  // every host
  EXPECT_TRUE(test::connects_from("127.0.0.2", port_of_socket(open)));
  ::close(open);
}

// A rank 0 that hosts the store admits MOEPLAN_STORE_PEERS: the store works for its ranks, and a
// host outside the list is not let in.
TEST(StoreSocket, ARankZeroStoreAdmitsTheListedPeers) {
  const int probe = store_listening_socket("127.0.0.1", 0, {});
  const int port = port_of_socket(probe);
  ::close(probe);
  const Environment env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                         {"MASTER_PORT", std::to_string(port)}, {"MOEPLAN_STORE_PEERS", "127.0.0.3"}});
  const auto rank = rank_env_from_environment();
  ASSERT_TRUE(rank.has_value());
  const auto store = join_store(*rank, std::chrono::seconds(10));
  store->set("key", std::vector<uint8_t>{'v'});
  EXPECT_EQ(store->get("key"), std::vector<uint8_t>{'v'});
  EXPECT_TRUE(test::connects_from("127.0.0.3", port));
  EXPECT_FALSE(test::connects_from("127.0.0.2", port));
}

// What a rank of spawn_local_ranks writes into `dir` once every rank has reached the launcher's
// store: how it was started, its place, and the launcher's MOEPLAN_PROFILES (which a rank
// needs to find the profiles the launcher found).
int write_place(const std::string& dir, const std::string& how) {
  const std::optional<RankEnv> env = rank_env_from_environment();
  if (!env) return 10;
  const auto store = join_store(*env, std::chrono::seconds(60));
  store->add("arrived", 1);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (store->add("arrived", 0) < env->world_size)
    if (std::chrono::steady_clock::now() > give_up) return 11;
    else std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::ofstream(dir + "/rank-" + std::to_string(env->rank))
      << how << " " << env->rank << " of " << env->world_size << " by " << env->launcher
      << " with " << (std::getenv("MOEPLAN_PROFILES") ? std::getenv("MOEPLAN_PROFILES") : "nothing");
  return 0;
}

std::string read_place(const std::string& dir, int64_t rank) {
  std::ifstream in(dir + "/rank-" + std::to_string(rank));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class LocalRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/moeplan-ranks-XXXXXX";
    ASSERT_NE(::mkdtemp(name), nullptr);
    dir_ = name;
    ::setenv("MOEPLAN_PROFILES", "/the/launcher's", 1);
  }
  void TearDown() override {
    ::unsetenv("MOEPLAN_PROFILES");
    std::filesystem::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(LocalRanks, AreCopiesOfTheLauncherAndReachItsStore) {
  ASSERT_TRUE(one_thread_runs()) << "the test process runs threads of its own";
  const std::string dir = dir_;
  EXPECT_EQ(spawn_local_ranks({"never run"}, 3, [&] { return write_place(dir, "copy"); }, 30), 0);
  for (int64_t r = 0; r < 3; ++r)
    EXPECT_EQ(read_place(dir_, r), "copy " + std::to_string(r) + " of 3 by moeplan with /the/launcher's");
  EXPECT_STREQ(std::getenv("MOEPLAN_PROFILES"), "/the/launcher's");
  EXPECT_FALSE(rank_env_from_environment().has_value()) << "the launcher's own environment changed";
}

TEST_F(LocalRanks, AFailedRankGivesItsCode) {
  const std::string dir = dir_;
  const int code = spawn_local_ranks({"never run"}, 2, [&] {
    const int placed = write_place(dir, "copy");
    return placed != 0 ? placed : rank_env_from_environment()->rank == 1 ? 5 : 0;
  }, 30);
  EXPECT_EQ(code, 5);
}

// Started by the next test as its ranks; skipped when run on its own.
TEST(LocalRank, AnExecutedRankWritesItsPlace) {
  const char* dir = std::getenv("RANKS_TEST_DIR");
  if (dir == nullptr || std::getenv("MOEPLAN_RANK") == nullptr) GTEST_SKIP() << "runs as a rank of the next test";
  ASSERT_EQ(write_place(dir, "exec"), 0);
}

// A launcher with another thread cannot copy itself safely: its ranks run its program with the
// arguments given (here this test program, running the test above).
TEST_F(LocalRanks, ALauncherWithOtherThreadsStartsItsProgramInstead) {
  std::promise<void> go;
  std::thread other([done = go.get_future()]() mutable { done.wait(); });
  ::setenv("RANKS_TEST_DIR", dir_.c_str(), 1);
  const std::optional<std::string> self = this_program_path();
  ASSERT_TRUE(self.has_value());
  const int code = spawn_local_ranks({*self, "--gtest_filter=LocalRank.AnExecutedRankWritesItsPlace"}, 2,
                                     [] { return 99; }, 30);
  go.set_value();
  other.join();
  ::unsetenv("RANKS_TEST_DIR");
  EXPECT_EQ(code, 0);
  for (int64_t r = 0; r < 2; ++r)
    EXPECT_EQ(read_place(dir_, r), "exec " + std::to_string(r) + " of 2 by moeplan with /the/launcher's");
}

}  // namespace
}  // namespace moeplan::executor
