#pragma once
// A plan's step when routing is not balanced (core/routing_profile.h): each micro-batch's expert
// loads drawn from a routing profile, every MoE block of that micro-batch waiting for its
// busiest expert-parallel rank. The step is reported over draws (median, p95), with the busiest
// rank's load over every drawn micro-batch and block, for the memory at the tail.
//
// How a draw is priced: what one MoE block of one micro-batch costs beyond the plan's own
// routing when its busiest rank carries load L (the experts' forward, backward and recomputed
// forward, and the exchanges, grown with the busiest rank's slots) is the step estimate's
// difference between L on every block and micro-batch and the plan's own load, spread over
// them; a draw adds it for each block and micro-batch at the load it drew, summed per pipeline
// stage (its chunks' blocks under interleaving), the slowest stage setting the step.
//
// CPU ranks that share fewer processors than a node has ranks (host.processors) had their
// operations timed with every rank busy, each getting processors / ranks of one. While the
// ranks of an expert group wait for its busiest one (blocked in the exchange, off the
// processors), only one rank per group computes, each getting min(1, processors / groups): the
// busiest rank's extra work runs that much faster, and its delay is divided by the ratio.

#include <cstdint>
#include <map>
#include <vector>

#include "moeplan/core/routing_profile.h"
#include "moeplan/core/rules.h"
#include "moeplan/simulator/analytic.h"

namespace moeplan::sim {

// Refers to the parts of `config`, which must outlive it.
class RoutingDelay {
 public:
  RoutingDelay(const RunConfig& config, const LayoutShapes& shapes);
  // Seconds a step takes beyond the plan's own routing when its MoE blocks' loads are
  // `loads` ([MoE block][micro-batch][expert] shares, every micro-batch of the step).
  double delay_s(const StepRouting& loads);
  // One MoE block of one micro-batch with its busiest rank at `load`, beyond the plan's own.
  double block_delay_s(double load);
  double base_load() const { return base_load_; }  // the plan's own busiest-rank load
  int64_t expert_degree() const { return expert_degree_; }

 private:
  RunConfig config_;
  LayoutShapes shapes_;
  int64_t expert_degree_ = 1;
  double base_load_ = 1, base_step_s_ = 0, blocks_ = 1;
  double wait_speedup_ = 1;  // how much faster the busiest rank computes while its group waits
  std::vector<int64_t> moe_block_stage_;   // the pipeline stage of each MoE block, in block order
  std::map<int64_t, double> by_load_;      // block delay by load in 1/256ths
};

struct RoutedStep {
  double base_step_s = 0;  // the plan's step under its own routing
  double base_load = 1;    // the busiest expert-parallel rank's load there
  std::vector<double> step_s;  // one per draw
  double median_s = 0, p95_s = 0;
  // The busiest expert-parallel rank's load (what it computes, under a capacity factor) over
  // every drawn micro-batch and MoE block.
  double load_median = 1, load_p99 = 1;
  double dropped_fraction = 0;  // of the slots, at the plan's capacity factor (0 when dropless)
};

// `draws` steps drawn from `profile` (seeded), each `base_step_s` plus its delay, times a ratio
// drawn from the profile's step spread where it has one.
RoutedStep simulate_routing(const RunConfig& config, const LayoutShapes& shapes, double base_step_s,
                            const RoutingProfile& profile, int64_t draws, uint64_t seed);

}  // namespace moeplan::sim
