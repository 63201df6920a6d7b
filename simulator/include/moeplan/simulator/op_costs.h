#pragma once
// Per-op times and sizes of one micro-batch on one rank, from the model, the configuration and
// the cost model. The analytic estimate and the step simulator both start from these.


#include "moeplan/core/rules.h"
#include "moeplan/simulator/cost_model.h"

namespace moeplan::sim {

struct OpCosts {
  // Forward compute of one block, split so that selective checkpointing can recompute the MoE
  // part alone. From FLOPs, backward is twice the forward; from a profile's measured op times
  // (cluster.op_times, when its shapes are the model's) each is what was measured.
  double attention_forward_s = 0;  // norms, q/k/v/o projections, attention core
  double attention_backward_s = 0;
  double moe_forward_s = 0;        // router and experts, at the mean expert load
  double moe_forward_busiest_s = 0;  // the same on the busiest expert-parallel rank
  double moe_backward_busiest_s = 0;
  double head_forward_s = 0;       // lm head and loss
  double head_s = 0;               // lm head and loss, forward and backward, and the embedding
  bool measured = false;           // times from the profile's op_times
  // Per block: what the executor's measured whole micro-batch took beyond its operations,
  // forward and backward (included in the attention times above); 0 where not measured.
  double framework_forward_s = 0, framework_backward_s = 0;
  double attention_flops = 0;
  double moe_flops = 0;  // at the mean load
  double head_flops = 0;

  double dispatch_send_bytes = 0;  // per rank and exchange (busiest rank's share)
  // Tensor parallelism (T > 1): the all-reduce ending attention (tokens x hidden) and the one
  // ending the experts or MLP (the busiest rank's slots x hidden); 0 without.
  double tensor_bytes = 0, tensor_moe_bytes = 0;
  double stage_send_bytes = 0;     // activations (or their gradients) passed between stages
  double unit_bytes = 0;           // one block's flat parameters, unsharded, in the compute dtype
  // The executor's flat units as gathered (padded to a multiple of S): a block's dense part
  // and its experts apart, the embedding, the final norm with the lm head.
  double dense_unit_bytes = 0, expert_unit_bytes = 0, embed_unit_bytes = 0, head_unit_bytes = 0;
  double offload_bytes = 0;        // what one block keeps for backward (what offloading moves)
  double dense_shard_bytes = 0;    // gradient shard of the dense parameters
  double expert_shard_bytes = 0;   // gradient shard of this rank's experts
  double optimizer_s = 0;
  double forward_flops_per_token = 0;  // the model's, for MFU
};

OpCosts op_costs(const RunConfig& config);

// The model one pipeline stage runs: num_layers / P blocks (the step simulator and the
// estimate also give it the embedding and the head).
ModelSpec stage_model(const RunConfig& config);

// Router and experts forward of one micro-batch on a rank whose experts get `load` times the
// mean share of routed tokens.
double moe_forward_seconds(const RunConfig& config, double load);
double moe_backward_seconds(const RunConfig& config, double load);

// Whether the profile's measured op times were taken at this plan's shapes and precision.
bool op_times_apply(const RunConfig& config);

}  // namespace moeplan::sim
