// Tensor-parallel collectives and pipeline stages in the step simulator, against figures worked
// out by hand from the profile's link numbers and the op costs.

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

using test::Scenario;

// Llama 3 8B (dense, 32 blocks, hidden 4096) on one p4d node: W ranks, T tensor-parallel, P
// stages, no data parallelism beyond what is left.
Scenario dense(int64_t world, int64_t t, int64_t p, int64_t accumulation, Checkpointing ckpt = Checkpointing::kNone) {
  Scenario c{test::model("llama-3-8b"), test::hardware("p4d.24xlarge", world), {}, {}, {}};
  c.parallel.world_size = world;
  c.parallel.tensor_parallel_degree = t;
  c.parallel.pipeline_parallel_degree = p;
  c.parallel.activation_checkpointing = ckpt;
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = accumulation;
  c.training.seq_len = 2048;
  c.training.global_batch_tokens = world / (t * p) * accumulation * 2048;
  return c;
}

using test::with_free_communication;

// T = 2 on two ranks of a node. Each block ends attention and its MLP with an all-reduce of
// the micro-batch's activations, 2048 tokens x 4096 x 2 bytes = 16,777,216 bytes, in forward
// and again (of their gradients) in backward: 4 per block, 128 per micro-batch. A ring
// all-reduce of n = 2 takes NCCL's base latency and 2 (n - 1) = 2 step latencies, and moves
// 2 (n - 1) / n = 1 x the bytes over the NVSwitch link.
TEST(TensorParallel, AllReducesPerBlockWorkedByHand) {
  const Scenario c = dense(2, 2, 1, 2);
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  ASSERT_FALSE(c.cluster.all_reduce_fit.given());
  const double bytes = 2048.0 * 4096 * 2;
  const int64_t op_ns =
      to_sim_time(c.cluster.collective_base_latency_s + 2 * c.cluster.intra_node_latency_s).count() +
      to_sim_time(bytes / c.cluster.intra_node_bandwidth_bytes_per_s).count();
  const StepSimulation sim = simulate_step(c.config(), {.all_ranks = true, .all_micro_batches = true});
  std::map<OpKind, int> count;
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.rank != 0 || op_category(op.kind) != "all_reduce") continue;
    ++count[op.kind];
    EXPECT_EQ(op.bytes, bytes);
    const auto col = static_cast<size_t>(op.collective);
    EXPECT_EQ((sim.times.end[i] - sim.times.collective_start[col]).count(), op_ns) << op_kind_name(op.kind);
  }
  EXPECT_EQ(count[OpKind::kTensorForward], 2 * 2 * 32);
  EXPECT_EQ(count[OpKind::kTensorBackward], 2 * 2 * 32);
  EXPECT_EQ(count[OpKind::kTensorRecompute], 0);
  EXPECT_EQ(count[OpKind::kGradAllReduce], 0);  // R = 1: nothing to sync

  // Forward's sit on the compute chain; backward's run beside the weight gradient of the
  // region's first GEMM (Megatron's asynchronous tensor-parallel communication), which hides
  // some of them, and slow that compute by the profile's overlap_slowdown: the step is longer
  // by at least the forward ones' time and at most all of it, slowed.
  const double with = simulate_step(c.config()).estimate.step_time_s;
  const double without = simulate_step(with_free_communication(c).config()).estimate.step_time_s;
  const double forward = 128 * op_ns * 1e-9;
  EXPECT_GE(with - without, forward - 1e-9);
  EXPECT_LT(with - without, 2 * forward * (1 + c.cluster.overlap_slowdown));
}

// Recomputed blocks run their all-reduces again: both under full checkpointing, the MLP's
// under selective.
TEST(TensorParallel, RecomputeRepeatsTheForwardAllReduces) {
  for (auto [ckpt, per_block] : {std::pair{Checkpointing::kFull, 2}, std::pair{Checkpointing::kSelective, 1}}) {
    const Scenario c = dense(2, 2, 1, 1, ckpt);
    const StepSimulation sim = simulate_step(c.config(), {.all_ranks = true, .all_micro_batches = true});
    int recomputed = 0;
    for (const Op& op : sim.graph.ops()) recomputed += op.rank == 0 && op.kind == OpKind::kTensorRecompute;
    EXPECT_EQ(recomputed, per_block * 32) << c.describe();
  }
}

// Each rank runs 1/T of every matrix multiply: heads, MLP columns and the vocabulary.
TEST(TensorParallel, ComputeSplitsOverTheRanks) {
  const OpCosts one = op_costs(dense(1, 1, 1, 1).config());
  const OpCosts four = op_costs(dense(4, 4, 1, 1).config());
  EXPECT_DOUBLE_EQ(four.attention_flops, one.attention_flops / 4);
  EXPECT_DOUBLE_EQ(four.moe_flops, one.moe_flops / 4);
  EXPECT_DOUBLE_EQ(four.head_flops, one.head_flops / 4);  // 128,256 = 4 x 32,064
  EXPECT_DOUBLE_EQ(four.forward_flops_per_token, one.forward_flops_per_token);
  EXPECT_DOUBLE_EQ(four.tensor_bytes, 2048.0 * 4096 * 2);
}

