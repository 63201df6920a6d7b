#pragma once
// torchtitan's parts, put together in framework.cc.

#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/frameworks/training_log.h"

namespace moeplan::frameworks {

// A job config (TOML) and a torchrun line that trains it (launch.cc).
std::vector<launch::LaunchFile> export_torchtitan(const Plan& plan, Diagnostics& problems);
// Its step lines (log.cc).
bool read_torchtitan_log_line(const LogLine& line, TrainingLog& log);

// The layouts it runs, as rules (rules.cc).
extern const TargetRules kTorchtitanRules;

}  // namespace moeplan::frameworks
