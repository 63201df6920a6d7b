#pragma once
// Closed-form estimate of one optimizer step: compute time plus the communication that cannot
// hide behind it. Cheap enough to score millions of candidates per second; the planner ranks
// with it before (or instead of) the discrete-event simulation.

#include <array>

#include "moeplan/core/rules.h"
#include "moeplan/simulator/cost_model.h"
#include "moeplan/simulator/op_costs.h"

namespace moeplan::sim {

// The communication groups of one mesh layout; computed once per (E, S, placement).
// The dimensions a dense shard spanning the expert and context ranks covers.
inline constexpr std::array<MeshDim, 3> kShardSpanDims{MeshDim::kShard, MeshDim::kExpert, MeshDim::kContext};

struct LayoutShapes {
  GroupShape expert;   // the mesh's E: the dense gradients' first sync
  GroupShape shard;    // S: all-gather / reduce-scatter of model states
  GroupShape replica;  // R: gradient all-reduce of expert parameters
  GroupShape tensor;   // T: all-reduces inside each block
  GroupShape pipeline; // P: activations to the next stage
  // The expert group the tokens travel in: E along the mesh, or with folded tensor or context
  // ranks (ParallelConfig::expert_fold) E ranks ETP apart.
  GroupShape exchange;
  GroupShape context;  // C: keys and values passed between a sequence's chunks; dense gradients
  // S x E (the mesh's) x C: the dense parameters' shard group where it spans the expert and
  // context ranks (ParallelConfig::dense_shard_spans_experts).
  GroupShape shard_span;

  // The group the dense parameters are gathered and their gradients reduce-scattered in, and
  // the routed experts' (the same where both span the context ranks).
  const GroupShape& dense_shard(const ParallelConfig& p) const { return p.dense_shard_spanning() ? shard_span : shard; }
  const GroupShape& expert_shard(const ParallelConfig& p) const {
    return p.dense_shard_spanning() && p.expert_shard_degree() == p.dense_shard_degree() ? shard_span : shard;
  }
};
LayoutShapes layout_shapes(const ClusterSpec& cluster, const ParallelConfig& parallel);

struct StepEstimate {
  double step_time_s = 0;
  double tokens_per_s = 0;
  double model_flops_per_step = 0;  // 3 x forward FLOPs of the global batch (no recompute)
  double tflops_per_gpu = 0;
  double mfu = 0;
  // Where a step's time goes on one rank (seconds per step). compute + recompute + optimizer +
  // contention + exposed_comm = step_time_s; the closed form also splits exposed_comm into the four parts
  // below (the simulator leaves them 0).
  double compute_s = 0;              // forward + backward kernels
  // compute_s by kernel class: GEMMs, the attention core, memory-bound kernels (norms,
  // activations, residuals, softmax and loss, routing and permutation, FP8 casts).
  double gemm_s = 0, attention_s = 0, memory_bound_s = 0;
  double recompute_s = 0;            // forward again under activation checkpointing
  double expert_comm_s = 0;          // token dispatch and combine, tensor and context collectives (on the critical path)
  double shard_comm_exposed_s = 0;   // all-gather / reduce-scatter not hidden behind compute
  double grad_sync_s = 0;            // gradient all-reduce across replicas
  double pipeline_bubble_s = 0;      // stages idle while the pipeline fills and drains (in exposed_comm_s)
  double offload_exposed_s = 0;      // activation copies not hidden behind compute
  double optimizer_s = 0;            // AdamW update of the local shard
  // Compute slowed by communication running beside it (the profile's overlap_slowdown times
  // the overlapped time).
  double contention_s = 0;
  // The rest of the step: the busiest rank's compute stream waiting on communication.
  double exposed_comm_s = 0;
  // No schedule is faster: the busiest rank's compute and token exchanges form one chain, and
  // an exchange takes at least its time with the network card to itself.
  double lower_bound_s = 0;
};

// With a cache, the kernel costs come from it (computed there once for all candidates that
// share them).
StepEstimate estimate_step(const RunConfig& config, const LayoutShapes& shapes, KernelCostCache* cache = nullptr);

// Fills tokens/s, model FLOPs, TFLOP/s per GPU and MFU from step_time_s.
void fill_rates(const RunConfig& config, StepEstimate& estimate);
// Splits compute_s by kernel class in the shares of the micro-batch's kernels.
void split_compute(const OpCosts& costs, StepEstimate& estimate);

}  // namespace moeplan::sim
