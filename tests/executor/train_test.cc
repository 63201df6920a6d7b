// Training through the real binary on real text: resuming from a checkpoint in a new process
// gives bitwise the same losses as training straight through.

#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "moeplan/core/trace.h"
#include "moeplan/executor/training/run_measurement.h"
#include "run_fixture.h"

namespace moeplan::test {
namespace {

class Resume : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
    if (files.empty()) return;
    const Command r = prepare_data(files, dir_->file("data"), 512, 64);
    ASSERT_EQ(r.exit_code, 0) << show(r);
    model_ = write_small_model(*dir_, 512);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (model_.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  }
  static TempDir* dir_;
  static std::string model_;
};

TempDir* Resume::dir_ = nullptr;
std::string Resume::model_;

TEST_P(Resume, TwentyStepsEqualTenPlusCheckpointPlusTen) {
  const std::string precision = GetParam();
  const std::string plan = dir_->file("plan-" + precision + ".json");
  // 4 sequences of 64 per step, at most 2 per micro-batch: gradient accumulation is exercised.
  const Command made = make_plan(model_, plan, 64, 256, precision, 2);
  ASSERT_EQ(made.exit_code, 0) << show(made);
  const std::string data = dir_->file("data");
  const std::string straight = dir_->file("straight-" + precision), split = dir_->file("split-" + precision);
  const std::string common = plan + " --data " + data + " --threads 1";

  Command r = run_moeplan(("run " + common + " --out " + straight + " --steps 20"));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  r = run_moeplan(("run " + common + " --out " + split + " --steps 10 --checkpoint-every 10"));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  r = run_moeplan(("run " + common + " --out " + split + " --steps 20 --resume"));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  EXPECT_NE(r.all().find("resumed from"), std::string::npos) << show(r);

  const std::vector<Json> a = read_metrics(straight), b = read_metrics(split);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]["step"], a[i]["step"]);
    // Bitwise: the JSON numbers round-trip doubles exactly.
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(b[i]["grad_norm"].get<double>(), a[i]["grad_norm"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(b[i]["tokens_per_expert"], a[i]["tokens_per_expert"]) << "step " << i + 1;
  }
  // Training does something: the loss at step 20 is below the first one.
  EXPECT_LT(a.back()["loss"].get<double>(), a.front()["loss"].get<double>());
}

INSTANTIATE_TEST_SUITE_P(Precisions, Resume, ::testing::Values("fp32", "mixed"));

// A one-rank run writes its report and measured trace and prints predicted against measured.
// Real text in dir/data and a one-rank fp32 plan of the small model, two micro-batches of 64
// tokens a step: the plan's path, or "" without the fortunes.
std::string small_run_plan(const TempDir& dir) {
  const auto files = fortune_files({"wisdom"});
  if (files.empty()) return "";
  EXPECT_EQ(prepare_data(files, dir.file("data"), 512, 64).exit_code, 0);
  const std::string model = write_small_model(dir, 512), plan = dir.file("plan.json");
  EXPECT_EQ(make_plan(model, plan, 64, 256, "fp32", 2).exit_code, 0);
  return plan;
}

