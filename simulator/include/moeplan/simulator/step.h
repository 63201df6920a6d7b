#pragma once
// The discrete-event simulation of one optimizer step (docs/architecture.md section 9).
//
// By default one node's ranks are simulated and every other node is taken to behave like it:
// under a uniform layout all nodes run the same ops at the same times, so a collective's
// members on other nodes arrive when their counterparts here do, and the network card of
// every node carries what this node's card carries. Micro-batches after the third repeat the
// third; the step is extrapolated from them. Both reductions can be switched off, and tests
// check that they change nothing.

#include <cstdint>
#include <vector>

#include "moeplan/core/rules.h"
#include "moeplan/core/trace.h"
#include "moeplan/simulator/analytic.h"
#include "moeplan/simulator/graph.h"
#include "moeplan/simulator/kernels.h"

namespace moeplan::sim {

struct StepSimOptions {
  bool all_ranks = false;          // simulate every rank instead of one node
  bool all_micro_batches = false;  // simulate every micro-batch instead of three
};

struct StepSimulation {
  StepEstimate estimate;
  StepGraph graph{1, 1};
  GraphTimes times;
  std::vector<int64_t> ranks;  // global rank of each simulated rank
  int64_t micro_batches = 0;   // simulated micro-batches
  double nic_busy_s = 0;       // time node 0's card carried traffic (extrapolated)
  double block_activation_bytes = 0;  // what one block keeps for backward, per micro-batch
  // One micro-batch's share of the step on the simulated stage: the period of the repeated
  // micro-batches (with one simulated micro-batch, the time to its end).
  double micro_batch_s = 0;
  // The kernels inside the compute ops, for the trace (empty where the profile's measured op
  // times stand in for the kernel model).
  MicroBatchKernels kernels;
  // A dense block's among MoE blocks, and which of the simulated blocks are dense.
  MicroBatchKernels dense_kernels;
  std::vector<bool> dense_blocks;
  Checkpointing checkpointing = Checkpointing::kNone;
};

// With pipeline stages (P > 1) the graph, the trace and the phases are one stage's (the last,
// which runs the head; every stage's ranks are simulated as that stage) and the estimate is the
// whole pipeline's: the 1F1B schedule of simulate_pipeline() around the stage's micro-batch
// period.
StepSimulation simulate_step(const RunConfig& config, const StepSimOptions& options = {});

// The simulated step as a trace (pid = global rank). Each compute op is drawn as the kernels it
// runs (GEMMs, the attention core, memory-bound kernels), in proportion to their times, named
// "mb<m>.L<l>.<kernel>.<op>" so that the phases read as before.
Trace step_trace(const StepSimulation& simulation);
// With each rank's memory curve: `resident_bytes` held throughout the step (model states,
// working buffers, the runtime; from the memory model) plus the activations each block keeps
// from the end of its forward to the end of its backward, less those offloaded from the end
// of their offload to the start of their reload.
Trace step_trace(const StepSimulation& simulation, double resident_bytes);

// Seconds of one simulated rank's step in the phases the executor measures (run report):
// forward (each micro-batch from its first op to the loss, a third of the head op), backward
// (from there to its last op), optimizer (gradient all-reduces and the update), and the time
// inside each kind of collective (all_to_all, all_gather, reduce_scatter, all_reduce) and
// copy. Meaningful when every micro-batch was simulated.
std::vector<std::pair<std::string, double>> phase_seconds(const StepSimulation& simulation, int32_t rank);

}  // namespace moeplan::sim
