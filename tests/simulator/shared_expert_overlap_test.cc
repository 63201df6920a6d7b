// The shared experts' forward beside the forward exchanges (moe.overlap_shared_expert,
// Megatron-Core's --moe-shared-expert-overlap): their first GEMM and activation beside the
// dispatch, their second beside the combine. The estimate and the step simulator take the same
// share of each exchange off the chain and count it as compute slowed beside communication.

#include <gtest/gtest.h>

#include "moeplan/simulator/analytic.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

using test::Scenario;

// Moonlight-16B-A3B (64 experts, top-6, one shared expert of 2,816) over E16 on two p5 nodes:
// every exchange crosses the card, longer than the shared expert's forward beside it.
Scenario moonlight(bool overlap) {
  Scenario c =
      test::make_scenario("moonlight-16b-a3b", "p5.48xlarge", 16, 16, 1, "RSE", Checkpointing::kNone, 1, 4, 4096);
  c.moe.load_balancing = LoadBalancing::kBalanced;
  c.moe.overlap_shared_expert = overlap;
  return c;
}

TEST(SharedExpertOverlap, HidesTheExchangesBehindTheSharedExpertsForward) {
  const Scenario off = moonlight(false), on = moonlight(true);
  ASSERT_TRUE(validate(on.config()).empty()) << on.describe();
  const OpCosts o = op_costs(on.config());
  EXPECT_GT(o.shared_up_forward_s, o.shared_down_forward_s);  // fc1 (two halves of SwiGLU) and its activation
  EXPECT_GT(o.shared_down_forward_s, 0);
  const SharedExpertCover cover = shared_expert_cover(on.config(), o);
  EXPECT_DOUBLE_EQ(cover.dispatch, o.shared_up_forward_s);
  EXPECT_DOUBLE_EQ(cover.combine, o.shared_down_forward_s);
  EXPECT_EQ(shared_expert_cover(off.config(), o).dispatch, 0);

  // The estimate: each forward dispatch and combine loses what runs beside it, and that time
  // runs slowed beside the exchange.
  const LayoutShapes shapes = layout_shapes(on.cluster, on.parallel);
  const CostModel cost(on.cluster);
  const double exchange = cost.seconds(token_exchange_cost(cost, on.config(), o.dispatch_send_bytes, shapes.exchange),
                                       shapes.exchange);
  ASSERT_GT(exchange, cover.dispatch);
  const double hidden_per_step =
      4.0 * static_cast<double>(on.model.moe_blocks()) * cover.hidden(exchange, false);
  EXPECT_DOUBLE_EQ(cover.hidden(exchange, false), cover.dispatch + cover.combine);
  const StepEstimate before = estimate_step(off.config(), shapes), after = estimate_step(on.config(), shapes);
  EXPECT_NEAR(before.expert_comm_s - after.expert_comm_s, hidden_per_step, 1e-9 * before.step_time_s);
  EXPECT_NEAR(after.contention_s - before.contention_s, on.cluster.overlap_slowdown * hidden_per_step,
              1e-9 * before.step_time_s);
  EXPECT_LT(after.step_time_s, before.step_time_s);

  // The simulator: the first block with experts' forward dispatch is shorter by the shared
  // experts' first GEMM and activation.
  auto dispatch_s = [&](const Scenario& s) {
    const StepSimulation sim = simulate_step(s.config());
    const int layer = static_cast<int>(s.model.first_dense_layers);
    for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
      const Op& op = sim.graph.ops()[i];
      if (op.rank == 0 && op.kind == OpKind::kDispatch && op.layer == layer && op.micro_batch == 1)
        return to_seconds(sim.times.end[i] - sim.times.start[i]);
    }
    return -1.0;
  };
  const double whole = dispatch_s(off), overlapped = dispatch_s(on);
  ASSERT_GT(whole, 0);
  EXPECT_NEAR(overlapped, whole - cover.dispatch, 0.02 * whole);
  EXPECT_LT(simulate_step(on.config()).estimate.step_time_s, simulate_step(off.config()).estimate.step_time_s);
}

// It changes nothing without shared experts, without expert parallelism, or under the merged
// 1F1B schedule, which already runs every exchange beside another micro-batch.
TEST(SharedExpertOverlap, NeedsSharedExpertsAndAnExchange) {
  Scenario c = moonlight(true);
  const OpCosts o = op_costs(c.config());
  c.moe.overlap_exchange = true;
  EXPECT_EQ(shared_expert_cover(c.config(), o).dispatch, 0);
  c.moe.overlap_exchange = false;
  c.parallel.expert_parallel_degree = 1;
  EXPECT_EQ(shared_expert_cover(c.config(), o).dispatch, 0);
  Scenario mixtral{test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), {}, {}, {}};
  mixtral.parallel = moonlight(true).parallel;
  mixtral.parallel.expert_parallel_degree = 8;
  mixtral.moe.overlap_shared_expert = true;
  EXPECT_EQ(shared_expert_cover(mixtral.config(), op_costs(mixtral.config())).dispatch, 0);
}

}  // namespace
}  // namespace moeplan::sim
