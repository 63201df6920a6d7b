#pragma once
// The commands whose work needs the executor (LibTorch): their options, declared in
// run_command.cc, calibrate_command.cc and export_command.cc, and their work, done in
// executor_commands.cc and rehearse.cc, or refused by no_executor_commands.cc in a build
// without the executor.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/parallel_config.h"
#include "moeplan/planner/rehearsal.h"

namespace moeplan::cli {

struct RunArgs {
  std::string plan;
  std::string data;
  std::string out = "run";
  int64_t steps = 0;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string init_from;  // Hugging Face folder to start from
  bool rehearse = false;  // the plan's layout on local ranks with the model shrunk
  planner::Shrink shrink;  // --shrink-*, the planner's defaults
  std::string record_routing, replay_routing, planted_fault;  // a rehearsal's child runs (executor/run.h)
  int threads = 0;
  int64_t timeout_seconds = 60;
  int64_t grace_seconds = 30;  // after SIGTERM or SIGINT, to end the step in flight and save
  std::string stop_after;      // a time limit ("4h", "03:50:00"); "" for none
  int64_t max_nonfinite_steps = 3;
  int64_t kernel_trace_step = 0;  // 0: none
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
  Precision precision = Precision::kFp32;
  LoadBalancing load_balancing = LoadBalancing::kSinkhorn;
  int64_t max_micro_batch = 8;
  bool quick = false;
  int passes = 0;
  int64_t timeout_seconds = 120;
  std::string command;
  std::vector<std::string> argv;
};

struct ExportArgs {
  std::string checkpoint;  // step folder, checkpoints folder or run folder
  std::string hf;          // output folder (Hugging Face layout)
  int64_t max_shard_bytes = int64_t{5} << 30;
};

int run_run(const RunArgs& args);
int run_rehearse(const RunArgs& args);
int run_calibrate(const CalibrateArgs& args);
int run_export(const ExportArgs& args);

}  // namespace moeplan::cli
