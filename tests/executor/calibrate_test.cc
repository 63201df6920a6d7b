// The closed loop on this machine: `moeplan calibrate` measures two CPU ranks and writes a
// profile; `moeplan validate` plans, runs and compares a reduced matrix with it; `moeplan
// simulate --measured` compares one run phase by phase. Real gloo, real text, the real binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/training/run_measurement.h"
#include "moeplan/simulator/op_costs.h"
#include "run_fixture.h"

namespace moeplan::test {
namespace {

TEST(Calibrate, ProfileFromTwoRanksValidatesAReducedMatrix) {
  const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
  if (files.empty()) GTEST_SKIP() << "needs the fortunes package (real English text)";
  const TempDir dir;
  const std::string model = write_small_model(dir, 512);
  const std::string data = dir.file("data");
  ASSERT_EQ(prepare_data(files, data, 512, 256).exit_code, 0);

  // The reduced matrix, held to bounds: peak memory to the acceptance bound (15%), step time
  // to median 25% and worst 40%, and the predicted order mostly kept. Two calibration passes,
  // three steps and two rounds on a shared machine are noisier than the full matrix; measured
  // here: median 5 to 15%, worst 16 to 21%, memory 5 to 6%, Kendall tau 0.67 to 1
  // (docs/validation.md). A shared machine's speed also drifts: once, every run of a validation
  // measured 15 to 67% slower than the calibration of a minute before, both ranks alike, and
  // once in CI two calibrations and validations in a row did, at the same binary's measured
  // step times as usual when run again. A broken timing bound therefore calibrates and
  // validates again, three times in all; any other failure, or a third broken bound, fails.
  const std::string profile = dir.file("local-test.json");
  std::string val_dir;
  Command cal, val;
  constexpr int kAttempts = 3;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    cal = run_moeplan("calibrate --ranks 2 --quick --passes 2 --model " + model + " --name local-test --out " + profile);
    ASSERT_EQ(cal.exit_code, 0) << show(cal);
    val_dir = dir.file("val" + std::to_string(attempt));
    val = run_moeplan("validate --profile " + profile + " --model " + model + " --data " + data + " --out " + val_dir +
                      " --quick --steps 3 --rounds 2 --check --max-median-error 0.25 --max-worst-error 0.4"
                      " --max-memory-error 0.15 --min-kendall 0.3");
    const bool timing_bound = val.err.find("bound broken: median step-time") != std::string::npos ||
                              val.err.find("bound broken: worst step-time") != std::string::npos ||
                              val.err.find("bound broken: Kendall") != std::string::npos;
    if (val.exit_code == 0 || !timing_bound || attempt == kAttempts) break;
    std::cout << "attempt " << attempt << " broke a timing bound; calibrating again:\n" << show(val) << "\n";
  }
  EXPECT_NE(cal.out.find("calibrate ["), std::string::npos) << "progress is shown";
  const ClusterSpec c = read_cluster_file(profile);
  EXPECT_EQ(c.name, "local-test");
  EXPECT_EQ(c.gpus_per_node, 2);
  EXPECT_FALSE(c.comm_overlaps_compute);
  EXPECT_EQ(c.op_times.vocab_size, 512);
  EXPECT_EQ(c.op_times.seq_len, 256);
  EXPECT_EQ(c.op_times.precision, "fp32");
  for (std::string_view name : kOpTimeCurves) {
    const CurvePoints& curve = op_time_curve(c.op_times, name);
    ASSERT_FALSE(curve.empty()) << name;
    for (const auto& [x, seconds] : curve) EXPECT_GT(seconds, 0) << name << " at " << x;
  }
  // Two ranks: the operations split over both, as tensor parallelism runs them.
  ASSERT_EQ(c.op_times.tensor_splits.size(), 1u);
  ASSERT_NE(c.op_times.split(2), nullptr);
  for (std::string_view name : kTensorSplitCurves) {
    const CurvePoints& curve = split_curve(*c.op_times.split(2), name);
    ASSERT_FALSE(curve.empty()) << name;
    for (const auto& [x, seconds] : curve) EXPECT_GT(seconds, 0) << name << " at " << x;
  }
  // And the experts over both: the whole micro-batch with its exchanges timed apart.
  ASSERT_EQ(c.op_times.expert_splits.size(), 1u);
  ASSERT_NE(c.op_times.expert_split(2), nullptr);
  for (size_t i = 0; i < kExpertSplitCurves.size(); ++i) {
    const CurvePoints& curve = c.op_times.expert_split(2)->*kExpertSplitCurveFields[i];
    ASSERT_EQ(curve.size(), c.op_times.micro_batch_forward.size()) << kExpertSplitCurves[i];
    for (const auto& [x, seconds] : curve) EXPECT_GE(seconds, 0) << kExpertSplitCurves[i] << " at " << x;
  }
  EXPECT_GT(c.op_times.expert_split(2)->micro_batch_backward.back().second, 0);
  // And the states sharded over both: the whole micro-batch with every unit gathered.
  ASSERT_NE(c.op_times.shard_split(2), nullptr);
  for (size_t i = 0; i < kShardSplitCurves.size(); ++i) {
    const CurvePoints& curve = c.op_times.shard_split(2)->*kShardSplitCurveFields[i];
    ASSERT_EQ(curve.size(), c.op_times.micro_batch_forward.size()) << kShardSplitCurves[i];
    for (const auto& [x, seconds] : curve) EXPECT_GT(seconds, 0) << kShardSplitCurves[i] << " at " << x;
  }
  for (const CollectiveFit* f : {&c.all_gather_fit, &c.all_to_all_fit, &c.all_reduce_fit, &c.reduce_scatter_fit}) {
    EXPECT_GT(f->bandwidth_bytes_per_s, 1e6);
    EXPECT_LT(f->latency_s, 0.1);
  }
  EXPECT_FALSE(c.all_gather_fit.points.empty()) << "measured at the model's unit sizes";
  // Each kind after four stretches of compute, longer and longer, costing nothing negative.
  for (std::string_view kind : kAfterComputeKinds) {
    const CurvePoints& curve = *c.after_compute.of(kind);
    EXPECT_GE(curve.size(), 3u) << kind;
    for (size_t i = 0; i < curve.size(); ++i) {
      EXPECT_GE(curve[i].second, 0) << kind;
      if (i > 0) {
        EXPECT_GT(curve[i].first, curve[i - 1].first) << kind;
      }
    }
  }
  EXPECT_NE(c.sources.at("framework.collective_after_compute").find("lockstep"), std::string::npos);
  EXPECT_GT(c.peak_fp32_flops, 1e9);
  EXPECT_NE(c.sources.at("framework.op_times").find("moeplan calibrate"), std::string::npos);
  const Json raw = read_json_file(dir.file("local-test.measured.json"));
  EXPECT_EQ(raw.at("collectives").size(), 4u);
  // Each time is the lower quartile of its passes (of two: the faster), so no pass ran any
  // figure faster than the one kept, and neither pass is faster in the median of the figures.
  ASSERT_EQ(raw.at("passes").get<int>(), 2);
  const Json& slowdown = raw.at("pass_slowdown");
  ASSERT_EQ(slowdown.size(), 2u);
  const double a = slowdown[0].get<double>(), b = slowdown[1].get<double>();
  EXPECT_GE(a, 1.0 - 1e-9);
  EXPECT_GE(b, 1.0 - 1e-9);
  // Where the machine counts a hypervisor's steal, each pass says how much it took.
  if (executor::processor_times().has_value()) {
    ASSERT_EQ(raw.at("pass_steal").size(), 2u);
    for (const Json& steal : raw.at("pass_steal")) {
      EXPECT_GE(steal.get<double>(), 0.0);
      EXPECT_LE(steal.get<double>(), 1.0);
    }
  }

