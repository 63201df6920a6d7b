#include "moeplan/core/routing_summary.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moeplan {
namespace {

// Ten steps of one expert group, two micro-batches, two layers of four experts, top-1 (32
// tokens a step). Layer 0: an even micro-batch (busiest 1.0) and one whose busiest expert takes
// 8 of 16 (2.0), in the last step 10 of 16 (2.5). Layer 1: 6 of 16 (1.5), then even.
std::vector<StepRecord> ten_steps() {
  std::vector<StepRecord> steps;
  for (int64_t s = 1; s <= 10; ++s) {
    StepRecord r;
    r.step = s;
    r.tokens = 32;
    const std::vector<int64_t> skewed = s == 10 ? std::vector<int64_t>{10, 2, 2, 2} : std::vector<int64_t>{8, 4, 2, 2};
    r.exchange_slots = {{{{4, 4, 4, 4}, {6, 2, 4, 4}}, {skewed, {4, 4, 4, 4}}}};
    r.tokens_per_expert = {{4 + skewed[0], 4 + skewed[1], 4 + skewed[2], 4 + skewed[3]}, {10, 6, 8, 8}};
    r.exchange_seconds = {0.1 * static_cast<double>(s), 0.5};
    r.seconds = static_cast<double>(s);  // 1 to 10 s
    steps.push_back(r);
  }
  return steps;
}

// Layer 0's 20 loads: ten 1.0, nine 2.0, one 2.5. The median interpolates between the 10th and
// 11th (1.0 and 2.0): 1.5; the p95 sits at 18.05 of 19: 2.0 + 0.05 x 0.5 = 2.025. Each step's
// two micro-batches differ by 1.0 (1.5 in the last). The first step's median is 1.5, the last's
// (1.0 and 2.5) 1.75.
TEST(RoutingSummary, BusiestOverMeanPerLayerWorkedByHand) {
  const RoutingSummary r = summarise_routing(ten_steps(), 1, 0, "metrics.jsonl");
  EXPECT_EQ(r.steps, 10);
  EXPECT_EQ(r.groups, 1);
  EXPECT_EQ(r.micro_batches, 2);
  EXPECT_EQ(r.num_experts, 4);
  EXPECT_EQ(r.experts_per_token, 1);
  ASSERT_EQ(r.layers.size(), 2u);
  const RoutingSpread& l0 = r.layers[0];
  EXPECT_DOUBLE_EQ(l0.median, 1.5);
  EXPECT_DOUBLE_EQ(l0.p95, 2.025);
  EXPECT_DOUBLE_EQ(l0.max, 2.5);
  EXPECT_DOUBLE_EQ(l0.within_step, 1.0);
  EXPECT_DOUBLE_EQ(l0.first, 1.5);
  EXPECT_DOUBLE_EQ(l0.last, 1.75);
  EXPECT_DOUBLE_EQ(r.layers[1].max, 1.5);
  EXPECT_DOUBLE_EQ(r.layers[1].median, 1.25);
  EXPECT_DOUBLE_EQ(r.all.max, 2.5);
  // Rank 0's 0.1 to 1.0 s: median 0.55; rank 1's 0.5 every step.
  ASSERT_EQ(r.exchange_seconds.size(), 2u);
  EXPECT_DOUBLE_EQ(r.exchange_seconds[0], 0.55);
  EXPECT_DOUBLE_EQ(r.exchange_seconds[1], 0.5);
  // Steps of 1 to 10 s: median 5.5, p95 at 8.55 of 9: 9.55. A dropless run drops nothing.
  EXPECT_DOUBLE_EQ(r.step_median_s, 5.5);
  EXPECT_DOUBLE_EQ(r.step_p95_s, 9.55);
  EXPECT_EQ(r.dropped_fraction, -1.0);
  EXPECT_EQ(r.undisturbed_steps, 0);  // the steps do not say what a hypervisor took
  EXPECT_EQ(format_routing_summary(r).find("left alone"), std::string::npos);
  // Steps 1 to 4 and 10 left alone (steal under 1%), 5 to 9 not: 1, 2, 3, 4, 10 s.
  std::vector<StepRecord> stolen = ten_steps();
  for (StepRecord& s : stolen) s.steal = s.step >= 5 && s.step <= 9 ? 0.05 : 0.002;
  const RoutingSummary alone = summarise_routing(stolen, 1, 0, "metrics.jsonl");
  EXPECT_EQ(alone.undisturbed_steps, 5);
  EXPECT_DOUBLE_EQ(alone.undisturbed_median_s, 3.0);
  EXPECT_DOUBLE_EQ(alone.undisturbed_p95_s, 4 + 0.8 * 6);  // at 3.8 of 4: 4 + 0.8 x (10 - 4)
  EXPECT_DOUBLE_EQ(alone.step_median_s, 5.5);              // every step still counts in the whole
  EXPECT_NE(format_routing_summary(alone).find("step time over the 5 steps the hypervisor left alone (steal under 1%)"),
            std::string::npos)
      << format_routing_summary(alone);
  std::vector<StepRecord> dropping = ten_steps();
  for (StepRecord& s : dropping) s.dropped_slots = {4, 0};  // 4 of a step's 64 slots
  EXPECT_DOUBLE_EQ(summarise_routing(dropping, 1, 0, "metrics.jsonl").dropped_fraction, 4.0 / 64.0);
  EXPECT_NE(format_routing_summary(summarise_routing(dropping, 1, 0, "metrics.jsonl")).find("slots dropped at capacity: 6.25%"),
            std::string::npos);

  // Over two ranks of two experts: {8, 4 | 2, 2} is 12 of 16 on the busier rank, 1.5 times the mean.
  const RoutingSummary ranks = summarise_routing(ten_steps(), 2, 2, "metrics.jsonl");
  EXPECT_EQ(ranks.steps, 9);
  EXPECT_DOUBLE_EQ(ranks.layers[0].max, 1.5);
  const std::string table = format_routing_summary(ranks);
  EXPECT_NE(table.find("by rank: 0: 0.600 1: 0.500"), std::string::npos) << table;
  EXPECT_NE(table.find("busiest of 2 expert-parallel ranks over the mean"), std::string::npos) << table;
  EXPECT_NE(table.find("steps 2 to 10 (9), 2 MoE layers, 4 experts, top-1; 1 expert group x 2 micro-batches"),
            std::string::npos)
      << table;
}

TEST(RoutingSummary, TheMeasuredProfileHoldsEveryMicroBatch) {
  const RoutingProfile p = measured_routing_profile(ten_steps(), 9, "run");
  EXPECT_EQ(p.kind, RoutingKind::kMeasured);
  EXPECT_EQ(p.num_experts, 4);
  EXPECT_EQ(p.experts_per_token, 1);
  ASSERT_EQ(p.layers(), 2);
  ASSERT_EQ(p.micro_batches(), 4);  // steps 9 and 10, two micro-batches each
  EXPECT_EQ(p.slots[0][3], (std::vector<int64_t>{10, 2, 2, 2}));
  EXPECT_EQ(p.slots[1][0], (std::vector<int64_t>{6, 2, 4, 4}));
  EXPECT_EQ(routing_profile_from_json(routing_profile_json(p), "again"), p);
}

TEST(RoutingSummary, RunsItCannotReadAreRefused) {
  std::vector<StepRecord> steps = ten_steps();
  const auto problem = [](const std::vector<StepRecord>& s, int64_t from, int64_t degree) {
    try {
      summarise_routing(s, from, degree, "metrics.jsonl");
    } catch (const InputError& e) {
      return e.lines().front();
    }
    return std::string();
  };
  EXPECT_NE(problem(steps, 11, 0).find("has no step from step 11 on"), std::string::npos);
  EXPECT_NE(problem(steps, 1, 3).find("--expert-degree: = 3 does not divide the run's 4 experts"), std::string::npos);
  steps[4].exchange_slots.clear();
  EXPECT_NE(problem(steps, 1, 0).find("step 5: has no per-micro-batch expert counts"), std::string::npos);
  steps = ten_steps();
  steps[3].exchange_slots[0].pop_back();
  EXPECT_NE(problem(steps, 1, 0).find("step 4: counts another shape"), std::string::npos);
  steps = ten_steps();
  steps[0].tokens = 30;
  EXPECT_NE(problem(steps, 1, 0).find("not a whole number per token"), std::string::npos);
}

}  // namespace
}  // namespace moeplan