TEST(Run, WritesReportAndTraceAndComparesWithThePrediction) {
  TempDir dir;
  const std::string plan = small_run_plan(dir);
  if (plan.empty()) GTEST_SKIP() << "needs Debian's fortunes package";
  const Json planned = read_json_file(plan);
  const Command r = run_moeplan("run " + plan + " --data " + dir.file("data") + " --out " + dir.file("out") +
                                " --threads 1 --steps 3");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  for (const char* line :
       {"step time (median)", "step time (undisturbed)", "tokens/s", "peak memory per rank", "last step of rank 0"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << show(r);

  const Json report = read_json_file(dir.file("out/report.json"));
  EXPECT_EQ(report["measured"]["steps"], 3);
  // Every step's time as the metrics file has it; the figures over them leave the first out.
  std::vector<double> seconds;
  std::ifstream metrics(dir.file("out/metrics.jsonl"));
  for (std::string line; std::getline(metrics, line);) seconds.push_back(Json::parse(line)["step_s"].get<double>());
  EXPECT_EQ(report["measured"]["step_seconds"].get<std::vector<double>>(), seconds);
  ASSERT_EQ(seconds.size(), 3u);
  EXPECT_DOUBLE_EQ(report["measured"]["step_time_s"].get<double>(), (seconds[1] + seconds[2]) / 2);
  EXPECT_DOUBLE_EQ(report["measured"]["undisturbed_step_time_s"].get<double>(), std::min(seconds[1], seconds[2]));
  // Each step's share of the machine's processor time stolen by a hypervisor, where the machine
  // counts it (Linux's /proc/stat), beside the step in both files.
  if (executor::processor_times().has_value()) {
    std::vector<double> steal;
    std::ifstream lines(dir.file("out/metrics.jsonl"));
    for (std::string line; std::getline(lines, line);) steal.push_back(Json::parse(line).at("steal").get<double>());
    for (double x : steal) EXPECT_TRUE(x >= 0 && x <= 1) << x;
    EXPECT_EQ(report["measured"]["step_steal"].get<std::vector<double>>(), steal);
  }
  EXPECT_EQ(report["measured"]["ranks"], 1);
  EXPECT_EQ(report["predicted"]["step_time_s"], planned["prediction"]["step_time_s"]);
  const double step = report["measured"]["step_time_s"].get<double>();
  EXPECT_GT(step, 0);
  EXPECT_NEAR(report["relative_error"]["step_time"].get<double>(),
              step / planned["prediction"]["step_time_s"].get<double>() - 1, 1e-12);
  const int64_t peak = report["measured"]["peak_rss_bytes"].get<int64_t>();
  const int64_t baseline = report["measured"]["baseline_rss_bytes_per_rank"][0].get<int64_t>();
  EXPECT_GT(baseline, 0);
  EXPECT_GT(peak, baseline);
  const int64_t tensors = report["measured"]["peak_tensor_bytes_per_rank"][0].get<int64_t>();
  EXPECT_GT(tensors, 0);
  EXPECT_LT(tensors, peak);
  // The tokens per expert of the last step: top-2 of every token, per layer.
  const Json& load = report["measured"]["tokens_per_expert"];
  ASSERT_EQ(load.size(), 4u);
  int64_t slots = 0;
  for (const Json& n : load[0]) slots += n.get<int64_t>();
  EXPECT_EQ(slots, 2 * 256);

  // The last step as a trace: a forward and a backward per micro-batch, then the optimizer.
  const Trace trace = trace_from_json(read_json_file(dir.file("out/trace.json")), "trace.json");
  EXPECT_EQ(trace.source, "measured");
  std::vector<std::string> names;
  for (const TraceEvent& e : trace.events) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"forward", "backward", "forward", "backward", "optimizer"}));
  for (size_t i = 1; i < trace.events.size(); ++i)
    EXPECT_GE(trace.events[i].start_ns, trace.events[i - 1].start_ns + trace.events[i - 1].duration_ns);
}

// --kernel-trace N: PyTorch's profiler records step N alone into a Chrome trace, the forward's
// matrix multiplies and the backward's, which autograd runs on a thread of its own.
TEST(Run, KernelTraceRecordsTheStepsOperators) {
  TempDir dir;
  const std::string plan = small_run_plan(dir);
  if (plan.empty()) GTEST_SKIP() << "needs Debian's fortunes package";
  const Command r = run_moeplan("run " + plan + " --data " + dir.file("data") + " --out " + dir.file("out") +
                                " --threads 1 --steps 3 --kernel-trace 2");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const Json trace = read_json_file(dir.file("out/kernels-rank-0.json"));
  std::map<std::string, int64_t> calls;
  for (const Json& e : trace.at("traceEvents"))
    if (e.value("ph", "") == "X") ++calls[e.value("name", "")];
  // Per micro-batch and layer: the router and three matrices per expert that took rows, and
  // the attention's projections; the head once per micro-batch. Two micro-batches, one step.
  EXPECT_GE(calls["aten::mm"] + calls["aten::matmul"], 2 * 4) << show(r);
  EXPECT_GE(calls["autograd::engine::evaluate_function: MmBackward0"], 2 * 4);
  EXPECT_EQ(calls["aten::embedding"], 2) << "one step's two micro-batches, not the run's";
  const Command bad = run_moeplan("run " + plan + " --data " + dir.file("data") + " --out " + dir.file("bad") +
                                  " --kernel-trace 0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--kernel-trace"), std::string::npos) << show(bad);
}

