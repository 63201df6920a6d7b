#pragma once
// SMP's parts, put together in framework.cc.

#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/frameworks/training_log.h"

namespace moeplan::frameworks {

// The estimator's settings and a Python snippet that launches them (launch.cc).
std::vector<launch::LaunchFile> export_smp(const Plan& plan, Diagnostics& problems);
// The lines of its example script and the Hugging Face Trainer's summary (log.cc).
bool read_smp_log_line(const LogLine& line, TrainingLog& log);

// The layouts it runs, as rules (rules.cc).
extern const TargetRules kSmpRules;

}  // namespace moeplan::frameworks
