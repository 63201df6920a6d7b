#include "moeplan/simulator/op_costs.h"

#include "moeplan/core/moe_load.h"
#include "moeplan/core/units.h"

namespace moeplan::sim {

double moe_forward_seconds(const RunConfig& c, double load) {
  const ModelSpec& m = c.model;
  const CostModel cost(c.cluster);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double h = static_cast<double>(m.hidden_size);
  const double ffn = static_cast<double>(m.intermediate_size);
  const double tokens = static_cast<double>(c.parallel.micro_batch_size) * static_cast<double>(c.training.seq_len);
  const double slots = static_cast<double>(m.experts_per_token) * tokens * load;
  const double local_experts = static_cast<double>(m.num_experts) / static_cast<double>(c.parallel.expert_parallel_degree);
  const double router_flops = 2.0 * tokens * h * static_cast<double>(m.num_experts);
  // Each local expert runs its three GEMMs on its share of the rank's slots.
  return cost.matmul_seconds(router_flops, router_flops, fp32) +
         cost.matmul_seconds(2.0 * slots * 3.0 * h * ffn, 2.0 * slots / local_experts * h * ffn, fp32);
}

OpCosts op_costs(const RunConfig& c) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const CostModel cost(c.cluster);
  const ParamCounts params = count_parameters(m);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double a = fp32 ? kBytesFp32 : kBytesBf16;
  const double e = static_cast<double>(p.expert_parallel_degree);
  const double s = static_cast<double>(p.hybrid_shard_degree);
  const double h = static_cast<double>(m.hidden_size);
  const double ffn = static_cast<double>(m.intermediate_size);
  const double vocab = static_cast<double>(m.vocab_size);
  const double seq = static_cast<double>(c.training.seq_len);
  const double tokens = static_cast<double>(p.micro_batch_size) * seq;
  // Token-expert pairs per rank: each rank routes k per token and the E ranks of the group
  // share the pairs; the busiest rank gets its load (moe_load.h) times the mean.
  const double mean_slots = static_cast<double>(m.experts_per_token) * tokens;
  const double busiest_slots = mean_slots * busiest_expert_rank_load(m, c.moe, p.expert_parallel_degree);

  const double q_width = static_cast<double>(m.num_attention_heads * m.head_dim);
  const double kv_width = static_cast<double>(m.num_key_value_heads * m.head_dim);
  double context = seq / 2.0;  // causal: a token sees half the sequence on average
  if (m.sliding_window && *m.sliding_window < c.training.seq_len) context = static_cast<double>(*m.sliding_window);
  const double proj_flops = 2.0 * tokens * static_cast<double>(params.attention_per_layer);
  const double core_flops = 4.0 * tokens * q_width * context;
  const double router_flops = 2.0 * tokens * h * static_cast<double>(m.num_experts);
  auto expert_flops = [&](double slots) { return 2.0 * slots * 3.0 * h * ffn; };
  auto moe_seconds = [&](double slots) { return moe_forward_seconds(c, slots / mean_slots); };

  OpCosts o;
  o.attention_forward_s = cost.matmul_seconds(proj_flops, 2.0 * tokens * h * h, fp32) +
                          cost.matmul_seconds(core_flops, 4.0 * seq * static_cast<double>(m.head_dim) * context, fp32);
  o.moe_forward_s = moe_seconds(mean_slots);
  o.moe_forward_busiest_s = moe_seconds(busiest_slots);

  o.head_forward_s = cost.matmul_seconds(2.0 * tokens * vocab * h, 2.0 * tokens * vocab * h, fp32);
  o.attention_flops = proj_flops + core_flops;
  o.moe_flops = router_flops + expert_flops(mean_slots);
  o.head_flops = 2.0 * tokens * vocab * h;

  o.dispatch_send_bytes = busiest_slots * h * a;
  o.unit_bytes = (static_cast<double>(params.dense_per_layer()) +
                  static_cast<double>(m.num_experts * params.expert) / e) * a;
  o.offload_bytes = tokens * h * a;  // the block input
  if (p.activation_checkpointing == Checkpointing::kSelective)
    o.offload_bytes += tokens * (3.0 * h + 2.0 * q_width + 2.0 * kv_width) * a;
  o.dense_shard_bytes = static_cast<double>(params.dense()) / s * a;
  o.expert_shard_bytes = static_cast<double>(params.experts()) / e / s * a;

  // AdamW reads and writes parameter, gradient and both moments (and the fp32 master).
  const double shard_params = static_cast<double>(params.dense()) / s + static_cast<double>(params.experts()) / e / s;
  double state_bytes = 0;
  switch (c.training.precision) {
    case Precision::kBf16: state_bytes = 2 + 2 + 2 + 2; break;
    case Precision::kMixed: state_bytes = 2 + 4 + 4 + 4 + 4; break;
    case Precision::kFp32: state_bytes = 4 + 4 + 4 + 4; break;
  }
  o.optimizer_s = cost.memory_bound_seconds(2.0 * shard_params * state_bytes);
  o.forward_flops_per_token = forward_flops_per_token(m, c.training.seq_len);
  return o;
}

}  // namespace moeplan::sim
