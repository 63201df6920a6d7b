// Searches of large spaces: every candidate simulated (tens of thousands), and the current MoE
// models on hundreds of GPUs. Seconds to a minute each optimised and five to ten times that under
// the sanitizers, so they run in the slow tier of the optimised build; the search's code runs
// under the sanitizers in the fast tier's smaller searches (search_test.cc, cli_test.cc).
#include "moeplan/planner/search.h"

#include <gtest/gtest.h>

#include <map>

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

// Every candidate that fits, simulated: the unpruned search of `gpus`, made once for both tests
// below (the program is one ctest test).
const SearchResult& unpruned(int64_t gpus) {
  static std::map<int64_t, SearchResult> done;
  auto it = done.find(gpus);
  if (it == done.end()) {
    SearchOptions options = unpruned_space(gpus);
    options.prune = false;
    options.keep = 1000000;
    it = done.emplace(gpus, search(mixtral(), p4d(gpus), options)).first;
  }
  return it->second;
}

// The unpruned ranking cut to the pruned search's length is the unpruned search at that `keep`:
// both sort the same simulated candidates and take them in order.
TEST(Search, PruningDoesNotChangeTheRanking) {
  for (int64_t gpus : {16, 64}) {
    const SearchResult a = search(mixtral(), p4d(gpus), unpruned_space(gpus));
    const SearchResult& b = unpruned(gpus);
    EXPECT_LT(a.stats.simulated, b.stats.simulated);
    ASSERT_EQ(a.ranked.size(), unpruned_space(gpus).keep);
    ASSERT_GE(b.ranked.size(), a.ranked.size());
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
    const SearchOptions options = unpruned_space(gpus);
    const SearchResult& r = unpruned(gpus);
    EXPECT_GT(r.ranked.size(), 1000u);
    for (const Candidate& c : r.ranked) {
      const RunConfig config{mixtral(), cluster, c.parallel, options.moe, options.training};
      const double bound = sim::estimate_step(config, sim::layout_shapes(cluster, c.parallel)).lower_bound_s;
      EXPECT_GE(c.estimate.step_time_s, bound * (1 - 1e-6)) << describe(c.parallel);
    }
  }
}

// The MoE models of the shipped profiles plan on H100 (p5) and on A100 40 GB (p4d, twice the
// GPUs), and the plan's memory, estimated again from its layout, is what the search kept and
// fits the device. `scale`: the GPUs on `instance` for each model's H100 count.
void current_moe_models_plan(const char* instance, int64_t scale) {
  for (const auto& [name, gpus] : {std::pair<const char*, int64_t>{"deepseek-v3", 256},
                                   {"kimi-k2", 512},
                                   {"qwen3-235b-a22b", 64},
                                   {"qwen3-30b-a3b", 8},
                                   {"gpt-oss-120b", 16},
                                   {"gpt-oss-20b", 8},
                                   {"moonlight-16b-a3b", 8}}) {
    const int64_t n = scale * gpus;
    {
      SCOPED_TRACE(std::string(name) + " on " + std::to_string(n) + " x " + instance);
      SearchOptions options = test::search_options(n);
      options.estimator = Estimator::kAnalytic;
      options.keep = 1;
      const ClusterSpec cluster = test::hardware(instance, n);
      const ModelSpec& model = test::model(name);
      const SearchResult r = search(model, cluster, options);
      ASSERT_FALSE(r.ranked.empty());
      const Candidate& best = r.ranked.front();
      const MemoryEstimate again = estimate_memory({model, cluster, best.parallel, options.moe, options.training});
      EXPECT_EQ(again.device_total, best.memory.device_total);
      EXPECT_LE(again.device_total, cluster.usable_memory_bytes());
    }
  }
}

// Apart, so that the two halves run side by side in the test tiers.
TEST(Search, CurrentMoeModelsPlanOnH100) { current_moe_models_plan("p5.48xlarge", 1); }
TEST(Search, CurrentMoeModelsPlanOnA100) { current_moe_models_plan("p4d.24xlarge", 2); }

}  // namespace
}  // namespace moeplan::planner
