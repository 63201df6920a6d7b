// Multi-rank training through the real binary, on real gloo process groups between local
// processes: every layout of 4 ranks trains the same model to the same losses as one rank with
// the same global batch, and checkpoints move between layouts.

#include <gtest/gtest.h>

#include <cmath>

#include "run_fixture.h"

namespace moeplan::test {
namespace {

struct Layout {
  std::string name;
  int64_t e, s;
  std::string checkpointing;
  bool offload;
  std::string dispatcher = "alltoall";
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) { return info.param.name; }
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class Parallel : public ::testing::TestWithParam<Layout> {
 protected:
  static constexpr int64_t kSteps = 20;
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
    if (files.empty()) return;
    const Command r = prepare_data(files, dir_->file("data"), 512, 64);
    ASSERT_EQ(r.exit_code, 0) << show(r);
    model_ = write_small_model(*dir_, 512);
    // One rank, 4 micro-batches of one sequence: what 4 ranks of one sequence each train on.
    reference_plan_ = dir_->file("plan-1.json");
    const Command made = make_plan(model_, reference_plan_, 64, 256, "fp32", 1);
    ASSERT_EQ(made.exit_code, 0) << show(made);
    const Command run = run_moeplan("run " + reference_plan_ + " --data " + dir_->file("data") + " --out " +
                                    dir_->file("reference") + " --steps " + std::to_string(kSteps));
    ASSERT_EQ(run.exit_code, 0) << show(run);
    reference_ = read_metrics(dir_->file("reference"));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (model_.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
    ASSERT_EQ(reference_.size(), static_cast<size_t>(kSteps));
  }

  // The reference plan spread over 4 ranks with the layout's degrees.
  static std::string plan_for(const Layout& l) {
    Json plan = read_json_file(reference_plan_);
    Json& p = plan["parallel"];
    p["world_size"] = 4;
    p["expert_parallel_degree"] = l.e;
    p["hybrid_shard_degree"] = l.s;
    p["replica_degree"] = 4 / (l.e * l.s);
    p["micro_batch_size"] = 1;
    p["gradient_accumulation_steps"] = 1;
    p["activation_checkpointing"] = l.checkpointing;
    p["activation_offloading"] = l.offload;
    plan["moe"]["dispatcher"] = l.dispatcher;
    // Four ranks on this 2-vCPU machine: oversubscribed, which changes the speed, not the result.
    plan["cluster"]["num_nodes"] = 2;
    plan["alternatives"] = Json::array();
    return dir_->write("plan-" + l.name + ".json", plan);
  }

  static TempDir* dir_;
  static std::string model_, reference_plan_;
  static std::vector<Json> reference_;
};

TempDir* Parallel::dir_ = nullptr;
std::string Parallel::model_, Parallel::reference_plan_;
std::vector<Json> Parallel::reference_;

TEST_P(Parallel, MatchesTheOneRankLossCurve) {
  const Layout& l = GetParam();
  const std::string out = dir_->file("run-" + l.name);
  const Command r = run_moeplan("run " + plan_for(l) + " --data " + dir_->file("data") + " --out " + out +
                                " --steps " + std::to_string(kSteps) + " --timeout 60");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const std::vector<Json> m = read_metrics(out);
  ASSERT_EQ(m.size(), static_cast<size_t>(kSteps)) << show(r);
  for (size_t i = 0; i < m.size(); ++i) {
    const double a = reference_[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
    EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a)) << "step " << i + 1 << ": one rank " << a << ", " << l.name << " " << b;
    // Routing decisions are discrete: the same tokens reach the same experts.
    EXPECT_EQ(m[i]["tokens_per_expert"], reference_[i]["tokens_per_expert"]) << "step " << i + 1;
    EXPECT_EQ(m[i]["tokens"], reference_[i]["tokens"]);
  }
  // The run leaves its measured trace and report.
  EXPECT_TRUE(std::filesystem::exists(out + "/trace.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/report.json"));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Parallel,
    ::testing::Values(Layout{"E1S1R4", 1, 1, "none", false}, Layout{"E2S2R1", 2, 2, "none", false},
                      Layout{"E4S1R1", 4, 1, "none", false}, Layout{"E2S1R2", 2, 1, "none", false},
                      Layout{"E1S1R4_full", 1, 1, "full", false}, Layout{"E2S2R1_full", 2, 2, "full", false},
                      Layout{"E4S1R1_selective", 4, 1, "selective", false},
                      Layout{"E2S1R2_selective", 2, 1, "selective", false},
                      Layout{"E1S1R4_full_offload", 1, 1, "full", true},
                      Layout{"E2S2R1_full_offload", 2, 2, "full", true},
                      Layout{"E4S1R1_selective_offload", 4, 1, "selective", true},
                      Layout{"E2S1R2_full_offload", 2, 1, "full", true},
                      Layout{"E4S1R1_allgather", 4, 1, "none", false, "allgather"}),
    layout_name);

}  // namespace
}  // namespace moeplan::test
