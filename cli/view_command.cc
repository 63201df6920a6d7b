// `moeplan view ...`: everything after `view` goes to moeplan-view, the timeline viewer, built
// with Qt (viewer/).
#include "command.h"

namespace moeplan::cli {

Command add_view_command(CLI::App& app, const Invocation& invocation) {
  CLI::App* cmd = app.add_subcommand(
      "view", "Show a step's timeline, simulated and measured (`moeplan view trace.json [measured.json] [--png F]`)");
  cmd->prefix_command();
  const char* argv0 = invocation.argv[0];
  return {cmd, [cmd, argv0] {
            return exec_sibling("moeplan-view", "view", "the viewer (Qt6: apt-get install qt6-base-dev)",
                                cmd->remaining(), argv0);
          }};
}

}  // namespace moeplan::cli