// P = 4 stages of 8 blocks on four ranks, 8 micro-batches, free communication, no data
// parallelism. Under 1F1B the last stage (its blocks and the head, X_last per micro-batch) is
// the slowest and never waits after its first micro-batch: the step is the first micro-batch's
// forward through the three stages before it, the last stage's 8 micro-batches, the last
// micro-batch's backward through the three before it, and the update:
//   m X_last + (P - 1) X_mid + optimizer, with X_mid = X_last - head.
// Parallel folding, Mixtral 8x7B on two p5 nodes with T = 2: E = 8 with the experts split over
// T (E8 over eight data-parallel ranks) against E = 8 folded (ETP 1: four data-parallel ranks
// and the two tensor ranks). Folding moves the experts' work between ranks, not its amount:
// the same expert FLOPs per rank, no tensor-parallel region around the routed experts (Mixtral
// has no shared ones), and the exchange over the folded group of 8 consecutive ranks (one
// node) where the mesh's E dimension is 4 ranks 2 apart.
TEST(TensorParallel, FoldedExpertsExchangeOverTheTensorRanksAndEndNoRegion) {
  Scenario c{test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), {}, {}, {}};
  c.parallel.world_size = 16;
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  c.parallel.expert_parallel_degree = 8;
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = 4;
  c.training.seq_len = 4096;
  c.training.global_batch_tokens = 8 * 4 * 4096;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  Scenario folded = c;
  folded.parallel.expert_tensor_parallel_degree = 1;
  folded.parallel.hybrid_shard_degree = 1;
  ASSERT_TRUE(validate(folded.config()).empty()) << folded.describe();
  EXPECT_EQ(folded.parallel.expert_data_degree(), 4);
  EXPECT_EQ(folded.parallel.replica_degree(), 2);

  const OpCosts split = op_costs(c.config()), fold = op_costs(folded.config());
  EXPECT_NEAR(fold.moe_flops, split.moe_flops, 1e-9 * split.moe_flops);
  EXPECT_GT(split.tensor_moe_bytes, 0);
  EXPECT_EQ(fold.tensor_moe_bytes, 0);
  // No collective there for the experts' weight gradient to run beside.
  EXPECT_GT(split.tensor_moe_overlap_s, 0);
  EXPECT_EQ(fold.tensor_moe_overlap_s, 0);
  EXPECT_EQ(fold.dispatch_send_bytes, split.dispatch_send_bytes);
  // The experts' parameters a rank holds: one expert whole against one expert's half (the split
  // spreads the 8 experts over all 16 ranks, the fold over 8 of them, replicated twice).
  EXPECT_EQ(fold.expert_shard_bytes, 2 * split.expert_shard_bytes);

  const LayoutShapes shapes = layout_shapes(folded.cluster, folded.parallel);
  EXPECT_EQ(shapes.exchange.size, 8);
  EXPECT_EQ(shapes.exchange.nodes, 1);
  EXPECT_EQ(shapes.expert.size, 4);
  const LayoutShapes unfolded = layout_shapes(c.cluster, c.parallel);
  EXPECT_EQ(unfolded.exchange.size, 8);
  EXPECT_EQ(unfolded.exchange.nodes, 2);  // E8 over the data-parallel ranks, 2 apart: both nodes

  // In the simulated step the folded layout runs no tensor-parallel collective beside the
  // experts: half as many per block as the split one.
  auto tensor_ops = [](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config(), {.all_ranks = true, .all_micro_batches = true});
    int n = 0;
    for (const Op& op : sim.graph.ops())
      if (op.rank == 0 && op.kind == OpKind::kTensorForward) ++n;
    return n;
  };
  EXPECT_EQ(tensor_ops(c), 2 * 32 * 4);
  EXPECT_EQ(tensor_ops(folded), 32 * 4);
}

