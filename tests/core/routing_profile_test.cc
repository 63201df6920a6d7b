#include "moeplan/core/routing_profile.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/moe_load.h"
#include "test_support.h"

namespace moeplan {
namespace {

// The problems an input error carries, as "path: message" lines.
std::vector<std::string> problems(const std::function<void()>& read) {
  try {
    read();
  } catch (const InputError& e) {
    std::vector<std::string> out;
    for (const Diagnostic& d : e.diagnostics()) out.push_back(d.path + ": " + d.message);
    return out;
  }
  return {};
}

bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

// Two MoE layers of four experts, three recorded micro-batches each.
RoutingProfile measured() {
  RoutingProfile r;
  r.kind = RoutingKind::kMeasured;
  r.source = "a test";
  r.num_experts = 4;
  r.experts_per_token = 2;
  r.slots = {{{4, 2, 1, 1}, {2, 2, 2, 2}, {0, 0, 8, 0}}, {{1, 1, 1, 5}, {8, 0, 0, 0}, {3, 3, 1, 1}}};
  return r;
}

TEST(RoutingProfile, SpecNamesBalancedSkewOrAFile) {
  EXPECT_EQ(routing_profile_from_spec("balanced").kind, RoutingKind::kBalanced);
  const RoutingProfile skew = routing_profile_from_spec("skew:2.5");
  EXPECT_EQ(skew.kind, RoutingKind::kSkew);
  EXPECT_DOUBLE_EQ(skew.skew, 2.5);
  EXPECT_EQ(describe_routing(skew), "skew:2.5");

  for (const char* bad : {"skew:0.5", "skew:", "skew:two", "skew:2x", "skew:nan", "skew:inf"}) {
    const auto lines = problems([&] { routing_profile_from_spec(bad, "--routing"); });
    ASSERT_EQ(lines.size(), 1u) << bad;
    EXPECT_TRUE(mentions(lines, "skew:X takes a number X >= 1")) << bad;
  }
  try {
    routing_profile_from_spec("no-such-profile.json", "--routing");
    FAIL() << "a missing file was taken";
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), "--routing");
    EXPECT_NE(e.lines().front().find("no such file"), std::string::npos);
  }

  test::TempDir dir;
  const std::string path = dir.file("routing.json");
  write_routing_profile(measured(), path);
  EXPECT_EQ(routing_profile_from_spec(path), measured());
  EXPECT_EQ(describe_routing(measured()), "measured (2 layers x 3 micro-batches)");
}

TEST(RoutingProfile, EveryKindReadsBackAsWritten) {
  RoutingProfile skew;
  skew.kind = RoutingKind::kSkew;
  skew.skew = 3.25;
  skew.source = "by hand";
  RoutingProfile spread = measured();
  spread.step_spread = {0.92, 1.0, 1.0, 1.31};
  for (const RoutingProfile& r : {RoutingProfile{}, skew, measured(), spread})
    EXPECT_EQ(routing_profile_from_json(routing_profile_json(r), "x"), r);
  EXPECT_FALSE(routing_profile_json(measured()).contains("step_spread"));  // written only when measured
  EXPECT_EQ(describe_routing(spread), "measured (2 layers x 3 micro-batches) with steps spread to 1.26 x at the p95");
}

