#pragma once
// Megatron-LM's parts, put together in framework.cc.

#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/frameworks/launch.h"

namespace moeplan::frameworks {

// The arguments of pretrain_gpt.py and a torchrun line that passes them (launch.cc).
std::vector<launch::LaunchFile> export_megatron(const Plan& plan, Diagnostics& problems);

}  // namespace moeplan::frameworks
