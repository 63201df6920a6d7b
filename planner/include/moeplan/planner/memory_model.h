#pragma once
// Per-rank memory of a training configuration, item by item (docs/architecture.md section 8).
// docs/memory-model.md derives every term.

#include <cstdint>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"

namespace moeplan::planner {

// Activation bytes of one transformer block for one micro-batch.
struct BlockActivations {
  int64_t block_input = 0;  // the residual stream entering the block
  int64_t attention = 0;    // everything the attention sub-block keeps for backward
  int64_t core = 0;         // of that, what the attention core alone keeps (scores or log-sum-exp)
  int64_t latent_up = 0;    // of that, latent attention's every-head q, k and v (its up projections' outputs)
  int64_t moe = 0;          // everything the MoE sub-block keeps for backward
  int64_t full() const { return attention + moe; }
};

// How a block is split over the ranks of a tensor-parallel group (Megatron): heads and
// intermediate columns over `degree` ranks; with `sequence`, the hidden-width tensors between
// the split regions (norms, residual stream) along the sequence too.
struct TensorSplit {
  int64_t degree = 1;
  bool sequence = false;
};

// A micro-batch of `micro_batch` sequences of `seq_len` tokens; `expert_token_slots` token-expert
// pairs processed on the rank's experts (k x tokens x imbalance, before any tensor split); what
// the framework's kernels keep; what one rank of a tensor-parallel group keeps of it.
BlockActivations block_activations(const ModelSpec& model, int64_t micro_batch, int64_t seq_len,
                                   int64_t expert_token_slots, int64_t element_bytes, Kernels kernels,
                                   AttentionKernel attention, TensorSplit split = {}, bool fp8 = false);
// The attention kernel the kernel set implies (fused: flash, eager: unfused).
BlockActivations block_activations(const ModelSpec& model, int64_t micro_batch, int64_t seq_len,
                                   int64_t expert_token_slots, int64_t element_bytes,
                                   Kernels kernels = Kernels::kFused, TensorSplit split = {});

struct MemoryEstimate {
  // Model states.
  int64_t parameters = 0;        // local shard, in the parameter dtype (bf16 compute copy in mixed)
  int64_t master_weights = 0;    // fp32 shard (mixed precision only)
  int64_t gradients = 0;         // local shard
  int64_t optimizer_states = 0;  // AdamW first and second moments of the shard
  // Transient buffers.
  int64_t gathered_parameters = 0;  // the block in use and the one being prefetched (S > 1)
  int64_t gradient_buffers = 0;     // one block's unsharded gradient before reduce-scatter
  int64_t activations = 0;          // kept for backward, plus one block's recompute working set
  int64_t activation_working_set = 0;  // of activations, the recomputed block's (0 without recompute)
  int64_t moe_dispatch_buffers = 0;
  int64_t logits = 0;
  // Allocated once for the step: DeepEP's NVLink and RDMA buffers (dispatcher deepep).
  int64_t communication_buffers = 0;
  int64_t framework_overhead = 0;
  int64_t fragmentation = 0;  // (factor - 1) x the transient items
  int64_t device_total = 0;
  int64_t offloaded_activations = 0;  // host memory per rank

  int64_t model_states() const { return parameters + master_weights + gradients + optimizer_states; }
  std::vector<MemoryItem> device_items() const;
  std::vector<MemoryItem> host_items() const;
};

// Parameters held by one rank before and after sharding: its stage's blocks (the first stage
// also holds the embedding, the last the final norm and lm head; the larger of the two counts),
// its experts, and its 1/T of each matrix (norms and the router included, a slight over-count).
struct ShardSizes {
  int64_t local_params = 0;  // dense + this rank's experts, unsharded
  int64_t shard_params = 0;  // what the rank keeps: each flat parameter padded and split over S
  int64_t shard_expert_params = 0;  // of shard_params, the experts'
  int64_t largest_unit_params = 0;  // the biggest flat parameter gathered at once
};
// The `blocks` of one pipeline stage of `model` (or all of them); `with_ends`: the embedding or
// the head (the larger) on the stage, both with one stage. Routed experts are split over
// `expert_tensor_degree` ranks (0: tensor_degree).
ShardSizes stage_shard_sizes(const ModelSpec& model, StageBlockCounts blocks, int64_t expert_degree,
                             int64_t shard_degree, int64_t tensor_degree, int64_t pipeline_degree, bool with_ends,
                             int64_t expert_tensor_degree = 0);
// The busiest of `pipeline_degree` equal stages of `model`.
ShardSizes shard_sizes(const ModelSpec& model, int64_t expert_degree, int64_t shard_degree, int64_t tensor_degree = 1,
                       int64_t pipeline_degree = 1);
// The stage with the most MoE blocks, then the most blocks: the one whose parameters and kept
// activations are the largest.
StageBlockCounts busiest_stage(const ModelSpec& model, const ParallelConfig& parallel);

// Which pipeline stage's memory: the busiest (most blocks, the embedding or head, the first
// stage's micro-batches in flight), or the same without the embedding and head, as a middle
// stage holds (what Korthikanti et al. report).
enum class StageView : uint8_t { kBusiest, kBlocksOnly };
MemoryEstimate estimate_memory(const RunConfig& config, StageView view = StageView::kBusiest);
// The same with the busiest expert-parallel rank carrying `load` times the mean rank's slots
// (what routing draws reach at their tail, sim/routing.h): its dispatch buffers and expert
// activations grow with it.
MemoryEstimate estimate_memory_at_load(const RunConfig& config, double load);

// Host memory available to one rank: the node's memory shared by its ranks.
int64_t host_limit_bytes(const ClusterSpec& cluster, int64_t world_size);

MemoryBreakdown to_breakdown(const MemoryEstimate& m, const ClusterSpec& cluster, int64_t world_size);

}  // namespace moeplan::planner
