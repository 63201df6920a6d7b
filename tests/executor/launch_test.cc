// How a rank reads its place in the run from its launcher's environment variables.

#include "moeplan/executor/launch.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/core/errors.h"

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
                             "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"})
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

}  // namespace
}  // namespace moeplan::executor
