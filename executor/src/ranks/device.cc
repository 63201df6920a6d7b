#include "moeplan/executor/ranks/device.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <memory>
#include <set>
#include <shared_mutex>

#if MOEPLAN_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
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

namespace {

// cuda:index made current, named by the driver's model name.
ComputeDevice cuda_device(int64_t index) {
  ComputeDevice out;
#if MOEPLAN_WITH_CUDA
  out.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(out.device.index());
  // A first tensor on it: its context and the caching allocator exist from here on (the
  // allocator's figures are read before the model is built).
  (void)torch::empty({1}, torch::TensorOptions().device(out.device));
  cudaDeviceProp prop{};
  const std::string model = cudaGetDeviceProperties(&prop, out.device.index()) == cudaSuccess ? prop.name : "GPU";
  out.name = model + " (" + out.device.str() + ")";
#else
  (void)index;
#endif
  return out;
}

}  // namespace

ComputeDevice choose_device(const ClusterSpec& cluster, int64_t local_rank) {
  const int64_t gpus = cuda_device_count();
  RankPlace place = place_rank(cluster.device, local_rank, gpus);
  if (place.gpu >= 0 && !place.own_gpu) {  // a GPU of its own or none: no sharing here
    place.gpu = -1;
    place.note = "local rank " + std::to_string(local_rank) + " has no GPU of its own (" + std::to_string(gpus) +
                 " here)";
  }
  return rank_device(place);
}

RankPlace place_rank(DeviceKind kind, int64_t local_rank, int64_t gpus, bool cuda_built) {
  RankPlace p;
  if (kind != DeviceKind::kCuda) return p;
  if (!cuda_built) {
    p.note = "this moeplan was built with a LibTorch without CUDA";
  } else if (gpus <= 0) {
    p.note = "this machine has no CUDA device";
  } else {
    p.gpu = local_rank % gpus;
    p.own_gpu = local_rank < gpus;
    if (!p.own_gpu)
      p.note = "local rank " + std::to_string(local_rank) + " shares GPU " + std::to_string(p.gpu) + " (" +
               std::to_string(gpus) + " here)";
  }
  return p;
}

std::vector<RankPlace> places_of_world(c10d::Store& store, int64_t rank, int64_t world_size, const RankPlace& mine) {
  const std::string said = std::to_string(mine.gpu) + " " + (mine.own_gpu ? "1" : "0") + " " + mine.note;
  store.set("place/" + std::to_string(rank), std::vector<uint8_t>(said.begin(), said.end()));
  std::vector<RankPlace> all;
  for (int64_t r = 0; r < world_size; ++r) {
    const std::vector<uint8_t> bytes = store.get("place/" + std::to_string(r));  // waits for it
    const std::string text(bytes.begin(), bytes.end());
    const size_t first = text.find(' '), second = text.find(' ', first + 1);
    if (first == std::string::npos || second == std::string::npos)
      throw std::runtime_error("rank " + std::to_string(r) + " told its place as \"" + text + "\"");
    RankPlace p;
    p.gpu = std::stoll(text.substr(0, first));
    p.own_gpu = text.compare(first + 1, second - first - 1, "1") == 0;
    p.note = text.substr(second + 1);
    all.push_back(std::move(p));
  }
  return all;
}

const char* name_of(GroupBackend b) { return b == GroupBackend::kNccl ? "NCCL" : "gloo"; }

GroupBackend choose_backend(const std::vector<RankPlace>& ranks, bool nccl_built) {
  if (!nccl_built || ranks.empty()) return GroupBackend::kGloo;
  for (const RankPlace& r : ranks)
    if (r.gpu < 0 || !r.own_gpu) return GroupBackend::kGloo;
  return GroupBackend::kNccl;
}

