#pragma once
// plan.json: a self-contained description of a training run and what moeplan predicts for it.
// It carries the model and the cluster inline so that it runs without the profile files.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan {

inline constexpr int64_t kPlanSchemaVersion = 1;

struct MemoryItem {
  std::string name;
  int64_t bytes = 0;
  bool operator==(const MemoryItem&) const = default;
};

// Per-rank memory, item by item. The totals are the sums of the items.
struct MemoryBreakdown {
  std::vector<MemoryItem> device;
  int64_t device_total_bytes = 0;
  int64_t device_limit_bytes = 0;  // usable device memory (capacity minus headroom)
  std::vector<MemoryItem> host;    // offloaded activations, per rank
  int64_t host_total_bytes = 0;
  int64_t host_limit_bytes = 0;  // host memory per rank
  bool operator==(const MemoryBreakdown&) const = default;
};

struct TimeItem {
  std::string name;
  double seconds = 0;
  bool operator==(const TimeItem&) const = default;
};

struct Prediction {
  std::string estimator;  // "analytic" or "simulator"
  double step_time_s = 0;
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;  // model FLOPs (no recompute) per GPU per second / 1e12
  double mfu = 0;             // model FLOPs utilisation against peak bf16
  MemoryBreakdown memory;
  std::vector<TimeItem> time;  // where a step's time goes, per rank
  bool operator==(const Prediction&) const = default;
};

struct Alternative {
  ParallelConfig parallel;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;
  int64_t device_peak_bytes = 0;
  bool operator==(const Alternative&) const = default;
};

struct Provenance {
  std::string moeplan_version;
  std::string command;
  bool operator==(const Provenance&) const = default;
};

struct Plan {
  int64_t schema_version = kPlanSchemaVersion;
  ModelSpec model;
  ClusterSpec cluster;
  ParallelConfig parallel;
  MoeConfig moe;
  TrainingConfig training;
  Prediction prediction;
  std::vector<Alternative> alternatives;
  Provenance provenance;
  bool operator==(const Plan&) const = default;
};

// Reads and checks a plan: types and ranges of every field, unknown fields, the validity rules,
// and that memory items add up to their totals. Throws InputError with every problem.
Plan plan_from_json(const Json& json, const std::string& origin);
Plan read_plan_file(const std::string& path);
Json to_json(const Plan& plan);
// The exact bytes written to plan.json (2-space indent, trailing newline).
std::string plan_to_text(const Plan& plan);

// Writes text to path atomically: a temporary file in the same folder, fsync, rename.
// The folder is fsynced too, so the rename survives a power loss.
void write_file_atomic(const std::string& path, const std::string& text);

// Makes the entries of a folder (new names, renames) durable.
void fsync_directory(const std::string& dir);

}  // namespace moeplan
