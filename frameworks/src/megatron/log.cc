// Megatron-LM's log: its "iteration N/M | ... elapsed time per iteration (ms): ..." lines, its
// memory report ("max allocated", in MB) and its timers ("(min, max) time across ranks (ms)").
#include <algorithm>

#include "log_lines.h"
#include "megatron.h"

namespace moeplan::frameworks {

namespace {

const LogSource kMegatronLog{
    .name = "Megatron-LM",
    .step_seconds = [](const LoggedIteration& it, const Plan&) { return it.step_ms / 1000.0; },
    .memory_figure = "peak allocated per GPU, busiest reporting rank (GiB)",
};

void iteration(const LogLine& line, TrainingLog& log) {
  claim(log, kMegatronLog, line);
  const std::string_view text = line.text;
  LoggedIteration it;
  it.line = line.number;
  const auto iteration = after(text, " iteration ");
  const auto ms = after(text, "elapsed time per iteration (ms):");
  const auto batch = after(text, "global batch size:");
  if (!iteration || *iteration < 0 || *iteration > kMaxCount || !ms || *ms <= 0 ||
      (batch && (*batch < 0 || *batch > kMaxCount)))
    refuse(line, "is a Megatron-LM iteration line without a readable iteration number and elapsed time");
  it.iteration = static_cast<int64_t>(*iteration);
  it.step_ms = *ms;
  it.tflops_per_gpu = after(text, "throughput per GPU (TFLOP/s/GPU):").value_or(0);
  it.global_batch = static_cast<int64_t>(batch.value_or(0));
  it.loss = after(text, "lm loss:").value_or(0);
  log.iterations.push_back(it);
}

void memory(const LogLine& line, TrainingLog& log) {
  claim(log, kMegatronLog, line);
  const auto mb = after(line.text, "max allocated:");
  if (!mb || *mb < 0) refuse(line, "is a Megatron-LM memory report without a readable \"max allocated\"");
  log.max_allocated_bytes = std::max(log.max_allocated_bytes, *mb * 1024 * 1024);
}

// "    forward-backward ...................................: (1234.56, 1240.12)"
void timer(const LogLine& line, TrainingLog& log, size_t dots) {
  const std::string_view text = line.text;
  const std::string name(trim(text.substr(0, dots)));
  if (name.empty() || name.find(' ') != std::string::npos) return;  // not a timer line
  const size_t open = text.find(": (", dots);
  const size_t comma = text.find(',', open);
  if (comma == std::string::npos) return;
  const auto max_ms = number_at(text.substr(comma + 1));
  if (!max_ms || *max_ms < 0) refuse(line, "is a Megatron-LM timer line without a readable (min, max)");
  claim(log, kMegatronLog, line);
  log.timer_max_ms[name].push_back(*max_ms);
}

}  // namespace

bool read_megatron_log_line(const LogLine& line, TrainingLog& log) {
  const std::string_view text = line.text;
  if (text.find(" iteration ") != std::string::npos && text.find("elapsed time per iteration (ms):") != std::string::npos)
    iteration(line, log);
  else if (text.find("memory (MB)") != std::string::npos && text.find("max allocated:") != std::string::npos)
    memory(line, log);
  else if (const size_t dots = text.find(" ...."); dots != std::string::npos && text.find("): (") == std::string::npos &&
                                                  text.find(": (") != std::string::npos)
    timer(line, log, dots);
  else
    return false;
  return true;
}

}  // namespace moeplan::frameworks
