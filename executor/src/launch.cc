#include "moeplan/executor/launch.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/executor/stop.h"

namespace moeplan::executor {

namespace {

struct Names {
  const char* launcher;
  const char *rank, *world, *local, *addr, *port;
};

constexpr Names kLaunchers[] = {
    {"moeplan", "MOEPLAN_RANK", "MOEPLAN_WORLD_SIZE", "MOEPLAN_LOCAL_RANK", "MOEPLAN_STORE_ADDR", "MOEPLAN_STORE_PORT"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "MASTER_ADDR",
     "MASTER_PORT"},
};

int64_t integer(const char* name, int64_t lo, int64_t hi, Diagnostics& d) {
  const char* v = std::getenv(name);
  if (!v) {
    d.error(name, "is not set");
    return 0;
  }
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) {
    d.error(name, std::string("= \"") + v + "\" is not an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
    return 0;
  }
  return x;
}

// The IPv4 address of interface `name`, or "" when it has none.
std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (const ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next)
    if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET && name == a->ifa_name) {
      char text[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
      found = text;
    }
  ::freeifaddrs(list);
  return found;
}

// The local address this host uses to reach `host` (a UDP socket's route, nothing is sent), or
// "" when there is no route.
std::string address_towards(const std::string& host, int64_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return "";
  std::string address;
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t n = sizeof local;
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &n) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr)
      address = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return address;
}

// A socket listening on IPv4 `host` (a name or an address of this machine) at `port` (0: a free
// one) for the store server to take over: c10d's own server would listen on every interface,
// so that any host that reaches this one could read and write the run's keys.
int listening_socket(const std::string& host, int64_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string where = host + ":" + std::to_string(port);
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr)
    throw InputError(where, {{"", "the store's address does not resolve to an IPv4 address"}});
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  const bool ok = fd >= 0 && ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) == 0 &&
                  ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0;
  const std::string reason = std::strerror(errno);
  ::freeaddrinfo(found);
  if (!ok) {
    if (fd >= 0) ::close(fd);
    throw InputError(where, {{"", "the store cannot listen there (" + reason +
                                      "); the rank that hosts it must be on that host"}});
  }
  return fd;
}

int64_t port_of(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

}  // namespace

std::optional<RankEnv> rank_env_from_environment() {
  for (const Names& n : kLaunchers) {
    if (!std::getenv(n.rank)) continue;
    Diagnostics d;
    RankEnv env;
    env.launcher = n.launcher;
    env.world_size = integer(n.world, 1, 1 << 20, d);
    env.rank = integer(n.rank, 0, std::max<int64_t>(0, env.world_size - 1), d);
    env.local_rank = std::getenv(n.local) ? integer(n.local, 0, 1 << 20, d) : 0;
    const char* addr = std::getenv(n.addr);
    if (!addr || !*addr)
      d.error(n.addr, "is not set: the address of the rank-0 host");
    else
      env.master_addr = addr;
    env.master_port = integer(n.port, 1, 65535, d);
    // torchrun's agent hosts the store its workers use and says so; otherwise rank 0 hosts it.
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    env.store_hosted_elsewhere =
        env.launcher == "moeplan" || (env.launcher == "torchrun" && agent_store && std::string(agent_store) == "True");
    // Gloo listens where the peers can reach it: the interface GLOO_SOCKET_IFNAME names (as
    // in PyTorch), else the one that routes to the rank-0 host (loopback on one machine).
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      env.bind_address = interface_address(ifname);
      if (env.bind_address.empty()) d.error("GLOO_SOCKET_IFNAME", std::string("\"") + ifname + "\" has no IPv4 address");
    } else if (d.empty()) {
      env.bind_address = address_towards(env.master_addr, env.master_port);
      if (env.bind_address.empty()) d.error(n.addr, "= \"" + env.master_addr + "\" cannot be reached from this host");
    }
    d.throw_if_any(std::string(n.launcher) + " environment");
    return env;
  }
  return std::nullopt;
}

