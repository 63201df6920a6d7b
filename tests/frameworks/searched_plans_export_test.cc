// Searches for each framework whose plans go through its exporter: a search of the whole space
// for each, in the slow tier of the optimised build (exhaustive_search_test.cc says why).
#include <gtest/gtest.h>

#include <string>

#include "framework_rules.h"
#include "refusal.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan {
namespace {

using test::refusal;

// What `moeplan search --target X` writes, X's exporter takes: the search and the exporter
// apply the same rules.
TEST(ExportLaunch, EveryPlanSearchedForAFrameworkExports) {
  for (const Target target : {test::framework_rules("smp"), test::framework_rules("megatron"),
                              test::framework_rules("torchtitan")}) {
    for (const int64_t gpus : {16, 64}) {
      planner::SearchOptions options = test::search_options(gpus);
      options.training.precision = Precision::kMixed;
      options.training.fp32_gradients = target != test::framework_rules("smp");
      if (target == test::framework_rules("torchtitan")) options.moe.load_balancing = LoadBalancing::kAuxLoss;
      options.target = target;
      options.keep = 8;
      const ModelSpec& model = test::model("mixtral-8x7b");
      const ClusterSpec cluster = test::hardware("p5.48xlarge", gpus);
      const planner::SearchResult result = planner::search(model, cluster, options);
      SCOPED_TRACE(std::string(framework(target).name) + " on " + std::to_string(gpus) + " GPUs");
      ASSERT_FALSE(result.ranked.empty());
      for (size_t i = 0; i < result.ranked.size(); ++i) {
        planner::SearchResult one = result;
        std::swap(one.ranked[0], one.ranked[i]);
        const Plan plan = planner::make_plan(model, cluster, options, one, "test");
        EXPECT_EQ(refusal([&] { launch::export_launch(plan, target, "p.json"); }), "") << describe(plan.parallel);
      }
    }
  }
}

}  // namespace
}  // namespace moeplan
