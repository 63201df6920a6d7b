#include "moeplan/executor/ranks/rank_start.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/filter.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

extern char** environ;
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/process.h"
#include "moeplan/executor/ranks/stop.h"

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

// IPv4 `text` ("10.0.0.1") in host byte order, or nothing.
std::optional<uint32_t> ipv4(const std::string& text) {
  in_addr a{};
  if (::inet_pton(AF_INET, text.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

uint32_t mask_of(int bits) { return bits == 0 ? 0 : ~uint32_t{0} << (32 - bits); }

// Drops, in the kernel, every packet to `fd` from an IPv4 source outside `peers`: on a listening
// TCP socket, the handshakes of other hosts (the connections it accepts inherit the filter). A
// classic BPF program: load the source address from the IP header, then per range compare its
// masked bits and accept on a match; locked, so the store server cannot take it off.
void admit_only(int fd, const std::vector<PeerRange>& peers, const std::string& where) {
  std::vector<sock_filter> program;
  program.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, static_cast<uint32_t>(SKF_NET_OFF) + 12));
  program.push_back(BPF_STMT(BPF_MISC | BPF_TAX, 0));
  const size_t n = peers.size(), accept = 2 + 3 * n + 1;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t mask = mask_of(peers[i].bits);
    const size_t compare = 2 + 3 * i + 2;
    program.push_back(BPF_STMT(BPF_MISC | BPF_TXA, 0));
    program.push_back(BPF_STMT(BPF_ALU | BPF_AND | BPF_K, mask));
    program.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, peers[i].address & mask,
                               static_cast<uint8_t>(accept - compare - 1), 0));
  }
  program.push_back(BPF_STMT(BPF_RET | BPF_K, 0));            // drop
  program.push_back(BPF_STMT(BPF_RET | BPF_K, 0xffffffffu));  // keep the whole packet
  const sock_fprog filter{static_cast<unsigned short>(program.size()), program.data()};
  const int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &filter, sizeof filter) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_LOCK_FILTER, &on, sizeof on) != 0)
    throw InputError(where, {{"", std::string("the store cannot limit who connects (") + std::strerror(errno) + ")"}});
}