int spawn_local_ranks(const std::vector<std::string>& argv, int64_t world_size, int64_t failure_grace_seconds,
                      int64_t stop_grace_seconds) {
  // The store lives in this process, so it outlives any rank (a lost rank 0 included).
  c10d::TCPStoreOptions so;
  so.masterListenFd = listening_socket("127.0.0.1", 0);  // loopback: the ranks are on this machine
  so.port = static_cast<uint16_t>(port_of(*so.masterListenFd));
  so.isServer = true;
  so.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const std::string port = std::to_string(store->getPort());

  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::map<pid_t, int64_t> children;
  for (int64_t rank = 0; rank < world_size; ++rank) {
    // Built before fork: the child only calls execve (this process has threads).
    std::vector<std::string> vars;
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "MOEPLAN_", 8) != 0) vars.emplace_back(*e);
    vars.push_back("MOEPLAN_RANK=" + std::to_string(rank));
    vars.push_back("MOEPLAN_WORLD_SIZE=" + std::to_string(world_size));
    vars.push_back("MOEPLAN_LOCAL_RANK=" + std::to_string(rank));
    vars.push_back("MOEPLAN_STORE_ADDR=127.0.0.1");
    vars.push_back("MOEPLAN_STORE_PORT=" + port);
    std::vector<char*> envp;
    for (std::string& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    // The rank starts with stop signals blocked (the mask survives execve) and unblocks them
    // once it catches them: one sent meanwhile waits instead of killing it half started.
    sigset_t before;
    ::pthread_sigmask(SIG_SETMASK, nullptr, &before);
    block_stop_signals();
    const pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &before, nullptr);  // the child keeps them blocked
    if (pid < 0) {
      std::perror("moeplan: fork");
      for (const auto& [p, r] : children) ::kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::execve("/proc/self/exe", args.data(), envp.data());
      ::_exit(127);
    }
    children[pid] = rank;
  }

  int failed = 0;   // the first failed rank's exit code
  bool stopped = false;
  int forwarded = 0;  // the stop signal passed on to the ranks
  constexpr auto kNone = std::chrono::steady_clock::time_point::max();
  auto deadline = kNone;  // after a failure or a stop signal: the ranks have until then to exit
  std::string why;        // what the deadline was for
  int64_t grace = 0;
  while (!children.empty()) {
    if (forwarded == 0 && stop_signal() != 0) {
      forwarded = stop_signal();
      for (const auto& [p, r] : children) ::kill(p, forwarded);
      const auto by = stop_signal_time() + std::chrono::seconds(stop_grace_seconds);
      if (by < deadline) {
        deadline = by;
        why = "to stop after " + signal_name(forwarded) + " (--grace-seconds)";
        grace = stop_grace_seconds;
      }
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid <= 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (const auto& [p, r] : children) {
          std::fprintf(stderr, "moeplan: error: rank %lld did not exit within %lld s %s: killed\n",
                       static_cast<long long>(r), static_cast<long long>(grace), why.c_str());
          ::kill(p, SIGKILL);
        }
        if (failed == 0) failed = 1;
        deadline = kNone;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    const auto it = children.find(pid);
    if (it == children.end()) continue;
    const int64_t rank = it->second;
    children.erase(it);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (WIFEXITED(status) && code == kExitOk) continue;
    if (WIFEXITED(status) && code == kExitStopped) {
      stopped = true;
      continue;
    }
    if (WIFSIGNALED(status))
      std::fprintf(stderr, "moeplan: error: rank %lld was killed by signal %d (%s)\n", static_cast<long long>(rank),
                   WTERMSIG(status), strsignal(WTERMSIG(status)));
    if (failed == 0) failed = code;
    const auto by = std::chrono::steady_clock::now() + std::chrono::seconds(failure_grace_seconds);
    if (by < deadline) {
      deadline = by;
      why = "after rank " + std::to_string(rank) + " failed";
      grace = failure_grace_seconds;
    }
  }
  if (failed != 0) return failed;
  return stopped ? kExitStopped : kExitOk;
}

c10::intrusive_ptr<c10d::Store> join_store(const RankEnv& env, std::chrono::milliseconds timeout, StoreRole role) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = role == StoreRole::kRank && env.rank == 0 && !env.store_hosted_elsewhere;
  if (so.isServer) so.masterListenFd = listening_socket(env.master_addr, env.master_port);
  so.numWorkers = c10::nullopt;
  so.waitWorkers = false;
  so.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
}

JoinedWorld join_world(const RankEnv& env, std::chrono::milliseconds timeout, const std::string& prefix) {
  const c10::intrusive_ptr<c10d::Store> store = join_store(env, timeout);
  JoinedWorld joined;
  joined.world = Communicator(make_gloo_group(store, prefix, static_cast<int>(env.rank),
                                              static_cast<int>(env.world_size), timeout, env.bind_address),
                              "world");
  auto meshes = std::make_shared<int>(0);
  joined.mesh_of = [store, meshes, env, timeout, prefix](const ParallelConfig& parallel) {
    const auto keys = c10::make_intrusive<c10d::PrefixStore>(prefix + "mesh-" + std::to_string((*meshes)++), store);
    return std::make_unique<DeviceMesh>(parallel, env.rank, keys, timeout, env.bind_address);
  };
  return joined;
}

}  // namespace moeplan::executor
