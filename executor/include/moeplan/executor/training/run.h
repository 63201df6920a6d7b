#pragma once
// A training run, one rank's part of it. The one loop over steps that the one-rank reference
// trainer and the sharded trainer share: the data order, metrics.jsonl and progress lines,
// checkpoints (every rank writes its shard, rank 0 commits the manifest with the run's state),
// resuming, starting from a Hugging Face model, and the measured trace and report at the end.

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor {

class TokenDataset;

struct RunOptions {
  std::string data_dir;
  std::string out_dir;           // metrics.jsonl and checkpoints/ go here
  int64_t stop_after_step = 0;   // 0: the plan's training.steps (the schedule always uses those)
  int64_t checkpoint_every = 0;  // 0: no checkpoints
  bool resume = false;           // continue from the newest complete checkpoint in out_dir
  std::string init_from;         // a Hugging Face Mixtral folder to start from (not with a resumed checkpoint)
  int threads = 0;               // intra-op threads; 0: one (see docs/performance.md)
  int64_t timeout_seconds = 60;  // collectives and rendezvous of a multi-rank run
  // Stopping early (stop.h): after a stop signal the ranks have this long to end the step in
  // flight and save; with a time limit they stop, saved, before a next step would pass it.
  int64_t grace_seconds = 30;
  int64_t stop_after_seconds = 0;  // 0: no time limit
  // Steps in a row whose loss or gradients held a NaN or an Inf: each is skipped (no update),
  // and this many end the run with an error naming where it began.
  int64_t max_nonfinite_steps = 3;
  // The step whose operators and kernels PyTorch's profiler records into
  // out_dir/kernels-rank-R.json (a Chrome trace); 0: none.
  int64_t kernel_trace_step = 0;
  // A rehearsal's runs (rehearsal.h): the layout records its routing into this folder, the
  // one-rank reference replays the record in that folder (routing_record.h); a layout that
  // records may carry a fault planted by the rehearsal's test hook (rehearsal_fault.h).
  std::string record_routing;
  std::string replay_routing;
  RehearsalFault planted_fault = RehearsalFault::kNone;
  std::ostream* progress = nullptr;
};

struct RunResult {
  int64_t first_step = 0;  // first step trained by this call
  int64_t last_step = 0;
  std::vector<StepRecord> steps;
  int64_t peak_rss_bytes = 0;  // VmHWM of this process
  std::string last_checkpoint;
  std::optional<RunReport> report;  // on rank 0, when the run trained up to its last step
  std::string stopped_by;  // why the run stopped before its last step ("SIGTERM", "--stop-after 4h"); "" if it did not
};

// What the loop drives: one rank's part of the model and its optimizer.
class StepTrainer {
 public:
  virtual ~StepTrainer() = default;
  // One optimizer step over this rank's micro-batches [micro_batch_size, seq_len].
  virtual StepRecord step(const std::vector<torch::Tensor>& micro_batches) = 0;
  virtual int64_t step_count() const = 0;
  // This rank's part of parameters, AdamW moments (and generator) by global name.
  virtual NamedTensors state() const = 0;
  // Takes this rank's part out of a checkpoint of any layout.
  virtual void load_state(const SlicedState& state, int64_t step, int64_t optimizer_step, Diagnostics& d) = 0;
  // Parameters from a Hugging Face folder (this rank's part), fresh optimizer state.
  virtual void load_hugging_face(const std::string& dir) = 0;
  virtual const PhaseClock& clock() const = 0;
  // The most rows one of this rank's experts computed in a layer of a micro-batch since the
  // last call (0 where the trainer does not count them).
  virtual int64_t take_busiest_expert_rows() { return 0; }
  // The parameters (and buffers) of which this rank keeps a part: what it reads of a checkpoint to resume
  // (every rank of a layout holding every shard at once outgrew the memory of a 64-rank
  // rehearsal). Empty: all of them.
  virtual std::set<std::string> held_parameters() const { return {}; }
};

// This rank's place in the run.
struct RunRank {
  int64_t rank = 0, world_size = 1;
  int64_t reader = 0, readers = 1;  // which of the data readers this rank is
  std::function<void()> barrier = [] {};
  // Sums a small int64 tensor over every rank, in place (one rank: nothing to do).
  std::function<void(torch::Tensor&)> sum_over_ranks = [](torch::Tensor&) {};
  std::string where = "CPU rank";  // what measured the run, for the report
  torch::Device device = torch::kCPU;  // where this rank computes
  int64_t baseline_device_bytes = 0;   // device memory in use before the model, as the driver counts it (GPU)
};

// The state a checkpoint's manifest carries beside the shards.
struct CheckpointState {
  int64_t samples_consumed = 0;  // of the whole world
  int64_t optimizer_step = 0;
  // With the plan's model, precision, seed and layout, and the data folder's shape.
  Json to_json(const Plan& plan, const TokenDataset& data) const;
  // Reports into d what does not fit the plan (model, precision, data position, step).
  static CheckpointState read(const Plan& plan, const Json& state, Diagnostics& d);
};

// The checkpoint to resume from ("" for a fresh run), after checking that the run folder
// suits the options: --resume needs a complete checkpoint, a fresh run an empty folder.
std::string prepare_run_folder(const RunOptions& options);

// Trains from the checkpoint `resume_from` (or options.init_from, or the start) up to the last
// step: the loop every rank of every run goes through. `baseline_rss_bytes`: the resident set
// before the model was built.
RunResult run_steps(const Plan& plan, const RunOptions& options, const TokenDataset& data, StepTrainer& trainer,
                    const RunRank& me, const std::string& resume_from, int64_t baseline_rss_bytes);

// Reports into d what in the data folder or the options does not fit the plan.
void check_run_inputs(const Plan& plan, const TokenDataset& data, const RunOptions& options, Diagnostics& d);

// Keeps the metrics.jsonl lines of steps up to `last_step` (a resumed run rewrites the rest).
void truncate_metrics(const std::string& path, int64_t last_step);
// The metrics.jsonl lines of a run folder, parsed (none when the file is missing). A last line
// without its newline is one a running run is still writing, and is left out.
std::vector<Json> read_metrics(const std::string& run_dir);

}  // namespace moeplan::executor
