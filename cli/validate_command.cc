// `moeplan validate`: plan, run and compare a matrix of configurations (validation/validate.h).
#include <memory>

#include "choice.h"
#include "command.h"
#include "moeplan/validation/validate.h"

namespace moeplan::cli {

namespace {

// --check and the bounds it holds the errors to.
void add_bound_options(CLI::App& cmd, validation::ValidateOptions& v) {
  cmd.add_flag("--check", v.check, "Exit 1 when an error bound below is broken");
  cmd.add_option("--max-median-error", v.max_median_error, "Bound on the median |step-time error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  cmd.add_option("--max-worst-error", v.max_worst_error, "Bound on the worst |step-time error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  cmd.add_option("--max-memory-error", v.max_memory_error, "Bound on the worst |peak-memory error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  cmd.add_option("--min-kendall", v.min_kendall, "Least Kendall tau of predicted vs measured order")
      ->capture_default_str()->check(CLI::Range(-1.0, 1.0));
}

}  // namespace

Command add_validate_command(CLI::App& app) {
  auto v = std::make_shared<validation::ValidateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "validate", "Plan, run and compare a matrix of configurations: how right are the predictions?");
  cmd->add_option("--profile", v->profile, "Hardware profile file (from moeplan calibrate)")->required();
  cmd->add_option("--model", v->model, "Model profile name or file")->capture_default_str();
  cmd->add_option("--profiles", v->profiles, "Folder with hardware/ and models/ profiles");
  cmd->add_option("--data", v->data, "Folder written by `moeplan data prepare`")->required();
  cmd->add_option("--out", v->out, "Folder for the runs, the table and the plot")->capture_default_str();
  cmd->add_option("--ranks", v->ranks, "Ranks per run (default: the profile's gpus_per_node)")->check(CLI::Range(1, 64));
  cmd->add_option("--steps", v->steps, "Training steps per run (the first is not timed)")
      ->capture_default_str()->check(CLI::Range(2, 10000));
  cmd->add_option("--seq-len", v->seq_len, "Sequence length")->capture_default_str()->check(CLI::Range(2, 1 << 16));
  cmd->add_option("--global-batch-tokens", v->global_batch_tokens, "Tokens per step")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  add_choice(*cmd, "--precision", v->precision, kPrecisionNames, "bf16, mixed or fp32")->capture_default_str();
  cmd->add_flag("--quick", v->quick,
                "The reduced matrix (four configurations of experts, shards and replicas, a tensor split, a pipeline)");
  cmd->add_option("--rounds", v->rounds,
                  "Runs of every configuration, the matrix in alternating order; the fastest counts "
                  "(default 3, 1 with --quick)")
      ->check(CLI::Range(int64_t{1}, int64_t{100}));
  add_bound_options(*cmd, *v);
  return {cmd, [v] { return validation::run_validation(*v); }};
}

}  // namespace moeplan::cli
