#pragma once
// What a run's routing was, from its metrics (core/step_record.h): how much the busiest expert
// (or expert-parallel rank) of each micro-batch took over the mean, per layer, how that spread
// within a step and drifted over training, and the measured routing profile it makes
// (core/routing_profile.h). `moeplan routing RUN` prints and writes them.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/routing_profile.h"
#include "moeplan/core/step_record.h"

namespace moeplan {

// The busiest expert's (or rank's) load over the mean, over micro-batches.
struct RoutingSpread {
  double median = 1, p95 = 1, max = 1;
  double within_step = 0;  // the median over steps of (highest - lowest) among a step's micro-batches
  double first = 1, last = 1;  // the median over the first and over the last tenth of the steps
};

struct RoutingSummary {
  int64_t steps = 0, first_step = 0, last_step = 0;
  int64_t groups = 0, micro_batches = 0;  // expert groups, and micro-batches of each a step
  int64_t num_experts = 0, experts_per_token = 0;
  int64_t expert_degree = 0;  // ranks the experts are spread over (num_experts: each its own)
  std::vector<RoutingSpread> layers;
  RoutingSpread all;  // every layer's micro-batches together
  // Each rank's seconds inside the expert exchanges a step, median over the steps (empty where
  // the run did not record them: E = 1).
  std::vector<double> exchange_seconds;
  // The steps' measured seconds: median and 95th percentile (what `simulate --routing`
  // predicts for a plan from a routing profile), and the share of slots dropped at capacity
  // (-1 when the run did not drop).
  double step_median_s = 0, step_p95_s = 0;
  // The same over the steps the hypervisor left alone (core/step_record.h's undisturbed); 0
  // steps where the run did not record steal.
  int64_t undisturbed_steps = 0;
  double undisturbed_median_s = 0, undisturbed_p95_s = 0;
  double dropped_fraction = -1;
};

// The steps from `from_step` on; `expert_degree` 0 counts each expert on its own. An InputError
// at `origin` when no step has per-micro-batch counts or their shapes differ.
RoutingSummary summarise_routing(const std::vector<StepRecord>& steps, int64_t from_step, int64_t expert_degree,
                                 const std::string& origin);
// Every micro-batch of every expert group from `from_step` on, as a measured profile.
RoutingProfile measured_routing_profile(const std::vector<StepRecord>& steps, int64_t from_step,
                                        const std::string& source);
std::string format_routing_summary(const RoutingSummary& summary);

}  // namespace moeplan
