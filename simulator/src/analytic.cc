#include "moeplan/simulator/analytic.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/units.h"
#include "moeplan/simulator/op_costs.h"

namespace moeplan::sim {

LayoutShapes layout_shapes(const ClusterSpec& cluster, const ParallelConfig& parallel) {
  return {group_shape(cluster, parallel, MeshDim::kExpert),
          group_shape(cluster, parallel, MeshDim::kShard),
          group_shape(cluster, parallel, MeshDim::kReplica), group_shape(cluster, parallel, MeshDim::kTensor),
          group_shape(cluster, parallel, MeshDim::kPipeline)};
}

namespace {

// What ends a tensor-parallel region of `bytes`, in forward (and recompute) or backward: as
// measured inside the split's whole micro-batch where the profile has it, else
// CostModel::tensor_region_cost.
double region_seconds(const CostModel& cost, const OpCosts& o, const ParallelConfig& p, double bytes,
                      const GroupShape& g, bool backward) {
  const double measured = backward ? o.tensor_region_backward_s : o.tensor_region_forward_s;
  return measured > 0 ? measured : cost.tensor_region_seconds(bytes, g, p.sequence_parallel);
}

StepEstimate estimate_stage(const RunConfig& c, const LayoutShapes& shapes, const OpCosts& o) {
  const ParallelConfig& p = c.parallel;
  const CostModel cost(c.cluster);
  const double layers = static_cast<double>(c.model.num_layers);
  const double a = c.training.precision == Precision::kFp32 ? kBytesFp32 : kBytesBf16;
  auto region = [&](double bytes, const GroupShape& g, bool backward = false) {
    return region_seconds(cost, o, p, bytes, g, backward);
  };

  // The busiest expert's rank sets the pace of every block.
  const double compute =
      layers * (o.attention_forward_s + o.attention_backward_s + o.moe_forward_busiest_s + o.moe_backward_busiest_s) +
      o.head_s;
  double recompute = 0;
  if (p.activation_checkpointing == Checkpointing::kFull)
    recompute = layers * (o.attention_forward_s + o.moe_forward_busiest_s);
  if (p.activation_checkpointing == Checkpointing::kSelective) recompute = layers * o.moe_forward_busiest_s;
  if (p.activation_checkpointing == Checkpointing::kAttentionCore) recompute = layers * o.core_forward_s;

  // Token dispatch: forward and backward each dispatch and combine once per layer; a
  // recomputed MoE block does its forward pair again.
  double expert_comm = 0;
  double expert_chain_min = 0;
  double nic_bytes_a2a = 0;
  if (p.expert_parallel_degree > 1) {
    double per_exchange;
    if (c.moe.dispatcher == Dispatcher::kAllToAll) {
      per_exchange = cost.all_to_all_seconds(o.dispatch_send_bytes, shapes.expert);
    } else {
      // Gather every rank's tokens, then reduce-scatter the expert outputs back.
      const double group_bytes = static_cast<double>(p.expert_parallel_degree * p.micro_batch_size *
                                                     c.training.seq_len * c.model.hidden_size) * a;
      per_exchange = 0.5 * (cost.all_gather_seconds(group_bytes, shapes.expert) +
                            cost.reduce_scatter_seconds(group_bytes, shapes.expert));
    }
    const double exchanges = 4.0 + (recomputes_moe(p.activation_checkpointing) ? 2.0 : 0.0);
    // Under tensor parallelism the backward dispatch (the input gradients going home) runs
    // beside the experts' weight gradients, after the tensor-parallel collective before it, and
    // the next block's backward combine beside attention's.
    const bool tensor = p.tensor_parallel_degree > 1;
    const double moe_beside =
        std::max(0.0, o.tensor_moe_overlap_s - (tensor ? region(o.tensor_moe_bytes, shapes.tensor, true) : 0.0));
    const double attention_beside =
        std::max(0.0, o.tensor_overlap_s - (tensor ? region(o.tensor_bytes, shapes.tensor, true) : 0.0));
    expert_comm = layers * (exchanges * per_exchange - std::min(per_exchange, moe_beside) -
                            std::min(per_exchange, attention_beside));
    if (c.moe.dispatcher == Dispatcher::kAllToAll) {
      GroupShape alone = shapes.expert;
      alone.groups_per_node = 1;
      const double alone_s = cost.all_to_all_seconds(o.dispatch_send_bytes, alone);
      expert_chain_min = layers * (exchanges * alone_s - std::min(alone_s, o.tensor_moe_overlap_s) -
                                   std::min(alone_s, o.tensor_overlap_s));
      nic_bytes_a2a = layers * exchanges * cost.all_to_all_cost(o.dispatch_send_bytes, shapes.expert).nic_bytes_per_node *
                      static_cast<double>(shapes.expert.groups_per_node);
    }
  }

  // Tensor parallelism: two all-reduces per block in forward, two in backward, and those of
  // what is recomputed, on the compute chain.
  double tensor_comm = 0;
  double tensor_chain_min = 0;  // the same, each group alone on the node's card
  double beside_compute = 0;    // per micro-batch: communication running beside compute
  if (p.tensor_parallel_degree > 1) {
    GroupShape alone = shapes.tensor;
    alone.groups_per_node = 1;
    auto per_layer = [&](const GroupShape& g) {
      const double attention = region(o.tensor_bytes, g);
      const double moe = region(o.tensor_moe_bytes, g);
      // Backward's collectives run beside the weight gradients of the regions' first GEMMs.
      double all = attention + moe + std::max(0.0, region(o.tensor_bytes, g, true) - o.tensor_overlap_s) +
                   std::max(0.0, region(o.tensor_moe_bytes, g, true) - o.tensor_moe_overlap_s);
      if (p.activation_checkpointing == Checkpointing::kFull) all += attention + moe;
      if (p.activation_checkpointing == Checkpointing::kSelective) all += moe;
      return all;
    };
    tensor_comm = layers * per_layer(shapes.tensor);
    beside_compute += layers * (std::min(region(o.tensor_bytes, shapes.tensor, true), o.tensor_overlap_s) +
                                std::min(region(o.tensor_moe_bytes, shapes.tensor, true), o.tensor_moe_overlap_s));
    // The bound counts forward's and recompute's alone: backward's may hide behind the weight
    // gradients entirely.
    tensor_chain_min =
        layers * (per_layer(alone) - std::max(0.0, region(o.tensor_bytes, alone, true) - o.tensor_overlap_s) -
                  std::max(0.0, region(o.tensor_moe_bytes, alone, true) - o.tensor_moe_overlap_s));
  }

  // Sharded model states: each block's unit is gathered for forward and again for backward,
  // and its gradient reduce-scattered, behind the compute of the neighbouring block.
  double shard_comm_exposed = 0;
  double gather_stream_min = 0;  // per micro-batch
  double nic_bytes = 0;          // per micro-batch, through each node's card
  if (p.hybrid_shard_degree > 1) {
    const double gather = cost.all_gather_seconds(o.unit_bytes, shapes.shard);
    const double scatter = cost.reduce_scatter_seconds(o.unit_bytes, shapes.shard);
    const double per_block_comm = 2.0 * gather + scatter;
    const double per_block_compute = (compute + recompute - o.head_s) / layers;
    // The first gather has nothing to hide behind; the rest overlap block by block.
    shard_comm_exposed = gather + layers * std::max(0.0, per_block_comm - per_block_compute);
    beside_compute += layers * std::min(per_block_comm, per_block_compute);
    // The gather stream runs 2 L gathers per micro-batch, the gradient stream L reduce-scatters.
    const CollectiveCost g = cost.all_gather_cost(o.unit_bytes, shapes.shard);
    GroupShape alone = shapes.shard;
    alone.groups_per_node = 1;
    gather_stream_min = 2.0 * layers * cost.all_gather_seconds(o.unit_bytes, alone);
    nic_bytes += 3.0 * layers * g.nic_bytes_per_node * static_cast<double>(shapes.shard.groups_per_node);
  }

  // Activation offload: every stored block activation goes to the host and comes back.
  double offload_exposed = 0;
  if (p.activation_offloading) {
    const double copies = 2.0 * layers * cost.pcie_seconds(o.offload_bytes);
    offload_exposed = std::max(0.0, copies - (compute + recompute));
  }

  // Gradient sync across replicas once per step: dense shards over E x R (hierarchically: E,
  // then R on 1/E of the bytes), expert shards over R.
  const double e = static_cast<double>(p.expert_parallel_degree);
  auto sync = [&](double bytes, const GroupShape& g) {
    return p.distributed_optimizer ? cost.reduce_scatter_seconds(bytes, g) + cost.all_gather_seconds(bytes, g)
                                   : cost.all_reduce_seconds(bytes, g);
  };
  const double full_sync =
      sync(o.dense_shard_bytes, shapes.expert) + sync(o.dense_shard_bytes / e + o.expert_shard_bytes, shapes.replica);
  double grad_sync = full_sync;
  // On GPUs the sync runs behind the last micro-batch's backward, block by block, where the
  // framework starts it there.
  if (c.cluster.gradient_sync_overlaps_backward())
    grad_sync = std::max(full_sync / layers, full_sync - (compute + recompute) * 2.0 / 3.0);

  const double accum = static_cast<double>(p.gradient_accumulation_steps);
  StepEstimate out;
  out.compute_s = accum * compute;
  out.recompute_s = accum * recompute;
  out.expert_comm_s = accum * (expert_comm + tensor_comm);
  out.shard_comm_exposed_s = accum * shard_comm_exposed;
  out.offload_exposed_s = accum * offload_exposed;
  out.grad_sync_s = grad_sync;
  out.optimizer_s = o.optimizer_s;
  if (c.cluster.comm_overlaps_compute)
    out.contention_s = c.cluster.overlap_slowdown * (accum * beside_compute + full_sync - grad_sync);
  // The busiest resource's work: the compute chain, the gather stream, or a node's card
  // (shared fairly, so it never idles while it has bytes to move).
  const double card_s = accum * (nic_bytes + nic_bytes_a2a) / c.cluster.inter_node_bandwidth_bytes_per_s;
  out.lower_bound_s = std::max({accum * (compute + recompute + expert_chain_min + tensor_chain_min) + o.optimizer_s,
                                accum * gather_stream_min, card_s});
  out.exposed_comm_s = out.expert_comm_s + out.shard_comm_exposed_s + out.offload_exposed_s + out.grad_sync_s;
  out.step_time_s = out.compute_s + out.recompute_s + out.exposed_comm_s + out.optimizer_s + out.contention_s;
  split_compute(o, out);
  return out;
}

}  // namespace

StepEstimate estimate_step(const RunConfig& c, const LayoutShapes& shapes, KernelCostCache* cache) {
  const ParallelConfig& p = c.parallel;
  auto costs = [&](const RunConfig& config) {
    return cache != nullptr ? op_costs(config, cache->get(config)) : op_costs(config);
  };
  if (p.pipeline_parallel_degree <= 1) {
    StepEstimate out = estimate_stage(c, shapes, costs(c));
    fill_rates(c, out);
    return out;
  }
  // The last stage (its blocks and the head) and the 1F1B bubble: the other P - 1 stages'
  // micro-batch time (no head), over V with interleaved chunks, and a transfer each way per
  // stage boundary. A stage with more blocks than the last (uneven ends) sets the pace.
  const ModelSpec blocks = stage_model(c);
  const RunConfig stage{blocks, c.cluster, c.parallel, c.moe, c.training, c.target};
  const OpCosts o = costs(stage);
  StepEstimate out = estimate_stage(stage, shapes, o);
  const double accum = static_cast<double>(p.gradient_accumulation_steps);
  const double stages = static_cast<double>(p.pipeline_parallel_degree);
  const double per_micro_batch = (out.step_time_s - out.optimizer_s - out.grad_sync_s) / accum;
  const double busy_per_micro_batch = (out.compute_s + out.recompute_s) / accum;
  const double send = CostModel(c.cluster).send_seconds(o.stage_send_bytes, shapes.pipeline);
  const double chunks = static_cast<double>(std::max<int64_t>(1, p.virtual_pipeline_degree));
  const double per_block = std::max(0.0, per_micro_batch - o.head_s) / std::max<double>(1.0, static_cast<double>(blocks.num_layers));
  double slowest = per_micro_batch;
  for (int64_t i = 0; i + 1 < p.pipeline_parallel_degree; ++i)
    slowest = std::max(slowest, per_block * static_cast<double>(stage_layers(c.model.num_layers, p, i)));
  out.pipeline_bubble_s = (stages - 1) * (std::max(0.0, per_micro_batch - o.head_s) / chunks + 2.0 * send) +
                          accum * (slowest - per_micro_batch);
  out.exposed_comm_s += out.pipeline_bubble_s;
  out.step_time_s += out.pipeline_bubble_s;
  out.lower_bound_s += (stages - 1) * std::max(0.0, busy_per_micro_batch - o.head_s) / chunks;
  fill_rates(c, out);
  return out;
}

void split_compute(const OpCosts& o, StepEstimate& out) {
  out.gemm_s = out.compute_s * o.compute_share[0];
  out.attention_s = out.compute_s * o.compute_share[1];
  out.memory_bound_s = out.compute_s * o.compute_share[2];
}

void fill_rates(const RunConfig& c, StepEstimate& out) {
  const double step_tokens = static_cast<double>(c.training.global_batch_tokens);
  const double world = static_cast<double>(c.parallel.world_size);
  out.tokens_per_s = step_tokens / out.step_time_s;
  out.model_flops_per_step = 3.0 * forward_flops_per_token(c.model, c.training.seq_len) * step_tokens;
  out.tflops_per_gpu = out.model_flops_per_step / out.step_time_s / world / kTera;
  out.mfu = out.model_flops_per_step / out.step_time_s / world / c.cluster.peak_bf16_flops;
}

}  // namespace moeplan::sim
