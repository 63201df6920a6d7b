// Searches that simulate tens of thousands of candidates: each takes tens of seconds optimised
// and ten times that under the sanitizers, so they run in the slow tier of the optimised build.
#include "moeplan/planner/search.h"

#include <gtest/gtest.h>

#include "moeplan/simulator/analytic.h"
#include "test_support.h"

namespace moeplan::planner {
namespace {

const ModelSpec& mixtral() { return test::model("mixtral-8x7b"); }
ClusterSpec p4d(int64_t gpus) { return test::hardware("p4d.24xlarge", gpus); }

TEST(Search, ThousandGpusFindAPlan) {
  const SearchResult r = search(mixtral(), p4d(1024), test::search_options(1024));
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.ranked.front().parallel.world_size, 1024);
}

// The bound only skips candidates that cannot enter the ranking: the result is the same as
// simulating every candidate that fits.
// Unpruned searches simulate every candidate that fits (7,658 on 16 GPUs; 103,390 on 64, where
// the space is cut to micro-batch 1 without offloading to keep the test short).
SearchOptions unpruned_space(int64_t gpus) {
  SearchOptions options = test::search_options(gpus);
  if (gpus > 16) {
    options.pins.micro_batch_size = 1;
    options.pins.offloading = false;
  }
  return options;
}

TEST(Search, PruningDoesNotChangeTheRanking) {
  for (int64_t gpus : {16, 64}) {
    SearchOptions pruned = unpruned_space(gpus);
    SearchOptions full = pruned;
    full.prune = false;
    const SearchResult a = search(mixtral(), p4d(gpus), pruned);
    const SearchResult b = search(mixtral(), p4d(gpus), full);
    EXPECT_LT(a.stats.simulated, b.stats.simulated);
    ASSERT_EQ(a.ranked.size(), b.ranked.size());
    for (size_t i = 0; i < a.ranked.size(); ++i) {
      EXPECT_EQ(a.ranked[i].parallel, b.ranked[i].parallel) << gpus << " GPUs, rank " << i;
      EXPECT_EQ(a.ranked[i].estimate.step_time_s, b.ranked[i].estimate.step_time_s);
    }
  }
}

// Every simulated step is at least the analytic lower bound.
TEST(Search, SimulationNeverBeatsTheLowerBound) {
  for (int64_t gpus : {16, 64}) {
    const ClusterSpec cluster = p4d(gpus);
    SearchOptions options = unpruned_space(gpus);
    options.prune = false;
    options.keep = 1000000;
    const SearchResult r = search(mixtral(), cluster, options);
    EXPECT_GT(r.ranked.size(), 1000u);
    for (const Candidate& c : r.ranked) {
      const RunConfig config{mixtral(), cluster, c.parallel, options.moe, options.training};
      const double bound = sim::estimate_step(config, sim::layout_shapes(cluster, c.parallel)).lower_bound_s;
      EXPECT_GE(c.estimate.step_time_s, bound * (1 - 1e-6)) << describe(c.parallel);
    }
  }
}

}  // namespace
}  // namespace moeplan::planner