// What the loss keeps grows with the vocabulary as the memory model counts it: two fp32 tensors
// of the logits' size at its peak (the softmax it keeps and, in backward, the logits' gradient;
// LibTorch's log-softmax with the negative log-likelihood keeps three). The same two-rank
// layout with two vocabularies, two micro-batches a step (the second's loss meets the first's
// gradients): the measured peak of live tensors differs by what the plans' predicted tensors
// differ by (the logits and the embedding and head states), to 10%.
TEST(Run, TheLossKeepsWhatTheMemoryModelCountsOfTheLogits) {
  TempDir dir;
  const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
  if (files.empty()) GTEST_SKIP() << "needs Debian's fortunes package";
  double measured[2], predicted[2];
  const int64_t vocabularies[2] = {2048, 8192};
  for (int i = 0; i < 2; ++i) {
    const std::string v = std::to_string(vocabularies[i]), data = dir.file("data-" + v);
    ASSERT_EQ(prepare_data(files, data, vocabularies[i], 128).exit_code, 0);
    TempDir model_dir;
    const std::string model = write_small_model(model_dir, vocabularies[i]);
    const std::string plan = dir.file("plan-" + v + ".json");
    const Command s = run_moeplan("search --gpus 2 --instance local-cpu --model " + model +
                                  " --seq-len 128 --global-batch-tokens 2048 --precision fp32 --expert-parallel-degree 1"
                                  " --hybrid-shard-degree 1 --tensor-parallel-degree 1 --pipeline-parallel-degree 1"
                                  " --checkpointing none --offload off --micro-batch 4 --target moeplan --out " + plan);
    ASSERT_EQ(s.exit_code, 0) << show(s);
    const Command r = run_moeplan("run " + plan + " --data " + data + " --out " + dir.file("out-" + v) +
                                  " --threads 1 --steps 2");
    ASSERT_EQ(r.exit_code, 0) << show(r);
    const Json report = read_json_file(dir.file("out-" + v + "/report.json"));
    measured[i] = report["measured"]["peak_tensor_bytes_per_rank"][0].get<double>();
    const Json planned = read_json_file(plan);
    predicted[i] = 0;
    for (const auto& [item, bytes] : planned["prediction"]["memory"]["device"].items())
      if (item != "framework_overhead" && item != "fragmentation") predicted[i] += bytes.get<double>();
  }
  const double grown = measured[1] - measured[0], predicted_grown = predicted[1] - predicted[0];
  EXPECT_NEAR(grown / predicted_grown, 1.0, 0.1)
      << "measured " << measured[0] << " -> " << measured[1] << " bytes, predicted " << predicted[0] << " -> "
      << predicted[1];
}

TEST(Run, RefusesToOverwriteARunWithoutResume) {
  TempDir dir;
  const auto files = fortune_files({"wisdom"});
  if (files.empty()) GTEST_SKIP() << "needs Debian's fortunes package";
  ASSERT_EQ(prepare_data(files, dir.file("data"), 512, 64).exit_code, 0);
  const std::string model = write_small_model(dir, 512), plan = dir.file("plan.json");
  ASSERT_EQ(make_plan(model, plan, 64, 128, "fp32", 2).exit_code, 0);
  const std::string run = ("run " + plan + " --data " + dir.file("data") + " --out " +
                                          dir.file("out") + " --threads 1 --steps 1");
  ASSERT_EQ(run_moeplan(run).exit_code, 0);
  const Command again = run_moeplan(run);
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.all().find("--resume"), std::string::npos) << show(again);
  // --resume without any checkpoint is an error too, not a silent fresh start.
  const Command resume = run_moeplan(run + " --resume");
  EXPECT_EQ(resume.exit_code, 2);
  EXPECT_NE(resume.all().find("no complete checkpoint"), std::string::npos) << show(resume);
  EXPECT_EQ(read_metrics(dir.file("out")).size(), 1u);
}

}  // namespace
}  // namespace moeplan::test
