#pragma once
// Per-op times and sizes of one micro-batch on one rank, from the model, the configuration and
// the cost model. The analytic estimate and the step simulator both start from these.


#include <array>
#include <map>

#include "moeplan/core/rules.h"
#include "moeplan/simulator/cost_model.h"

namespace moeplan::sim {

// The compute of one micro-batch: from the kernel model (kernels.h), or from a profile's
// measured op times (cluster.op_times, when its shapes are the model's). It depends on the
// model and its blocks, the cluster, T, sequence parallelism, the micro-batch, E and the expert
// load, the precision and FP8, not on S, R, the placement, checkpointing or offloading: the
// search computes it once for all the candidates that share it (KernelCostCache).
struct KernelCosts {
  // Forward compute of one block, split so that selective checkpointing can recompute the MoE
  // part alone.
  double attention_forward_s = 0;  // norms, q/k/v/o projections, attention core
  double attention_backward_s = 0;
  double moe_forward_s = 0;        // router and experts, at the mean expert load
  double moe_forward_busiest_s = 0;  // the same on the busiest expert-parallel rank
  double moe_backward_busiest_s = 0;
  double core_forward_s = 0;       // the attention core alone (recomputed under attention_core)
  double core_backward_s = 0;      // its backward
  double latent_up_forward_s = 0;  // latent attention's up projections (recomputed under latent_up)
  double head_forward_s = 0;       // lm head and loss
  double head_s = 0;               // lm head and loss, forward and backward, and the embedding
  bool measured = false;           // times from the profile's op_times
  // Per block: what the executor's measured whole micro-batch took beyond its operations,
  // forward and backward (included in the attention times above); 0 where not measured.
  double framework_forward_s = 0, framework_backward_s = 0;
  // Per block of a fully recomputed plan (measured whole micro-batches with every block
  // checkpointed, OpTimes::recomputed_micro_batch_*): what recomputing a block takes beyond its
  // forward, which ran without autograd (the attention times above are that forward's). 0
  // elsewhere: a recompute is priced as the forward.
  double recompute_beyond_forward_s = 0;
  // Per tensor-parallel region (two per block): what the tensor group's collectives took inside
  // the measured whole micro-batch of the plan's split, in forward and in backward, those of
  // the embedding, the head and the loss spread over the regions with the blocks'; 0 where not
  // measured (the cost model then prices each region: CostModel::tensor_region_cost).
  double tensor_region_forward_s = 0, tensor_region_backward_s = 0;
  // Per sync point of the token exchange (forward: the counts' all-gather, the dispatch and the
  // combine of each MoE block; backward: the two exchanges): what the expert group's
  // collectives took inside the measured whole micro-batch with the experts over E ranks
  // (T = 1), the waits for the other ranks included; 0 where not measured (the cost model then
  // prices each exchange).
  double expert_exchange_forward_s = 0, expert_exchange_backward_s = 0;
  // Per block, forward and backward: what the whole micro-batch measured with the states
  // sharded over the plan's S ranks (OpTimes::shard_splits) took beyond the one measured on one
  // rank: every unit's gather (prefetched, as the executor runs them) and gradient
  // reduce-scatter, and what they took from the compute beside them. Where measured
  // (shard_measured) a block's gathers carry it and the reduce-scatters are sync points of no
  // cost of their own.
  bool shard_measured = false;
  double shard_forward_s = 0, shard_backward_s = 0;
  double attention_flops = 0;
  double moe_flops = 0;  // at the mean load
  double head_flops = 0;
  double core_flops = 0;  // the attention core's forward
  double latent_up_flops = 0;  // latent attention's up projections' forward
  // In backward the collective of each region's input gradient runs beside the weight
  // gradient of its first GEMM (Megatron's asynchronous tensor-parallel communication).
  double tensor_overlap_s = 0, tensor_moe_overlap_s = 0;
  // Seconds by kernel class (KernelClass order: GEMMs, attention core, memory-bound kernels)
  // of a block's forward and backward on the busiest rank, and of the head's; measured op
  // times count as GEMMs.
  std::array<double, 3> block_by_class{}, head_by_class{};
  // A dense block among MoE blocks (ModelSpec::first_dense_layers of the stage): its
  // feed-forward layer over every token, forward and backward, the weight gradient of its first
  // GEMM, and the whole block by kernel class; 0 where the model has none (a stage without them
  // still prices them for the stages that have them).
  double dense_forward_s = 0, dense_backward_s = 0, dense_flops = 0, tensor_dense_overlap_s = 0;
  std::array<double, 3> dense_block_by_class{};
  // The shared experts' forward: up to and with the activation (their first GEMM, the gate),
  // and their second GEMM; 0 without shared experts.
  double shared_up_forward_s = 0, shared_down_forward_s = 0;
};

struct OpCosts : KernelCosts {
  // Shares of a micro-batch's compute on the busiest rank by kernel class.
  std::array<double, 3> compute_share{1.0, 0.0, 0.0};