// A folded expert group across nodes (Qwen3-30B-A3B, T2 with E16 folded: 16 consecutive ranks
// on two p5 nodes) is simulated as its two groups along the mesh's E dimension (8 ranks, 2
// apart); together they push the folded group's bytes through node 0's card once.
TEST(TensorParallel, AFoldedExchangeCrossesTheCardOnce) {
  Scenario c{test::model("qwen3-30b-a3b"), test::hardware("p5.48xlarge", 32), {}, {}, {}};
  c.parallel.world_size = 32;
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  c.parallel.expert_parallel_degree = 16;
  c.parallel.expert_tensor_parallel_degree = 1;
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = 2;
  c.training.seq_len = 4096;
  c.training.global_batch_tokens = 16 * 2 * 4096;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  ASSERT_EQ(shapes.exchange.nodes, 2);
  const double whole = CostModel(c.cluster).all_to_all_cost(op_costs(c.config()).dispatch_send_bytes, shapes.exchange)
                           .nic_bytes_per_node;
  ASSERT_GT(whole, 0);
  // The first dispatch's collectives with members on node 0 (ranks 0-7), and their card bytes.
  auto node_0_dispatch = [](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config(), {.all_ranks = true, .all_micro_batches = true});
    std::set<int32_t> ids;
    for (const Op& op : sim.graph.ops())
      if (op.rank < 8 && op.kind == OpKind::kDispatch && op.layer == 0 && op.micro_batch == 0) ids.insert(op.collective);
    double bytes = 0;
    for (const int32_t id : ids) bytes += sim.graph.collectives()[static_cast<size_t>(id)].nic_bytes_per_node;
    return std::pair{ids.size(), bytes};
  };
  const auto [collectives, bytes] = node_0_dispatch(c);
  ASSERT_EQ(collectives, 2u);
  EXPECT_NEAR(bytes, whole, 1e-6 * whole);

  // With the shards innermost (PRETS, S8 T2 E4 folded) each folded group is 4 ranks 8 apart on 4
  // nodes, and its two tensor ranks are on different nodes: node 0 holds one member of 8
  // groups, and each of its 8 mesh-E groups carries its whole group's bytes.
  Scenario spread = c;
  spread.parallel.expert_parallel_degree = 4;
  spread.parallel.hybrid_shard_degree = 8;
  spread.parallel.placement = *Placement::parse("PRETS");
  ASSERT_TRUE(validate(spread.config()).empty()) << spread.describe();
  const LayoutShapes spread_shapes = layout_shapes(spread.cluster, spread.parallel);
  ASSERT_EQ(spread_shapes.exchange.per_node, 1);
  const double per_group = CostModel(spread.cluster)
                               .all_to_all_cost(op_costs(spread.config()).dispatch_send_bytes, spread_shapes.exchange)
                               .nic_bytes_per_node;
  const double spread_bytes = node_0_dispatch(spread).second;
  EXPECT_NEAR(spread_bytes, static_cast<double>(spread_shapes.exchange.groups_per_node) * per_group, 1e-6 * spread_bytes);
}

// Merged 1F1B (moe.overlap_exchange): each of a block's four exchanges runs beside another
// micro-batch's compute, so only what it takes beyond that compute holds the chain. Mixtral
// 8x7B, E8 two ranks apart over two p5 nodes (every exchange crosses the cards).
TEST(ExchangeOverlap, OnlyWhatAnExchangeTakesBeyondThePairedComputeIsExposed) {
  Scenario c{test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), {}, {}, {}};
  c.parallel.world_size = 16;
  c.parallel.expert_parallel_degree = 8;
  c.parallel.hybrid_shard_degree = 2;
  c.parallel.placement = *Placement::parse("ESR");
  c.parallel.micro_batch_size = 1;
  c.parallel.gradient_accumulation_steps = 4;
  c.training.seq_len = 4096;
  c.training.global_batch_tokens = 16 * 4 * 4096;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  Scenario overlapped = c;
  overlapped.moe.overlap_exchange = true;
  ASSERT_TRUE(validate(overlapped.config()).empty()) << overlapped.describe();
  auto exchanges = [](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config(), {.all_ranks = true, .all_micro_batches = true});
    std::map<OpKind, double> seconds;
    for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
      const Op& op = sim.graph.ops()[i];
      if (op.rank == 0 && op.layer == 3 && op.micro_batch == 1 && op.collective >= 0)
        seconds[op.kind] += to_seconds(sim.times.end[i] - sim.times.collective_start[static_cast<size_t>(op.collective)]);
    }
    // The step without what compute loses beside communication (that follows below).
    return std::pair{seconds, sim.estimate.step_time_s - sim.estimate.contention_s};
  };
  const auto [alone, step_alone] = exchanges(c);
  const auto [beside, step_beside] = exchanges(overlapped);
  const ExchangeCover cover = exchange_cover(op_costs(c.config()));
  EXPECT_GT(cover.dispatch, 0);
  for (const auto& [kind, covered] : {std::pair{OpKind::kDispatch, cover.dispatch},
                                      std::pair{OpKind::kCombine, cover.combine},
                                      std::pair{OpKind::kCombineBackward, cover.combine_backward},
                                      std::pair{OpKind::kDispatchBackward, cover.dispatch_backward}}) {
    ASSERT_GT(alone.at(kind), 0) << op_kind_name(kind);
    EXPECT_NEAR(beside.count(kind) ? beside.at(kind) : 0.0, std::max(0.0, alone.at(kind) - covered),
                0.05 * alone.at(kind) + 1e-6)
        << op_kind_name(kind);
  }
  EXPECT_LT(step_beside, step_alone);

  // What each exchange takes beside the other micro-batch's compute slows that compute by the
  // profile's overlap_slowdown: 32 blocks x the four covered parts x 4 micro-batches more
  // contention than without the overlap in the estimate, and at least as much in the simulator
  // (whose shorter chain also puts more of the gradient sync beside compute). Here that costs
  // about what the overlap saves: the exchanges are short beside this compute.
  const OpCosts o = op_costs(c.config());
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const CostModel cost(c.cluster);
  const double exchange = cost.all_to_all_seconds(o.dispatch_send_bytes, shapes.exchange);
  const double added = c.cluster.overlap_slowdown * 32 * 4 * cover.covered(exchange);
  ASSERT_GT(added, 0);
  const double sim_added = simulate_step(overlapped.config()).estimate.contention_s - simulate_step(c.config()).estimate.contention_s;
  const double est_added = estimate_step(overlapped.config(), shapes).contention_s - estimate_step(c.config(), shapes).contention_s;
  EXPECT_NEAR(est_added, added, 0.02 * added);
  EXPECT_GE(sim_added, 0.98 * added);
  EXPECT_LT(sim_added, 1.5 * added);

  // Under T = 2 the backward exchanges' exposed parts also run beside the weight gradients: the
  // analytic bound still holds below the simulated step.
  Scenario tensor = overlapped;
  tensor.parallel.tensor_parallel_degree = 2;
  tensor.parallel.sequence_parallel = true;
  tensor.parallel.hybrid_shard_degree = 1;
  tensor.training.global_batch_tokens = 8 * 4 * 4096;
  ASSERT_TRUE(validate(tensor.config()).empty()) << tensor.describe();
  const double bound = estimate_step(tensor.config(), layout_shapes(tensor.cluster, tensor.parallel)).lower_bound_s;
  EXPECT_GE(simulate_step(tensor.config()).estimate.step_time_s, bound * (1 - 1e-6));
}

