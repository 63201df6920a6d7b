#pragma once
// What the frameworks' exporters share: numbers and a plan's summary as launch files write
// them, and the torchrun script that starts a plan's ranks.

#include <cstdint>
#include <string>

#include "moeplan/core/plan.h"

namespace moeplan::frameworks {

// Sequences per optimizer step.
int64_t global_batch_sequences(const Plan& plan);
// A number as a launch file writes it: integers without a fraction, others shortest round-trip.
std::string number(double value);
// The plan in one line for a file's header comment.
std::string summary(const Plan& plan);
// A bash script that starts the plan's ranks with torchrun on each node (NODE_RANK and
// MASTER_ADDR from the environment): `setup` lines, then torchrun with `entry` and the
// script's own arguments. `what` says what runs, for the header.
std::string torchrun_script(const Plan& plan, const std::string& what, const std::string& setup, const std::string& entry);

}  // namespace moeplan::frameworks
