#include "moeplan/core/moe_load.h"

#include <gtest/gtest.h>

#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan {
namespace {

const ModelSpec& mixtral() { return test::model("mixtral-8x7b"); }

// One expert at 1.5 x the mean share (1.5/8 = 0.1875), the other seven split the rest
// (0.8125/7 each). With E = 2, rank 0 holds experts 0-3: 2 x (0.1875 + 3 x 0.8125/7) = 1.0714...;
// with E = 8 rank 0 holds expert 0 alone: 8 x 0.1875 = 1.5; with E = 1 there is nothing to
// balance: 1.
TEST(MoeLoad, SkewNumberGivesRankLoads) {
  MoeConfig moe;
  moe.expert_load_imbalance = 1.5;
  EXPECT_DOUBLE_EQ(expert_rank_load(mixtral(), moe, 2, 0), 2 * (0.1875 + 3 * 0.8125 / 7));
  EXPECT_DOUBLE_EQ(expert_rank_load(mixtral(), moe, 8, 0), 1.5);
  EXPECT_DOUBLE_EQ(busiest_expert_rank_load(mixtral(), moe, 1), 1.0);
  double sum = 0;
  for (double s : expert_shares(mixtral(), moe)) sum += s;
  EXPECT_DOUBLE_EQ(sum, 1.0);
}

// Capacity factor 1.25 over 4 experts: each computes at most 1.25 / 4 = 0.3125 of the slots.
// Shares 0.5, 0.25, 0.15, 0.10: the first drops 0.1875; over two ranks the first computes
// 0.3125 + 0.25 = 0.5625 of 0.5 each, 1.125 times the mean. Padded, every expert computes its
// whole capacity: 1.25 on every rank.
TEST(MoeLoad, CapacityBoundsWhatARankComputes) {
  const std::vector<double> shares{0.5, 0.25, 0.15, 0.10};
  MoeConfig moe;
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 2, moe), 1.5);  // dropless: 0.75 of 0.5
  EXPECT_EQ(dropped_fraction(shares, moe), 0.0);
  moe.capacity_factor = 1.25;
  EXPECT_DOUBLE_EQ(computed_share(0.5, 4, moe), 0.3125);
  EXPECT_DOUBLE_EQ(computed_share(0.1, 4, moe), 0.1);
  EXPECT_DOUBLE_EQ(dropped_fraction(shares, moe), 0.1875);
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 2, moe), 1.125);
  moe.pad_to_capacity = true;
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 2, moe), 1.25);
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 4, moe), 1.25);

  // The plan's own routing: 8 experts, the busiest 3 times the mean, capacity 2: it computes
  // 2 / 8 of the slots and drops 1 / 8; its rank (E8) computes 2 times the mean.
  ModelSpec m = test::model("mixtral-8x7b");
  MoeConfig skew;
  skew.expert_load_imbalance = 3.0;
  skew.capacity_factor = 2.0;
  EXPECT_DOUBLE_EQ(busiest_expert_rank_load(m, skew, 8), 2.0);
  EXPECT_DOUBLE_EQ(dropped_fraction(m, skew), 0.125);
  skew.capacity_factor = 0;
  EXPECT_DOUBLE_EQ(busiest_expert_rank_load(m, skew, 8), 3.0);
}

// Counts 1,1,1,1,2,2,2,2: rank 1 of E = 2 holds 8 of 12 slots, 4/3 of the mean.
TEST(MoeLoad, CountsGiveRankLoads) {
  MoeConfig moe;
  moe.tokens_per_expert = {1, 1, 1, 1, 2, 2, 2, 2};
  EXPECT_DOUBLE_EQ(expert_rank_load(mixtral(), moe, 2, 0), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(expert_rank_load(mixtral(), moe, 2, 1), 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(busiest_expert_rank_load(mixtral(), moe, 2), 4.0 / 3.0);
}

struct Setup16 {
  ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  ParallelConfig parallel;
  MoeConfig moe;
  TrainingConfig training;
  Setup16() {
    parallel.world_size = 16;
    parallel.expert_parallel_degree = 2;
    parallel.hybrid_shard_degree = 1;  // no gathers: the experts' compute sets the pace
    parallel.activation_checkpointing = Checkpointing::kFull;
    parallel.micro_batch_size = 1;
    parallel.gradient_accumulation_steps = 4;
    training.seq_len = 2048;
    training.global_batch_tokens = 16 * 4 * 2048;
  }
  RunConfig config() const { return {mixtral(), cluster, parallel, moe, training}; }
  double step() const {
    EXPECT_TRUE(validate(config()).empty());
    return sim::simulate_step(config()).estimate.step_time_s;
  }
};

// Uniform counts are uniform routing; which rank is the busy one does not matter; a busy
// rank slows the step (every token exchange waits for it) and grows its buffers.
TEST(MoeLoad, MeasuredCountsDriveTheSimulationAndTheMemoryModel) {
  Setup16 uniform;
  Setup16 counted_uniform;
  counted_uniform.moe.tokens_per_expert = {5, 5, 5, 5, 5, 5, 5, 5};
  EXPECT_EQ(uniform.step(), counted_uniform.step());

  Setup16 busy_first;
  busy_first.moe.tokens_per_expert = {2, 2, 2, 2, 1, 1, 1, 1};
  Setup16 busy_second;
  busy_second.moe.tokens_per_expert = {1, 1, 1, 1, 2, 2, 2, 2};
  EXPECT_EQ(busy_first.step(), busy_second.step());
  EXPECT_GT(busy_second.step(), uniform.step());

  // 2 x 2048 slots at 4/3: 5,461.33 -> 5,462 slots on the busy rank.
  const planner::MemoryEstimate m = planner::estimate_memory(busy_second.config());
  EXPECT_EQ(m.moe_dispatch_buffers, (4096 + 5462) * 4096 * 2);
}

}  // namespace
}  // namespace moeplan
