#pragma once
// A pipeline of P stages running m micro-batches with the 1F1B schedule (Narayanan et al.,
// "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
// section 2.2): stage s runs min(P - 1 - s, m) forwards first, then alternates one forward
// and one backward, then runs the backwards left (each rank's order comes from core's
// pipeline_schedule). A micro-batch's forward on stage s waits
// for its forward on stage s - 1 and the transfer of its activations; its backward on stage
// s for its backward on stage s + 1 and the transfer of the gradients. Executed on the
// step-graph engine: one simulated rank per stage, its compute stream in schedule order,
// activations arriving on its copy stream and gradients on its gradient stream.

#include <cstdint>
#include <vector>

#include "moeplan/simulator/graph.h"

namespace moeplan::sim {

struct PipelineStage {
  double forward_s = 0;   // one micro-batch through the stage's layers
  double backward_s = 0;  // and back (with any recompute)
};

struct PipelineSimulation {
  StepGraph graph{1, 1};
  GraphTimes times;
  double step_s = 0;  // from the first forward to the last backward
  // The share of the step the busiest stage is idle: (P - 1) / (m + P - 1) for equal stages
  // and free transfers.
  double bubble_fraction = 0;
};

// `p2p_s`: one transfer of a micro-batch's activations (or their gradients) between two
// neighbouring stages. Stages must be non-empty and micro_batches >= 1.
//
// With `chunks` v > 1, the interleaved schedule of the same paper (section 2.2.2): each rank
// holds v chunks of its stage (each 1/v of its forward and backward), virtual stage s being
// chunk s / P of rank s % P, so a micro-batch crosses P v - 1 boundaries; rank r runs
// 2 (P - r - 1) + (v - 1) P forwards first, and micro-batches go in rounds of P, which must
// divide m (as Megatron-LM requires). The bubble shrinks to (P - 1) / v of a micro-batch's
// forward and backward.
PipelineSimulation simulate_pipeline(const std::vector<PipelineStage>& stages, int64_t micro_batches, double p2p_s,
                                     int64_t chunks = 1);

// simulate_pipeline's step_s, for many micro-batches from two short runs: after its warm-up the
// schedule repeats every round of P micro-batches, so the step grows by the same time per
// round. Runs 4P and 5P micro-batches and extrapolates when m is larger (tests check it
// against the whole schedule).
double pipeline_step_seconds(const std::vector<PipelineStage>& stages, int64_t micro_batches, double p2p_s,
                             int64_t chunks = 1);

}  // namespace moeplan::sim
