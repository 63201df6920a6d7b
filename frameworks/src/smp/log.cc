// What a run of SMP prints: the "Batch N Loss: ..., Speed: ... samples/sec, Model TFLOPS/GPU:
// ..." lines of SMP's example training script, and the summary the Hugging Face Trainer prints
// at the end of train() ({'train_runtime': ..., 'train_samples_per_second': ...,
// 'train_steps_per_second': ...}; its per-step lines carry no time).
//
// The Trainer's summary is read here, beside the script's lines, rather than as an entry of
// its own: the Trainer is no framework moeplan plans for (no target, no rules, no launch
// files), only a log it reads, and on SageMaker it is the other common driver of a training
// script (the Transformers Trainer takes SageMaker's model parallelism). Here it is also tried
// before the script's lines and named after them, as it always was.
#include "log_lines.h"
#include "smp.h"

namespace moeplan::frameworks {

namespace {

// Speed is the job's sequences per second over one micro-batch of every reader.
const LogSource kSmpScriptLog{
    .name = "SMP",
    .step_seconds =
        [](const LoggedIteration& it, const Plan& plan) {
          const double seq = static_cast<double>(plan.training.seq_len);
          const double step_tokens = static_cast<double>(plan.training.global_batch_tokens);
          return step_tokens / (it.samples_per_s * seq);
        },
};

// The summary covers the whole train(): there is no warm-up line to leave out.
const LogSource kHfTrainerLog{
    .name = "Hugging Face Trainer",
    .step_seconds = [](const LoggedIteration& it, const Plan&) { return it.step_ms / 1000.0; },
    .summarises_run = true,
};

// {'train_runtime': 1234.5, 'train_samples_per_second': 12.3, 'train_steps_per_second': 0.39, ...}
void trainer_summary(const LogLine& line, TrainingLog& log) {
  claim(log, kHfTrainerLog, line);
  LoggedIteration it;
  it.line = line.number;
  const auto steps = after(line.text, "'train_steps_per_second':");
  const auto samples = after(line.text, "'train_samples_per_second':");
  if (!steps || *steps <= 0 || !samples || *samples <= 0)
    refuse(line, "is a Hugging Face Trainer summary without readable train_steps_per_second and "
                 "train_samples_per_second");
  it.iteration = static_cast<int64_t>(log.iterations.size());
  it.step_ms = 1000.0 / *steps;
  it.samples_per_s = *samples;
  it.loss = after(line.text, "'train_loss':").value_or(0);
  log.iterations.push_back(it);
}

void script_batch(const LogLine& line, TrainingLog& log) {
  const std::string_view text = line.text;
  if (text.find("Validation") != std::string::npos) return;
  claim(log, kSmpScriptLog, line);
  LoggedIteration it;
  it.line = line.number;
  const auto batch = after(text, "Batch ");
  const auto speed = after(text, "Speed:");
  if (!batch || *batch < 0 || *batch > kMaxCount || !speed || *speed <= 0)
    refuse(line, "is a line of SMP's script without a readable Batch and Speed");
  it.iteration = static_cast<int64_t>(*batch);
  it.samples_per_s = *speed;
  it.tflops_per_gpu = after(text, "Model TFLOPS/GPU:").value_or(0);
  it.loss = after(text, "Loss:").value_or(0);
  log.iterations.push_back(it);
}

}  // namespace

bool read_smp_log_line(const LogLine& line, TrainingLog& log) {
  const std::string_view text = line.text;
  if (text.find("'train_runtime':") != std::string::npos && text.find("'train_steps_per_second':") != std::string::npos)
    trainer_summary(line, log);
  else if (text.find("Batch ") != std::string::npos && text.find(" Loss: ") != std::string::npos &&
           text.find("samples/sec") != std::string::npos && text.find("Running Avg") == std::string::npos)
    script_batch(line, log);
  else
    return false;
  return true;
}

}  // namespace moeplan::frameworks
