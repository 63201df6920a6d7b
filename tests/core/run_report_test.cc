#include "moeplan/core/run_report.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moeplan/core/fit.h"
#include "test_support.h"

namespace moeplan {
namespace {

RunReport two_rank_report() {
  RunReport r;
  r.parallel = "E2 S1 R1 RSE ckpt=none mbs=8 ga=2";
  r.profile = "local-cpu";
  r.where = "CPU ranks (gloo)";
  r.ranks = 2;
  r.set_step_seconds({1.5, 0.9, 0.8, 1.2, 0.9, 0.85, 1.0, 0.95});
  r.tokens_per_s = 9000;
  r.peak_rss_bytes_per_rank = {700, 800};
  r.baseline_rss_bytes_per_rank = {300, 310};
  r.peak_tensor_bytes_per_rank = {200, 220};
  r.peak_step_tensor_bytes_per_rank = {150, 170};
  r.busiest_expert_rows_per_rank = {40, 52};
  r.peak_rss_bytes = 800;
  r.predicted_step_time_s = 0.75;
  r.predicted_tokens_per_s = 10800;
  r.predicted_bytes_per_rank = 1000;
  r.tokens_per_expert = {{10, 20, 30, 4}, {16, 16, 16, 16}};
  r.phase_seconds = {{"forward", 0.3}, {"expert.all_to_all", 0.1}, {"shard.all_gather", 0.05},
                     {"L0.offload", 0.02}, {"L0.reload", 0.01}, {"backward", 0.4}};
  return r;
}

// The diagnostics the reader reports for json; fails the test if it accepts it.
std::vector<Diagnostic> problems(const Json& json) {
  try {
    run_report_from_json(json, "run/report.json");
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), "run/report.json");
    return e.diagnostics();
  }
  ADD_FAILURE() << "run_report_from_json accepted " << json.dump();
  return {};
}

bool names(const std::vector<Diagnostic>& found, const std::string& path) {
  for (const Diagnostic& d : found)
    if (d.path == path) return true;
  return false;
}

TEST(RunReport, WrittenAndReadBackTheSame) {
  const RunReport r = two_rank_report();
  const Json written = to_json(r);
  const RunReport back = run_report_from_json(written, "report.json");
  EXPECT_EQ(to_json(back), written);
  EXPECT_EQ(back.tokens_per_expert, r.tokens_per_expert);
  EXPECT_EQ(back.phase_seconds, r.phase_seconds);
  // The file also carries the errors, for whoever reads it by eye: the same numbers.
  EXPECT_DOUBLE_EQ(written["relative_error"]["step_time"].get<double>(), 0.9 / 0.75 - 1);
  EXPECT_DOUBLE_EQ(back.step_time_error(), 0.9 / 0.75 - 1);
  EXPECT_DOUBLE_EQ(back.memory_error(), 800.0 / 1000 - 1);
  EXPECT_EQ(back.peak_step_tensor_bytes(), 170);
  EXPECT_EQ(back.busiest_expert_rows(), 52);
}

// A GPU run: the caching allocator's figures are written, read back, and are what the memory
// model's device bytes are held to; a CPU run's report has none of them.
TEST(RunReport, GpuRunsAreHeldToTheirDeviceMemory) {
  RunReport r = two_rank_report();
  EXPECT_FALSE(to_json(r)["measured"].contains("peak_device_bytes"));
  r.peak_device_allocated_bytes_per_rank = {850, 870};
  r.peak_device_reserved_bytes_per_rank = {900, 950};
  r.peak_device_bytes_per_rank = {1000, 1100};
  r.peak_device_bytes = 1100;
  r.device_workspace_bytes_per_rank = {64, 64};
  EXPECT_EQ(r.peak_memory_bytes(), 1100);
  EXPECT_NEAR(r.memory_error(), 0.1, 1e-12);
  const Json written = to_json(r);
  const RunReport back = run_report_from_json(written, "report.json");
  EXPECT_EQ(to_json(back), written);
  EXPECT_EQ(back.peak_device_reserved_bytes_per_rank, r.peak_device_reserved_bytes_per_rank);
  EXPECT_EQ(back.device_workspace_bytes_per_rank, r.device_workspace_bytes_per_rank);
  EXPECT_NEAR(written["relative_error"]["peak_memory"].get<double>(), 0.1, 1e-12);
  Json older = written;  // a report written before the workspaces were counted
  older["measured"].erase("device_workspace_bytes_per_rank");
  EXPECT_TRUE(run_report_from_json(older, "report.json").device_workspace_bytes_per_rank.empty());
}

