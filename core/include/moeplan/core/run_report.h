#pragma once
// report.json: what a run measured beside what its plan predicted. The executor writes it at
// the end of a run; `moeplan simulate --measured`, `moeplan validate` and the rehearsal read it
// back with one strict reader that names the field of any problem.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/phases.h"

namespace moeplan {

// The simulator's phase of a measured span: "forward", "backward" and "optimizer" as they are,
// a collective "<group>.<kind>" as its kind, "<...>.offload" and "<...>.reload" as copies.
std::string phase_of_measured_span(std::string_view name);

// Measured against predicted, as every report and comparison states it: measured / predicted
// - 1 (0 where nothing was predicted).
double relative_error(double measured, double predicted);

struct RunReport {
  std::string parallel;  // "E2 S1 R1 RSE ckpt=none mbs=8 ga=2"
  std::string profile;
  std::string where;  // what measured it
  int64_t ranks = 1;
  int64_t steps = 0;
  std::vector<double> step_seconds;  // the time of every step this run made, in order
  // Each step's steal share (StepRecord::steal) beside step_seconds; empty where the machine
  // does not say.
  std::vector<double> step_steal;
  // Over the steps, the first (warm-up) one left out when there are more: the median, and the
  // lower quartile, the like of a prediction (calibration keeps the lower quartile of its passes:
  // the machine running nothing else beside the job, as a cluster's node does).
  double step_time_s = 0, undisturbed_step_time_s = 0;
  double tokens_per_s = 0;
  std::vector<int64_t> peak_rss_bytes_per_rank, baseline_rss_bytes_per_rank, peak_tensor_bytes_per_rank,
      peak_step_tensor_bytes_per_rank, busiest_expert_rows_per_rank;
  int64_t peak_rss_bytes = 0;  // the largest rank's
  // Ranks on a GPU: the CUDA caching allocator's peaks of allocated and reserved bytes, and the
  // device memory at its peak as the driver would count it (what was in use on the device before
  // the model, the context with it, plus the peak reserved), and of the allocated bytes those
  // cuBLAS's workspaces held (the framework's, not the model's); empty on CPU ranks.
  std::vector<int64_t> peak_device_allocated_bytes_per_rank, peak_device_reserved_bytes_per_rank,
      peak_device_bytes_per_rank, device_workspace_bytes_per_rank;
  int64_t peak_device_bytes = 0;  // the largest rank's
  // What the memory model's device bytes are measured against: the device's peak on a GPU, the
  // resident set's on CPU ranks.
  int64_t peak_memory_bytes() const { return peak_device_bytes > 0 ? peak_device_bytes : peak_rss_bytes; }
  double predicted_step_time_s = 0, predicted_tokens_per_s = 0;
  int64_t predicted_bytes_per_rank = 0;
  std::vector<std::vector<int64_t>> tokens_per_expert;  // of the last step, [layer][expert]
  std::vector<std::pair<std::string, double>> phase_seconds;  // rank 0's last step, per span name

  // Sets step_seconds, steps and the two figures over them.
  void set_step_seconds(std::vector<double> seconds);
  // Over the steps the median leaves in (the first left out when there are more): the mean steal
  // share, and how many steps the hypervisor disturbed (steal at kUndisturbedSteal or more);
  // both 0 without step_steal.
  double mean_steal() const;
  int64_t stolen_steps() const;
  double step_time_error() const { return relative_error(step_time_s, predicted_step_time_s); }
  double undisturbed_step_time_error() const { return relative_error(undisturbed_step_time_s, predicted_step_time_s); }
  double tokens_per_s_error() const { return relative_error(tokens_per_s, predicted_tokens_per_s); }
  double memory_error() const {
    return relative_error(static_cast<double>(peak_memory_bytes()), static_cast<double>(predicted_bytes_per_rank));
  }
  // Rank 0's last step by the simulator's phase names (phase_of_measured_span), summed.
  std::vector<std::pair<std::string, double>> phases() const;
  // The busiest rank's live tensors inside a step, and the most rows one rank's experts took.
  int64_t peak_step_tensor_bytes() const;
  int64_t busiest_expert_rows() const;
};

Json to_json(const RunReport& report);
// Strict: every field typed and checked, unknown fields refused, problems named by field path
// and thrown together as an InputError of `origin`.
RunReport run_report_from_json(const Json& json, const std::string& origin);
RunReport read_run_report(const std::string& path);

}  // namespace moeplan