  EXPECT_EQ(val.exit_code, 0) << show(val);
  const Json v = read_json_file(val_dir + "/validation.json");
  std::cout << "reduced matrix: " << v.at("summary").dump() << "\n";
  // Four of experts, shards and replicas, one tensor split and one pipeline, each family's
  // errors apart.
  ASSERT_EQ(v.at("configurations").size(), 6u);
  ASSERT_EQ(v.at("by_layout").size(), 3u);
  EXPECT_EQ(v.at("by_layout")[1].at("layouts"), "tensor split");
  EXPECT_EQ(v.at("by_layout")[1].at("configurations"), 1);
  for (const Json& row : v.at("configurations")) {
    EXPECT_GT(row.at("predicted_step_time_s").get<double>(), 0);
    // The fastest of the two rounds counts; the median round is reported beside it.
    const Json& rounds = row.at("rounds");
    ASSERT_EQ(rounds.size(), 2u);
    const double fastest = std::min(rounds[0].at("measured_step_time_s").get<double>(),
                                    rounds[1].at("measured_step_time_s").get<double>());
    EXPECT_GT(fastest, 0);
    EXPECT_EQ(row.at("measured_step_time_s").get<double>(), fastest);
    EXPECT_GE(row.at("median_round_step_time_s").get<double>(), fastest);
    for (const Json& r : rounds) {
      EXPECT_GE(r.at("slowest_processor").get<double>(), 1.0);
      // The share of the machine a hypervisor took over the run's steps (0 where none, or where
      // the machine does not say).
      EXPECT_GE(r.at("steal").get<double>(), 0.0);
      EXPECT_LE(r.at("steal").get<double>(), 1.0);
      // Each run's steps predicted from its own routing: at least the plan's balanced step.
      EXPECT_GT(r.at("routed_step_time_s").get<double>(), 0);
    }
    EXPECT_NEAR(row.at("routed_step_time_error").get<double>(),
                row.at("measured_step_time_s").get<double>() / row.at("routed_step_time_s").get<double>() - 1.0, 1e-12);
  }
  const double tau = v.at("summary").at("kendall_tau").get<double>();
  EXPECT_GE(tau, -1.0);
  EXPECT_LE(tau, 1.0);
  const std::string svg = read_text(val_dir + "/validation.svg");
  size_t circles = 0;
  for (size_t at = svg.find("<circle"); at != std::string::npos; at = svg.find("<circle", at + 1)) ++circles;
  EXPECT_EQ(circles, 6u);
  EXPECT_NE(read_text(val_dir + "/validation.md").find("Kendall tau"), std::string::npos);
  EXPECT_NE(read_text(val_dir + "/validation.md").find("with each run's measured routing"), std::string::npos);

