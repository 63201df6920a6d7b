// moeplan: plan, simulate and run Mixture-of-Experts pretraining.
// Composition root: add the subcommands, parse the command line, run the one given.

#include <CLI/CLI.hpp>

#include <vector>

#include "command.h"
#include "moeplan/core/process.h"

namespace {

int run_command_line(int argc, char** argv) {
  using namespace moeplan::cli;
  CLI::App app{"moeplan: plan, simulate and run Mixture-of-Experts pretraining"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MOEPLAN_VERSION);
  const Invocation invocation{argc, argv};
  const std::vector<Command> commands{
      add_search_command(app, invocation),    add_check_command(app),
      add_export_launch_command(app),         add_compare_command(app),
      add_simulate_command(app),              add_data_command(app, invocation),
      add_view_command(app, invocation),      add_run_command(app, invocation),
      add_calibrate_command(app, invocation), add_validate_command(app),
      add_export_command(app),                add_compare_published_command(app),
      add_compare_profiles_command(app),      add_routing_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints help with exit 0 and errors with its own code; keep bad input at 2.
    const int code = app.exit(e);
    return code == 0 ? moeplan::kExitOk : moeplan::kExitBadInput;
  }
  for (const Command& command : commands)
    if (command.app->parsed()) return command.run();
  return moeplan::kExitBadInput;
}

}  // namespace

// Everything the command wrote is closed by the time it returns: the process ends without the
// static destructors (end_process).
int main(int argc, char** argv) { moeplan::end_process(run_command_line(argc, argv)); }
