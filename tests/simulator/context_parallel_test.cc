// Context parallelism (C > 1) in the op costs, the memory model, the estimate and the step
// simulator: each rank takes 1 / C of every sequence, its key-value exchange costs what it takes
// beyond the attention beside it, and the expert group spans the context ranks.

#include <gtest/gtest.h>

#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/analytic.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

using test::Scenario;

// Llama 3 8B (dense: 32 blocks, 32 heads, 8 key-value heads of 128) on one p5 node, 8192-token
// sequences, C context ranks and 8 / C replicas, 16 sequences a step.
Scenario llama(int64_t cp) {
  Scenario c{test::model("llama-3-8b"), test::hardware("p5.48xlarge", 8), {}, {}, {}};
  c.parallel.world_size = 8;
  c.parallel.context_parallel_degree = cp;
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = 2 * cp;
  c.training.seq_len = 8192;
  c.training.global_batch_tokens = 16 * 8192;
  return c;
}

TEST(ContextParallel, EachRankTakesItsShareOfEverySequence) {
  const Scenario whole = llama(1), split = llama(2);
  ASSERT_TRUE(validate(split.config()).empty()) << split.describe();
  EXPECT_EQ(split.parallel.replica_degree(), 4);
  EXPECT_EQ(split.parallel.data_parallel_degree(), 4);
  const OpCosts one = op_costs(whole.config()), two = op_costs(split.config());
  // Projections, the MLP and the causal attention core: half of each per rank (the chunk pairs
  // are balanced, so each rank's queries see half the sequence on average, as a whole one does).
  EXPECT_NEAR(two.attention_flops, one.attention_flops / 2, 1e-9 * one.attention_flops);
  EXPECT_NEAR(two.core_flops, one.core_flops / 2, 1e-9 * one.core_flops);
  EXPECT_NEAR(two.moe_flops, one.moe_flops / 2, 1e-9 * one.moe_flops);
  // Each step of the ring passes the rank's keys and values: 4096 tokens x (8 x 128 + 8 x 128)
  // x 2 bytes.
  EXPECT_EQ(one.context_kv_bytes, 0);
  EXPECT_DOUBLE_EQ(two.context_kv_bytes, 4096.0 * 2048 * 2);
  // A block's activations: half per rank.
  const planner::MemoryEstimate m1 = planner::estimate_memory(whole.config()), m2 = planner::estimate_memory(split.config());
  EXPECT_NEAR(static_cast<double>(m2.activations), static_cast<double>(m1.activations) / 2,
              0.01 * static_cast<double>(m1.activations));
}

// The ring: C - 1 steps, each passing the keys and values on beside one chunk pair's attention
// (1 / C of the core); what a step's transfer takes beyond that is exposed. Free links expose
// nothing; a slow link exposes the difference.
TEST(ContextParallel, TheRingExposesWhatAStepTakesBeyondItsChunk) {
  Scenario c = llama(4);
  c.parallel.gradient_accumulation_steps = 8;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  const OpCosts o = op_costs(c.config());
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(shapes.context.size, 4);
  const CostModel cost(c.cluster);
  const ContextExchangeCost fast = context_exchange_cost(cost, o, c.parallel, shapes.context);
  // NVLink moves a step's 8 MiB in about 25 us, well inside a chunk pair's attention.
  EXPECT_LT(cost.send_seconds(o.context_kv_bytes, shapes.context), o.core_forward_s / 4);
  EXPECT_EQ(fast.forward_s, 0);
  EXPECT_EQ(fast.backward_s, 0);

  Scenario slow = c;
  slow.cluster.intra_node_bandwidth_bytes_per_s = 2e9;
  const CostModel slow_cost(slow.cluster);
  const ContextExchangeCost x = context_exchange_cost(slow_cost, o, slow.parallel, shapes.context);
  const double send = slow_cost.send_seconds(o.context_kv_bytes, shapes.context);
  ASSERT_GT(send, o.core_forward_s / 4);
  EXPECT_NEAR(x.forward_s, 3 * (send - o.core_forward_s / 4), 1e-12);
  EXPECT_NEAR(x.backward_s, 3 * (slow_cost.send_seconds(2 * o.context_kv_bytes, shapes.context) - o.core_backward_s / 4),
              1e-12);

  // The step simulator puts it on the compute chain after each block's attention, forward and
  // backward: with the slow link the step grows by it, block by block, micro-batch by micro-batch.
  // (The compute does not depend on the link: only the exchange is slower.)
  const StepSimulation fast_step = simulate_step(c.config(), {.all_micro_batches = true});
  const StepSimulation slow_step = simulate_step(slow.config(), {.all_micro_batches = true});
  int forward_ops = 0, backward_ops = 0;
  for (const Op& op : slow_step.graph.ops()) {
    if (op.rank != 0) continue;
    forward_ops += op.kind == OpKind::kContextForward;
    backward_ops += op.kind == OpKind::kContextBackward;
  }
  EXPECT_EQ(forward_ops, 32 * 8);
  EXPECT_EQ(backward_ops, 32 * 8);
  EXPECT_GT(slow_step.estimate.step_time_s - fast_step.estimate.step_time_s, 8 * 32 * (x.forward_s + x.backward_s) * 0.9);
  // The estimate counts the same exposed time.
  const StepEstimate est_fast = estimate_step(c.config(), shapes), est_slow = estimate_step(slow.config(), shapes);
  EXPECT_NEAR(est_slow.expert_comm_s - est_fast.expert_comm_s, 8 * 32 * (x.forward_s + x.backward_s),
              1e-6 * est_slow.step_time_s);
  EXPECT_GE(slow_step.estimate.step_time_s, est_slow.lower_bound_s);
}

