// `moeplan run plan.json --rehearse`: the planner shrinks the plan, the executor rehearses it.
#include <iostream>

#include "executor_commands.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/rehearsal/rehearsal.h"
#include "moeplan/planner/rehearsal.h"
#include "moeplan/validation/matrix.h"

namespace moeplan::cli {

int run_rehearse(const RunArgs& args) {
  const Plan plan = read_plan_file(args.plan);  // the rules of the cluster layout, against the cluster
  executor::RehearsalOptions o;
  o.plan_path = args.plan;
  o.data_dir = args.data.empty() ? plan.training.data : args.data;
  if (o.data_dir.empty())
    throw InputError("--data", {{"", args.plan + " names no training data (training.data); prepare some with "
                                        "`moeplan data prepare` (any vocabulary: the rehearsal shrinks the model "
                                        "to it) and pass --data DIR"}});
  o.out_dir = args.out;
  o.steps = args.steps > 0 ? args.steps : 2;
  o.threads = args.threads;
  o.timeout_seconds = args.timeout_seconds;
  o.progress = &std::cout;
  executor::check_rehearsal(plan, o);
  // The checks run after the ranks, on whole tensors, many of them small: one thread, as the
  // ranks use (an OpenMP pool spinning on two cores shared with others took most of their time).
  executor::set_compute_threads(1);
  const executor::TokenDataset data = executor::TokenDataset::open(o.data_dir);
  const Plan small = planner::rehearsal_plan(plan, args.shrink, data.vocab_size(),
                                             data.block_size(), o.steps);
  const Plan reference = planner::reference_plan(small);
  executor::check_rehearsal_plans(small, reference, data, o);
  const std::string self = validation::self_path();
  const executor::Rehearsal r = executor::rehearse(
      plan, small, reference, o,
      [&self](const std::vector<std::string>& words, const std::string& log) {
        std::vector<std::string> argv{self};
        argv.insert(argv.end(), words.begin(), words.end());
        return validation::run_logged(argv, log);
      },
      [&small](double load) { return planner::predicted_cpu_tensor_bytes(planner::with_measured_load(small, load)); },
      planner::predicted_cpu_tensor_bytes(plan));
  return r.ready ? kExitOk : 1;
}

}  // namespace moeplan::cli
