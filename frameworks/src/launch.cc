#include "moeplan/frameworks/launch.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "launch_files.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::frameworks {

int64_t global_batch_sequences(const Plan& plan) {
  return plan.training.seq_len > 0 ? plan.training.global_batch_tokens / plan.training.seq_len : 0;
}

std::string number(double value) {
  if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 1e15)
    return std::to_string(static_cast<int64_t>(value));
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.17g", value);
  // The shortest form that reads back as the same double.
  for (int digits = 1; digits <= 17; ++digits) {
    char shorter[32];
    std::snprintf(shorter, sizeof shorter, "%.*g", digits, value);
    if (std::strtod(shorter, nullptr) == value) return shorter;
  }
  return buffer;
}

std::string summary(const Plan& plan) {
  return plan.model.name + " on " + std::to_string(plan.cluster.num_nodes) + " x " + plan.cluster.name + " (" +
         std::to_string(plan.parallel.world_size) + " GPUs): " + describe(plan.parallel);
}

std::string torchrun_script(const Plan& plan, const std::string& what, const std::string& setup, const std::string& entry) {
  const ClusterSpec& c = plan.cluster;
  char step[32];
  std::snprintf(step, sizeof step, "%.3f", plan.prediction.step_time_s);
  return "#!/bin/bash\n# " + what + " of " + summary(plan) + ",\n# predicted " + step +
         " s per step (written by `moeplan export-launch`). Run on every node with NODE_RANK and\n"
         "# MASTER_ADDR set; arguments after the script are passed on.\n"
         "set -euo pipefail\n" +
         setup + "exec torchrun --nnodes " + std::to_string(c.num_nodes) + " --nproc-per-node " +
         std::to_string(plan.parallel.world_size / c.num_nodes) +
         " --node-rank \"${NODE_RANK:-0}\" \\\n"
         "  --master-addr \"${MASTER_ADDR:-localhost}\" --master-port \"${MASTER_PORT:-29500}\" \\\n"
         "  " + entry + " \"$@\"\n";
}

}  // namespace moeplan::frameworks

namespace moeplan::launch {

namespace {

// "smp, megatron or torchtitan": the frameworks with launch files, in the list's order.
std::string exported_frameworks() {
  std::vector<std::string_view> names;
  for (const Framework* f : all_frameworks())
    if (f->export_launch) names.push_back(f->name);
  std::string text;
  for (size_t i = 0; i < names.size(); ++i)
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + std::string(names[i]);
  return text;
}

}  // namespace

std::vector<LaunchFile> export_launch(const Plan& plan, Target target, const std::string& origin) {
  const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training, target};
  Diagnostics problems;
  for (const Violation& v : validate(config))
    problems.error(v.field, v.message + " (rule " + std::string(v.name) + ")");
  std::vector<LaunchFile> files;
  if (const auto exporter = framework(target).export_launch)
    files = exporter(plan, problems);
  else
    problems.error("", "export-launch writes files for " + exported_frameworks() +
                           "; `moeplan run` trains the plan itself");
  problems.throw_if_any(origin);
  return files;
}

}  // namespace moeplan::launch
