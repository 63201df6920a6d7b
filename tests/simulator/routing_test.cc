#include "moeplan/simulator/routing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "moeplan/core/moe_load.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

// Mixtral 8x7B on one p5 node, experts over 8 ranks (one expert each), 4 micro-batches a step.
test::Scenario eight_experts(int64_t pipeline = 1) {
  test::Scenario c = test::make_scenario("mixtral-8x7b", "p5.48xlarge", 8 * pipeline, 8, 1, "PRSET",
                                         Checkpointing::kFull, 1, 4, 4096);
  c.parallel.pipeline_parallel_degree = pipeline;
  return c;
}

// One micro-batch's shares over 8 experts with the first rank (expert 0) at `load` times the mean.
std::vector<double> shares_at(double load) {
  std::vector<double> s(8, (1.0 - load / 8.0) / 7.0);
  s[0] = load / 8.0;
  return s;
}

StepRouting every_block_at(const ModelSpec& m, int64_t micro_batches, double load) {
  return StepRouting(static_cast<size_t>(m.moe_layers()),
                     std::vector<std::vector<double>>(static_cast<size_t>(micro_batches), shares_at(load)));
}

// The defining case: every block of every micro-batch at load L costs what the step estimate
// says L on every block costs, beyond the plan's own (balanced) routing.
TEST(RoutedStep, UniformLoadsAddWhatTheEstimateAdds) {
  const test::Scenario c = eight_experts();
  const RunConfig config = c.config();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  RoutingDelay delay(config, shapes);
  EXPECT_EQ(delay.base_load(), 1.0);
  EXPECT_EQ(delay.block_delay_s(1.0), 0.0);
  const double base = estimate_step(config, shapes).step_time_s;
  for (double load : {1.5, 2.0, 3.0}) {
    const MoeConfig moe = with_busiest_rank_load(c.model, c.moe, 8, load);
    EXPECT_DOUBLE_EQ(busiest_expert_rank_load(c.model, moe, 8), load);
    const double skewed = estimate_step({c.model, c.cluster, c.parallel, moe, c.training}, shapes).step_time_s;
    EXPECT_NEAR(delay.delay_s(every_block_at(c.model, 4, load)), skewed - base, 1e-9 * skewed) << load;
    EXPECT_GT(skewed, base);
  }
  EXPECT_LT(delay.block_delay_s(1.5), delay.block_delay_s(2.0));
}

// Processor sharing worked by hand: jobs 0.4, 0.5, 1.2 and 1.9 on 2 processors move at half a
// processor each until 0.4 ends (0.8 s), the three left at 2/3 until 0.5 ends (0.15 s more), the
// two left at one each until 1.2 ends (0.7 s), and 1.9 alone (0.7 s): 2.35 s, against 2 s for
// four jobs of 1. With a processor each, the longest job.
TEST(RoutedStep, SharedProcessorsServeTheUnfinishedRanksEqually) {
  EXPECT_NEAR(shared_makespan({1.9, 0.4, 1.2, 0.5}, 2), 2.35, 1e-12);
  EXPECT_DOUBLE_EQ(shared_makespan({1, 1, 1, 1}, 2), 2.0);
  EXPECT_DOUBLE_EQ(shared_makespan({1.9, 0.4, 1.2, 0.5}, 4), 1.9);
  EXPECT_DOUBLE_EQ(shared_makespan({1.9, 0.4, 1.2, 0.5}, 1), 4.0);  // one processor: the sum
  EXPECT_DOUBLE_EQ(shared_makespan({}, 2), 0.0);
}

// Ranks sharing processors: 8 ranks on 4 processors timed their operations at half a processor
// each. Experts over all 8 (one group on the 4 processors), the first rank at 2 and seven at
// 6/7: all eight at half a processor until the seven finish (12/7 s), then the first alone on a
// whole one (8/7 s more): 20/7 s against 2 s balanced, priced as a busiest rank at 10/7. Over 2
// ranks (4 groups, a processor each): two ranks on one processor take the sum of their loads,
// as balanced ones do, so nobody waits. With a processor for every rank, the busiest load.
TEST(RoutedStep, RanksSharingProcessorsArePricedByTheirMakespan) {
  test::Scenario c = eight_experts();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const std::vector<double> hot = shares_at(2.0);
  EXPECT_DOUBLE_EQ(RoutingDelay(c.config(), shapes).priced_load(hot), 2.0);  // GPU ranks
  c.cluster.host_processors = 8;
  EXPECT_DOUBLE_EQ(RoutingDelay(c.config(), shapes).priced_load(hot), 2.0);
  c.cluster.host_processors = 4;
  RoutingDelay shared(c.config(), shapes);
  EXPECT_NEAR(shared.priced_load(hot), 10.0 / 7.0, 1e-12);
  EXPECT_NEAR(shared.delay_s(every_block_at(c.model, 4, 2.0)),
              static_cast<double>(c.model.moe_layers() * 4) * shared.block_delay_s(10.0 / 7.0), 1e-12);
  EXPECT_LT(shared.block_delay_s(10.0 / 7.0), shared.block_delay_s(2.0));
  c.parallel.expert_parallel_degree = 2;
  RoutingDelay pairs(c.config(), layout_shapes(c.cluster, c.parallel));
  ASSERT_GT(busiest_rank_load(hot, 2), 1.0);
  EXPECT_NEAR(pairs.priced_load(hot), 1.0, 1e-12);
  EXPECT_NEAR(pairs.delay_s(every_block_at(c.model, 4, 2.0)), 0.0, 1e-12);
}