TEST(RunReport, StepFiguresLeaveTheWarmUpStepOut) {
  const RunReport r = two_rank_report();
  EXPECT_EQ(r.steps, 8);
  EXPECT_DOUBLE_EQ(r.step_time_s, 0.9);               // of 0.8 0.85 0.9 0.9 0.95 1.0 1.2
  EXPECT_DOUBLE_EQ(r.undisturbed_step_time_s, 0.85);  // index (7 - 1) / 4 = 1
  EXPECT_DOUBLE_EQ(r.undisturbed_step_time_error(), 0.85 / 0.75 - 1);
  RunReport one;
  one.set_step_seconds({2.0});  // a single step is all there is
  EXPECT_DOUBLE_EQ(one.step_time_s, 2.0);
  EXPECT_DOUBLE_EQ(one.undisturbed_step_time_s, 2.0);
  EXPECT_DOUBLE_EQ(lower_quartile({}), 0);
  EXPECT_DOUBLE_EQ(lower_quartile({3, 1, 2, 4, 5}), 2);
}

// Each step's steal share, where the machine says it: written, read back, and counted over the
// steps the median counts (the warm-up step left out).
TEST(RunReport, TheStepsStealIsKeptAndCounted) {
  RunReport r = two_rank_report();
  EXPECT_FALSE(to_json(r)["measured"].contains("step_steal"));
  EXPECT_DOUBLE_EQ(r.mean_steal(), 0);
  EXPECT_EQ(r.stolen_steps(), 0);
  r.step_steal = {0.5, 0, 0, 0.02, 0, 0.3, 0.009, 0.01};
  EXPECT_DOUBLE_EQ(r.mean_steal(), (0.02 + 0.3 + 0.009 + 0.01) / 7);
  EXPECT_EQ(r.stolen_steps(), 3);  // 0.02, 0.3 and 0.01; not the first step's 0.5
  const Json written = to_json(r);
  EXPECT_EQ(run_report_from_json(written, "report.json").step_steal, r.step_steal);
  Json j = written;
  j["measured"]["step_steal"][3] = 2;
  EXPECT_TRUE(names(problems(j), "measured.step_steal[3]"));
  j = written;
  j["measured"]["step_steal"].erase(0);  // seven shares for eight steps
  EXPECT_TRUE(names(problems(j), "measured.step_steal"));
}

TEST(RunReport, MeasuredSpansTakeTheSimulatorsPhaseNames) {
  const std::vector<std::pair<std::string, double>> phases = two_rank_report().phases();
  const std::vector<std::pair<std::string, double>> expected = {
      {"forward", 0.3}, {"all_to_all", 0.1}, {"all_gather", 0.05}, {"copy", 0.03}, {"backward", 0.4}};
  ASSERT_EQ(phases.size(), expected.size());
  for (size_t i = 0; i < phases.size(); ++i) {
    EXPECT_EQ(phases[i].first, expected[i].first);
    EXPECT_NEAR(phases[i].second, expected[i].second, 1e-12);
  }
  EXPECT_EQ(phase_of_measured_span(phase::kOptimizer), "optimizer");
}

TEST(RunReport, EveryBadFieldIsNamed) {
  Json j = to_json(two_rank_report());
  j["measured"]["step_time_s"] = "fast";
  j["measured"]["peak_rss_bytes_per_rank"][1] = -5;
  j["measured"]["tokens_per_expert"][0] = "lots";
  j["measured"]["step_seconds"][2] = -1;
  j["predicted"].erase("device_bytes_per_rank");
  j["plan"]["extra"] = 1;
  const std::vector<Diagnostic> found = problems(j);
  EXPECT_TRUE(names(found, "measured.step_time_s"));
  EXPECT_TRUE(names(found, "measured.peak_rss_bytes_per_rank[1]"));
  EXPECT_TRUE(names(found, "measured.tokens_per_expert[0]"));
  EXPECT_TRUE(names(found, "measured.step_seconds[2]"));
  EXPECT_TRUE(names(found, "predicted.device_bytes_per_rank"));
  EXPECT_TRUE(names(found, "plan.extra"));
}

TEST(RunReport, NotAReportOrAnotherVersionIsRefused) {
  EXPECT_TRUE(names(problems(Json::array()), ""));
  Json j = to_json(two_rank_report());
  j["schema_version"] = 1;  // before the report carried every step's time
  EXPECT_TRUE(names(problems(j), "schema_version"));
  j = to_json(two_rank_report());
  j.erase("measured");
  EXPECT_TRUE(names(problems(j), "measured"));
  j = to_json(two_rank_report());
  j["measured"]["ranks"] = 3;  // two ranks' figures
  EXPECT_TRUE(names(problems(j), "measured.peak_rss_bytes_per_rank"));
  j = to_json(two_rank_report());
  j["measured"]["steps"] = 9;  // eight steps' times
  EXPECT_TRUE(names(problems(j), "measured.step_seconds"));
  j = to_json(two_rank_report());
  j["measured"]["undisturbed_step_time_s"] = 0.8;  // the steps' lower quartile is 0.85
  EXPECT_TRUE(names(problems(j), "measured.undisturbed_step_time_s"));
}

TEST(RunReport, AMissingFileIsAnInputErrorNamingIt) {
  const test::TempDir tmp;
  EXPECT_THROW(read_run_report(tmp.file("report.json")), InputError);
}

}  // namespace
}  // namespace moeplan
