// The hardware profile written from a calibration: the base profile with what was measured in
// place of its numbers, each with a source that says how.
#include "moeplan/executor/calibration/calibrate.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace moeplan::executor {

namespace {

// The processors this process may run on, as the kernel's affinity mask says (at least 1).
int64_t processors_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// A GPU's profile: its base's datasheet rates, kernel model and collectives stay (what one GPU
// cannot measure of its node); the executor's operations at the model's shapes, the host copies
// and the memory beyond the caching allocator are what was measured.
ClusterSpec calibrated_gpu(ClusterSpec p, const Calibration& c, const CalibrateOptions& o, const std::string& how) {
  char text[512];
  auto say = [&](const std::string& field, const std::string& what) { p.sources[field] = what + "; " + how; };
  std::snprintf(text, sizeof text,
                "%s, its nodes and interconnect as %s says; one %s calibrated by moeplan calibrate in %.0f s",
                p.description.c_str(), "the base profile", o.device_name.c_str(), c.seconds);
  p.description = text;
  p.sources.erase("description");
  p.pcie_bandwidth_bytes_per_s = 2.0 / (1.0 / c.offload_write_bytes_per_s + 1.0 / c.offload_read_bytes_per_s);
  std::snprintf(text, sizeof text,
                "measured: 256 MiB copies between pinned host memory and the GPU, %.1f GB/s to the host and %.1f GB/s "
                "back (the mean time per byte of the two)",
                c.offload_write_bytes_per_s / 1e9, c.offload_read_bytes_per_s / 1e9);
  say("host.pcie_bandwidth_bytes_per_s", text);
  p.framework_overhead_bytes = c.overhead_bytes;
  say("framework.overhead_bytes",
      "measured: the most device memory in use beyond what the CUDA caching allocator reserved (the CUDA context, "
      "cuBLAS and cuDNN) while the executor's operations ran");
  // The executor runs LibTorch's operations one after another; its attention is flash.
  p.kernels = Kernels::kEager;
  p.attention = AttentionKernel::kFlash;
  say("framework.kernels", "moeplan's executor: LibTorch operations one after another (no fused RMSNorm or SwiGLU)");
  say("framework.attention", "moeplan's executor: LibTorch's scaled-dot-product attention (flash on the GPU)");
  p.op_times = c.op_times;
  say("framework.op_times",
      "measured on one " + o.device_name + ": medians of the executor's operations at these shapes, the device "
      "synchronised around each, routing by " + std::string(name_of(kLoadBalancingNames, o.load_balancing)) +
      ", a median within each of " + std::to_string(c.passes) + " passes, the lower quartile of the passes kept");
  return p;
}

}  // namespace

