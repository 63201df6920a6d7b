#include "moeplan/executor/ranks/collectives.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
// NCCL where LibTorch has it and its own nccl.h is found (executor/CMakeLists.txt).
#if MOEPLAN_WITH_CUDA && defined(USE_C10D_NCCL) && defined(MOEPLAN_NCCL_HEADER)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define MOEPLAN_WITH_NCCL 1
#else
#define MOEPLAN_WITH_NCCL 0
#endif

#include <cassert>
#include <cstdio>
#include <limits>
#include <numeric>

namespace moeplan::executor {

namespace {

// Sums of bf16 tensors are taken in fp32 and rounded once, as the one-rank step adds them.
bool sums_wide(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace

void CollectiveActivity::enter(const char* op, const std::string& group) {
  const std::lock_guard<std::mutex> lock(mutex_);
  inside_ = true;
  current_ = std::string(op) + " on " + group;
  since_ = std::chrono::steady_clock::now();
}

void CollectiveActivity::leave() {
  const std::lock_guard<std::mutex> lock(mutex_);
  inside_ = false;
  last_ = std::move(current_);
  since_ = std::chrono::steady_clock::now();
}

std::string CollectiveActivity::describe() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f s",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count());
  if (inside_) return "in " + current_ + " for " + seconds;
  return "outside any collective for " + std::string(seconds) + " (the last: " + (last_.empty() ? "none yet" : last_) +
         ")";
}

Communicator::Communicator(BackendGroup group, std::string name, int64_t first_rank, torch::Device device)
    : group_(std::move(group)), name_(std::move(name)), first_rank_(first_rank), device_(device) {
  if (group_) {
    rank_ = group_->getRank();
    size_ = group_->getSize();
    // gloo reads host memory, NCCL the device's.
    wire_ = group_->getBackendName() == "nccl" ? device_ : torch::Device(torch::kCPU);
  }
}

torch::Tensor Communicator::to_wire(const torch::Tensor& t) const { return t.to(wire_).contiguous(); }

torch::Tensor Communicator::from_wire(const torch::Tensor& t, const torch::Device& home) const { return t.to(home); }

template <class F>
void Communicator::run(const char* op, int64_t bytes, F&& f, bool observe, const std::string& peer) {
  const auto start = std::chrono::steady_clock::now();
  if (activity_) activity_->enter(op, name_);
  try {
    f();
    if (activity_) activity_->leave();
    if (observe && observer_) observer_(op, bytes, start, std::chrono::steady_clock::now());
  } catch (const std::exception& e) {
    if (activity_) activity_->leave();
    throw CollectiveError(std::string(op) + peer + " on " + name_ + " (rank " + std::to_string(rank_) + " of " +
                          std::to_string(size_) + ") failed: " + first_line(e.what()));
  }
}

void Communicator::all_reduce_sum(torch::Tensor& t) {
  if (!group_) return;
  run("all-reduce", static_cast<int64_t>(t.nbytes()), [&] {
    const bool widen = sums_wide(t);
    std::vector<torch::Tensor> tensors{to_wire(widen ? t.to(torch::kFloat) : t)};
    group_->allreduce(tensors)->wait();
    if (!tensors[0].is_same(t)) t.copy_(tensors[0]);
  });
}

torch::Tensor Communicator::all_gather(const torch::Tensor& shard) {
  PendingGather pending = start_all_gather(shard);
  return finish_all_gather(pending);
}

Communicator::PendingGather Communicator::start_all_gather(const torch::Tensor& shard) {
  PendingGather p;
  p.start = std::chrono::steady_clock::now();
  if (!group_) {
    p.gathered = shard.clone();
    return p;
  }
  run("all-gather", 0, [&] {
    p.home = shard.device();
    p.input = to_wire(shard);
    // Into one result tensor, rank r's part at rows r (all_gather_into_tensor).
    std::vector<int64_t> shape = p.input.sizes().vec();
    shape[0] *= size_;
    p.gathered = torch::empty(shape, p.input.options());
    p.work = group_->_allgather_base(p.gathered, p.input);
  }, /*observe=*/false);
  return p;
}

torch::Tensor Communicator::finish_all_gather(PendingGather& p) {
  if (p.work) {
    const auto start = p.start, waiting = std::chrono::steady_clock::now();
    run("all-gather", static_cast<int64_t>(p.gathered.nbytes()), [&] { p.work->wait(); }, /*observe=*/false);
    const auto end = std::chrono::steady_clock::now();
    if (observer_) observer_("all-gather", static_cast<int64_t>(p.gathered.nbytes()), start, end);
    if (wait_observer_) wait_observer_("all-gather", 0, waiting, end);
    p.work.reset();
  }
  p.input = torch::Tensor();
  p.gathered = from_wire(p.gathered, p.home);
  return p.gathered;
}

torch::Tensor Communicator::reduce_scatter_sum(const torch::Tensor& full) {
  PendingScatter pending = start_reduce_scatter_sum(full);
  return finish_reduce_scatter(pending);
}

Communicator::PendingScatter Communicator::start_reduce_scatter_sum(const torch::Tensor& full) {
  if (full.size(0) % size_ != 0)
    throw CollectiveError("reduce-scatter on " + name_ + ": " + std::to_string(full.size(0)) +
                          " rows do not split into " + std::to_string(size_) + " equal chunks");
  PendingScatter p;
  p.start = std::chrono::steady_clock::now();
  p.type = full.scalar_type();
  p.home = full.device();
  p.bytes = static_cast<int64_t>(full.nbytes());
  if (!group_) {
    p.result = full.clone();
    return p;
  }
  run("reduce-scatter", 0, [&] {
    std::vector<int64_t> shape = full.sizes().vec();
    shape[0] /= size_;
    if (group_->getBackendName() == "gloo") {
      // gloo's own reduce-scatter takes twice as long as an all-to-all of the equal chunks and a
      // local sum, which move the same bytes as a ring (docs/decisions.md).
      p.input = to_wire(full);
      p.result = torch::empty_like(p.input);
      std::vector<int64_t> equal;  // empty split lists: equal chunks
      p.work = group_->alltoall_base(p.result, p.input, equal, equal);
      shape.insert(shape.begin(), size_);
      p.result = p.result.view(shape);
      p.chunks = true;
      return;
    }
    p.input = to_wire(sums_wide(full) ? full.to(torch::kFloat) : full);
    p.result = torch::empty(shape, p.input.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    p.work = group_->_reduce_scatter_base(p.result, p.input, options);
  }, /*observe=*/false);
  return p;
}

torch::Tensor Communicator::finish_reduce_scatter(PendingScatter& p) {
  if (!p.work) return std::move(p.result);
  torch::Tensor result;
  const auto waiting = std::chrono::steady_clock::now();
  run("reduce-scatter", p.bytes, [&] {
    p.work->wait();
    p.work.reset();
    const bool widen = p.type == torch::kBFloat16;  // sums_wide
    torch::Tensor summed = p.chunks ? (widen ? p.result.to(torch::kFloat) : p.result).sum(0) : p.result;
    result = from_wire(summed.scalar_type() == p.type ? summed : summed.to(p.type), p.home);
  }, /*observe=*/false);
  const auto end = std::chrono::steady_clock::now();
  if (observer_) observer_("reduce-scatter", p.bytes, p.start, end);
  if (wait_observer_) wait_observer_("reduce-scatter", 0, waiting, end);
  p.input = p.result = torch::Tensor();
  return result;
}

torch::Tensor Communicator::all_to_all(const torch::Tensor& input, const std::vector<int64_t>& send_rows,
                                       const std::vector<int64_t>& recv_rows) {
  assert(static_cast<int64_t>(send_rows.size()) == size_ && static_cast<int64_t>(recv_rows.size()) == size_ &&
         "one split per rank");
  if (!group_) return input.clone();
  torch::Tensor result;
  run("all-to-all", static_cast<int64_t>(input.nbytes()), [&] {
    std::vector<int64_t> send = send_rows, recv = recv_rows;
    torch::Tensor in = to_wire(input);
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] = std::accumulate(recv.begin(), recv.end(), int64_t{0});
    torch::Tensor out = torch::empty(shape, in.options());
    group_->alltoall_base(out, in, recv, send)->wait();
    result = from_wire(out, input.device());
  });
  return result;
}

void Communicator::broadcast(torch::Tensor& t, int64_t root) {
  if (!group_) return;
  run("broadcast", static_cast<int64_t>(t.nbytes()), [&] {
    std::vector<torch::Tensor> tensors{to_wire(t)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    group_->broadcast(tensors, options)->wait();
    if (!tensors[0].is_same(t)) t.copy_(tensors[0]);
  });
}

void Communicator::barrier() {
  if (!group_) return;
  run("barrier", 0, [&] { group_->barrier()->wait(); });
}

void Communicator::check_peer(const char* op, int64_t peer, int64_t tag) const {
  const std::string where = std::string(op) + " on " + name_ + " (rank " + std::to_string(rank_) + " of " +
                            std::to_string(size_) + ")";
  if (size_ == 1) throw std::logic_error(where + ": a group of one has no peer");
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw std::logic_error(where + ": rank " + std::to_string(peer) + " is not another rank of the group");
  if (tag < 0 || tag > std::numeric_limits<int32_t>::max())
    throw std::logic_error(where + ": tag " + std::to_string(tag) + " is not a non-negative 32-bit integer");
}

void Communicator::send(const torch::Tensor& t, int64_t dst, int64_t tag) {
  PendingTransfer pending = start_send(t, dst, tag);
  finish_transfer(pending);
}

torch::Tensor Communicator::recv(c10::IntArrayRef shape, torch::ScalarType type, int64_t src, int64_t tag) {
  PendingTransfer pending = start_recv(shape, type, src, tag);
  return finish_transfer(pending);
}

Communicator::PendingTransfer Communicator::start_send(const torch::Tensor& t, int64_t dst, int64_t tag) {
  check_peer("send", dst, tag);
  PendingTransfer p;
  p.peer = dst;
  p.sending = true;
  p.start = std::chrono::steady_clock::now();
  run("send", 0, [&] {
    p.buffer = to_wire(t);
    std::vector<torch::Tensor> tensors{p.buffer};
    p.work = group_->send(tensors, static_cast<int>(dst), static_cast<int>(tag));
  }, /*observe=*/false, " to rank " + std::to_string(dst));
  return p;
}

Communicator::PendingTransfer Communicator::start_recv(c10::IntArrayRef shape, torch::ScalarType type, int64_t src,
                                                       int64_t tag) {
  check_peer("recv", src, tag);
  PendingTransfer p;
  p.peer = src;
  p.start = std::chrono::steady_clock::now();
  run("recv", 0, [&] {
    p.buffer = torch::empty(shape, torch::TensorOptions().dtype(type).device(wire_));
    std::vector<torch::Tensor> tensors{p.buffer};
    p.work = group_->recv(tensors, static_cast<int>(src), static_cast<int>(tag));
  }, /*observe=*/false, " from rank " + std::to_string(src));
  return p;
}

torch::Tensor Communicator::finish_transfer(PendingTransfer& p) {
  const char* op = p.sending ? "send" : "recv";
  if (p.work) {
    const int64_t bytes = static_cast<int64_t>(p.buffer.nbytes());
    // gloo waits as long as the group's timeout, then throws: no hang on a silent peer.
    const std::string peer = (p.sending ? " to rank " : " from rank ") + std::to_string(p.peer);
    run(op, bytes, [&] { p.work->wait(); }, /*observe=*/false, peer);
    if (observer_) observer_(op, bytes, p.start, std::chrono::steady_clock::now());
    p.work.reset();
  }
  torch::Tensor received = p.sending ? torch::Tensor() : from_wire(p.buffer, device_);
  p.buffer = torch::Tensor();
  return received;
}

BackendGroup make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
                             int size, std::chrono::milliseconds timeout, const std::string& address) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
}

bool nccl_built() { return MOEPLAN_WITH_NCCL != 0; }

BackendGroup make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank,
                             int size, std::chrono::milliseconds timeout, const torch::Device& device) {
#if MOEPLAN_WITH_NCCL
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options);
  // The communicator is made on this rank's device (eagerly, so that a wrong device fails here
  // and not at the first collective).
  group->eagerConnectSingleDevice(device);
  return group;
#else
  (void)store, (void)prefix, (void)rank, (void)size, (void)timeout, (void)device;
  throw CollectiveError("NCCL group " + prefix + ": this moeplan was built without NCCL");
#endif
}

}  // namespace moeplan::executor
