// `moeplan calibrate`: measure this machine and write a hardware profile; the work is the
// executor's (executor_commands.h).
#include <memory>

#include "choice.h"
#include "command.h"
#include "executor_commands.h"

namespace moeplan::cli {

Command add_calibrate_command(CLI::App& app, const Invocation& invocation) {
  auto args = std::make_shared<CalibrateArgs>();
  args->command = invocation.text();
  args->argv = invocation.words();
  CLI::App* cmd = app.add_subcommand("calibrate", "Measure this machine as a cluster of CPU ranks (or its GPU, with a "
                                                  "GPU profile as --base) and write a hardware profile");
  cmd->add_option("--ranks", args->ranks, "Ranks (processes) measured together")
      ->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--model", args->model, "Model whose shapes are measured (profile name or file)")
      ->capture_default_str();
  cmd->add_option("--base", args->base, "Hardware profile whose other numbers are kept")->capture_default_str();
  cmd->add_option("--profiles", args->profiles, "Folder with hardware/ and models/ profiles");
  cmd->add_option("--name", args->name, "Name of the new profile (default: local-<host name>)");
  cmd->add_option("--out", args->out, "Profile file to write (default: <name>.json)");
  cmd->add_option("--seq-len", args->seq_len, "Sequence length measured")
      ->capture_default_str()->check(CLI::Range(2, 1 << 16));
  add_choice(*cmd, "--precision", args->precision, kPrecisionNames, "bf16, mixed or fp32")->capture_default_str();
  add_choice(*cmd, "--load-balancing", args->load_balancing, kLoadBalancingNames, "Routing measured")
      ->capture_default_str();
  cmd->add_option("--max-micro-batch", args->max_micro_batch, "Largest micro-batch measured")
      ->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_flag("--quick", args->quick, "Fewer sizes and repeats");
  cmd->add_option("--passes", args->passes,
                  "Measure every figure this many times over the calibration and keep the lower quartile "
                  "(default 5, 1 with --quick)")
      ->check(CLI::Range(1, 20));
  cmd->add_option("--timeout", args->timeout_seconds, "Seconds a collective may wait for a peer")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{3600}));
  return {cmd, [args] { return run_calibrate(*args); }};
}

}  // namespace moeplan::cli