TEST(Pipeline, StepIsTheScheduleAroundTheLastStageWorkedByHand) {
  const Scenario c = with_free_communication(dense(4, 1, 4, 8));
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  ModelSpec blocks = c.model;
  blocks.num_layers = 8;
  const RunConfig stage{blocks, c.cluster, c.parallel, c.moe, c.training};
  const OpCosts o = op_costs(stage);
  auto ns = [](double s) { return to_seconds(to_sim_time(s)); };
  const double mid = 8 * (ns(o.attention_forward_s) + ns(o.attention_backward_s) + ns(o.moe_forward_busiest_s) +
                          ns(o.moe_backward_busiest_s));
  const double last = mid + ns(o.head_s);
  const double expected = 8 * last + 3 * mid + ns(o.optimizer_s);
  const StepEstimate e = simulate_step(c.config()).estimate;
  EXPECT_NEAR(e.step_time_s, expected, 1e-6);
  EXPECT_NEAR(e.pipeline_bubble_s, 3 * mid, 1e-6);
  // The closed form agrees, and stays a lower bound.
  const StepEstimate a = estimate_step(c.config(), layout_shapes(c.cluster, c.parallel));
  EXPECT_NEAR(a.step_time_s, expected, 1e-6);
  EXPECT_LE(a.lower_bound_s, e.step_time_s * (1 + 1e-6));  // the search's margin for ns rounding
}

// Activations under 1F1B: the first stage holds P micro-batches of its L / P blocks, as much
// as one stage holding all L blocks for one micro-batch; parameters shrink to the stage's.
TEST(Pipeline, FirstStageHoldsPMicroBatchesOfItsBlocks) {
  const Scenario one = dense(4, 1, 1, 8);
  const Scenario four = dense(4, 1, 4, 8);
  const planner::MemoryEstimate m1 = planner::estimate_memory(one.config());
  const planner::MemoryEstimate m4 = planner::estimate_memory(four.config());
  EXPECT_EQ(m4.activations, m1.activations);
  const ParamCounts p = count_parameters(one.model);
  EXPECT_EQ(planner::shard_sizes(one.model, 1, 1, 1, 4).local_params,
            std::max(p.embedding, p.final_norm + p.lm_head) + 8 * p.dense_per_layer() + 8 * p.expert);
  // Fewer micro-batches than stages: only those are in flight.
  Scenario short_step = dense(4, 1, 4, 2);
  EXPECT_EQ(planner::estimate_memory(short_step.config()).activations * 2, m4.activations);
}

}  // namespace
}  // namespace moeplan::sim