  double dispatch_send_bytes = 0;  // per rank and exchange (busiest rank's share)
  // Context parallelism (C > 1): the keys and values of a rank's chunks of one block, what each
  // step of the exchange passes on (0 without).
  double context_kv_bytes = 0;
  // Tensor parallelism (T > 1): the all-reduce ending attention (tokens x hidden) and the one
  // ending the experts or MLP (the busiest rank's slots x hidden); 0 without.
  double tensor_bytes = 0, tensor_moe_bytes = 0;
  double stage_send_bytes = 0;     // activations (or their gradients) passed between stages
  double unit_bytes = 0;           // one block's flat parameters, unsharded, in the compute dtype
  double dense_block_bytes = 0;    // the same for a dense block among MoE blocks
  double tensor_dense_bytes = 0;   // the all-reduce ending a dense block's feed-forward layer (T > 1)
  // The executor's flat units as gathered (padded to a multiple of S): a block's dense part
  // and its experts apart, the embedding, the final norm with the lm head; a dense block among
  // MoE blocks is one unit.
  double dense_unit_bytes = 0, expert_unit_bytes = 0, embed_unit_bytes = 0, head_unit_bytes = 0;
  double dense_block_unit_bytes = 0;
  double offload_bytes = 0;        // what one block keeps for backward (what offloading moves)
  double dense_shard_bytes = 0;    // gradient shard of the dense parameters
  double expert_shard_bytes = 0;   // gradient shard of this rank's experts
  double optimizer_s = 0;
  double forward_flops_per_token = 0;  // the model's, for MFU
};

// Under moe.overlap_exchange, the compute of another micro-batch that each of a block's four
// token exchanges runs beside (Megatron-Core's merged 1F1B schedule pairs one micro-batch's
// forward with another's backward): the forward dispatch beside the experts' backward, the
// forward combine beside attention's backward, the backward combine beside attention's forward,
// the backward dispatch beside the experts' forward. Only what an exchange takes beyond it is
// exposed.
struct ExchangeCover {
  double dispatch = 0, combine = 0, combine_backward = 0, dispatch_backward = 0;
  // What `exchange_s` seconds for each of the four leave exposed, per block; the backward
  // dispatch's exposed part may run beside the experts' weight gradients (`moe_beside`) and the
  // backward combine's beside attention's (`attention_beside`), as without the overlap.
  double exposed(double exchange_s, double moe_beside = 0, double attention_beside = 0) const;
  // What the four take beside the other micro-batch's compute, per block: that compute shares
  // the GPU with them and slows by the profile's overlap_slowdown for as long.
  double covered(double exchange_s) const;
};
ExchangeCover exchange_cover(const KernelCosts& kernels);

// Under moe.overlap_shared_expert (with shared experts and E > 1, and not already under
// moe.overlap_exchange), what runs beside each forward exchange on the shared experts' stream:
// their first GEMM and activation beside the dispatch, their second GEMM beside the combine
// (also when the MoE sub-block is recomputed). Backward runs in turn. 0 where it does not apply.
struct SharedExpertCover {
  double dispatch = 0, combine = 0;
  // What the forward exchanges of one block (and their recomputation) hide, each of `exchange_s`.
  double hidden(double exchange_s, bool recomputed) const;
};
SharedExpertCover shared_expert_cover(const RunConfig& config, const KernelCosts& kernels);

// One token exchange (a dispatch or a combine) of `send_bytes` a rank in the expert group `g`:
// NCCL's all-to-all; DeepEP's fused kernels (moe.dispatcher), whose network share is each
// token once per other node it is routed to (fused_network_bytes); or, for the all-gather
// dispatcher, half of an all-gather and a reduce-scatter of the whole group's tokens. The
// estimate and the step simulator both price exchanges here.
CollectiveCost token_exchange_cost(const CostModel& cost, const RunConfig& config, double send_bytes,
                                   const GroupShape& g);
// What a rank's `send_bytes` of slots put on the network under DeepEP: a token crosses it once
// for each other node of the group that holds one of its k experts. With the experts spread
// evenly over the group's nodes and routing balanced, a node is missed with the probability
// that none of the k distinct experts falls on it; under group-limited routing whose groups
// each sit on whole nodes, at least with the probability that none of its groups is chosen.
double fused_network_bytes(const ModelSpec& model, double send_bytes, const GroupShape& g);

// Context parallelism (C > 1): what one block's key-value exchange over the C ranks (group
// shape `g`) leaves exposed on the compute chain, per micro-batch, in forward (again for a
// recomputed attention core) and in backward. Ring (p2p): C - 1 steps, each passing the keys and
// values on (in backward with their gradients) beside the attention of the chunk before; what
// a step takes beyond that chunk's attention is exposed. all_gather: the keys and values
// gathered whole before the attention, in backward gathered again and their gradients
// reduce-scattered, all exposed.
struct ContextExchangeCost {
  double forward_s = 0, backward_s = 0;
};
ContextExchangeCost context_exchange_cost(const CostModel& cost, const OpCosts& costs, const ParallelConfig& parallel,
                                          const GroupShape& g);

KernelCosts kernel_costs(const RunConfig& config);
OpCosts op_costs(const RunConfig& config, const KernelCosts& kernels);
OpCosts op_costs(const RunConfig& config);

// The kernel costs of the candidates of one search (one model, cluster, MoE and training
// setting), each computed once and looked up by what they depend on.
class KernelCostCache {
 public:
  const KernelCosts& get(const RunConfig& config);

