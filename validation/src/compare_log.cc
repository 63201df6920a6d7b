#include "moeplan/validation/compare_log.h"

#include <cstdio>

#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/run_report.h"

namespace moeplan::validation {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The median of a timer's reports after the first `skip`, which fall in the skipped iterations.
double timer_median(const std::vector<double>& reports, int64_t skip) {
  if (static_cast<int64_t>(reports.size()) <= skip) return median(reports);
  return median(std::vector<double>(reports.begin() + skip, reports.end()));
}

std::string figure(double v) {
  char text[32];
  std::snprintf(text, sizeof text, v >= 1000 ? "%.0f" : "%.4g", v);
  return text;
}

// The predicted seconds of one item of the step (0 when the prediction has none).
double predicted_seconds(const Prediction& p, const std::string& name) {
  for (const TimeItem& item : p.time)
    if (item.name == name) return item.seconds;
  return 0;
}

}  // namespace

LogComparison compare_with_log(const Plan& plan, const TrainingLog& log, int64_t skip, const std::string& origin) {
  LogComparison c;
  c.format = log.format;
  const std::vector<LoggedIteration>& all = log.iterations;
  if (log.format->summarises_run) skip = 0;
  if (static_cast<int64_t>(all.size()) <= skip)
    throw InputError(origin, {{"", "holds " + std::to_string(all.size()) + " iteration lines, none left after the " +
                                       std::to_string(skip) + " skipped (--skip-iterations)"}});
  c.skipped = skip;
  c.iterations = static_cast<int64_t>(all.size()) - skip;

  const double seq = static_cast<double>(plan.training.seq_len);
  const double step_tokens = static_cast<double>(plan.training.global_batch_tokens);
  std::vector<double> step_s, tflops;
  double memory = log.max_allocated_bytes;
  for (size_t i = static_cast<size_t>(skip); i < all.size(); ++i) {
    const LoggedIteration& it = all[i];
    step_s.push_back(log.format->step_seconds(it, plan));
    // Megatron-LM logs its global batch size.
    if (it.global_batch > 0 && static_cast<double>(it.global_batch) * seq != step_tokens && c.notes.empty())
      c.notes.push_back("line " + std::to_string(it.line) + ": global batch size " + std::to_string(it.global_batch) +
                        " sequences, the plan's is " + std::to_string(plan.training.global_batch_tokens /
                                                                      plan.training.seq_len));
    if (it.tflops_per_gpu > 0) tflops.push_back(it.tflops_per_gpu);
    memory = std::max(memory, it.memory_bytes);
  }
  const double measured_step = median(step_s);
  c.figures.push_back({"step time (s)", measured_step, plan.prediction.step_time_s});
  c.figures.push_back({"tokens/s", step_tokens / measured_step, plan.prediction.tokens_per_s});
  if (!tflops.empty())
    c.figures.push_back({"TFLOP/s per GPU (as " + std::string(log.format->name) + " counts)", median(tflops),
                         plan.prediction.tflops_per_gpu, false});
  if (memory > 0)
    c.figures.push_back({std::string(log.format->memory_figure), memory / kGiB,
                         static_cast<double>(plan.prediction.memory.device_total_bytes) / kGiB});
  // Megatron-LM's timers: the forward and backward of every micro-batch (their compute,
  // recomputation and every wait), and the optimizer step.
  const double optimizer_s = predicted_seconds(plan.prediction, "optimizer");
  if (const auto fb = log.timer_max_ms.find("forward-backward"); fb != log.timer_max_ms.end())
    c.figures.push_back({"phase forward-backward (s)", timer_median(fb->second, skip) / 1000.0,
                         plan.prediction.step_time_s - optimizer_s});
  if (const auto opt = log.timer_max_ms.find("optimizer"); opt != log.timer_max_ms.end())
    c.figures.push_back({"phase optimizer (s)", timer_median(opt->second, skip) / 1000.0, optimizer_s});
  return c;
}

std::string format_log_comparison(const LogComparison& c, const std::string& plan_name, const std::string& log_name) {
  std::string out = "moeplan compare: " + plan_name + " against " + log_name + " (" +
                    std::string(c.format->name) + ", median of " + std::to_string(c.iterations) +
                    " logged iterations, the first " + std::to_string(c.skipped) + " skipped)\n\n";
  out += "| figure | measured | predicted | error (measured / predicted - 1) |\n|---|---:|---:|---:|\n";
  for (const LogFigure& f : c.figures) {
    char error[32] = "-";
    if (f.predicted > 0 && f.comparable)
      std::snprintf(error, sizeof error, "%+.1f%%", 100 * relative_error(f.measured, f.predicted));
    out += "| " + f.name + " | " + figure(f.measured) + " | " + (f.predicted > 0 ? figure(f.predicted) : "-") + " | " +
           error + " |\n";
  }
  for (const std::string& n : c.notes) out += "\nnote: " + n;
  if (!c.notes.empty()) out += "\n";
  return out;
}

}  // namespace moeplan::validation
