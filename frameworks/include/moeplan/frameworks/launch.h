#pragma once
// The files that launch a plan where it will train: SageMaker's model parallelism library v2
// (a PyTorch estimator's settings and a Python snippet), Megatron-LM (its arguments and a
// torchrun line) or torchtitan (a job config and a torchrun line), each written by its
// framework's entry (framework.h). Each exporter applies its framework's rules (core/rules.h,
// Target) and refuses, naming the rule, a plan that framework cannot run.

#include <string>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"

namespace moeplan::launch {

struct LaunchFile {
  std::string name;  // inside the output folder, e.g. "megatron-args.txt"
  std::string text;
};

// Throws InputError (origin `origin`, the plan file's name) listing every rule of `target`
// the plan breaks, and every field that framework cannot express. `target` is the rules of a
// framework with launch files (Framework::export_launch: smp, megatron or torchtitan).
std::vector<LaunchFile> export_launch(const Plan& plan, Target target, const std::string& origin);

}  // namespace moeplan::launch
