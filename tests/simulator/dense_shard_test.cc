// The dense parameters sharded over the expert and context ranks too
// (ParallelConfig::dense_shard_spans_experts, FSDP2's shard dimension spanning EP and CP): the
// memory model keeps 1 / (S x E x C) of them, the estimate and the simulator gather them over
// that group and sync their gradients over the replicas alone.

#include <gtest/gtest.h>

#include "moeplan/core/model_spec.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/analytic.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

using test::Scenario;

// Mixtral 8x7B on two p5 nodes: experts over E8, S1, two replicas; `span`: the dense
// parameters sharded over the 8 expert ranks.
Scenario mixtral(bool span) {
  Scenario c = test::make_scenario("mixtral-8x7b", "p5.48xlarge", 16, 8, 1, "RSE", Checkpointing::kFull, 1, 4, 4096);
  c.parallel.dense_shard_spans_experts = span;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  return c;
}

TEST(DenseShard, SpansTheExpertAndContextRanks) {
  Scenario c = mixtral(true);
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  EXPECT_TRUE(c.parallel.dense_shard_spanning());
  EXPECT_EQ(c.parallel.dense_shard_degree(), 8);
  EXPECT_EQ(c.parallel.expert_shard_degree(), 1);
  EXPECT_TRUE(c.parallel.shards_states());
  // With context ranks: S2 x E2 x C2; the expert group spans C, so the experts stay over S.
  c.parallel.expert_parallel_degree = 4;
  c.parallel.hybrid_shard_degree = 2;
  c.parallel.context_parallel_degree = 2;
  EXPECT_EQ(c.parallel.dense_shard_degree(), 8);
  EXPECT_EQ(c.parallel.expert_shard_degree(), 2);
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(shapes.shard_span.size, 8);
  // C directly outside T (stride 1), E at stride 2, S at stride 4: rank 0's group is the first
  // node's 8 ranks, which differ along all three.
  EXPECT_EQ(shapes.shard_span.per_node, 8);
  EXPECT_EQ(shapes.shard_span.nodes, 1);
  EXPECT_EQ(shapes.dense_shard(c.parallel).size, 8);
  EXPECT_EQ(shapes.expert_shard(c.parallel).size, 2);
  // Without experts to span (E1), C alone: the experts are sharded with the dense parameters.
  c.parallel.expert_parallel_degree = 1;
  EXPECT_EQ(c.parallel.dense_shard_degree(), 4);
  EXPECT_EQ(c.parallel.expert_shard_degree(), 4);
  // Nothing to span: the flag changes nothing.
  c.parallel.context_parallel_degree = 1;
  EXPECT_FALSE(c.parallel.dense_shard_spanning());
  EXPECT_EQ(c.parallel.dense_shard_degree(), 2);
}

// The group of rank 0 over S x E x C, wherever the placement puts them: E8 innermost is one
// node's 8 ranks; with R innermost ("ERS" puts S and R inside E) its members are 2 apart and
// span both nodes.
TEST(DenseShard, TheGroupFollowsThePlacement) {
  Scenario c = mixtral(true);
  LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(shapes.shard_span.size, 8);
  EXPECT_EQ(shapes.shard_span.per_node, 8);
  EXPECT_EQ(shapes.shard_span.nodes, 1);
  c.parallel.placement = *Placement::parse("ESR");
  shapes = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(shapes.shard_span.size, 8);
  EXPECT_EQ(shapes.shard_span.per_node, 4);
  EXPECT_EQ(shapes.shard_span.nodes, 2);
  EXPECT_EQ(shapes.shard_span.groups_per_node, 2);
}

// Memory: the dense parameters' share of every model state is 1 / 8; the experts' is whole.
TEST(DenseShard, EachRankKeepsItsShareOfTheDenseParameters) {
  const Scenario replicated = mixtral(false), sharded = mixtral(true);
  const planner::MemoryEstimate whole = planner::estimate_memory(replicated.config());
  const planner::MemoryEstimate split = planner::estimate_memory(sharded.config());
  const ParamCounts params = count_parameters(replicated.model);
  // bf16 parameters, gradients and two moments: 8 bytes a parameter.
  const double dense = static_cast<double>(params.dense());
  const double saved = static_cast<double>(whole.model_states() - split.model_states());
  EXPECT_NEAR(saved, 8.0 * dense * 7.0 / 8.0, 1e-3 * saved);
  // Gathered a unit at a time, as FSDP does: a block's dense part, its experts staying whole
  // (S = 1), or the embedding or head where larger.
  EXPECT_EQ(whole.gathered_parameters, 0);
  const planner::ShardSizes units =
      planner::stage_shard_sizes(sharded.model, planner::busiest_stage(sharded.model, sharded.parallel), 8, 8, 1, 1,
                                 true, 0);
  EXPECT_GT(split.gathered_parameters, 0);
  EXPECT_LT(split.gathered_parameters, 2 * units.largest_unit_params * 2);
  EXPECT_EQ(split.gradient_buffers * 2, split.gathered_parameters);
  // The distributed optimizer, pinned on top, divides the states over the 2 replicas alone.
  Scenario both = mixtral(true);
  both.parallel.distributed_optimizer = true;
  const planner::MemoryEstimate halved = planner::estimate_memory(both.config());
  EXPECT_NEAR(static_cast<double>(halved.optimizer_states), static_cast<double>(split.optimizer_states) / 2.0,
              1e-6 * static_cast<double>(split.optimizer_states) + 8);
}

