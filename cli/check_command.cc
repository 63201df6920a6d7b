// `moeplan check plan.json`: every problem of a plan, or that it is ok.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/units.h"
#include "moeplan/planner/memory_model.h"

namespace moeplan::cli {

namespace {

struct Check {
  std::string plan;
};

int run_check(const Check& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
    const planner::MemoryEstimate memory = planner::estimate_memory(config);
    std::vector<std::string> problems;
    const int64_t limit = plan.cluster.usable_memory_bytes();
    if (memory.device_total > limit)
      problems.push_back("parallel: needs " + std::to_string(memory.device_total) +
                         " bytes of device memory per GPU, over the usable " + std::to_string(limit));
    const int64_t host_limit = planner::host_limit_bytes(plan.cluster, plan.parallel.world_size);
    if (memory.offloaded_activations > host_limit)
      problems.push_back("parallel.activation_offloading: offloads " +
                         std::to_string(memory.offloaded_activations) + " bytes per rank, over the host's " +
                         std::to_string(host_limit));
    if (memory.device_total != plan.prediction.memory.device_total_bytes)
      problems.push_back("prediction.memory.device_total_bytes: = " +
                         std::to_string(plan.prediction.memory.device_total_bytes) +
                         " but the memory model gives " + std::to_string(memory.device_total) +
                         " for this configuration (edited by hand, or written by another version)");
    for (const std::string& p : problems) std::fprintf(stderr, "moeplan: error: %s: %s\n", args.plan.c_str(), p.c_str());
    if (!problems.empty()) return kExitNoPlan;
    std::printf("%s: ok: %s on %lld x %s, %.1f of %.1f GiB per GPU\n", args.plan.c_str(),
                describe(plan.parallel).c_str(), static_cast<long long>(plan.cluster.num_nodes),
                plan.cluster.name.c_str(), in_gib(memory.device_total), in_gib(limit));
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

}  // namespace

Command add_check_command(CLI::App& app) {
  auto check = std::make_shared<Check>();
  CLI::App* cmd = app.add_subcommand("check", "Validate a plan file and report every problem");
  cmd->add_option("plan", check->plan, "plan.json")->required();
  return {cmd, [check] { return run_check(*check); }};
}

}  // namespace moeplan::cli
