// `moeplan compare-profiles A B`: two hardware profiles side by side, figure by figure and in
// predicted step times (validation/compare_profiles.h).
#include <memory>

#include "choice.h"
#include "command.h"
#include "moeplan/validation/compare_profiles.h"

namespace moeplan::cli {

Command add_compare_profiles_command(CLI::App& app) {
  auto c = std::make_shared<validation::CompareProfilesOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compare-profiles", "How far apart two hardware profiles are: figure by figure, and in predicted step times");
  cmd->add_option("first", c->first, "Hardware profile file")->required();
  cmd->add_option("second", c->second, "Hardware profile file compared with the first")->required();
  cmd->add_option("--model", c->model, "Model of the validation matrix")->capture_default_str();
  cmd->add_option("--profiles", c->profiles, "Folder with hardware/ and models/ profiles");
  cmd->add_option("--ranks", c->ranks, "Ranks (default: the first profile's gpus_per_node)")->check(CLI::Range(1, 64));
  cmd->add_option("--seq-len", c->seq_len, "Sequence length")->capture_default_str()->check(CLI::Range(2, 1 << 16));
  cmd->add_option("--global-batch-tokens", c->global_batch_tokens, "Tokens per step")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  add_choice(*cmd, "--precision", c->precision, kPrecisionNames, "bf16, mixed or fp32")->capture_default_str();
  cmd->add_flag("--quick", c->quick, "The reduced matrix (as validate --quick)");
  cmd->add_option("--top", c->top, "Figures listed, the most different first")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{10000}));
  cmd->add_option("--out", c->out, "Folder for the plans (default: a temporary one, removed)");
  cmd->add_flag("--check", c->check, "Exit 1 when a predicted step time differs by more than the bound");
  cmd->add_option("--max-difference", c->max_difference, "Bound on |predicted step time difference|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  return {cmd, [c] { return validation::compare_profiles(*c); }};
}

}  // namespace moeplan::cli
