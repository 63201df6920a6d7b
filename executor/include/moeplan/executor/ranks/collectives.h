#pragma once
// The collectives a rank uses, over one c10d process group: the backend's own all-gather into
// one tensor, reduce-scatter of one tensor (on gloo an all-to-all of the chunks and a local
// sum, twice as fast there) and all-to-all with splits, every dtype moved as it is. Where
// values are added (all-reduce, reduce-scatter), bf16 is summed in fp32 and rounded once, as
// the one-rank step adds gradients.
// Every failure, a timeout included, becomes a CollectiveError that names the operation, the
// group and the rank.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include "moeplan/executor/libtorch.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeplan::executor {

// A process group of one backend (gloo or NCCL): a c10d backend.
using BackendGroup = c10::intrusive_ptr<c10d::Backend>;

class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a rank's collectives are doing, for its peers when one of them waited in vain: the
// collective in progress, or how long the rank has been outside any (computing, writing a file,
// or stuck there) and the last one it finished. The communicators of a rank share one; its
// heartbeat thread reads it.
class CollectiveActivity {
 public:
  void enter(const char* op, const std::string& group);
  void leave();
  // "in all-reduce on world for 0.2 s", or "outside any collective for 61.0 s (the last:
  // all-gather on shard)".
  std::string describe() const;

 private:
  mutable std::mutex mutex_;
  bool inside_ = false;
  std::string current_, last_;
  std::chrono::steady_clock::time_point since_ = std::chrono::steady_clock::now();
};

class Communicator {
 public:
  // name: for messages, e.g. "expert group 1". A null group is a group of this rank alone,
  // where every collective is a copy (or nothing); a process group of one still runs its
  // backend's collectives (how one device tests a backend's path).
  // first_rank: the lowest world rank of the group, which names it in traces.
  // device: where the rank computes, and where received tensors arrive. A gloo group moves
  // tensors through host memory (its transports read host memory), an NCCL group through the
  // device's (ordered on the current stream); a tensor given on the other one is copied there
  // and its result copied back.
  Communicator(BackendGroup group, std::string name, int64_t first_rank = 0, torch::Device device = torch::kCPU);
  Communicator() = default;

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  const torch::Device& device() const { return device_; }
  // Where tensors travel from: the host for gloo, the device for NCCL (the rank's device alone).
  const torch::Device& wire() const { return wire_; }
  int64_t first_rank() const { return first_rank_; }

  // In place: every rank ends with the sum.
  void all_reduce_sum(torch::Tensor& t);
  // The shards of every rank concatenated along dimension 0, in rank order.
  torch::Tensor all_gather(const torch::Tensor& shard);
  // The same all-gather started now and finished by finish_all_gather, so that the caller
  // computes meanwhile (gloo moves the bytes on its own threads). Every rank starts the same
  // gathers in the same order; a started gather must be finished, once.
  struct PendingGather {
    c10::intrusive_ptr<c10d::Work> work;  // null in a group of one
    torch::Tensor input, gathered;
    torch::Device home = torch::kCPU;  // the shard's device, where the result goes
    std::chrono::steady_clock::time_point start;
  };
  PendingGather start_all_gather(const torch::Tensor& shard);
  torch::Tensor finish_all_gather(PendingGather& pending);
  // full: [size * n, ...]. Returns this rank's chunk [n, ...] summed over the ranks.
  torch::Tensor reduce_scatter_sum(const torch::Tensor& full);
  // The same reduce-scatter started now and finished by finish_reduce_scatter, so that the
  // caller computes meanwhile (NCCL on its own stream, gloo on its own threads). Every rank
  // starts the same reduce-scatters in the same order; a started one must be finished, once.
  struct PendingScatter {
    c10::intrusive_ptr<c10d::Work> work;  // null in a group of one
    torch::Tensor input;                  // what travels, kept until the scatter is finished
    torch::Tensor result;                 // the output, or gloo's received chunks [size, n, ...]
    torch::ScalarType type = torch::kFloat;  // the input's, which the result takes
    torch::Device home = torch::kCPU;
    bool chunks = false;  // gloo's all-to-all of chunks, summed when finished
    int64_t bytes = 0;
    std::chrono::steady_clock::time_point start;
  };
  PendingScatter start_reduce_scatter_sum(const torch::Tensor& full);
  torch::Tensor finish_reduce_scatter(PendingScatter& pending);
  // Rows of input go to ranks in order, send_rows[r] to rank r; recv_rows[r] rows arrive from
  // rank r. Returns the received rows in rank order.
  torch::Tensor all_to_all(const torch::Tensor& input, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows);
  void broadcast(torch::Tensor& t, int64_t root);
  void barrier();