// One hot micro-batch in one block costs one block's delay; the others cost nothing.
TEST(RoutedStep, OneHotMicroBatchCostsOneBlock) {
  const test::Scenario c = eight_experts();
  RoutingDelay delay(c.config(), layout_shapes(c.cluster, c.parallel));
  StepRouting loads = every_block_at(c.model, 4, 1.0);
  loads[5][2] = shares_at(2.5);
  EXPECT_DOUBLE_EQ(delay.delay_s(loads), delay.block_delay_s(2.5));
  EXPECT_GT(delay.block_delay_s(2.5), 0.0);
}

// Two stages of 16 blocks each: hot blocks on one stage cost that stage's sum; on both, the
// slower stage's.
TEST(RoutedStep, TheSlowestStageSetsTheStep) {
  const test::Scenario c = eight_experts(2);
  RoutingDelay delay(c.config(), layout_shapes(c.cluster, c.parallel));
  StepRouting loads = every_block_at(c.model, 4, 1.0);
  loads[20][0] = loads[21][0] = shares_at(2.0);  // stage 1
  const double stage1 = 2.0 * delay.block_delay_s(2.0);
  EXPECT_DOUBLE_EQ(delay.delay_s(loads), stage1);
  loads[3][1] = shares_at(2.5);  // stage 0, less than stage 1's two
  ASSERT_LT(delay.block_delay_s(2.5), stage1);
  EXPECT_DOUBLE_EQ(delay.delay_s(loads), stage1);

  // Interleaved, two chunks a stage: blocks 0-7 and 16-23 on stage 0, 8-15 and 24-31 on stage
  // 1. Blocks 20, 21 and 3 are all stage 0's now.
  test::Scenario interleaved = c;
  interleaved.parallel.virtual_pipeline_degree = 2;
  RoutingDelay chunks(interleaved.config(), layout_shapes(interleaved.cluster, interleaved.parallel));
  EXPECT_DOUBLE_EQ(chunks.delay_s(loads), 2.0 * chunks.block_delay_s(2.0) + chunks.block_delay_s(2.5));
}

// At capacity factor 1.5 a rank computes at most 1.5 times the mean: hotter micro-batches cost
// what 1.5 costs, and their overflow is dropped.
TEST(RoutedStep, CapacityBoundsTheWaitAndDropsTheRest) {
  test::Scenario c = eight_experts();
  c.moe.capacity_factor = 1.5;
  const RunConfig config = c.config();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  RoutingDelay delay(config, shapes);
  StepRouting loads = every_block_at(c.model, 4, 1.0);
  loads[0][0] = shares_at(3.0);
  EXPECT_DOUBLE_EQ(delay.delay_s(loads), delay.block_delay_s(1.5));
  EXPECT_GT(delay.block_delay_s(1.5), 0.0);
  const double base = estimate_step(config, shapes).step_time_s;
  const RoutedStep skew = simulate_routing(config, shapes, base, routing_profile_from_spec("skew:3"), 8, 1);
  EXPECT_LE(skew.load_p99, 1.5 + 1e-12);
  // The busiest expert's 3/8 of the slots against a capacity of 1.5/8: about 1.5/8 dropped in each
  // micro-batch, give or take chance and the others' overflow.
  EXPECT_NEAR(skew.dropped_fraction, 1.5 / 8.0, 0.03);
  c.moe.capacity_factor = 0;
  const RoutedStep dropless = simulate_routing(c.config(), shapes, base, routing_profile_from_spec("skew:3"), 8, 1);
  EXPECT_EQ(dropless.dropped_fraction, 0.0);
  EXPECT_GT(dropless.median_s, skew.median_s);
}

