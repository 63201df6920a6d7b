#include "moeplan/simulator/analytic.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/units.h"

namespace moeplan::sim {

LayoutShapes layout_shapes(const ClusterSpec& cluster, const ParallelConfig& parallel) {
  return {group_shape(cluster, parallel, MeshDim::kExpert),
          group_shape(cluster, parallel, MeshDim::kShard),
          group_shape(cluster, parallel, MeshDim::kReplica)};
}

StepEstimate estimate_step(const RunConfig& c, const LayoutShapes& shapes) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const ClusterSpec& cl = c.cluster;
  const CostModel cost(cl);
  const ParamCounts params = count_parameters(m);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double act_bytes = fp32 ? kBytesFp32 : kBytesBf16;
  const double e = static_cast<double>(p.expert_parallel_degree);
  const double s = static_cast<double>(p.hybrid_shard_degree);
  const double layers = static_cast<double>(m.num_layers);
  const double h = static_cast<double>(m.hidden_size);
  const double ffn = static_cast<double>(m.intermediate_size);
  const double vocab = static_cast<double>(m.vocab_size);
  const double tokens = static_cast<double>(p.micro_batch_size * c.training.seq_len);
  const double imbalance = c.moe.expert_load_imbalance;
  // Token-expert pairs on the busiest rank: each rank routes k per token, and the E ranks of
  // the group share the pairs; the busiest expert sets the pace.
  const double expert_tokens = static_cast<double>(m.experts_per_token) * tokens * imbalance;
  const double local_experts = static_cast<double>(m.num_experts) / e;

  // Forward of one block, per micro-batch, split so that selective checkpointing can recompute
  // the MoE part alone.
  const double q_width = static_cast<double>(m.num_attention_heads * m.head_dim);
  double context = static_cast<double>(c.training.seq_len) / 2.0;
  if (m.sliding_window && *m.sliding_window < c.training.seq_len)
    context = static_cast<double>(*m.sliding_window);
  const double attn_proj_flops = 2.0 * tokens * static_cast<double>(params.attention_per_layer);
  const double attn_core_flops = 4.0 * tokens * q_width * context;
  const double router_flops = 2.0 * tokens * h * static_cast<double>(m.num_experts);
  const double expert_flops = 2.0 * expert_tokens * 3.0 * h * ffn;
  const double attention_fwd =
      cost.matmul_seconds(attn_proj_flops, 2.0 * tokens * h * h, fp32) +
      cost.matmul_seconds(attn_core_flops, 4.0 * static_cast<double>(c.training.seq_len) *
                                               static_cast<double>(m.head_dim) * context, fp32);
  const double moe_fwd = cost.matmul_seconds(router_flops, router_flops, fp32) +
                         cost.matmul_seconds(expert_flops, 2.0 * expert_tokens / local_experts * h * ffn, fp32);
  const double head_fwd = cost.matmul_seconds(2.0 * tokens * vocab * h, 2.0 * tokens * vocab * h, fp32);
  const double forward = layers * (attention_fwd + moe_fwd) + head_fwd;
  const double compute = 3.0 * forward;  // backward is twice the forward
  double recompute = 0;
  if (p.activation_checkpointing == Checkpointing::kFull) recompute = layers * (attention_fwd + moe_fwd);
  if (p.activation_checkpointing == Checkpointing::kSelective) recompute = layers * moe_fwd;

  // Token dispatch: forward and backward each dispatch and combine once per layer; a
  // recomputed MoE block does its forward pair again.
  double expert_comm = 0;
  if (p.expert_parallel_degree > 1) {
    double per_exchange;
    if (c.moe.dispatcher == Dispatcher::kAllToAll) {
      per_exchange = cost.all_to_all_seconds(expert_tokens * h * act_bytes, shapes.expert);
    } else {
      // Gather every rank's tokens, then reduce-scatter the expert outputs back.
      per_exchange = 0.5 * (cost.all_gather_seconds(e * tokens * h * act_bytes, shapes.expert) +
                            cost.reduce_scatter_seconds(e * tokens * h * act_bytes, shapes.expert));
    }
    const double exchanges = 4.0 + (p.activation_checkpointing == Checkpointing::kNone ? 0.0 : 2.0);
    expert_comm = layers * exchanges * per_exchange;
  }

