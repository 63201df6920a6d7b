#pragma once
// One function per framework, called by export_launch once the plan keeps that framework's
// rules.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/launch/launch.h"

namespace moeplan::launch {

std::vector<LaunchFile> export_smp(const Plan& plan, Diagnostics& problems);
std::vector<LaunchFile> export_megatron(const Plan& plan, Diagnostics& problems);
std::vector<LaunchFile> export_torchtitan(const Plan& plan, Diagnostics& problems);

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

}  // namespace moeplan::launch
