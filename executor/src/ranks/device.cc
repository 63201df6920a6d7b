#include "moeplan/executor/ranks/device.h"

#include <torch/cuda.h>

#if MOEPLAN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace moeplan::executor {

int64_t cuda_device_count() {
#if MOEPLAN_WITH_CUDA
  return torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
#else
  return 0;
#endif
}

std::string gpu_plan_but(const ClusterSpec& cluster) {
  return "the plan is for " + cluster.gpu_name + " GPUs (" + cluster.name + "), but ";
}

ComputeDevice choose_device(const ClusterSpec& cluster, int64_t local_rank) {
  ComputeDevice out;
  out.name = "CPU";
  if (cluster.device != DeviceKind::kCuda) return out;
#if MOEPLAN_WITH_CUDA
  const int64_t count = cuda_device_count();
  if (count == 0) {
    out.note = "this machine has no CUDA device";
    return out;
  }
  if (local_rank >= count) {
    out.note = "local rank " + std::to_string(local_rank) + " has no GPU of its own (" + std::to_string(count) +
               " here)";
    return out;
  }
  out.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  c10::cuda::set_device(out.device.index());
  // A first tensor on it: its context and the caching allocator exist from here on (the
  // allocator's figures are read before the model is built).
  (void)torch::empty({1}, torch::TensorOptions().device(out.device));
  cudaDeviceProp prop{};
  const std::string model = cudaGetDeviceProperties(&prop, out.device.index()) == cudaSuccess ? prop.name : "GPU";
  out.name = model + " (" + out.device.str() + ")";
#else
  (void)local_rank;
  out.note = "this moeplan was built with a LibTorch without CUDA";
#endif
  return out;
}

void wait_for(const torch::Device& device) {
#if MOEPLAN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

DeviceMemory device_memory(const torch::Device& device) {
  DeviceMemory m;
#if MOEPLAN_WITH_CUDA
  if (!device.is_cuda()) return m;
  using c10::CachingAllocator::StatType;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const auto all = static_cast<size_t>(StatType::AGGREGATE);
  m.reserved = stats.reserved_bytes[all].current;
  m.peak_allocated = stats.allocated_bytes[all].peak;
  m.peak_reserved = stats.reserved_bytes[all].peak;
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    m.used = static_cast<int64_t>(total - free);
    m.total = static_cast<int64_t>(total);
  }
#else
  (void)device;
#endif
  return m;
}

void reset_device_peaks(const torch::Device& device) {
#if MOEPLAN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

torch::Tensor to_device(const torch::Tensor& t, const torch::Device& device) {
  if (t.device() == device) return t;
  if (device.is_cuda() && t.device().is_cpu()) return t.pin_memory().to(device, /*non_blocking=*/true);
  return t.to(device);
}

}  // namespace moeplan::executor
