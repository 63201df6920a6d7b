#pragma once
// Which device a rank computes on, and what it reads off a CUDA device: its synchronisation and
// the caching allocator's peaks. The CPU path needs none of it; every function here is safe to
// call there (it does nothing or reports zeros).

#include <torch/csrc/distributed/c10d/Store.hpp>
#include "moeplan/executor/libtorch.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moeplan/core/cluster_spec.h"

#if MOEPLAN_WITH_CUDA
namespace c10::cuda {
struct CUDAEvent;
}
#endif

namespace moeplan::executor {

struct ComputeDevice {
  torch::Device device = torch::kCPU;
  std::string name;  // "NVIDIA H100 80GB HBM3 (cuda:0)", "CPU"
  // Why a GPU profile's rank is on the CPU here ("this machine has no CUDA device"; "" when it
  // is where the profile says).
  std::string note;
  bool is_cuda() const { return device.is_cuda(); }
};

// cuda:local_rank when the profile is a CUDA GPU's and this machine has that many GPUs (the
// device is made current); otherwise the CPU, with a note saying why when the profile wanted a GPU.
ComputeDevice choose_device(const ClusterSpec& cluster, int64_t local_rank);

// Where one rank of a many-rank run computes, from what it sees: the profile's kind of device,
// its local rank (LOCAL_RANK, as torchrun and SLURM set it) and the GPUs of its machine. A rank
// with a GPU of its own (local rank < GPUs) computes there; ranks beyond the GPUs share them,
// round robin (a workstation, a test), which NCCL cannot do.
struct RankPlace {
  int64_t gpu = -1;  // the CUDA device's index; -1: the CPU
  bool own_gpu = false;
  std::string note;  // why a GPU profile's rank is not on a GPU of its own; "" when it is
};
RankPlace place_rank(DeviceKind kind, int64_t local_rank, int64_t gpus, bool cuda_built = MOEPLAN_WITH_CUDA != 0);

// The backend of every process group of a run. One for the whole world: a group whose ranks
// disagree would hang at its first collective.
enum class GroupBackend : uint8_t { kGloo, kNccl };
const char* name_of(GroupBackend b);
// Every rank's place, told to the others through the rendezvous store ("place/<rank>"): every
// rank of the world calls it, and all get the same list, in rank order.
std::vector<RankPlace> places_of_world(c10d::Store& store, int64_t rank, int64_t world_size, const RankPlace& mine);

// NCCL when every rank computes on a GPU of its own and this build has NCCL; gloo otherwise (CPU
// ranks, or ranks that share a GPU: gloo then moves CUDA tensors through host memory).
GroupBackend choose_backend(const std::vector<RankPlace>& ranks, bool nccl_built);
// What a run says once at its start about where its ranks compute, e.g. "4 ranks share 1 GPU:
// their groups use gloo over CUDA tensors, staged through host memory (NCCL needs a GPU per
// rank)"; "" when there is nothing to say (CPU ranks of a CPU profile, or a GPU per rank on NCCL).
std::string describe_placement(const std::vector<RankPlace>& ranks, GroupBackend backend);

// choose_device for a rank of a many-rank run: place_rank's device, made current.
ComputeDevice rank_device(const RankPlace& place);

// "the plan is for H100-SXM5-80GB GPUs (p5.48xlarge), but ": how a run on the CPU of a GPU
// profile's plan begins to say why.
std::string gpu_plan_but(const ClusterSpec& cluster);

// How many CUDA devices this process sees (0 without CUDA).
int64_t cuda_device_count();

// Waits for the work queued on `device` (nothing on the CPU): host clocks then time what ran.
void wait_for(const torch::Device& device);

#if MOEPLAN_WITH_CUDA
// When the device reached `event`, on the host clock: its time after `reference`, an event
// recorded on the idle device whose host time `reference_time` was read just after, but never
// before `queued`, when the event was queued (the device stamps the reference a few
// microseconds after its host time is read, so an event reached at once could come out earlier).
// Waits for the event.
std::chrono::steady_clock::time_point host_time_of(const c10::cuda::CUDAEvent& reference,
                                                   std::chrono::steady_clock::time_point reference_time,
                                                   c10::cuda::CUDAEvent& event,
                                                   std::chrono::steady_clock::time_point queued);
#endif

// Marks in a device's queue of work, read as host times once the work has run, so that a step
// is timed without waiting for the device between its phases. On a GPU each mark is an event,
// placed on the host clock by its time after a reference event recorded when the device was
// idle; on the CPU, whose work runs as it is issued, the host clock when marked.
class DeviceMarks {
 public:
  using Clock = std::chrono::steady_clock;
  explicit DeviceMarks(const torch::Device& device = torch::kCPU);
  ~DeviceMarks();
  DeviceMarks(DeviceMarks&&) noexcept;
  DeviceMarks& operator=(DeviceMarks&&) noexcept;
  // Waits for the device, forgets the marks and takes a new reference.
  void restart();
  // A mark where the device's queue stands now: its index.
  size_t mark();
  // When the device reached mark i, on the host clock (waits for it on a GPU).
  Clock::time_point time_of(size_t i);
  // Whether marks are read later than made (a GPU's): a caller that samples anything else at
  // the time of a span's end does so when it adds the span.
  bool deferred() const { return device_.is_cuda(); }

 private:
  struct Events;  // a GPU's (device.cc)
  torch::Device device_;
  std::vector<Clock::time_point> host_;
  std::unique_ptr<Events> events_;
};

// The CUDA caching allocator's figures on one device (zeros on the CPU).
struct DeviceMemory {
  int64_t reserved = 0;                           // now
  int64_t peak_allocated = 0, peak_reserved = 0;  // since the last reset_device_peaks
  int64_t used = 0, total = 0;  // the whole device as the driver counts it (every process, the context too)
  // cuBLAS's workspaces, one per handle and stream that ran a matrix multiply (each thread has its
  // own handle, so forward and autograd's backward take one each): taken from the caching
  // allocator and counted in its allocated bytes, but the framework's, not the model's.
  int64_t blas_workspaces = 0;
};
DeviceMemory device_memory(const torch::Device& device);
int64_t device_allocated_bytes(const torch::Device& device);  // the caching allocator's now (0 on the CPU)
void reset_device_peaks(const torch::Device& device);

// PyTorch's profiler (Kineto) over what this process runs from start to save: its operators on
// every thread and, on a GPU, its kernels and copies; saved as a Chrome trace (JSON). One at a time.
void start_kernel_trace(const torch::Device& device);
void save_kernel_trace(const torch::Device& device, const std::string& path);

// A copy of `t` on `device`; from pinned host memory without blocking the host where it can.
torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device);

}  // namespace moeplan::executor
