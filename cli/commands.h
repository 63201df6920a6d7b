#pragma once
// The moeplan subcommands: each turns parsed arguments into calls of the libraries and
// prints the result, and returns an exit code (moeplan/core/exit_codes.h).

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/exit_codes.h"
#include "moeplan/core/plan.h"

namespace moeplan::cli {

struct SearchArgs {
  std::string gpus;  // "N" or a range "A:B" of cluster sizes
  // Time and money: tokens to train (0: not asked), what ranks the cluster sizes of a range,
  // the longest training wanted, and how long a restart after a failure takes.
  double train_tokens = 0;
  std::string objective = "time";
  double deadline_days = 0;
  double restart_minutes = 10;
  std::string instance = "p4d.24xlarge";
  std::string model = "mixtral-8x7b";
  std::string profiles;  // folder with hardware/ and models/; empty: the default
  int64_t seq_len = 2048;
  int64_t global_batch_tokens = 0;  // 0: the default for the world size
  std::string precision;  // empty: the target's (mixed for megatron and torchtitan, else bf16)
  // Optimizer settings written into the plan (the executor follows them).
  int64_t steps = 100;
  double learning_rate = 1e-4;
  double min_learning_rate = 1e-5;
  int64_t warmup_steps = 10;
  double expert_load_imbalance = 1.0;
  std::vector<double> tokens_per_expert;  // measured counts; overrides the imbalance
  int64_t max_micro_batch = 64;
  int64_t top = 5;
  bool explain = false;
  bool json = false;
  std::string out = "plan.json";
  std::string data;  // a prepared data folder the plan trains on (training.data)
  std::string estimator = "simulator";
  std::string command;  // the command line, recorded in the plan
  // Fixed choices (0 or empty: searched).
  int64_t expert_parallel_degree = 0, hybrid_shard_degree = 0, micro_batch_size = 0, loading_horizon = 0;
  int64_t tensor_parallel_degree = 0, pipeline_parallel_degree = 0, virtual_pipeline_degree = 0;
  std::string checkpointing, offloading, placement, sequence_parallel, distributed_optimizer;
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  // Where the plan will train: moeplan (what `moeplan run` trains), megatron (every layout
  // moeplan models, as Megatron-Core runs them) or smp (SMP's own restrictions too).
  std::string target = "moeplan";
  // What the training framework runs (empty: the profile's).
  std::string kernels, attention;
  bool fp8 = false;
  std::string gradients;       // empty: the target's (bf16 for smp, else fp32)
  std::string load_balancing;  // empty: the target's (aux_loss for megatron and torchtitan, else sinkhorn)
};

struct ExportLaunchArgs {
  std::string plan;
  std::string to;           // smp, megatron or torchtitan
  std::string out = ".";    // folder the files go into
};

struct CompareLogArgs {
  std::string plan;
  std::string log;
  int64_t skip = 1;  // logged iterations left out at the start (warm-up)
};

struct CheckArgs {
  std::string plan;
};

struct SimulateArgs {
  std::string plan;
  std::string trace;  // Chrome trace to write; empty: none
  bool all_ranks = false;
  bool all_micro_batches = false;
  std::string measured;  // a run's report.json: simulate with its expert load, compare phases
};

struct RunArgs {
  std::string plan;
  std::string data;
  std::string out = "run";
  int64_t steps = 0;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string init_from;  // Hugging Face folder to start from
  bool rehearse = false;  // the plan's layout on local ranks with the model shrunk
  int64_t shrink_width = 32, shrink_layers = 2, shrink_micro_batches = 32;
  std::string record_routing, replay_routing, planted_fault;  // a rehearsal's child runs (executor/training/run.h)
  int threads = 0;
  int64_t timeout_seconds = 60;
  int64_t grace_seconds = 30;  // after SIGTERM or SIGINT, to end the step in flight and save
  std::string stop_after;      // a time limit ("4h", "03:50:00"); "" for none
  int64_t max_nonfinite_steps = 3;
  std::vector<std::string> argv;  // the whole command line, to start local ranks with
};

struct CalibrateArgs {
  int64_t ranks = 2;
  std::string model = "mixtral-tiny";
  std::string base = "local-cpu";  // the profile whose unmeasured numbers (and policies) are kept
  std::string profiles;
  std::string name;  // default: local-<host name>
  std::string out;   // default: <name>.json
  int64_t seq_len = 256;
  std::string precision = "fp32";
  std::string load_balancing = "sinkhorn";
  int64_t max_micro_batch = 8;
  bool quick = false;
  int passes = 0;
  int64_t timeout_seconds = 120;
  std::string command;
  std::vector<std::string> argv;
};

int run_search(const SearchArgs& args);
int run_simulate(const SimulateArgs& args);
// The simulator's trace of a plan's step, every micro-batch, written to `path` (a run folder's
// simulated.json, beside the measured trace.json).
void write_simulated_trace(const Plan& plan, const std::string& path);
int run_check(const CheckArgs& args);
int run_export_launch(const ExportLaunchArgs& args);
int run_compare_log(const CompareLogArgs& args);
// Executor commands; without the executor built they say so and fail.
// `moeplan data ...` replaces this process by moeplan-data (next to this executable) with the
// same arguments.
int run_data(const std::vector<std::string>& args, const char* argv0);
// `moeplan view`: the timeline viewer, a separate executable with Qt (moeplan-view).
int run_view(const std::vector<std::string>& args, const char* argv0);
struct ExportArgs {
  std::string checkpoint;  // step folder, checkpoints folder or run folder
  std::string hf;          // output folder (Hugging Face layout)
  int64_t max_shard_bytes = int64_t{5} << 30;
};

int run_run(const RunArgs& args);
int run_rehearse(const RunArgs& args);
int run_export(const ExportArgs& args);
int run_calibrate(const CalibrateArgs& args);

}  // namespace moeplan::cli