int count_ops(const StepSimulation& sim, OpKind kind) {
  int n = 0;
  for (const Op& op : sim.graph.ops()) n += op.rank == 0 && op.kind == kind;
  return n;
}

// The simulator gathers each block's dense part over the 8 expert ranks (the experts are whole
// on their rank: nothing to gather), reduce-scatters its gradients there, and syncs the
// gradient shards over the two replicas only: one all-reduce a unit instead of two (over E,
// then R).
TEST(DenseShard, TheSimulatorGathersOverTheSpanAndSyncsOverTheReplicas) {
  const Scenario replicated = mixtral(false), sharded = mixtral(true);
  const StepSimulation before = simulate_step(replicated.config(), {.all_ranks = true});
  const StepSimulation after = simulate_step(sharded.config(), {.all_ranks = true});
  EXPECT_EQ(count_ops(before, OpKind::kGatherForward), 0);
  EXPECT_EQ(count_ops(before, OpKind::kReduceScatter), 0);
  const int layers = static_cast<int>(replicated.model.num_layers);
  // Per simulated micro-batch: the embedding, each block's dense part, the head twice.
  EXPECT_GT(count_ops(after, OpKind::kGatherForward), layers);
  EXPECT_GT(count_ops(after, OpKind::kReduceScatter), layers);
  // Each dense gather spans the 8 ranks of rank 0's node; each dense gradient shard synced
  // over the replicas is an eighth of its unit (bf16 gradients): the head's comes first.
  const OpCosts o = op_costs(sharded.config());
  bool gathered = false, synced = false;
  for (const Op& op : after.graph.ops()) {
    if (op.rank != 0) continue;
    if (op.kind == OpKind::kGatherForward && !gathered) {
      gathered = true;
      EXPECT_EQ(after.graph.collectives()[static_cast<size_t>(op.collective)].parts, 8);
      EXPECT_DOUBLE_EQ(op.bytes, o.embed_unit_bytes);
    }
    if (op.kind == OpKind::kGradAllReduce && !synced) {
      synced = true;
      EXPECT_EQ(after.graph.collectives()[static_cast<size_t>(op.collective)].parts, 2);
      EXPECT_DOUBLE_EQ(op.bytes, o.head_unit_bytes / 8);
    }
  }
  EXPECT_TRUE(gathered && synced);
  const int syncs_before = count_ops(before, OpKind::kGradAllReduce);
  const int syncs_after = count_ops(after, OpKind::kGradAllReduce);
  // Dense units (the embedding, each block's dense part, the head) synced over E and R before,
  // over R after; the experts over R both times.
  const int dense_units = layers + 2, expert_units = layers;
  EXPECT_EQ(syncs_before, 2 * dense_units + expert_units);
  EXPECT_EQ(syncs_after, dense_units + expert_units);
  // The estimate sees the same gathers: the gather stream has work, and the step is within
  // reach of the simulator's.
  const StepEstimate estimate = estimate_step(sharded.config(), layout_shapes(sharded.cluster, sharded.parallel));
  EXPECT_GT(estimate.lower_bound_s, 0);
  // The estimate gathers over the span too: the step's first gather has nothing to hide behind.
  EXPECT_EQ(estimate_step(replicated.config(), layout_shapes(replicated.cluster, replicated.parallel)).shard_comm_exposed_s,
            0);
  EXPECT_GT(estimate.shard_comm_exposed_s, 0);
  // Its gradient shards sync over the replicas alone: an eighth of the dense bytes, one ring
  // over R, where the replicated layout syncs them over E first.
  EXPECT_LT(estimate.grad_sync_s,
            estimate_step(replicated.config(), layout_shapes(replicated.cluster, replicated.parallel)).grad_sync_s);
  EXPECT_NEAR(estimate.step_time_s, after.estimate.step_time_s, 0.15 * after.estimate.step_time_s);
}

// Spread over two nodes (ESR: each group has 4 ranks on each node), every gather crosses the
// network card; inside a node none does.
TEST(DenseShard, AGroupAcrossNodesGathersOverTheCard) {
  auto gather_card_bytes = [](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config(), {.all_ranks = true});
    double bytes = 0;
    int gathers = 0;
    for (const Op& op : sim.graph.ops()) {
      if (op.rank != 0 || op.kind != OpKind::kGatherForward) continue;
      ++gathers;
      bytes += sim.graph.collectives()[static_cast<size_t>(op.collective)].nic_bytes_per_node;
    }
    EXPECT_GT(gathers, 0);
    return bytes;
  };
  Scenario inside = mixtral(true), across = mixtral(true);
  across.parallel.placement = *Placement::parse("ESR");
  ASSERT_TRUE(validate(across.config()).empty()) << across.describe();
  EXPECT_EQ(gather_card_bytes(inside), 0);
  EXPECT_GT(gather_card_bytes(across), 0);
}

}  // namespace
}  // namespace moeplan::sim