// Experts over 2 ranks, capacity factor 1: two hot experts on the first rank take 0.4 of the
// slots each and are clipped to 1/8, so that rank computes 0.35 of the slots where balanced it
// computes 0.5, and the other 0.1: every rank computes less than balanced and the block is
// faster, not slower. Dropless, the first rank's 0.9 makes the others wait.
TEST(RoutedStep, DroppingBelowTheMeanMakesTheBlockFaster) {
  test::Scenario c = eight_experts();
  c.parallel.expert_parallel_degree = 2;
  c.moe.capacity_factor = 1.0;
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  RoutingDelay delay(c.config(), shapes);
  const std::vector<double> hot{0.4, 0.4, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025};
  EXPECT_NEAR(busiest_rank_load(hot, 2, c.moe), 0.7, 1e-12);
  StepRouting loads = every_block_at(c.model, 4, 1.0);
  loads[0][0] = hot;
  EXPECT_LT(delay.block_delay_s(0.7), 0.0);
  EXPECT_NEAR(delay.delay_s(loads), delay.block_delay_s(0.7), 1e-15);
  c.moe.capacity_factor = 0;
  RoutingDelay dropless(c.config(), shapes);
  EXPECT_NEAR(busiest_rank_load(hot, 2, c.moe), 1.8, 1e-12);
  EXPECT_GT(dropless.delay_s(loads), 0.0);
}

TEST(RoutedStep, DrawsSpreadTheStepAndTheLoad) {
  const test::Scenario c = eight_experts();
  const RunConfig config = c.config();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const double base = estimate_step(config, shapes).step_time_s;
  const RoutedStep balanced = simulate_routing(config, shapes, base, routing_profile_from_spec("balanced"), 8, 1);
  EXPECT_EQ(balanced.median_s, base);
  EXPECT_EQ(balanced.p95_s, base);
  EXPECT_EQ(balanced.load_p99, 1.0);
  const RoutedStep skew = simulate_routing(config, shapes, base, routing_profile_from_spec("skew:2"), 32, 1);
  ASSERT_EQ(skew.step_s.size(), 32u);
  EXPECT_GT(skew.median_s, base);
  EXPECT_GE(skew.p95_s, skew.median_s);
  // One expert a rank: the busiest rank is the busiest expert, 2 times the mean give or take chance.
  EXPECT_NEAR(skew.load_median, 2.0, 0.05);
  EXPECT_GE(skew.load_p99, skew.load_median);
  // The same seed, the same draws.
  EXPECT_EQ(simulate_routing(config, shapes, base, routing_profile_from_spec("skew:2"), 32, 1).step_s, skew.step_s);

  // Without expert parallelism no rank waits for another.
  test::Scenario one = c;
  one.parallel.expert_parallel_degree = 1;
  one.parallel.hybrid_shard_degree = 8;
  const RunConfig alone = one.config();
  const LayoutShapes alone_shapes = layout_shapes(one.cluster, one.parallel);
  const double alone_base = estimate_step(alone, alone_shapes).step_time_s;
  EXPECT_EQ(simulate_routing(alone, alone_shapes, alone_base, routing_profile_from_spec("skew:2"), 4, 1).median_s,
            alone_base);
}

// A profile's step spread multiplies each drawn step by one of its ratios, drawn apart from the
// routing: the routing draws are the same with it and without, each step is its spreadless
// step times a ratio of the spread, and the drawn p95 holds the spread's tail.
TEST(RoutedStep, AStepSpreadMultipliesEachDrawAndLeavesTheRoutingAlone) {
  const test::Scenario c = eight_experts();
  const RunConfig config = c.config();
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const double base = estimate_step(config, shapes).step_time_s;
  const RoutingProfile skew = routing_profile_from_spec("skew:2");
  const RoutedStep alone = simulate_routing(config, shapes, base, skew, 200, 1);
  RoutingProfile spread = skew;
  spread.step_spread = {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5};
  const RoutedStep with = simulate_routing(config, shapes, base, spread, 200, 1);
  ASSERT_EQ(with.step_s.size(), alone.step_s.size());
  int slow = 0;
  for (size_t d = 0; d < with.step_s.size(); ++d) {
    const double ratio = with.step_s[d] / alone.step_s[d];
    EXPECT_TRUE(std::abs(ratio - 1.0) < 1e-12 || std::abs(ratio - 1.5) < 1e-12) << d << ": " << ratio;
    slow += ratio > 1.25;
  }
  EXPECT_GT(slow, 8);   // about one draw in ten, 20 of 200
  EXPECT_LT(slow, 40);
  EXPECT_EQ(with.load_p99, alone.load_p99);
  EXPECT_GE(with.median_s, alone.median_s);  // ratios of 1 in the middle
  EXPECT_LT(with.median_s, 1.1 * alone.median_s);
  EXPECT_GT(with.p95_s, 1.3 * alone.median_s);
  // Balanced routing with a spread: the steps vary by the spread alone.
  RoutingProfile even;
  even.step_spread = {0.9, 1.0, 1.2};
  const RoutedStep spread_only = simulate_routing(config, shapes, base, even, 64, 1);
  for (double s : spread_only.step_s)
    EXPECT_TRUE(std::abs(s / base - 0.9) < 1e-12 || std::abs(s / base - 1.0) < 1e-12 || std::abs(s / base - 1.2) < 1e-12);
  EXPECT_NEAR(spread_only.p95_s, 1.2 * base, 1e-9 * base);
}

}  // namespace
}  // namespace moeplan::sim