std::string describe_placement(const std::vector<RankPlace>& ranks, GroupBackend backend) {
  int64_t on_cpu = 0, sharing = 0;
  int64_t gpus = 0;
  for (const RankPlace& r : ranks) {
    if (r.gpu < 0) ++on_cpu;
    else if (!r.own_gpu) ++sharing;
    gpus = std::max(gpus, r.gpu + 1);
  }
  const auto count = [](int64_t n, const char* one, const char* many) {
    return std::to_string(n) + " " + (n == 1 ? one : many);
  };
  if (on_cpu > 0) {
    const RankPlace& first = *std::find_if(ranks.begin(), ranks.end(), [](const RankPlace& r) { return r.gpu < 0; });
    if (first.note.empty()) return "";  // a CPU profile: CPU ranks are what it asked for
    return first.note + ": " + count(on_cpu, "rank trains", "ranks train") + " on the CPU, joined by gloo";
  }
  if (backend == GroupBackend::kNccl) return "";
  if (sharing > 0)
    return count(static_cast<int64_t>(ranks.size()), "rank shares", "ranks share") + " " + count(gpus, "GPU", "GPUs") +
           ": their groups use gloo over CUDA tensors, staged through host memory (NCCL needs a GPU per rank)";
  return count(static_cast<int64_t>(ranks.size()), "rank", "ranks") +
         " on GPUs of their own, but this moeplan has no NCCL: their groups use gloo, staged through host memory";
}

ComputeDevice rank_device(const RankPlace& place) {
  if (place.gpu < 0) {
    ComputeDevice out;
    out.name = "CPU";
    out.note = place.note;
    return out;
  }
  ComputeDevice out = cuda_device(place.gpu);
  out.note = place.note;
  return out;
}

void wait_for(const torch::Device& device) {
#if MOEPLAN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

#if MOEPLAN_WITH_CUDA
struct DeviceMarks::Events {
  std::unique_ptr<c10::cuda::CUDAEvent> reference;
  DeviceMarks::Clock::time_point reference_time;
  std::vector<std::unique_ptr<c10::cuda::CUDAEvent>> marks;
  static std::unique_ptr<c10::cuda::CUDAEvent> recorded(const torch::Device& device) {
    auto e = std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault);  // timed
    e->record(c10::cuda::getCurrentCUDAStream(device.index()));
    return e;
  }
};
#else
struct DeviceMarks::Events {};
#endif

#if MOEPLAN_WITH_CUDA
std::chrono::steady_clock::time_point host_time_of(const c10::cuda::CUDAEvent& reference,
                                                   std::chrono::steady_clock::time_point reference_time,
                                                   c10::cuda::CUDAEvent& event,
                                                   std::chrono::steady_clock::time_point queued) {
  event.synchronize();
  const double ms = static_cast<double>(reference.elapsed_time(event));
  return std::max(queued, reference_time + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double, std::milli>(ms)));
}
#endif

DeviceMarks::DeviceMarks(const torch::Device& device) : device_(device) { restart(); }
DeviceMarks::~DeviceMarks() = default;
DeviceMarks::DeviceMarks(DeviceMarks&&) noexcept = default;
DeviceMarks& DeviceMarks::operator=(DeviceMarks&&) noexcept = default;

void DeviceMarks::restart() {
  host_.clear();
#if MOEPLAN_WITH_CUDA
  if (device_.is_cuda()) {
    wait_for(device_);
    events_ = std::make_unique<Events>();
    events_->reference = Events::recorded(device_);
    events_->reference_time = Clock::now();
  }
#endif
}

size_t DeviceMarks::mark() {
#if MOEPLAN_WITH_CUDA
  if (events_) events_->marks.push_back(Events::recorded(device_));
#endif
  host_.push_back(Clock::now());
  return host_.size() - 1;
}

DeviceMarks::Clock::time_point DeviceMarks::time_of(size_t i) {
#if MOEPLAN_WITH_CUDA
  if (events_) {
    return host_time_of(*events_->reference, events_->reference_time, *events_->marks.at(i), host_.at(i));
  }
#endif
  return host_.at(i);
}

void start_kernel_trace(const torch::Device& device) {
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> activities = {ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

void save_kernel_trace(const torch::Device& device, const std::string& path) {
  wait_for(device);  // the step's kernels all ended, so recorded
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  result->save(path);
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
  const auto held = [](at::cuda::WorkspaceMapWithMutex& w, size_t bytes) {
    std::shared_lock<std::shared_mutex> lock(w.mutex);
    return static_cast<int64_t>(w.map.size() * bytes);
  };
  m.blas_workspaces = held(at::cuda::cublas_handle_stream_to_workspace(), at::cuda::getChosenWorkspaceSize()) +
                      held(at::cuda::cublaslt_handle_stream_to_workspace(), at::cuda::getCUDABlasLtWorkspaceSize());
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

int64_t device_allocated_bytes(const torch::Device& device) {
#if MOEPLAN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
#else
  (void)device;
#endif
  return 0;
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