 private:
  std::map<std::array<int64_t, 9>, KernelCosts> costs_;
};

// The model the last pipeline stage runs: its blocks (num_layers / P, or last_stage_layers, its
// dense blocks first); the step simulator and the estimate also give it the head, and scale
// the other stages by their blocks' compute (stage_weight).
ModelSpec stage_model(const RunConfig& config);
// The compute of one micro-batch through `blocks` on the busiest rank (no head): forward,
// backward, and what checkpointing recomputes.
struct StageCompute {
  double forward = 0, backward = 0, recompute = 0;
  double total() const { return forward + backward + recompute; }
};
StageCompute stage_compute(const OpCosts& costs, const ParallelConfig& parallel, StageBlockCounts blocks);
// Its total: what the pipeline's stages are scaled by.
inline double stage_weight(const OpCosts& costs, const ParallelConfig& parallel, StageBlockCounts blocks) {
  return stage_compute(costs, parallel, blocks).total();
}

// Router and experts forward of one micro-batch on a rank whose experts get `load` times the
// mean share of routed tokens.
double moe_forward_seconds(const RunConfig& config, double load);
double moe_backward_seconds(const RunConfig& config, double load);

// Whether the profile's measured op times were taken at this plan's shapes and precision (and,
// for T > 1, at its tensor split).
bool op_times_apply(const RunConfig& config);

}  // namespace moeplan::sim
