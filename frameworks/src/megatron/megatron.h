#pragma once
// Megatron-LM's parts, put together in framework.cc.

#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/frameworks/training_log.h"

namespace moeplan::frameworks {

// The arguments of pretrain_gpt.py and a torchrun line that passes them (launch.cc).
std::vector<launch::LaunchFile> export_megatron(const Plan& plan, Diagnostics& problems);
// Its iteration lines, memory report and timers (log.cc).
bool read_megatron_log_line(const LogLine& line, TrainingLog& log);

// The layouts it runs, as rules (rules.cc).
extern const TargetRules kMegatronRules;

}  // namespace moeplan::frameworks
