#pragma once
// Each step of a run predicted from the expert loads it measured (core/step_record.h:
// exchange_slots) against the step it measured: the plan's step under balanced routing plus what
// the busiest expert-parallel rank of each micro-batch's MoE blocks adds (sim/routing.h). The
// expert groups of a step meet at its end, so the slowest group's wait counts. `moeplan routing
// RUN --predict` prints it.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/step_record.h"

namespace moeplan::validation {

struct PredictedStep {
  int64_t step = 0;
  double measured_s = 0;
  double predicted_s = 0;  // balanced_s plus the wait for the busiest ranks
  double busiest_load = 1;  // the busiest rank's load over the mean, averaged over the step's blocks
  std::optional<double> steal;  // the machine's share stolen during the step (StepRecord::steal)
};

struct RoutingCheck {
  double balanced_s = 0;  // the plan's step with every micro-batch balanced
  std::vector<PredictedStep> steps;
  // Median |error| of the steps' predictions, with and without the measured loads.
  double median_error = 0, median_error_balanced = 0;
  // The same over the steps the hypervisor left alone (none where the run did not record steal,
  // or none of its steps was left alone).
  int64_t undisturbed_steps = 0;
  double undisturbed_median_error = 0, undisturbed_median_error_balanced = 0;
  // The measured steps' own spread: the least median |error| any one step time could reach over
  // them (core/fit.h, median_error_floor), over every step and over those left alone. A
  // prediction nearer than this must follow something that varies from step to step.
  double error_floor = 0, undisturbed_error_floor = 0;
  // Under a capacity factor, the share of the steps' slots dropped: predicted from each expert
  // group's measured micro-batch loads at the plan's capacity (core/moe_load.h), and what the
  // run dropped (its dropped_slots); both -1 when the plan is dropless.
  double predicted_dropped = -1, measured_dropped = -1;
};

// The steps from `from_step` on (not the skipped ones). An InputError at `origin` when a step has
// no per-micro-batch counts or counts for another model.
RoutingCheck predict_steps_from_routing(const Plan& plan, const std::vector<StepRecord>& steps, int64_t from_step,
                                        const std::string& origin);
std::string format_routing_check(const RoutingCheck& check);

// How the steps varied beyond what their routing explains: each measured step over the step
// predicted from its own loads, over the median of those ratios (so their median is 1), sorted
// (a measured routing profile's step_spread).
std::vector<double> step_spread(const RoutingCheck& check);

}  // namespace moeplan::validation