  // Point to point, between pipeline stages: `t` goes to rank `dst` of this group, which takes
  // it with recv(t's shape, t's type, this rank, the same tag). Between two ranks, transfers
  // with one tag arrive in the order they were sent; separate tags keep separate streams apart
  // (activations and gradients between the same two stages). A gloo send returns only once the
  // peer has posted the matching recv, so two ranks that send to each other first deadlock
  // until the timeout: start such transfers with start_send / start_recv, then finish them.
  // After a timeout the link to that peer is closed: the group is done for.
  // A group of one has no peer: calling these on it, or naming this rank or no rank of the
  // group as the peer, is a bug (std::logic_error).
  void send(const torch::Tensor& t, int64_t dst, int64_t tag = 0);
  torch::Tensor recv(c10::IntArrayRef shape, torch::ScalarType type, int64_t src, int64_t tag = 0);
  // The same transfers started now and finished by finish_transfer (which returns the received
  // tensor, or an undefined one for a send). A started transfer must be finished, once; a
  // started send may read its tensor until then, so the caller leaves it unchanged.
  struct PendingTransfer {
    c10::intrusive_ptr<c10d::Work> work;
    torch::Tensor buffer;  // what travels: sent from, or received into
    int64_t peer = -1;
    bool sending = false;
    std::chrono::steady_clock::time_point start;
  };
  PendingTransfer start_send(const torch::Tensor& t, int64_t dst, int64_t tag = 0);
  PendingTransfer start_recv(c10::IntArrayRef shape, torch::ScalarType type, int64_t src, int64_t tag = 0);
  torch::Tensor finish_transfer(PendingTransfer& pending);

  // Called after every collective that moved data: the operation, the bytes this rank put in,
  // and when it started and ended (for the measured trace).
  using Observer = std::function<void(const char* op, int64_t bytes, std::chrono::steady_clock::time_point start,
                                      std::chrono::steady_clock::time_point end)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  // Called as each all-gather and reduce-scatter is finished (started ones included, 0 bytes):
  // the part of it that the finish waited for, which the rank's work did not hide.
  void set_wait_observer(Observer observer) { wait_observer_ = std::move(observer); }
  void set_activity(std::shared_ptr<CollectiveActivity> activity) { activity_ = std::move(activity); }

 private:
  // `peer`: " to rank 2" or " from rank 0" for a point-to-point transfer, for errors.
  template <class F>
  void run(const char* op, int64_t bytes, F&& f, bool observe = true, const std::string& peer = {});
  void check_peer(const char* op, int64_t peer, int64_t tag) const;
  // What travels: `t` contiguous on the wire's device. And what arrived, moved `home`.
  torch::Tensor to_wire(const torch::Tensor& t) const;
  torch::Tensor from_wire(const torch::Tensor& t, const torch::Device& home) const;

  BackendGroup group_;
  std::string name_ = "this rank";
  int64_t rank_ = 0, size_ = 1, first_rank_ = 0;
  torch::Device device_ = torch::kCPU, wire_ = torch::kCPU;
  Observer observer_, wait_observer_;
  std::shared_ptr<CollectiveActivity> activity_;
};

// A gloo process group of `size` ranks over a shared store; every member calls this with the
// same prefix (which keeps the store keys of different groups apart). `address` is this rank's
// own address, which its peers connect to.
BackendGroup make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
                             int size, std::chrono::milliseconds timeout, const std::string& address = "127.0.0.1");
// The same with NCCL, its communicator on `device` (the rank's own GPU), every collective bounded
// by `timeout`. Throws CollectiveError where this moeplan was built without NCCL.
BackendGroup make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
                             int size, std::chrono::milliseconds timeout, const torch::Device& device);
// Whether this moeplan can make NCCL groups (built against a LibTorch with CUDA and NCCL).
bool nccl_built();

}  // namespace moeplan::executor