// all_gather: the keys and values gathered whole before the attention, in backward gathered
// again and their gradients reduce-scattered; nothing hides them.
TEST(ContextParallel, AllGatherPaysTheWholeGather) {
  Scenario c = llama(4);
  c.parallel.gradient_accumulation_steps = 8;
  c.parallel.context_exchange = ContextExchange::kAllGather;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  const OpCosts o = op_costs(c.config());
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const CostModel cost(c.cluster);
  const ContextExchangeCost x = context_exchange_cost(cost, o, c.parallel, shapes.context);
  EXPECT_DOUBLE_EQ(x.forward_s, cost.all_gather_seconds(4 * o.context_kv_bytes, shapes.context));
  EXPECT_DOUBLE_EQ(x.backward_s, x.forward_s + cost.reduce_scatter_seconds(4 * o.context_kv_bytes, shapes.context));
  Scenario ring = c;
  ring.parallel.context_exchange = ContextExchange::kRing;
  EXPECT_GT(simulate_step(c.config()).estimate.step_time_s, simulate_step(ring.config()).estimate.step_time_s);
}

// The context ranks hold the same dense parameters: their gradients are reduced over C as well
// as over the replicas, one more all-reduce per unit on each rank.
TEST(ContextParallel, DenseGradientsAreReducedOverTheContextRanks) {
  auto grad_syncs = [](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config(), {.all_ranks = true});
    int n = 0;
    for (const Op& op : sim.graph.ops()) n += op.rank == 0 && op.kind == OpKind::kGradAllReduce;
    return n;
  };
  const int whole = grad_syncs(llama(1)), split = grad_syncs(llama(2));
  EXPECT_GT(whole, 0);
  EXPECT_EQ(split, 2 * whole);
}

// With experts, the expert group spans the context ranks (directly outside T): Mixtral 8x7B with
// E4 over C2 x the mesh's E2, T2 on 16 p5 ranks. An expert group is 4 ranks 2 apart (one tensor
// rank of each context rank of each mesh-E coordinate), inside one node.
TEST(ContextParallel, TheExpertGroupSpansTheContextRanks) {
  Scenario c{test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), {}, {}, {}};
  c.parallel.world_size = 16;
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  c.parallel.context_parallel_degree = 2;
  c.parallel.expert_parallel_degree = 4;
  c.parallel.hybrid_shard_degree = 1;
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = 2;
  c.training.seq_len = 8192;
  c.training.global_batch_tokens = 4 * 2 * 8192;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  EXPECT_EQ(c.parallel.expert_fold(), 2);
  EXPECT_EQ(c.parallel.expert_data_degree(), 2);
  EXPECT_EQ(c.parallel.replica_degree(), 2);
  EXPECT_EQ(c.parallel.stride(MeshDim::kContext), 2);
  EXPECT_EQ(c.parallel.stride(MeshDim::kExpert), 4);
  EXPECT_EQ(c.parallel.expert_stride(), 2);
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(shapes.exchange.size, 4);
  EXPECT_EQ(shapes.exchange.per_node, 4);
  EXPECT_EQ(shapes.context.size, 2);
  // Each rank sends its own tokens: 8192 / 2 / T2 (sequence parallel) x top-2 x hidden x 2 bytes.
  const OpCosts o = op_costs(c.config());
  EXPECT_DOUBLE_EQ(o.dispatch_send_bytes, 8192.0 / 2 / 2 * 2 * 4096 * 2);
  // The experts are still split over the two tensor ranks (ETP = T): their region ends in a
  // collective, and the experts' weight gradient runs beside its backward.
  EXPECT_GT(o.tensor_moe_bytes, 0);
  EXPECT_GT(o.tensor_moe_overlap_s, 0);
  // A skewed router: the rank holding the busiest experts (0 and 1) is rank 0 of the group,
  // and the rank at context coordinate 1 (rank 2) holds experts 2 and 3, at the mean.
  Scenario skewed = c;
  skewed.moe.tokens_per_expert = {4, 4, 1, 1, 1, 1, 1, 3};
  const StepSimulation sim = simulate_step(skewed.config(), {.all_ranks = true});
  double busiest = 0, second = 0;
  for (const Op& op : sim.graph.ops()) {
    if (op.kind != OpKind::kExpertForward || op.layer != 0 || op.micro_batch != 0) continue;
    if (op.rank == 0) busiest = to_seconds(op.duration);
    if (op.rank == 2) second = to_seconds(op.duration);
  }
  EXPECT_GT(busiest, 1.5 * second);
}

}  // namespace
}  // namespace moeplan::sim