TEST(RoutingProfile, BadFilesAreRefusedNamingTheField) {
  const Json good = routing_profile_json(measured());
  const auto refused = [&](const std::function<void(Json&)>& change) {
    Json j = good;
    change(j);
    return problems([&] { routing_profile_from_json(j, "routing.json"); });
  };
  EXPECT_TRUE(mentions(refused([](Json& j) { j["slots"][1][0] = {1, 1, 1}; }), "slots[1][0]: expected 4 slot counts"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["slots"][0][2] = {1, -1, 1, 1}; }), "slots[0][2]: expected 4"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["slots"][0][2] = {0, 0, 0, 0}; }), "slots[0][2]: routes no slot"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["slots"][1].erase(0); }), "slots[1]: has 2 micro-batches"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["slots"] = Json::array(); }), "slots: expected a list of 1 to"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["experts_per_token"] = 5; }), "experts_per_token: = 5 is more than"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["kind"] = "zipf"; }), "kind: expected one of"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["schema_version"] = 2; }), "schema_version: = 2"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["skew"] = 2; }), "skew: unknown field"));  // not a measured profile's
  EXPECT_TRUE(mentions(refused([](Json& j) { j.erase("num_experts"); }), "num_experts"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = Json::array(); }), "step_spread: expected a list"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = 1.2; }), "step_spread: expected a list"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = {0.9, 0.0}; }),
                       "step_spread[1]: expected a ratio above 0"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = {1.0, "1.2"}; }), "step_spread[1]: expected a ratio"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = {1.0, 101}; }), "step_spread[1]: expected a ratio"));
  EXPECT_TRUE(mentions(refused([](Json& j) { j["step_spread"] = {1.1, 0.9}; }), "step_spread[1]: = 0.9 is below"));
  EXPECT_TRUE(refused([](Json& j) { j["step_spread"] = {0.9, 1.0, 1.4}; }).empty());
  EXPECT_TRUE(refused([](Json&) {}).empty());
  Json skew = {{"schema_version", 1}, {"kind", "skew"}, {"skew", 0.5}};
  EXPECT_TRUE(mentions(problems([&] { routing_profile_from_json(skew, "x"); }), "skew: "));
  EXPECT_FALSE(mentions(problems([&] { routing_profile_from_json(skew, "x"); }), "unknown field"));
  EXPECT_TRUE(mentions(problems([&] { routing_profile_from_json(Json::array(), "x"); }), "expected a routing profile"));
}

TEST(RoutingProfile, MismatchesWithTheModelAreNamed) {
  EXPECT_TRUE(routing_mismatches(measured(), 4, 2, 2, "--routing").empty());
  const auto d = routing_mismatches(measured(), 8, 1, 3, "--routing");
  ASSERT_EQ(d.size(), 2u);  // another depth is not a mismatch: the layers stretch
  EXPECT_EQ(d[0].path, "--routing");
  EXPECT_EQ(d[0].message, "is measured with num_experts = 4, the model has 8");
  EXPECT_EQ(d[1].message, "is measured with experts_per_token = 2, the model has 1");
  EXPECT_EQ(routing_mismatches(routing_profile_from_spec("skew:8"), 8, 2, 4, "--routing").size(), 1u);
  EXPECT_TRUE(routing_mismatches(routing_profile_from_spec("skew:7.5"), 8, 2, 4, "--routing").empty());
}

// Two experts with exponent 1: shares 1/(1 + 1/2) and (1/2)/(1 + 1/2), the busiest 4/3 of the mean.
TEST(RoutingProfile, ZipfExponentGivesTheAskedSkew) {
  EXPECT_NEAR(zipf_exponent_for_skew(4.0 / 3.0, 2), 1.0, 1e-9);
  EXPECT_EQ(zipf_exponent_for_skew(1.0, 8), 0.0);
  for (int64_t n : {4, 8, 64, 256}) {
    for (double skew : {1.1, 2.0, 3.5}) {
      const double s = zipf_exponent_for_skew(skew, n);
      double sum = 0;
      for (int64_t i = 1; i <= n; ++i) sum += std::pow(static_cast<double>(i), -s);
      EXPECT_NEAR(static_cast<double>(n) / sum, skew, 1e-9) << n << " experts, skew " << skew;
    }
  }
}

TEST(RoutingProfile, BalancedDrawsAreEven) {
  RoutingRng rng(1);
  const StepRouting step = draw_step_routing(RoutingProfile{}, 8, 3, 2, 4096, rng);
  ASSERT_EQ(step.size(), 3u);
  for (const auto& layer : step)
    for (const auto& shares : layer) EXPECT_EQ(shares, std::vector<double>(8, 0.125));
}

// Without chance (no slots given) each layer's shares are the Zipf shares in some order, the
// same order for every micro-batch of the step, and the orders differ between layers.
TEST(RoutingProfile, SkewDealsTheZipfSharesToTheExperts) {
  const RoutingProfile skew = routing_profile_from_spec("skew:3");
  RoutingRng rng(7);
  const StepRouting step = draw_step_routing(skew, 16, 4, 3, 0, rng);
  std::vector<size_t> busiest;
  for (const auto& layer : step) {
    std::vector<double> sorted = layer[0];
    std::sort(sorted.rbegin(), sorted.rend());
    EXPECT_NEAR(sorted.front() * 16, 3.0, 1e-9);
    EXPECT_NEAR(std::accumulate(sorted.begin(), sorted.end(), 0.0), 1.0, 1e-12);
    for (const auto& shares : layer) EXPECT_EQ(shares, layer[0]);
    busiest.push_back(static_cast<size_t>(std::max_element(layer[0].begin(), layer[0].end()) - layer[0].begin()));
  }
  EXPECT_GT(std::set<size_t>(busiest.begin(), busiest.end()).size(), 1u);
}

