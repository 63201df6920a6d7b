#pragma once
// Which device a rank computes on, and what it reads off a CUDA device: its synchronisation and
// the caching allocator's peaks. The CPU path needs none of it; every function here is safe to
// call there (it does nothing or reports zeros).

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "moeplan/core/cluster_spec.h"

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

// "the plan is for H100-SXM5-80GB GPUs (p5.48xlarge), but ": how a run on the CPU of a GPU
// profile's plan begins to say why.
std::string gpu_plan_but(const ClusterSpec& cluster);

// How many CUDA devices this process sees (0 without CUDA).
int64_t cuda_device_count();

// Waits for the work queued on `device` (nothing on the CPU): host clocks then time what ran.
void wait_for(const torch::Device& device);

// The CUDA caching allocator's figures on one device (zeros on the CPU).
struct DeviceMemory {
  int64_t reserved = 0;                           // now
  int64_t peak_allocated = 0, peak_reserved = 0;  // since the last reset_device_peaks
  int64_t used = 0, total = 0;  // the whole device as the driver counts it (every process, the context too)
};
DeviceMemory device_memory(const torch::Device& device);
void reset_device_peaks(const torch::Device& device);

// A copy of `t` on `device`; from pinned host memory without blocking the host where it can.
torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device);

}  // namespace moeplan::executor
