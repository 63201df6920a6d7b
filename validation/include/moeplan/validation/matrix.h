#pragma once
// The matrix `moeplan validate` runs and `moeplan compare-profiles` predicts: configurations
// of one node's ranks, each planned by the planner's search with its choices fixed, and the
// helpers that run this program's subcommands as child processes.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/core/plan.h"

namespace moeplan::validation {

struct MatrixConfig {
  std::string name;  // e.g. E2S1R1-full-offload-mbs2, E1S1R1T2-none-mbs4
  int64_t e = 1, s = 1, t = 1, p = 1, mbs = 1;
  Checkpointing checkpointing = Checkpointing::kNone;
  bool offload = false;
};

// What every configuration shares.
struct MatrixSetting {
  int64_t ranks = 2;
  std::string model, profiles;  // profiles: folder with hardware/ and models/; empty: the default
  int64_t seq_len = 256, global_batch_tokens = 4096;
  Precision precision = Precision::kFp32;
};

// Layouts of `ranks` ranks (every degree a power of two here), each with a different mix of
// checkpointing, offloading and micro-batch size: up to 10 configurations of experts, shards
// and replicas (9 on two ranks, 4 when quick), then those with every rank in one tensor split or one pipeline
// where the model's shapes and `seq_len` allow (2 each; 1 each when quick).
std::vector<MatrixConfig> validation_matrix(int64_t ranks, const ModelSpec& model, int64_t seq_len, bool quick);

// The plan of c on `profile` (a hardware profile), searched with c's choices fixed, written to
// `path`; throws std::runtime_error "<c.name>: search found no plan: <why>" when there is none.
Plan pinned_plan(const MatrixSetting& setting, const MatrixConfig& c, const std::string& profile,
                 const std::string& path);

// The same search as a command line of `self` (`moeplan search` with c's choices fixed, on
// `profile`, writing `plan`); the plan records it as the command that made it.
std::vector<std::string> pinned_search(const std::string& self, const MatrixSetting& setting, const MatrixConfig& c,
                                       const std::string& profile, const std::string& plan);

// This program's path.
std::string self_path();
// Runs argv with its output into log; the exit code (or 128 + signal).
int run_logged(const std::vector<std::string>& argv, const std::string& log);
// The last line of a file that is not empty.
std::string last_line(const std::string& path);

}  // namespace moeplan::validation
