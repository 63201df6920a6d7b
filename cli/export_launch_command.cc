// `moeplan export-launch plan.json --to F`: the files that launch a plan in another framework.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "choice.h"
#include "command.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/launch.h"

namespace moeplan::cli {

namespace {

struct ExportLaunch {
  std::string plan;
  Target to = nullptr;    // smp's, megatron's or torchtitan's rules
  std::string out = ".";     // folder the files go into
};

int run_export_launch(const ExportLaunch& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    const std::vector<launch::LaunchFile> files = launch::export_launch(plan, args.to, args.plan);
    std::error_code ec;
    std::filesystem::create_directories(args.out, ec);
    if (ec) throw InputError("--out", {{"", args.out + ": cannot create the folder: " + ec.message()}});
    for (const launch::LaunchFile& f : files) {
      const std::string path = (std::filesystem::path(args.out) / f.name).string();
      write_file_atomic(path, f.text);
      if (f.name.ends_with(".sh"))
        std::filesystem::permissions(path, std::filesystem::perms::owner_exec | std::filesystem::perms::group_exec,
                                     std::filesystem::perm_options::add);
      std::printf("wrote %s\n", path.c_str());
    }
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "moeplan: error: export-launch: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace

Command add_export_launch_command(CLI::App& app) {
  auto args = std::make_shared<ExportLaunch>();
  CLI::App* cmd =
      app.add_subcommand("export-launch", "Write the files that launch a plan in SMP, Megatron-LM or torchtitan");
  cmd->add_option("plan", args->plan, "plan.json")->required();
  add_framework_choice(*cmd, "--to", args->to, true, "The framework: ")->required();
  cmd->add_option("--out", args->out, "Folder for the files")->capture_default_str();
  return {cmd, [args] { return run_export_launch(*args); }};
}

}  // namespace moeplan::cli
