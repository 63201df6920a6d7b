// `moeplan data ...`: everything after `data` goes to moeplan-data, a process without LibTorch
// (executor/.../data_prepare.h).
#include "command.h"

namespace moeplan::cli {

Command add_data_command(CLI::App& app, const Invocation& invocation) {
  CLI::App* cmd = app.add_subcommand("data", "Prepare training data: `moeplan data prepare --help`");
  cmd->prefix_command();
  const char* argv0 = invocation.argv[0];
  return {cmd, [cmd, argv0] { return exec_sibling("moeplan-data", "data", "the executor", cmd->remaining(), argv0); }};
}

}  // namespace moeplan::cli
