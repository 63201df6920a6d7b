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
// operations timed with every rank busy, each getting processors / ranks of one. Between a
// block's dispatch and its combine, the ranks of an expert group compute their experts' rows
// and a rank that has finished waits in the exchange, off the processors: the operating system
// shares the processors among the ranks still computing, each at most one (processor sharing,
// shared_makespan). So a block with loads L_r is priced as the step estimate prices one whose
// busiest rank carries the makespan of the L_r over the makespan of balanced loads (both on
// the group's share of the node's processors): the busiest load itself where every rank has a
// processor, and less where the lighter ranks' finishing hands their processors to the others.

#include <cstdint>
#include <map>
#include <span>
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
  // The busiest-rank load that prices one micro-batch's block with expert `shares`: the busiest
  // rank's where every rank has a processor of its own, else the ranks' processor-shared
  // makespan over the balanced one.
  double priced_load(std::span<const double> shares);
  double base_load() const { return base_load_; }  // the plan's own busiest-rank load
  int64_t expert_degree() const { return expert_degree_; }

 private:
  RunConfig config_;
  LayoutShapes shapes_;
  int64_t expert_degree_ = 1;
  double base_load_ = 1, base_step_s_ = 0, blocks_ = 1;
  // The processors one expert group's ranks share (the node's, split by its groups); 0 where
  // every rank has one of its own.
  double group_processors_ = 0;
  double balanced_makespan_ = 1;  // of balanced loads on those processors
  std::vector<double> rank_loads_;  // scratch for priced_load
  std::vector<int64_t> moe_block_stage_;   // the pipeline stage of each MoE block, in block order
  std::map<int64_t, double> by_load_;      // block delay by load in 1/256ths
};

// How long jobs of `work` seconds each (on one processor) take together when `processors`
// processors are shared equally among the unfinished ones, none getting more than one: Linux's
// scheduler running single-threaded ranks. The longest job where there are processors enough.
double shared_makespan(std::vector<double> work, double processors);

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