// Balanced popularity (skew 1) over 8 experts: a micro-batch of S slots gives each expert a
// binomial share, variance p (1 - p) / S with p = 1/8. Both ways of drawing one are checked:
// S = 2048 (variance 224 slots: the normal approximation) and S = 48 (5.25 slots: inversion).
TEST(RoutingProfile, ChanceSpreadOfASmallMicroBatchIsBinomial) {
  const RoutingProfile even = routing_profile_from_spec("skew:1");
  for (double slots : {2048.0, 48.0}) {
    RoutingRng rng(42);
    const StepRouting step = draw_step_routing(even, 8, 1, 4000, slots, rng);
    double sum = 0, squares = 0, n = 0;
    for (const auto& shares : step[0]) {
      EXPECT_NEAR(std::accumulate(shares.begin(), shares.end(), 0.0), 1.0, 1e-12);
      for (double x : shares) {
        EXPECT_GE(x, 0.0);
        const double whole = x * slots;
        EXPECT_NEAR(whole, std::round(whole), 1e-9);  // whole slots
        sum += x;
        squares += x * x;
        n += 1;
      }
    }
    const double mean = sum / n, variance = squares / n - mean * mean;  // the mean is 1/8 by construction
    const double expected = 0.125 * 0.875 / slots;
    EXPECT_NEAR(variance / expected, 1.0, 0.06) << slots << " slots";
  }
}

TEST(RoutingProfile, DrawsFollowTheSeed) {
  const RoutingProfile skew = routing_profile_from_spec("skew:2");
  RoutingRng a(5), b(5), c(6);
  const StepRouting first = draw_step_routing(skew, 8, 2, 4, 1000, a);
  EXPECT_EQ(first, draw_step_routing(skew, 8, 2, 4, 1000, b));
  EXPECT_NE(first, draw_step_routing(skew, 8, 2, 4, 1000, c));
}

// A measured step: each micro-batch is one recorded micro-batch, the same one in every layer.
TEST(RoutingProfile, MeasuredDrawsReplayRecordedMicroBatches) {
  const RoutingProfile r = measured();
  RoutingRng rng(3);
  const StepRouting step = draw_step_routing(r, 4, 2, 50, 1e6, rng);
  std::set<size_t> seen;
  for (size_t m = 0; m < 50; ++m) {
    size_t pick = 3;
    for (size_t j = 0; j < 3; ++j) {
      std::vector<double> shares;
      for (int64_t c : r.slots[0][j]) shares.push_back(static_cast<double>(c) / 8.0);
      if (shares == step[0][m]) pick = j;
    }
    ASSERT_LT(pick, 3u) << "micro-batch " << m << " is not a recorded one";
    std::vector<double> second;
    for (int64_t c : r.slots[1][pick]) second.push_back(static_cast<double>(c) / 8.0);
    EXPECT_EQ(step[1][m], second);
    seen.insert(pick);
  }
  EXPECT_EQ(seen.size(), 3u);
  // A model of 5 MoE layers takes the two measured ones stretched: layers 0 to 2 from the first
  // (floor(l x 2 / 5) = 0, 0, 0), 3 and 4 from the second, one recorded micro-batch throughout.
  RoutingRng again(3);
  const StepRouting deep = draw_step_routing(r, 4, 5, 50, 1e6, again);
  ASSERT_EQ(deep.size(), 5u);
  for (size_t m = 0; m < 50; ++m) {
    EXPECT_EQ(deep[0][m], step[0][m]);
    EXPECT_EQ(deep[2][m], step[0][m]);
    EXPECT_EQ(deep[3][m], step[1][m]);
    EXPECT_EQ(deep[4][m], step[1][m]);
  }
}

TEST(RoutingProfile, BusiestRankLoad) {
  const std::vector<double> shares = {0.4, 0.1, 0.25, 0.25};
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 1), 1.0);
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 2), 1.0);  // 0.5 and 0.5
  EXPECT_DOUBLE_EQ(busiest_rank_load(shares, 4), 1.6);  // 0.4 of 4 ranks
}

}  // namespace
}  // namespace moeplan
