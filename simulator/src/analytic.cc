#include "moeplan/simulator/analytic.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "moeplan/core/units.h"
#include "moeplan/simulator/op_costs.h"

namespace moeplan::sim {

LayoutShapes layout_shapes(const ClusterSpec& cluster, const ParallelConfig& parallel) {
  const GroupShape expert = group_shape(cluster, parallel, MeshDim::kExpert);
  const GroupShape exchange =
      parallel.expert_fold() > 1
          ? group_shape(cluster, parallel.world_size, parallel.expert_parallel_degree, parallel.expert_stride())
          : expert;
  return {expert,
          group_shape(cluster, parallel, MeshDim::kShard),
          group_shape(cluster, parallel, MeshDim::kReplica),
          group_shape(cluster, parallel, MeshDim::kTensor),
          group_shape(cluster, parallel, MeshDim::kPipeline),
          exchange,
          group_shape(cluster, parallel, MeshDim::kContext),
          group_shape(cluster, parallel, kShardSpanDims)};
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

// What every part of one stage's estimate reads.
struct Stage {
  const RunConfig& c;
  const LayoutShapes& shapes;
  const OpCosts& o;
  CostModel cost;
  StageBlockCounts blocks;

  double layers() const { return static_cast<double>(blocks.layers); }
  double moe_layers() const { return static_cast<double>(blocks.moe_layers); }      // with routed experts
  double dense_layers() const { return static_cast<double>(blocks.layers - blocks.moe_layers); }

  double region(double bytes, const GroupShape& g, bool backward = false) const {
    if (bytes <= 0) return 0;  // no region: routed experts folded out of the tensor split, no shared ones
    return region_seconds(cost, o, c.parallel, bytes, g, backward);
  }
};

// The parts of a stage's time, per micro-batch (the gradient sync: per step), as the steps
// below add them.
struct StageTimes {
  double compute = 0;
  double recompute = 0;
  double expert_comm = 0;
  double expert_chain_min = 0;  // the same, each group alone on the node's card
  double nic_bytes_a2a = 0;     // through each node's card
  double tensor_comm = 0;
  double tensor_chain_min = 0;  // the same, each group alone on the node's card
  double context_comm = 0;      // the key-value exchange of context parallelism, exposed
  double beside_compute = 0;    // communication running beside compute
  double shard_comm_exposed = 0;
  double gather_stream_min = 0;
  double nic_bytes = 0;  // through each node's card
  double offload_exposed = 0;
  double full_sync = 0;  // per step
  double grad_sync = 0;  // per step: what the backward does not hide of full_sync
};

// The busiest expert's rank sets the pace of every block.
void add_compute(const Stage& s, StageTimes& t) {
  const StageCompute work = stage_compute(s.o, s.c.parallel, s.blocks);
  t.compute = work.forward + work.backward + s.o.head_s;
  t.recompute = work.recompute;
}

// Token dispatch: forward and backward each dispatch and combine once per layer; a
// recomputed MoE block does its forward pair again.
void add_expert_exchange(const Stage& s, StageTimes& t) {
  const RunConfig& c = s.c;
  const ParallelConfig& p = c.parallel;
  const OpCosts& o = s.o;
  const CostModel& cost = s.cost;
  const double layers = s.moe_layers();  // dense blocks exchange nothing
  if (p.expert_parallel_degree <= 1) return;
  // As measured inside the expert split's whole micro-batch (OpCosts::expert_exchange_forward_s):
  // three sync points forward, two backward, the forward's again where the block is recomputed,
  // as the step simulator charges them.
  if (o.expert_exchange_forward_s > 0) {
    const double forward = (recomputes_moe(p.activation_checkpointing) ? 2.0 : 1.0) * 3.0 * o.expert_exchange_forward_s;
    t.expert_comm = layers * (forward + 2.0 * o.expert_exchange_backward_s);
    t.expert_chain_min = t.expert_comm;
    return;
  }
  const double per_exchange =
      cost.seconds(token_exchange_cost(cost, c, o.dispatch_send_bytes, s.shapes.exchange), s.shapes.exchange);
  const double exchanges = 4.0 + (recomputes_moe(p.activation_checkpointing) ? 2.0 : 0.0);
  // Under tensor parallelism the backward dispatch (the input gradients going home) runs
  // beside the experts' weight gradients, after the tensor-parallel collective before it, and
  // the next block's backward combine beside attention's.
  const bool tensor = p.tensor_parallel_degree > 1;
  const double moe_beside =
      std::max(0.0, o.tensor_moe_overlap_s - (tensor ? s.region(o.tensor_moe_bytes, s.shapes.tensor, true) : 0.0));
  const double attention_beside =
      std::max(0.0, o.tensor_overlap_s - (tensor ? s.region(o.tensor_bytes, s.shapes.tensor, true) : 0.0));
  t.expert_comm = layers * (exchanges * per_exchange - std::min(per_exchange, moe_beside) -
                            std::min(per_exchange, attention_beside));
  // Merged 1F1B: each exchange beside another micro-batch's compute (the rule
  // exchange_overlap_schedule keeps recomputed exchanges out).
  const ExchangeCover cover = exchange_cover(o);
  if (c.moe.overlap_exchange) {
    t.expert_comm = layers * cover.exposed(per_exchange, moe_beside, attention_beside);
    t.beside_compute += layers * cover.covered(per_exchange);
  }
  // The shared experts' forward beside the forward exchanges (moe.overlap_shared_expert).
  const SharedExpertCover shared = shared_expert_cover(c, o);
  const bool recomputed = recomputes_moe(p.activation_checkpointing);
  const double shared_hidden = shared.hidden(per_exchange, recomputed);
  t.expert_comm -= layers * shared_hidden;
  t.beside_compute += layers * shared_hidden;
  GroupShape alone = s.shapes.exchange;
  alone.groups_per_node = 1;
  const double alone_s = cost.seconds(token_exchange_cost(cost, c, o.dispatch_send_bytes, alone), alone);
  t.expert_chain_min = c.moe.overlap_exchange
                           ? layers * cover.exposed(alone_s, o.tensor_moe_overlap_s, o.tensor_overlap_s)
                           : layers * (exchanges * alone_s - std::min(alone_s, o.tensor_moe_overlap_s) -
                                       std::min(alone_s, o.tensor_overlap_s) - shared.hidden(alone_s, recomputed));
  // Overlapped, an exchange's bytes are priced at the share of it that is exposed, as the
  // step simulator prices them.
  const double priced = c.moe.overlap_exchange ? (per_exchange > 0 ? cover.exposed(per_exchange) / per_exchange : 0.0)
                                               : exchanges;
  t.nic_bytes_a2a = layers * priced *
                    token_exchange_cost(cost, c, o.dispatch_send_bytes, s.shapes.exchange).nic_bytes_per_node *
                    static_cast<double>(s.shapes.exchange.groups_per_node);
}

// Tensor parallelism: two all-reduces per block in forward, two in backward, and those of
// what is recomputed, on the compute chain.
void add_tensor_collectives(const Stage& s, StageTimes& t) {
  const ParallelConfig& p = s.c.parallel;
  const OpCosts& o = s.o;
  if (p.tensor_parallel_degree <= 1) return;
  GroupShape alone = s.shapes.tensor;
  alone.groups_per_node = 1;
  // A block's two regions: attention's, and its feed-forward part's (`ffn` bytes, its first
  // GEMM's weight gradient `overlap`): the experts' or a dense block's.
  auto per_block = [&](const GroupShape& g, double ffn, double overlap) {
    const double attention = s.region(o.tensor_bytes, g);
    const double moe = s.region(ffn, g);
    // Backward's collectives run beside the weight gradients of the regions' first GEMMs.
    double all = attention + moe + std::max(0.0, s.region(o.tensor_bytes, g, true) - o.tensor_overlap_s) +
                 std::max(0.0, s.region(ffn, g, true) - overlap);
    if (p.activation_checkpointing == Checkpointing::kFull) all += attention + moe;
    if (p.activation_checkpointing == Checkpointing::kSelective) all += moe;
    return all;
  };
  auto beside = [&](double ffn, double overlap) {
    return std::min(s.region(o.tensor_bytes, s.shapes.tensor, true), o.tensor_overlap_s) +
           std::min(s.region(ffn, s.shapes.tensor, true), overlap);
  };
  // The bound counts forward's and recompute's alone: backward's may hide behind the weight
  // gradients entirely.
  auto chain_min = [&](double ffn, double overlap) {
    return per_block(alone, ffn, overlap) - std::max(0.0, s.region(o.tensor_bytes, alone, true) - o.tensor_overlap_s) -
           std::max(0.0, s.region(ffn, alone, true) - overlap);
  };
  const double moe = s.moe_layers(), dense = s.dense_layers();
  t.tensor_comm = moe * per_block(s.shapes.tensor, o.tensor_moe_bytes, o.tensor_moe_overlap_s);
  t.beside_compute += moe * beside(o.tensor_moe_bytes, o.tensor_moe_overlap_s);
  t.tensor_chain_min = moe * chain_min(o.tensor_moe_bytes, o.tensor_moe_overlap_s);
  if (dense > 0) {
    t.tensor_comm += dense * per_block(s.shapes.tensor, o.tensor_dense_bytes, o.tensor_dense_overlap_s);
    t.beside_compute += dense * beside(o.tensor_dense_bytes, o.tensor_dense_overlap_s);
    t.tensor_chain_min += dense * chain_min(o.tensor_dense_bytes, o.tensor_dense_overlap_s);
  }
}

// Context parallelism: each block's key-value exchange in forward and backward, and again
// where attention (or its core) is recomputed; on the compute chain.
void add_context_exchange(const Stage& s, StageTimes& t) {
  const ParallelConfig& p = s.c.parallel;
  if (p.context_parallel_degree <= 1) return;
  const ContextExchangeCost x = context_exchange_cost(s.cost, s.o, p, s.shapes.context);
  const bool again = p.activation_checkpointing == Checkpointing::kFull ||
                     p.activation_checkpointing == Checkpointing::kAttentionCore;
  t.context_comm = s.layers() * ((again ? 2.0 : 1.0) * x.forward_s + x.backward_s);
}

// Sharded model states: each block's unit is gathered for forward and again for backward,
// and its gradient reduce-scattered, behind the compute of the neighbouring block.
void add_sharded_states(const Stage& s, StageTimes& t) {
  const OpCosts& o = s.o;
  const CostModel& cost = s.cost;
  const double layers = s.layers();
  const ParallelConfig& p = s.c.parallel;
  if (!p.shards_states()) return;
  // As measured in the sharded whole micro-batch (OpCosts::shard_measured): each block's
  // gathers carry what it took beyond one rank's, on the chain, as the step simulator runs them.
  if (o.shard_measured) {
    t.shard_comm_exposed = layers * (o.shard_forward_s + o.shard_backward_s);
    t.gather_stream_min = t.shard_comm_exposed;
    return;
  }
  const double per_block_compute = (t.compute + t.recompute - o.head_s) / layers;
  // A block's units: (bytes, the group they are sharded over).
  using Units = std::initializer_list<std::pair<double, const GroupShape*>>;
  // Blocks of `units` each: an MoE block, or a dense block among MoE blocks.
  auto add_blocks = [&](double blocks, const Units& units) {
    if (blocks <= 0) return;
    double gather = 0, per_block_comm = 0, gather_alone = 0, nic = 0;
    for (const auto& [bytes, group] : units) {
      if (group->size <= 1) continue;
      GroupShape alone = *group;
      alone.groups_per_node = 1;
      const double g = cost.all_gather_seconds(bytes, *group);
      gather += g;
      per_block_comm += 2.0 * g + cost.reduce_scatter_seconds(bytes, *group);
      gather_alone += cost.all_gather_seconds(bytes, alone);
      nic += cost.all_gather_cost(bytes, *group).nic_bytes_per_node * static_cast<double>(group->groups_per_node);
    }
    // The first gather has nothing to hide behind; the rest overlap block by block.
    if (t.shard_comm_exposed == 0) t.shard_comm_exposed = gather;
    t.shard_comm_exposed += blocks * std::max(0.0, per_block_comm - per_block_compute);
    t.beside_compute += blocks * std::min(per_block_comm, per_block_compute);
    // The gather stream runs 2 gathers per block and micro-batch, the gradient stream one
    // reduce-scatter.
    t.gather_stream_min += 2.0 * blocks * gather_alone;
    t.nic_bytes += 3.0 * blocks * nic;
  };
  const GroupShape& dense = s.shapes.dense_shard(p);
  // Where the dense shard spans other ranks than the experts', a block's dense part and its
  // experts are gathered in their own groups.
  if (p.dense_shard_spanning())
    add_blocks(s.moe_layers(), {{o.dense_unit_bytes, &dense}, {o.expert_unit_bytes, &s.shapes.expert_shard(p)}});
  else
    add_blocks(s.moe_layers(), {{o.unit_bytes, &dense}});
  add_blocks(s.dense_layers(), {{o.dense_block_bytes, &dense}});
}

// Activation offload: every stored block activation goes to the host and comes back.
void add_activation_offload(const Stage& s, StageTimes& t) {
  if (!s.c.parallel.activation_offloading) return;
  const double copies = 2.0 * s.layers() * s.cost.pcie_seconds(s.o.offload_bytes);
  t.offload_exposed = std::max(0.0, copies - (t.compute + t.recompute));
}

// Gradient sync across replicas once per step: dense shards over E x C x R (hierarchically: E,
// then C on 1/E of the bytes, then R on 1/(E C)), expert shards over R (and C where the expert
// group does not span it).
void add_gradient_sync(const Stage& s, StageTimes& t) {
  const ParallelConfig& p = s.c.parallel;
  const OpCosts& o = s.o;
  const CostModel& cost = s.cost;
  const double e = static_cast<double>(p.expert_data_degree());
  const double cp = static_cast<double>(std::max<int64_t>(1, p.context_parallel_degree));
  auto sync = [&](double bytes, const GroupShape& g) {
    return p.distributed_optimizer ? cost.reduce_scatter_seconds(bytes, g) + cost.all_gather_seconds(bytes, g)
                                   : cost.all_reduce_seconds(bytes, g);
  };
  const bool experts_over_context = !p.expert_spans_context();
  if (p.dense_shard_spanning()) {
    // The expert and context ranks hold shards of the dense parameters (and of the experts
    // where the expert group does not span C): every shard syncs over R alone.
    t.full_sync = sync(o.dense_shard_bytes + o.expert_shard_bytes, s.shapes.replica);
  } else {
    t.full_sync = sync(o.dense_shard_bytes, s.shapes.expert) +
                  sync(o.dense_shard_bytes / e + (experts_over_context ? o.expert_shard_bytes : 0.0), s.shapes.context) +
                  sync(o.dense_shard_bytes / e / cp + o.expert_shard_bytes / (experts_over_context ? cp : 1.0),
                       s.shapes.replica);
  }
  t.grad_sync = t.full_sync;
  // On GPUs the sync runs behind the last micro-batch's backward, block by block, where the
  // framework starts it there.
  if (s.c.cluster.gradient_sync_overlaps_backward())
    t.grad_sync = std::max(t.full_sync / s.layers(), t.full_sync - (t.compute + t.recompute) * 2.0 / 3.0);
}

// The step: every micro-batch's parts, the sync and the optimizer, and the busiest resource's
// work as the bound below it.
StepEstimate step_of_stage(const Stage& s, const StageTimes& t) {
  const ClusterSpec& cluster = s.c.cluster;
  const OpCosts& o = s.o;
  const double accum = static_cast<double>(s.c.parallel.gradient_accumulation_steps);
  StepEstimate out;
  out.compute_s = accum * t.compute;
  out.recompute_s = accum * t.recompute;
  out.expert_comm_s = accum * (t.expert_comm + t.tensor_comm + t.context_comm);
  out.shard_comm_exposed_s = accum * t.shard_comm_exposed;
  out.offload_exposed_s = accum * t.offload_exposed;
  out.grad_sync_s = t.grad_sync;
  out.optimizer_s = o.optimizer_s;
  if (cluster.comm_overlaps_compute)
    out.contention_s = cluster.overlap_slowdown * (accum * t.beside_compute + t.full_sync - t.grad_sync);
  // The busiest resource's work: the compute chain, the gather stream, or a node's card
  // (shared fairly, so it never idles while it has bytes to move).
  const double card_s = accum * (t.nic_bytes + t.nic_bytes_a2a) / cluster.inter_node_bandwidth_bytes_per_s;
  out.lower_bound_s =
      std::max({accum * (t.compute + t.recompute + t.expert_chain_min + t.tensor_chain_min) + o.optimizer_s,
                accum * t.gather_stream_min, card_s});
  out.exposed_comm_s = out.expert_comm_s + out.shard_comm_exposed_s + out.offload_exposed_s + out.grad_sync_s;
  out.step_time_s = out.compute_s + out.recompute_s + out.exposed_comm_s + out.optimizer_s + out.contention_s;
  split_compute(o, out);
  return out;
}

StepEstimate estimate_stage(const RunConfig& c, const LayoutShapes& shapes, const OpCosts& o) {
  const Stage stage{c, shapes, o, CostModel(c.cluster), {c.model.blocks(), c.model.moe_blocks()}};
  StageTimes t;
  add_compute(stage, t);
  add_expert_exchange(stage, t);
  add_tensor_collectives(stage, t);
  add_context_exchange(stage, t);
  add_sharded_states(stage, t);
  add_activation_offload(stage, t);
  add_gradient_sync(stage, t);
  return step_of_stage(stage, t);
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
  // The other stages: the last's time without the head in the ratio of their blocks' compute.
  const double last_weight = stage_weight(o, p, {blocks.blocks(), blocks.moe_blocks()});
  const double per_weight = std::max(0.0, per_micro_batch - o.head_s) / (last_weight > 0 ? last_weight : 1.0);
  // The fill and drain: each other stage's micro-batch once (the last stage's blocks may be more,
  // with multi-token prediction's).
  // Every stage runs all the micro-batches, so the busiest stage's bound (the last stage's, in
  // the ratio of its blocks) bounds the step from below too (with uneven ends the middle stages
  // may hold twice the last's blocks).
  const double bound_per_micro_batch = std::max(0.0, out.lower_bound_s - o.optimizer_s) / accum;
  const double busy_per_weight = std::max(0.0, bound_per_micro_batch - o.head_s) / (last_weight > 0 ? last_weight : 1.0);
  double slowest = per_micro_batch, others = 0, busiest = bound_per_micro_batch;
  for (int64_t i = 0; i + 1 < p.pipeline_parallel_degree; ++i) {
    const double weight = stage_weight(o, p, stage_block_counts(c.model, p, i));
    const double stage_s = per_weight * weight;
    slowest = std::max(slowest, stage_s);
    busiest = std::max(busiest, busy_per_weight * weight);
    others += stage_s;
  }
  out.pipeline_bubble_s = others / chunks + (stages - 1) * 2.0 * send + accum * (slowest - per_micro_batch);
  out.exposed_comm_s += out.pipeline_bubble_s;
  out.step_time_s += out.pipeline_bubble_s;
  out.lower_bound_s += std::min((stages - 1) * std::max(0.0, busy_per_micro_batch - o.head_s), others) / chunks;
  out.lower_bound_s = std::max(out.lower_bound_s, accum * busiest + o.optimizer_s);
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
