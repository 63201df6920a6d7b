#pragma once
// `moeplan run plan.json --rehearse` (docs/executor.md, "Rehearsal"): a cluster plan's layout,
// with the model the planner shrank, trained on local CPU ranks as child runs of this program
// and checked against one rank that trains the same global batch, step by step from the
// layout's own state and replaying its routing: routing, losses and gradient norm, the
// checkpoint saved and resumed, and per-rank memory against the memory model. What rounding
// may explain is bounded by rehearsal_bounds.h; any more is a broken layout.

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/executor/io/tokens.h"

namespace moeplan::executor {

struct RehearsalOptions {
  std::string plan_path;  // as the user named it, for the record
  std::string data_dir;
  std::string out_dir;    // a new or empty folder
  int64_t steps = 2;      // N: steps 1..N-1, a checkpoint, then step N resumed from it
  int threads = 0;        // per rank; 0: the runs' default
  int64_t timeout_seconds = 60;
  std::ostream* progress = nullptr;  // the runs as they finish, the checks and the verdict
};

// Refuses, naming the field, what cannot be rehearsed here: a one-rank plan, the global token
// shuffle (one rank would route other token sets), more processes than this machine's available
// memory holds, fewer than 2 steps, a launcher's environment, an --out folder in use, and a
// planted fault (rehearsal_fault.h) the layout cannot carry. Throws InputError.
void check_rehearsal(const Plan& plan, const RehearsalOptions& options);

// Refuses shrunk plans that break a rule or do not match the data (what the runs would refuse).
void check_rehearsal_plans(const Plan& small, const Plan& reference, const TokenDataset& data,
                           const RehearsalOptions& options);

// Starts this program with `args` ({"run", plan, ...}), its output into `log`; the exit code.
using RunProgram = std::function<int(const std::vector<std::string>& args, const std::string& log)>;
// The memory model's live tensor bytes per rank for the shrunk plan when the busiest expert
// rank computes `load` times the mean rows.
using PredictTensorBytes = std::function<int64_t(double load)>;

struct RehearsalCheck {
  std::string name;
  bool ok = false;
  std::string detail;
};
struct Rehearsal {
  std::vector<RehearsalCheck> checks;
  bool ready = false;  // every check passed
};

// Writes `small` and `reference` into the folder, runs them, checks, writes rehearsal.json and
// reports to options.progress. `plan_tensor_bytes` is the memory model's tensor part of the
// cluster plan's figure, scaled by the measured ratio in the verdict.
Rehearsal rehearse(const Plan& plan, const Plan& small, const Plan& reference, const RehearsalOptions& options,
                   const RunProgram& run, const PredictTensorBytes& predict, int64_t plan_tensor_bytes);

}  // namespace moeplan::executor