ClusterSpec calibrated_cluster(const ClusterSpec& base, const Calibration& c, const CalibrateOptions& o,
                               const std::string& name, const std::string& how) {
  ClusterSpec p = base;
  p.name = name;
  if (o.device.is_cuda()) return calibrated_gpu(p, c, o, how);
  char text[512];
  auto say = [&](const std::string& field, const std::string& what) { p.sources[field] = what + "; " + how; };
  std::snprintf(text, sizeof text,
                "This machine as a cluster of %lld CPU ranks (one process each, gloo over loopback), calibrated "
                "by moeplan calibrate in %.0f s",
                static_cast<long long>(c.ranks), c.seconds);
  p.description = text;
  p.sources.erase("description");
  p.gpus_per_node = c.ranks;
  say("gpus_per_node", "the ranks calibrated together");
  p.host_processors = processors_available();
  say("host.processors", "measured: the processors this process may run on (sched_getaffinity), which the ranks share");
  const bool fp32 = o.precision == Precision::kFp32;
  (fp32 ? p.peak_fp32_flops : p.peak_bf16_flops) = c.peak_flops;
  if (fp32) p.peak_bf16_flops = std::max(p.peak_bf16_flops, p.peak_fp32_flops);
  std::snprintf(text, sizeof text, "measured: the fastest of %zu matrix multiplies at %s's shapes, %lld ranks busy",
                c.gemm.size(), o.model.name.c_str(), static_cast<long long>(c.ranks));
  say(fp32 ? "gpu.peak_fp32_flops" : "gpu.peak_bf16_flops", text);
  p.matmul_efficiency = c.efficiency;
  say("gpu.matmul_efficiency.points", "measured: each multiply's rate over the fastest");
  p.hbm_bandwidth_bytes_per_s = c.copy_bandwidth_bytes_per_s;
  say("gpu.memory_bandwidth_bytes_per_s", "measured: bytes read and written by a 64 MiB tensor copy");
  p.pcie_bandwidth_bytes_per_s =
      2.0 / (1.0 / c.offload_write_bytes_per_s + 1.0 / c.offload_read_bytes_per_s);
  std::snprintf(text, sizeof text,
                "measured: the activation offload file, written at %.2f GB/s and read at %.2f GB/s (the mean time "
                "per byte of the two)",
                c.offload_write_bytes_per_s / 1e9, c.offload_read_bytes_per_s / 1e9);
  say("host.pcie_bandwidth_bytes_per_s", text);
  for (const CollectiveSweep& s : c.collectives) {
    CollectiveFit f = fit_collective(s, c.ranks);
    for (size_t i = 0; i < s.unit_bytes.size(); ++i) f.points.emplace_back(s.unit_bytes[i], s.unit_seconds[i]);
    if (s.name == "all_gather") p.all_gather_fit = f;
    if (s.name == "all_to_all") p.all_to_all_fit = f;
    if (s.name == "all_reduce") p.all_reduce_fit = f;
    if (s.name == "reduce_scatter") p.reduce_scatter_fit = f;
    if (s.name == "all_gather" && f.given()) {
      p.intra_node_latency_s = f.latency_s;
      p.intra_node_bandwidth_bytes_per_s = f.bandwidth_bytes_per_s;
      say("intra_node.latency_s", "measured: the all-gather fit below");
      say("intra_node.bandwidth_bytes_per_s", "measured: the all-gather fit below");
    }
  }
  if (!c.collectives.empty()) {
    std::string fits = "measured: gloo collectives from " + std::to_string(static_cast<int64_t>(c.collectives[0].bytes.front())) +
                       " to " + std::to_string(static_cast<int64_t>(c.collectives[0].bytes.back())) +
                       " bytes (each the mean time of many calls, its tail included), latency + bytes / bandwidth "
                       "fitted by least squares, and measured at the sizes of " +
                       o.model.name + "'s flat units (points) (R^2:";
    for (const CollectiveSweep& s : c.collectives) {
      std::snprintf(text, sizeof text, " %s %.3f", s.name.c_str(), s.r_squared);
      fits += text;
    }
    say("intra_node.collectives", fits + ")");
  }
  // One process per core: gloo's threads and the compute share the cores.
  p.comm_overlaps_compute = false;
  say("framework.comm_overlaps_compute",
      "moeplan policy for CPU ranks: a collective's threads take the cores the ranks compute on (measured on 2 "
      "vCPUs: an all-gather of 3 MiB took 30-45 ms prefetched beside compute against 14 ms alone, and the step "
      "time did not change without prefetching, docs/validation.md)");
  p.after_compute = c.after_compute;
  if (!c.after_compute.empty())
    say("framework.collective_after_compute",
        "measured: a one-element all-reduce, a tokens-per-expert all-gather and a one-sequence dispatch all-to-all, "
        "each after stretches of compute (a router forward, an attention forward, a micro-batch forward, forward "
        "and backward) on every rank in lockstep: how far the slowest rank's stretch ran past its median (median "
        "over the calls) plus how far the collective on the rank that came last ran past its back-to-back mean "
        "(mean over the calls); the lower quartile of " + std::to_string(c.passes) + " passes");
  p.framework_overhead_bytes = c.overhead_bytes;
  std::snprintf(text, sizeof text,
                "measured: the peak resident set less the peak of live tensors over three optimizer steps of the "
                "executor's trainer on the data-parallel layout of the ranks, as a run's report measures it "
                "(%.0f MiB before any tensor work)",
                static_cast<double>(c.baseline_rss_bytes) / (1 << 20));
  say("framework.overhead_bytes", text);
  p.op_times = c.op_times;
  say("framework.op_times",
      "measured: medians of the executor's operations at these shapes, every rank busy at once, routing by " +
          std::string(name_of(kLoadBalancingNames, o.load_balancing)) + ", a median within each of " +
          std::to_string(c.passes) + " passes, the lower quartile of the passes kept");
  return p;
}

}  // namespace moeplan::executor
