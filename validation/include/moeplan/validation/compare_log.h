#pragma once
// `moeplan compare plan.json --log FILE`: a run of the plan in another framework (its own
// per-iteration log lines, moeplan/frameworks/training_log.h) beside the plan's prediction:
// step time, tokens per second, the framework's TFLOP/s, peak memory, and Megatron-LM's phases
// where its timers were logged.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/training_log.h"

namespace moeplan::validation {

struct LogFigure {
  std::string name;  // e.g. "step time (s)"
  double measured = 0;
  double predicted = 0;  // 0: the plan predicts no such figure
  bool comparable = true;  // false: counted another way than the prediction, shown beside it
};

struct LogComparison {
  const LogSource* format = nullptr;  // whose log it is
  int64_t iterations = 0;  // logged iterations compared (after the skipped ones)
  int64_t skipped = 0;
  std::vector<LogFigure> figures;
  std::vector<std::string> notes;  // where the log and the plan disagree on the run itself
};

// The medians of the log's iterations after the first `skip`, converted to the plan's units
// (SMP's script counts micro-batches: its step is gradient_accumulation_steps of them). Throws
// InputError (origin `origin`) when nothing is left to compare.
LogComparison compare_with_log(const Plan& plan, const TrainingLog& log, int64_t skip, const std::string& origin);

// The comparison as a table with a header line.
std::string format_log_comparison(const LogComparison& c, const std::string& plan_name, const std::string& log_name);

}  // namespace moeplan::validation