  // Sharded model states: each block's unit is gathered for forward and again for backward,
  // and its gradient reduce-scattered, behind the compute of the neighbouring block.
  const double unit_params = static_cast<double>(params.dense_per_layer()) +
                             static_cast<double>(m.num_experts * params.expert) / e;
  double shard_comm_exposed = 0;
  if (p.hybrid_shard_degree > 1) {
    const double unit_bytes = unit_params * act_bytes;
    const double gather = cost.all_gather_seconds(unit_bytes, shapes.shard);
    const double scatter = cost.reduce_scatter_seconds(unit_bytes, shapes.shard);
    const double per_block_comm = 2.0 * gather + scatter;
    const double per_block_compute = (compute + recompute - 3.0 * head_fwd) / layers;
    // The first gather has nothing to hide behind; the rest overlap block by block.
    shard_comm_exposed = gather + layers * std::max(0.0, per_block_comm - per_block_compute);
  }

  // Activation offload: every stored block activation goes to the host and comes back.
  double offload_exposed = 0;
  if (p.activation_offloading) {
    double stored = tokens * h * act_bytes;  // the block input
    if (p.activation_checkpointing == Checkpointing::kSelective)
      stored += tokens * (3.0 * h + 2.0 * q_width +
                          2.0 * static_cast<double>(m.num_key_value_heads * m.head_dim)) * act_bytes;
    const double copies = 2.0 * layers * cost.pcie_seconds(stored);
    offload_exposed = std::max(0.0, copies - (compute + recompute));
  }

  const double accum = static_cast<double>(p.gradient_accumulation_steps);
  // Gradient sync across replicas once per step: dense shards over E x R (hierarchically: E,
  // then R on 1/E of the bytes), expert shards over R.
  const double dense_shard_bytes = static_cast<double>(params.dense()) / s * act_bytes;
  const double expert_shard_bytes = static_cast<double>(params.experts()) / e / s * act_bytes;
  const double grad_sync = cost.all_reduce_seconds(dense_shard_bytes, shapes.expert) +
                           cost.all_reduce_seconds(dense_shard_bytes / e + expert_shard_bytes, shapes.replica);
  // AdamW reads and writes parameter, gradient and both moments (and the fp32 master).
  const double shard_params = static_cast<double>(params.dense()) / s +
                              static_cast<double>(params.experts()) / e / s;
  double state_bytes = 0;
  switch (c.training.precision) {
    case Precision::kBf16: state_bytes = 2 + 2 + 2 + 2; break;
    case Precision::kMixed: state_bytes = 2 + 4 + 4 + 4 + 4; break;
    case Precision::kFp32: state_bytes = 4 + 4 + 4 + 4; break;
  }
  const double optimizer = cost.memory_bound_seconds(2.0 * shard_params * state_bytes);

  StepEstimate out;
  out.compute_s = accum * compute;
  out.recompute_s = accum * recompute;
  out.expert_comm_s = accum * expert_comm;
  out.shard_comm_exposed_s = accum * shard_comm_exposed;
  out.offload_exposed_s = accum * offload_exposed;
  out.grad_sync_s = grad_sync;
  out.optimizer_s = optimizer;
  out.step_time_s = out.compute_s + out.recompute_s + out.expert_comm_s + out.shard_comm_exposed_s +
                    out.offload_exposed_s + out.grad_sync_s + out.optimizer_s;
  const double step_tokens = static_cast<double>(c.training.global_batch_tokens);
  out.tokens_per_s = step_tokens / out.step_time_s;
  out.model_flops_per_step = 3.0 * forward_flops_per_token(m, c.training.seq_len) * step_tokens;
  const double world = static_cast<double>(p.world_size);
  out.tflops_per_gpu = out.model_flops_per_step / out.step_time_s / world / kTera;
  out.mfu = out.model_flops_per_step / out.step_time_s / world / cl.peak_bf16_flops;
  return out;
}

}  // namespace moeplan::sim
