// `moeplan routing RUN`: how a run's router spread the tokens (core/routing_summary.h), and the
// measured routing profile that `--routing FILE` plans with.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "command.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/core/routing_summary.h"
#include "moeplan/core/step_record.h"
#include "moeplan/planner/search.h"
#include "moeplan/validation/routing_check.h"

namespace moeplan::cli {

namespace {

struct RoutingOptions {
  std::string run_dir;
  int64_t from_step = 1;
  int64_t expert_degree = 0;
  std::string out;
  bool predict = false;
  std::string profile;  // price the run's plan on this hardware profile instead of its own
};

int summarise(const RoutingOptions& o) {
  try {
    const std::string metrics = o.run_dir + "/metrics.jsonl";
    const std::vector<StepRecord> steps = read_step_records(metrics);
    std::printf("routing of %s: %s", o.run_dir.c_str(),
                format_routing_summary(summarise_routing(steps, o.from_step, o.expert_degree, metrics)).c_str());
    // Each step predicted from its own loads: printed with --predict; the profile written keeps
    // how the steps varied beyond that (its step spread), or goes without it, saying why, where
    // the run's plan.json cannot price them.
    std::optional<validation::RoutingCheck> check;
    if (o.predict || (!o.out.empty() && std::filesystem::exists(o.run_dir + "/plan.json"))) {
      try {
        Plan plan = read_plan_file(o.run_dir + "/plan.json");
        if (!o.profile.empty())
          plan.cluster = planner::size_cluster(load_hardware(o.profile, profile_dir("")), plan.parallel.world_size);
        check = validation::predict_steps_from_routing(plan, steps, o.from_step, metrics);
      } catch (const InputError& e) {
        if (o.predict) throw;
        print_error(e);
        std::fprintf(stderr, "moeplan: %s is written without a step spread (its steps could not be predicted)\n",
                     o.out.c_str());
      }
    }
    if (o.predict) std::printf("%s", validation::format_routing_check(*check).c_str());
    if (!o.out.empty()) {
      RoutingProfile profile = measured_routing_profile(
          steps, o.from_step, "measured by moeplan run " + o.run_dir + " from step " + std::to_string(o.from_step));
      if (check) profile.step_spread = validation::step_spread(*check);
      write_routing_profile(profile, o.out);
      std::printf("wrote %s: %s\n", o.out.c_str(), describe_routing(profile).c_str());
    }
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
  return kExitOk;
}

}  // namespace

Command add_routing_command(CLI::App& app) {
  auto o = std::make_shared<RoutingOptions>();
  CLI::App* cmd = app.add_subcommand(
      "routing", "How a run's router spread the tokens over the experts, and its measured routing profile");
  cmd->add_option("run", o->run_dir, "A run folder (moeplan run --out), with its metrics.jsonl")->required();
  cmd->add_option("--from-step", o->from_step, "Leave out the steps before this one")
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--expert-degree", o->expert_degree,
                  "Count the busiest of this many expert-parallel ranks instead of the busiest expert")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--out", o->out, "Write the measured routing profile here (for --routing FILE)");
  cmd->add_flag("--predict", o->predict,
                "Predict each step from its measured expert loads with the run's plan.json, against the measured step");
  cmd->add_option("--profile", o->profile,
                  "With --predict or --out: price the run's plan on this hardware profile (name or .json) instead of the one "
                  "in its plan.json, e.g. one calibrated since");
  return {cmd, [o] { return summarise(*o); }};
}

}  // namespace moeplan::cli