int64_t port_of(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

constexpr size_t kMaxStorePeers = 64;  // a classic BPF jump reaches 255 instructions ahead

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

namespace {

// Whether environment entry `entry` ("NAME=value") sets one of the variables by which the moeplan
// launcher places its ranks. Its other variables (MOEPLAN_PROFILES, say) reach the ranks.
bool sets_rank_variable(const char* entry) {
  const Names& moeplan = kLaunchers[0];
  for (const char* name : {moeplan.rank, moeplan.world, moeplan.local, moeplan.addr, moeplan.port}) {
    const size_t n = std::strlen(name);
    if (std::strncmp(entry, name, n) == 0 && entry[n] == '=') return true;
  }
  return false;
}

// In a rank copied from its launcher: the environment a started rank has (the launcher's with
// `vars`), no stop signal of the launcher's, and a name of its own, "moeplan r<rank>" (ps -o
// comm, top; /proc/<pid>/environ still shows the launcher's variables, which a copy does not
// change).
void become_rank(int64_t rank, const std::vector<std::string>& vars) {
  const std::string name = "moeplan r" + std::to_string(rank);  // at most 15 characters are kept
  ::prctl(PR_SET_NAME, name.c_str(), 0, 0, 0);
  for (const std::string& v : vars) {
    const size_t eq = v.find('=');
    ::setenv(v.substr(0, eq).c_str(), v.substr(eq + 1).c_str(), 1);
  }
  reset_stop_signal();
  catch_stop_signals();
}

}  // namespace

int spawn_local_ranks(const std::vector<std::string>& argv, int64_t world_size, const std::function<int()>& rank_main,
                      int64_t failure_grace_seconds, int64_t stop_grace_seconds) {
  // Loopback, and this machine's own processes only: the ranks are on this machine. The store
  // that takes the socket over starts its thread after the ranks have started, so that this
  // process can copy itself into them.
  const int listening = store_listening_socket("127.0.0.1", 0, {PeerRange{0x7f000001, 32}});
  const int64_t port = port_of(listening);
  const bool copies = one_thread_runs();

  std::map<pid_t, int64_t> children;
  const auto kill_children = [&] {
    for (const auto& [p, r] : children) ::kill(p, SIGKILL);
  };
  for (int64_t rank = 0; rank < world_size; ++rank) {
    const std::vector<std::string> vars = {
        "MOEPLAN_RANK=" + std::to_string(rank), "MOEPLAN_WORLD_SIZE=" + std::to_string(world_size),
        "MOEPLAN_LOCAL_RANK=" + std::to_string(rank), "MOEPLAN_STORE_ADDR=127.0.0.1",
        "MOEPLAN_STORE_PORT=" + std::to_string(port)};
    // The rank starts with stop signals blocked and unblocks them once it catches them: one
    // sent meanwhile waits instead of killing it half started.
    pid_t pid = -1;
    if (copies) {
      pid = start_copy(
          [&] {
            ::close(listening);
            become_rank(rank, vars);
            return rank_main();
          },
          stop_signals());
    } else {
      ChildProgram child;
      child.path = "/proc/self/exe";
      child.argv = argv;
      child.environment.emplace();
      for (char** e = environ; *e; ++e)
        if (!sets_rank_variable(*e)) child.environment->emplace_back(*e);
      child.environment->insert(child.environment->end(), vars.begin(), vars.end());
      child.blocked_signals = stop_signals();
      pid = start_child(child);
    }
    if (pid < 0) {
      std::perror("moeplan: fork");
      kill_children();
      ::close(listening);
      return 1;
    }
    children[pid] = rank;
  }

  // The store lives in this process, so it outlives any rank (a lost rank 0 included).
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions so;
    so.masterListenFd = listening;
    so.port = static_cast<uint16_t>(port);
    so.isServer = true;
    so.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (...) {
    kill_children();
    for (const auto& [p, r] : children) wait_for_child(p);
    throw;
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
    const ChildPoll poll = poll_children();
    if (poll.state == ChildPoll::State::kNoChildren) break;
    if (poll.state == ChildPoll::State::kNoneEnded) {
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
    const ChildExit& ended = poll.ended;
    const auto it = children.find(ended.pid);
    if (it == children.end()) continue;
    const int64_t rank = it->second;
    children.erase(it);
    const int code = ended.exited ? ended.code : 1;
    if (ended.exited && code == kExitOk) continue;
    if (ended.exited && code == kExitStopped) {
      stopped = true;
      continue;
    }
    if (ended.signal != 0)
      std::fprintf(stderr, "moeplan: error: rank %lld was killed by signal %d (%s)\n", static_cast<long long>(rank),
                   ended.signal, strsignal(ended.signal));
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

std::vector<PeerRange> parse_store_peers(const std::string& text, const std::string& origin) {
  Diagnostics d;
  std::vector<PeerRange> peers;
  std::string entry;
  std::istringstream entries(text);
  while (std::getline(entries, entry, ',')) {
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    if (entry.empty()) continue;
    const std::string quoted = "entry \"" + entry + "\"";
    if (const size_t slash = entry.find('/'); slash != std::string::npos) {
      const std::optional<uint32_t> address = ipv4(entry.substr(0, slash));
      const std::string bits = entry.substr(slash + 1);
      const bool digits = !bits.empty() && bits.size() <= 2 && bits.find_first_not_of("0123456789") == std::string::npos;
      if (!address || !digits || std::stoi(bits) > 32)
        d.error("", quoted + " is not a network (an IPv4 address, \"/\" and 0 to 32 bits)");
      else
        peers.push_back({*address, std::stoi(bits)});
      continue;
    }
    if (const std::optional<uint32_t> address = ipv4(entry)) {
      peers.push_back({*address, 32});
      continue;
    }
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(entry.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
      d.error("", quoted + " is not an IPv4 address, a network or a host name that resolves to one");
      continue;
    }
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next)
      peers.push_back({ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr), 32});
    ::freeaddrinfo(found);
  }
  if (d.empty() && peers.empty()) d.error("", "names no host: every connection would be refused");
  if (peers.size() > kMaxStorePeers)
    d.error("", std::to_string(peers.size()) + " hosts and networks; at most " + std::to_string(kMaxStorePeers) +
                    " (name a network for more)");
  d.throw_if_any(origin);
  return peers;
}

std::vector<PeerRange> default_store_peers(const std::string& address) {
  const std::optional<uint32_t> own = ipv4(address);
  if (!own) return {};
  ifaddrs* list = nullptr;
  int bits = 32;
  if (*own >> 24 != 127 && ::getifaddrs(&list) == 0) {
    for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next)
      if (a->ifa_addr != nullptr && a->ifa_netmask != nullptr && a->ifa_addr->sa_family == AF_INET &&
          ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr) == *own) {
        const uint32_t mask = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr);
        bits = __builtin_popcount(mask);
      }
    ::freeifaddrs(list);
  }
  return {PeerRange{*own, bits}};
}