  // The framework overhead is what a data-parallel run holds beyond its tensors (its peak
  // resident set less its peak of live tensors, the rank with the larger resident set), to 10%.
  const double overhead = static_cast<double>(c.framework_overhead_bytes);
  EXPECT_NE(c.sources.at("framework.overhead_bytes").find("optimizer steps"), std::string::npos);
  int data_parallel_runs = 0;
  for (const Json& row : v.at("configurations")) {
    const std::string name = row.at("name").get<std::string>();
    if (name.rfind("E1S1R2", 0) != 0) continue;
    const Json report = read_json_file(val_dir + "/" + name + "/run-1/report.json");
    const Json& m = report.at("measured");
    size_t rank = 0;
    for (size_t r = 1; r < m.at("peak_rss_bytes_per_rank").size(); ++r)
      if (m.at("peak_rss_bytes_per_rank")[r].get<double>() > m.at("peak_rss_bytes_per_rank")[rank].get<double>()) rank = r;
    const double beyond = m.at("peak_rss_bytes_per_rank")[rank].get<double>() -
                          m.at("peak_tensor_bytes_per_rank")[rank].get<double>();
    EXPECT_NEAR(beyond / overhead, 1.0, 0.1) << name << ": " << beyond / (1 << 20) << " MiB beyond tensors, "
                                             << overhead / (1 << 20) << " MiB calibrated";
    std::cout << name << ": " << beyond / (1 << 20) << " MiB beyond tensors, " << overhead / (1 << 20)
              << " MiB calibrated\n";
    ++data_parallel_runs;
  }
  EXPECT_GT(data_parallel_runs, 0);

