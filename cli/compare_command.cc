// `moeplan compare plan.json --log F`: a plan's prediction beside a run's log.
#include <cstdio>
#include <memory>
#include <string>

#include "command.h"
#include "moeplan/core/plan.h"
#include "moeplan/frameworks/training_log.h"
#include "moeplan/validation/compare_log.h"

namespace moeplan::cli {

namespace {

struct CompareLog {
  std::string plan;
  std::string log;
  int64_t skip = 1;  // logged iterations left out at the start (warm-up)
};

int run_compare_log(const CompareLog& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    const TrainingLog log = read_training_log(args.log);
    const validation::LogComparison c = validation::compare_with_log(plan, log, args.skip, args.log);
    const std::string text = validation::format_log_comparison(c, args.plan, args.log);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

}  // namespace

Command add_compare_command(CLI::App& app) {
  auto args = std::make_shared<CompareLog>();
  CLI::App* cmd = app.add_subcommand(
      "compare", "Put a plan's prediction beside a run's log from Megatron-LM, torchtitan or SMP's script");
  cmd->add_option("plan", args->plan, "plan.json")->required();
  cmd->add_option("--log", args->log, "The run's log (its per-iteration lines)")->required();
  cmd->add_option("--skip-iterations", args->skip, "Logged iterations left out at the start")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  return {cmd, [args] { return run_compare_log(*args); }};
}

}  // namespace moeplan::cli
