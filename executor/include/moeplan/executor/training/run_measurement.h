#pragma once
// What a run measures and how it is compared with the plan: phase spans of a step as trace
// events, peak memory per rank, the measured trace (trace.json), the report (report.json) and
// the one-screen summary printed at the end of a run.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/run_report.h"
#include "moeplan/core/step_record.h"
#include "moeplan/core/trace.h"
#include "moeplan/executor/ranks/device.h"

namespace moeplan::executor {

// What one rank records of a step: spans per phase, as trace events of this rank, and the bytes
// of live tensors at the start of the step and at the end of every span (the trace's memory
// curve; none where tensors are not counted, see install_tensor_allocator).
class PhaseClock {
 public:
  using Clock = std::chrono::steady_clock;
  void start_step();
  // group: a collective's group (core/trace.h), -1 for anything else.
  void add(std::string name, std::string category, TraceStream stream, Clock::time_point start, Clock::time_point end,
           double bytes = 0, int64_t group = -1);
  // A compute span of `phase` between marks `begin` and `end` of `marks`: added now where the
  // marks are host times (the CPU's: the memory curve samples the tensors then), else kept until
  // add_marked_spans() reads them once the step's device work has run.
  void add_marked(std::string_view phase, DeviceMarks& marks, size_t begin, size_t end);
  void add_marked_spans(DeviceMarks& marks);
  const std::vector<TraceEvent>& events() const { return events_; }
  const std::vector<MemorySample>& memory() const { return memory_; }
  void set_rank(int64_t rank) { rank_ = rank; }
  // A rank on a GPU: the memory curve samples the device's allocated bytes (the caching
  // allocator's, cuBLAS's workspaces in them), not the host's tensors.
  void set_device(const torch::Device& device) { device_ = device; }

 private:
  void sample_memory(Clock::time_point at);

  struct MarkedSpan {
    std::string_view phase;
    size_t begin, end;
  };
  std::vector<TraceEvent> events_;
  std::vector<MemorySample> memory_;
  std::vector<MarkedSpan> marked_;
  Clock::time_point origin_ = Clock::now();
  int64_t rank_ = 0;
  torch::Device device_ = torch::kCPU;
};

// Resident set of this process now (VmRSS) and at its peak (VmHWM), in bytes; 0 where /proc is
// missing.
int64_t current_rss_bytes();
int64_t peak_rss_bytes();

// The machine's processor time so far, every processor together, in clock ticks: all of it and
// what the hypervisor gave to other guests (steal). None where /proc/stat does not say.
struct ProcessorTimes {
  int64_t total = 0, steal = 0;
};
std::optional<ProcessorTimes> processor_times(const std::string& stat_path = "/proc/stat");
// The stolen share of the time between two readings; none where either is missing or no time
// passed between them.
std::optional<double> steal_share(const std::optional<ProcessorTimes>& before,
                                  const std::optional<ProcessorTimes>& after);

// One rank's share of the measurement.
struct RankMeasurement {
  int64_t rank = 0;
  int64_t peak_rss_bytes = 0;
  int64_t baseline_rss_bytes = 0;  // before the model was built: the runtime and its libraries
  int64_t peak_tensor_bytes = 0;   // live tensors at their peak (install_tensor_allocator)
  int64_t peak_step_tensor_bytes = 0;  // the same inside training steps only (StepPeaks)
  int64_t busiest_expert_rows = 0;     // most rows its experts computed in a layer of a micro-batch
  // On a GPU (0 on the CPU): the caching allocator's peaks over the steps, and the device memory
  // in use before the model (its CUDA context; the driver counts every process on the device).
  int64_t peak_device_allocated_bytes = 0, peak_device_reserved_bytes = 0, baseline_device_bytes = 0;
  int64_t device_workspace_bytes = 0;  // cuBLAS's, within the allocated bytes (DeviceMemory::blas_workspaces)
  std::vector<TraceEvent> events;  // of the last step
  std::vector<MemorySample> memory;
};
Json to_json(const RankMeasurement& m);
RankMeasurement rank_measurement_from_json(const Json& j, const std::string& origin);

// Joins the ranks' measurements into trace.json and report.json in out_dir and returns the report.
RunReport write_run_outputs(const Plan& plan, const std::string& out_dir, const std::vector<StepRecord>& steps,
                            const std::vector<RankMeasurement>& ranks, const std::string& where);

// The one-screen summary: predicted against measured, the phases of a step, the expert load.
std::string format_summary(const RunReport& report);

}  // namespace moeplan::executor
