// torchtitan's log: its "step: N  loss: ...  memory: ...GiB(...%)  tps: ...  tflops: ..." lines
// (their colour codes already removed).
#include "log_lines.h"
#include "torchtitan.h"

namespace moeplan::frameworks {

namespace {

// tps is tokens per second per GPU.
const LogSource kTorchtitanLog{
    .name = "torchtitan",
    .step_seconds =
        [](const LoggedIteration& it, const Plan& plan) {
          const double step_tokens = static_cast<double>(plan.training.global_batch_tokens);
          const double world = static_cast<double>(plan.parallel.world_size);
          return step_tokens / (it.tokens_per_s_per_gpu * world);
        },
};

}  // namespace

bool read_torchtitan_log_line(const LogLine& line, TrainingLog& log) {
  const std::string_view text = line.text;
  if (text.find("step:") == std::string::npos || text.find("tps:") == std::string::npos) return false;
  claim(log, kTorchtitanLog, line);
  LoggedIteration it;
  it.line = line.number;
  const auto step = after(text, "step:");
  const auto tps = after(text, "tps:");
  if (!step || *step < 0 || *step > kMaxCount || !tps || *tps <= 0)
    refuse(line, "is a torchtitan step line without a readable step and tps");
  it.iteration = static_cast<int64_t>(*step);
  it.tokens_per_s_per_gpu = *tps;
  it.tflops_per_gpu = after(text, "tflops:").value_or(0);
  it.loss = after(text, "loss:").value_or(0);
  if (const auto gib = after(text, "memory:")) it.memory_bytes = *gib * 1024 * 1024 * 1024;
  log.iterations.push_back(it);
  return true;
}

}  // namespace moeplan::frameworks
