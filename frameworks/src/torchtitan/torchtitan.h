#pragma once
// torchtitan's parts, put together in framework.cc.

#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/frameworks/launch.h"

namespace moeplan::frameworks {

// A job config (TOML) and a torchrun line that trains it (launch.cc).
std::vector<launch::LaunchFile> export_torchtitan(const Plan& plan, Diagnostics& problems);

}  // namespace moeplan::frameworks
