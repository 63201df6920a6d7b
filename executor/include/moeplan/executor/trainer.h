#pragma once
// The training loop of one rank: a plan's model, precision and batch settings, trained on a
// prepared data folder with AdamW, warmup + cosine schedule, global-norm clipping and gradient
// accumulation; a line per step to metrics.jsonl and the progress stream; atomic checkpoints and
// exact resume.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/optimizer.h"
#include "moeplan/executor/run_report.h"
#include "moeplan/executor/tensor_file.h"

namespace moeplan::executor {

struct RunOptions {
  std::string data_dir;
  std::string out_dir;           // metrics.jsonl and checkpoints/ go here
  int64_t stop_after_step = 0;   // 0: the plan's training.steps (the schedule always uses those)
  int64_t checkpoint_every = 0;  // 0: no checkpoints
  bool resume = false;           // continue from the newest complete checkpoint in out_dir
  std::string init_from;         // a Hugging Face Mixtral folder to start from (not with a resumed checkpoint)
  int threads = 0;               // intra-op threads; 0: one (see docs/performance.md)
  int64_t timeout_seconds = 60;  // collectives and rendezvous of a multi-rank run
  std::ostream* progress = nullptr;
};

// The model, its optimizer and one optimizer step of a plan, without data or files (the
// benchmarks drive it directly).
class ModelTrainer {
 public:
  explicit ModelTrainer(const Plan& plan);

  // One optimizer step over gradient_accumulation_steps micro-batches of token ids
  // [micro_batch_size, seq_len]: forward, loss, backward (accumulated), clipping, AdamW.
  StepRecord step(const std::vector<torch::Tensor>& micro_batches);

  int64_t step_count() const { return step_; }
  // Parameters, AdamW moments and the CPU generator, by global name ("param/<name>", ...).
  NamedTensors state() const;
  // Restores what state() returned; every missing or mismatched tensor is reported into d.
  void load_state(const NamedTensors& tensors, int64_t step, int64_t optimizer_step, Diagnostics& d);
  const ParameterSet& parameters() const { return params_; }
  const PhaseClock& clock() const { return clock_; }

 private:
  const Plan& plan_;
  torch::ScalarType master_type_, compute_type_;
  ParameterSet params_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  PhaseClock clock_;
};

struct RunResult {
  int64_t first_step = 0;  // first step trained by this call
  int64_t last_step = 0;
  std::vector<StepRecord> steps;
  int64_t peak_rss_bytes = 0;  // VmHWM of this process
  std::string last_checkpoint;
  std::optional<RunReport> report;  // on rank 0, when the run trained at least one step
};

// Throws InputError for a plan, data folder or checkpoint that does not fit.
RunResult run_training(const Plan& plan, const RunOptions& options);

class TokenDataset;
// Reports into d what in the data folder or the options does not fit the plan.
void check_run_inputs(const Plan& plan, const TokenDataset& data, const RunOptions& options, Diagnostics& d);

// Keeps the metrics.jsonl lines of steps up to `last_step` (a resumed run rewrites the rest).
void truncate_metrics(const std::string& path, int64_t last_step);
// The metrics.jsonl lines of a run folder, parsed (none when the file is missing).
std::vector<Json> read_metrics(const std::string& run_dir);

// Reports into d what in a checkpoint's state does not fit the plan (model, precision, data
// position, optimizer step).
void check_checkpoint_state(const Plan& plan, const Json& state, Diagnostics& d);

// One metrics.jsonl line (no newline).
std::string to_json_line(const StepRecord& record);

}  // namespace moeplan::executor
