#pragma once
// The moeplan subcommands. Each declares its options once, into typed fields, on a subcommand
// of the program's CLI::App, and hands back what runs it from those fields once parsed; main()
// adds them all and runs the one given. A command's work returns an exit code
// (moeplan/core/exit_codes.h).

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/plan.h"

namespace moeplan::cli {

// The process's command line, as main() got it.
struct Invocation {
  int argc = 0;
  char** argv = nullptr;

  std::string text() const;                // "moeplan search --gpus 16": recorded in what a command writes
  std::vector<std::string> words() const;  // argv itself: to start local ranks with
};

struct Command {
  CLI::App* app = nullptr;   // the subcommand, parsed() once given
  std::function<int()> run;  // its work, from the parsed options; an exit code
};

Command add_search_command(CLI::App& app, const Invocation& invocation);
Command add_check_command(CLI::App& app);
Command add_export_launch_command(CLI::App& app);
Command add_compare_command(CLI::App& app);
Command add_simulate_command(CLI::App& app);
Command add_data_command(CLI::App& app, const Invocation& invocation);
Command add_view_command(CLI::App& app, const Invocation& invocation);
Command add_run_command(CLI::App& app, const Invocation& invocation);
Command add_calibrate_command(CLI::App& app, const Invocation& invocation);
Command add_validate_command(CLI::App& app);
Command add_export_command(CLI::App& app);
Command add_compare_published_command(CLI::App& app);
Command add_compare_profiles_command(CLI::App& app);
Command add_routing_command(CLI::App& app);

// One line per problem on stderr, "moeplan: error: <origin>: <problem>".
void print_error(const InputError& e);

// The simulator's trace of a plan's step, every micro-batch, written to `path` (a run folder's
// simulated.json, beside the measured trace.json).
void write_simulated_trace(const Plan& plan, const std::string& path);

// Runs the executable `name` next to the real path of this one in this process's place, with
// `args`; returns only when it cannot, having said so (it is built with `built_with`).
int exec_sibling(const char* name, const char* command, const char* built_with, const std::vector<std::string>& args,
                 const char* argv0);

}  // namespace moeplan::cli