  // Fed back: the first run's report against its plan, phase by phase.
  const std::string first = val_dir + "/" + v.at("configurations")[0].at("name").get<std::string>();
  const Command sim = run_moeplan("simulate " + first + "/plan.json --measured " + first + "/run-1/report.json");
  ASSERT_EQ(sim.exit_code, 0) << show(sim);
  for (const char* phase :
       {"forward", "backward", "optimizer", "step (median)", "step (undisturbed)", "measured expert load"})
    EXPECT_NE(sim.out.find(phase), std::string::npos) << phase << "\n" << sim.out;
}

// A DeepSeek-shaped model (latent attention, a shared expert, a dense first block, a prediction
// module): calibration measures its operations and whole micro-batches at its blocks, and the
// plans of it are priced from them, not from FLOPs (docs/validation.md, "Qwen3- and
// DeepSeek-shaped models").
TEST(Calibrate, DeepSeekBlocksAreMeasuredForItsPlans) {
  const TempDir dir;
  const std::string profile = dir.file("deepseek.json");
  const Command cal =
      run_moeplan("calibrate --ranks 2 --quick --passes 1 --model deepseek-v3-tiny --seq-len 64 --out " + profile);
  ASSERT_EQ(cal.exit_code, 0) << show(cal);
  const ClusterSpec c = read_cluster_file(profile);
  const ModelSpec m = read_model_file(profile_path("models/deepseek-v3-tiny.json"));
  EXPECT_EQ(c.op_times.blocks, OpTimesBlocks::of(m));
  EXPECT_GT(c.op_times.blocks.kv_lora_rank, 0);
  EXPECT_GT(c.op_times.blocks.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.op_times.blocks.mtp_layers, 1);
  EXPECT_FALSE(c.op_times.micro_batch_forward.empty());
  const std::string plan_path = dir.file("plan.json");
  const Command search = run_moeplan("search --gpus 2 --instance " + profile +
                                     " --model deepseek-v3-tiny --seq-len 64 --global-batch-tokens 1024 "
                                     "--precision fp32 --target moeplan --out " + plan_path);
  ASSERT_EQ(search.exit_code, 0) << show(search);
  const Plan plan = read_plan_file(plan_path);
  EXPECT_TRUE(sim::op_times_apply({plan.model, plan.cluster, plan.parallel, plan.moe, plan.training}));
  // Another model's plan on the same profile is not priced from them.
  ModelSpec without_mtp = plan.model;
  without_mtp.mtp_layers = 0;
  EXPECT_FALSE(sim::op_times_apply({without_mtp, plan.cluster, plan.parallel, plan.moe, plan.training}));
}

TEST(Calibrate, BadInputIsNamed) {
  const TempDir dir;
  const Command out = run_moeplan("calibrate --ranks 2 --out /nonexistent-folder/p.json");
  EXPECT_EQ(out.exit_code, 2) << show(out);
  EXPECT_NE(out.err.find("--out"), std::string::npos) << show(out);
  const Command data = run_moeplan("validate --profile " + profile_path("hardware/local-cpu.json") + " --data " +
                                   dir.file("none") + " --out " + dir.file("val"));
  EXPECT_EQ(data.exit_code, 2) << show(data);
  EXPECT_NE(data.err.find("--data"), std::string::npos) << show(data);
  const Command report = run_moeplan("simulate " + dir.write("plan.json", Json::object()) + " --measured x.json");
  EXPECT_EQ(report.exit_code, 2) << show(report);
}

}  // namespace
}  // namespace moeplan::test