int store_listening_socket(const std::string& host, int64_t port, const std::vector<PeerRange>& peers) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string where = host + ":" + std::to_string(port);
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr)
    throw InputError(where, {{"", "the store's address does not resolve to an IPv4 address"}});
  const uint32_t own = ntohl(reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr.s_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  const bool ok = fd >= 0 && ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) == 0 &&
                  ::bind(fd, found->ai_addr, found->ai_addrlen) == 0;
  const std::string reason = std::strerror(errno);
  ::freeaddrinfo(found);
  if (!ok) {
    if (fd >= 0) ::close(fd);
    throw InputError(where, {{"", "the store cannot listen there (" + reason +
                                      "); the rank that hosts it must be on that host"}});
  }
  // The filter is in place before the socket listens: no handshake gets past it.
  std::vector<PeerRange> admitted = peers;
  admitted.push_back({own, 32});  // this host's own processes, which connect from the address itself
  try {
    admit_only(fd, admitted, where);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::listen(fd, SOMAXCONN) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw InputError(where, {{"", "the store cannot listen there (" + why + ")"}});
  }
  return fd;
}

namespace {

// Who may connect to the store this rank 0 hosts: MOEPLAN_STORE_PEERS, else the network of the
// address it listens on.
std::vector<PeerRange> store_peers(const RankEnv& env) {
  if (const char* listed = std::getenv("MOEPLAN_STORE_PEERS"); listed != nullptr)
    return parse_store_peers(listed, "MOEPLAN_STORE_PEERS");
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return {};
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr, text, sizeof text);
  ::freeaddrinfo(found);
  return default_store_peers(text);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> join_store(const RankEnv& env, std::chrono::milliseconds timeout, StoreRole role) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = role == StoreRole::kRank && env.rank == 0 && !env.store_hosted_elsewhere;
  if (so.isServer) so.masterListenFd = store_listening_socket(env.master_addr, env.master_port, store_peers(env));
  so.numWorkers = c10::nullopt;
  so.waitWorkers = false;
  so.timeout = timeout;
  if (so.isServer) return c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const c10::DistNetworkError& e) {
    const std::string what = e.what_without_backtrace();
    throw std::runtime_error(
        "the rendezvous store at " + env.master_addr + ":" + std::to_string(env.master_port) +
        " took no connection from this host within " + std::to_string(timeout.count() / 1000) +
        " s: its host is not listening there yet, or it does not admit this host (MOEPLAN_STORE_PEERS on rank 0, "
        "else rank 0's subnet). LibTorch: " + what.substr(0, what.find('\n')));
  }
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
