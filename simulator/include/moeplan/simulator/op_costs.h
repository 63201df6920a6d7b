#pragma once
// Per-op times and sizes of one micro-batch on one rank, from the model, the configuration and
// the cost model. The analytic estimate and the step simulator both start from these.


#include "moeplan/core/rules.h"
#include "moeplan/simulator/cost_model.h"

namespace moeplan::sim {

struct OpCosts {
  // Forward compute of one block, split so that selective checkpointing can recompute the MoE
  // part alone. Backward is twice the forward.
  double attention_forward_s = 0;  // norms, q/k/v/o projections, attention core
  double moe_forward_s = 0;        // router and experts, at the mean expert load
  double moe_forward_busiest_s = 0;  // the same on the busiest expert-parallel rank
  double head_forward_s = 0;       // lm head and loss
  double attention_flops = 0;
  double moe_flops = 0;  // at the mean load
  double head_flops = 0;

  double dispatch_send_bytes = 0;  // per rank and exchange (busiest rank's share)
  double unit_bytes = 0;           // one block's flat parameters, unsharded, in the compute dtype
  double offload_bytes = 0;        // what one block keeps for backward (what offloading moves)
  double dense_shard_bytes = 0;    // gradient shard of the dense parameters
  double expert_shard_bytes = 0;   // gradient shard of this rank's experts
  double optimizer_s = 0;
  double forward_flops_per_token = 0;  // the model's, for MFU
};

OpCosts op_costs(const RunConfig& config);

// Router and experts forward of one micro-batch on a rank whose experts get `load` times the
// mean share of routed tokens.
double moe_forward_seconds(const RunConfig& config, double load);

}  // namespace moeplan::sim
