#pragma once
// Starting the ranks of a run. `moeplan run` spawns the plan's ranks on this machine itself;
// under torchrun (--no-python), SLURM (srun) or Open MPI (mpirun) each process reads its rank
// from their environment variables and joins.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/executor/ranks/collectives.h"
#include "moeplan/executor/ranks/mesh.h"

namespace moeplan::executor {

// Where a rank of a multi-rank run comes from.
struct RankEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;
  bool store_hosted_elsewhere = false;  // the moeplan launcher hosts the store; else rank 0 does
  std::string launcher;                 // "moeplan", "torchrun", "slurm", "mpirun"
  std::string bind_address = "127.0.0.1";  // where this rank's gloo connections listen
};

// The rank of this process from the environment, or nothing when no launcher set one:
//   moeplan (MOEPLAN_RANK, MOEPLAN_WORLD_SIZE, MOEPLAN_STORE_ADDR, MOEPLAN_STORE_PORT),
//   torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
//   SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR, MASTER_PORT),
//   Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
//   MASTER_ADDR, MASTER_PORT).
// Throws InputError naming the variable when one is missing or malformed.
std::optional<RankEnv> rank_env_from_environment();

// How this rank reaches the others: the rendezvous store at the launcher's address, hosted by
// rank 0 unless the launcher hosts it, every wait bounded by `timeout`. The run, its heartbeat
// and calibration all join through it. kClient: a further connection, never the host.
enum class StoreRole : uint8_t { kRank, kClient };
c10::intrusive_ptr<c10d::Store> join_store(const RankEnv& env, std::chrono::milliseconds timeout,
                                           StoreRole role = StoreRole::kRank);
// Who may connect to a rendezvous store hosted here: IPv4 hosts whose first `bits` bits match
// `address` (host byte order). Any other host's connection is dropped by the kernel before its
// handshake (a socket filter on the listening socket), so it reads and writes no key: its
// connect() times out as if nothing listened there.
struct PeerRange {
  uint32_t address = 0;
  int bits = 32;
};
// MOEPLAN_STORE_PEERS' form: comma-separated IPv4 addresses, host names (each of their IPv4
// addresses) and networks (10.0.0.0/16), at most 64 entries. Throws InputError naming `origin`
// and the entry.
std::vector<PeerRange> parse_store_peers(const std::string& text, const std::string& origin);
// Those a store listening on `address` (an IPv4 address of this host) admits when
// MOEPLAN_STORE_PEERS is not set: the network of the interface that holds the address (one
// cluster's hosts share a subnet), or on loopback the address alone.
std::vector<PeerRange> default_store_peers(const std::string& address);
// A socket listening on IPv4 `host` (a name or an address of this host) at `port` (0: a free one)
// for the store server to take over, admitting `peers` only (and this host's own address).
// c10d's own server would listen on every interface and take any connection. Throws InputError
// naming host:port when it cannot.
int store_listening_socket(const std::string& host, int64_t port, const std::vector<PeerRange>& peers);

// The whole world as one gloo group over a joined store, for work that needs no plan's mesh
// (calibration), and meshes of any layout of the same ranks over that store, each under keys
// of its own; `prefix` keeps the keys apart from other groups'.
struct JoinedWorld {
  Communicator world;
  MeshMaker mesh_of;
};
JoinedWorld join_world(const RankEnv& env, std::chrono::milliseconds timeout, const std::string& prefix);

// Runs this program as `world_size` local ranks and waits for them: hosts the rendezvous store
// and starts each rank with the moeplan variables set (rank_env_from_environment() reads them).
// A rank is a copy of this process (start_copy) that goes on with `rank_main` and exits with
// what it returns: it shares the LibTorch this process has loaded instead of loading it again
// (about half a second of CPU a rank). A launcher that runs other threads cannot be copied
// safely; its ranks run /proc/self/exe with `argv` (this program's arguments) instead, which
// brings them to the same `rank_main` through main. The launcher must not have started CUDA,
// whose threads would make it the second kind. When a rank fails, the others get
// `failure_grace_seconds` to exit on their own (their collectives time out and name the lost
// rank) before they are killed. A stop signal caught by this process (catch_stop_signals) goes
// on to every rank, which then has `stop_grace_seconds` to save and exit. Returns 0 when every
// rank succeeded, kExitStopped when they stopped early, else the first failed rank's code.
int spawn_local_ranks(const std::vector<std::string>& argv, int64_t world_size, const std::function<int()>& rank_main,
                      int64_t failure_grace_seconds, int64_t stop_grace_seconds = 30);

}  // namespace moeplan::executor
