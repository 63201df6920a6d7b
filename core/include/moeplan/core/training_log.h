#pragma once
// A training log of another framework, read back (each framework reads its own lines:
// moeplan/frameworks/training_log.h): its iterations, and what printed them.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moeplan/core/plan.h"

namespace moeplan {

// One logged iteration; a figure the line does not carry is 0.
struct LoggedIteration {
  int64_t line = 0;       // 1-based line number in the log
  int64_t iteration = 0;  // as the framework counts (SMP's script counts micro-batches)
  double step_ms = 0;              // Megatron: elapsed time per iteration; Trainer: 1 / steps per second
  double tokens_per_s_per_gpu = 0; // torchtitan: tps
  double samples_per_s = 0;        // SMP: Speed; Trainer: train_samples_per_second (the whole job's)
  double tflops_per_gpu = 0;       // as the framework counts them
  double memory_bytes = 0;         // torchtitan: max reserved
  int64_t global_batch = 0;        // Megatron: global batch size, in sequences
  double loss = 0;
};

// The lines one program prints while it trains (Megatron-LM, torchtitan, SMP's example
// script, the Hugging Face Trainer): the name messages give them, and how their figures become
// the plan's. Each is defined beside the reader of its lines, in frameworks/.
struct LogSource {
  std::string_view name;  // e.g. "Megatron-LM"
  // The seconds of one optimizer step of `plan` that an iteration line measures.
  double (*step_seconds)(const LoggedIteration& it, const Plan& plan) = nullptr;
  // One line covers the whole run: there are no warm-up iterations to leave out.
  bool summarises_run = false;
  // What its memory figure is, as a comparison names it.
  std::string_view memory_figure = "peak reserved per GPU (GiB)";
};

struct TrainingLog {
  const LogSource* format = nullptr;  // whose lines these are
  std::vector<LoggedIteration> iterations;
  // Megatron-LM's memory report ("max allocated", rank 0) in bytes; 0 when not logged.
  double max_allocated_bytes = 0;
  // Megatron-LM's timers, "(min, max) time across ranks (ms)": each timer's max per report.
  std::map<std::string, std::vector<double>> timer_max_ms;
};

}  // namespace moeplan
