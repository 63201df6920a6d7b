#pragma once
// The per-iteration lines other frameworks print while they train, read back: Megatron-LM's
// "iteration N/M | ... elapsed time per iteration (ms): ..." lines (with its memory report and
// timers), torchtitan's "step: N  loss: ...  memory: ...GiB(...%)  tps: ...  tflops: ..."
// lines, the "Batch N Loss: ..., Speed: ... samples/sec, Model TFLOPS/GPU: ..." lines of
// SMP's example training script, and the summary the Hugging Face Trainer prints at the end of
// train() ({'train_runtime': ..., 'train_samples_per_second': ..., 'train_steps_per_second':
// ...}; its per-step lines carry no time). Other lines are skipped; a line that starts like one of these
// but does not read is an error naming its number.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moeplan {

enum class LogFormat : uint8_t { kMegatron, kTorchtitan, kSmp, kHfTrainer };
std::string_view log_format_name(LogFormat format);

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

struct TrainingLog {
  LogFormat format = LogFormat::kMegatron;
  std::vector<LoggedIteration> iterations;
  // Megatron-LM's memory report ("max allocated", rank 0) in bytes; 0 when not logged.
  double max_allocated_bytes = 0;
  // Megatron-LM's timers, "(min, max) time across ranks (ms)": each timer's max per report.
  std::map<std::string, std::vector<double>> timer_max_ms;
};

// Throws InputError naming the file (and the line) when the log cannot be read, holds lines
// of more than one framework, or holds no iteration line at all.
TrainingLog read_training_log(const std::string& path);
// The same from text; `origin` names it in errors.
TrainingLog parse_training_log(std::string_view text, const std::string& origin);

}  // namespace moeplan
