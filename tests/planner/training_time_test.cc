// Days and dollars: the goodput model's numbers worked out by hand, and the cluster sizes a
// range search tries.
#include "moeplan/planner/training_time.h"

#include <gtest/gtest.h>

#include <cmath>

namespace moeplan::planner {
namespace {

// 10 nodes failing 3.6e-3 times an hour each: L = 10 x 3.6e-3 / 3600 = 1e-5 per second. 2 GB
// of states over 1 GB/s of PCIe: a 2 s pause per checkpoint, every D = sqrt(2 x 2 / 1e-5) =
// 632.456 s. A restart of 100 s: goodput (1 - 1e-5 (100 + 316.228)) / (1 + 2 / 632.456) =
// 0.995838 / 1.003162 = 0.992699. 1e9 tokens at 1e4 tokens/s: 1e5 s of training, 100,735.5 s
// of wall clock, 1.007 failures, 279.8 instance-hours at $10: $2,798.21.
TEST(TrainingTime, GoodputCountsFailuresCheckpointsAndRestarts) {
  ClusterSpec c;
  c.node_failures_per_hour = 3.6e-3;
  c.pcie_bandwidth_bytes_per_s = 1e9;
  c.instance_price_per_hour = 10;
  const TrainingTime t = training_time(c, 10, 1e9, 1e4, 2e9, 100);
  EXPECT_DOUBLE_EQ(t.checkpoint_pause_s, 2.0);
  EXPECT_NEAR(t.checkpoint_interval_s, 632.4555320336758, 1e-9);
  EXPECT_NEAR(t.goodput, 0.9926985339426628, 1e-12);
  EXPECT_NEAR(t.seconds, 100735.51695783595, 1e-6);
  EXPECT_NEAR(t.failures, 1.0073551695783596, 1e-9);
  EXPECT_NEAR(t.dollars, 2798.2088043843314, 1e-6);
}

TEST(TrainingTime, WithoutFailuresOrPriceTheStepAloneCounts) {
  ClusterSpec c;
  c.pcie_bandwidth_bytes_per_s = 1e9;
  const TrainingTime t = training_time(c, 4, 1e9, 1e4, 2e9, 100);
  EXPECT_DOUBLE_EQ(t.goodput, 1.0);
  EXPECT_DOUBLE_EQ(t.seconds, 1e5);
  EXPECT_DOUBLE_EQ(t.checkpoint_interval_s, 0.0);
  EXPECT_LT(t.dollars, 0);  // no price
  // Failures faster than a restart: the run never finishes.
  c.node_failures_per_hour = 3600.0 / 100 / 4;  // one failure every 100 s over 4 nodes
  const TrainingTime never = training_time(c, 4, 1e9, 1e4, 2e9, 100);
  EXPECT_EQ(never.goodput, 0.0);
  EXPECT_TRUE(std::isinf(never.seconds));
}

TEST(TrainingTime, RangeSizesArePowersOfTwoAndThreeTimesThemInWholeNodes) {
  EXPECT_EQ(cluster_sizes(16, 256, 8), (std::vector<int64_t>{16, 24, 32, 48, 64, 96, 128, 192, 256}));
  EXPECT_EQ(cluster_sizes(40, 100, 8), (std::vector<int64_t>{40, 48, 64, 96}));  // 100 is no whole node
  EXPECT_TRUE(cluster_sizes(1, 7, 8).empty());
}

}  // namespace
}  // namespace moeplan::planner
