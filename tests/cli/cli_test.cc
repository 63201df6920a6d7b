// Runs the real `moeplan` executable, as a user would, in a fresh folder per test.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/routing_profile.h"
#include "moeplan/core/step_record.h"
#include "moeplan/frameworks/training_log.h"
#include "moeplan/planner/training_time.h"
#include "moeplan/validation/compare_log.h"
#include "moeplan/validation/matrix.h"
#include "moeplan/validation/routing_check.h"
#include "moeplan/core/moe_load.h"
#include "moeplan/simulator/analytic.h"
#include "test_support.h"

namespace moeplan {
namespace {

namespace fs = std::filesystem;

using test::read_text;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Single quotes for the shell.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Outcome {
  int exit_code = -1;  // -1 when the process did not exit normally (killed by a signal)
  int signal = 0;
  std::string out;
  std::string err;
  std::vector<std::string> err_lines() const { return lines_of(err); }
};

// A fresh test::TempDir; commands run in it.
class Workdir : public test::TempDir {
 public:
  fs::path operator/(const std::string& name) const { return path() / name; }

  // Runs `moeplan <args>` here. MOEPLAN_PROFILES is unset so the built-in profile folder is used.
  Outcome moeplan(const std::string& args) const {
    const fs::path out = path() / ".stdout";
    const fs::path err = path() / ".stderr";
    const std::string command = "cd " + quoted(path().string()) + " && env -u MOEPLAN_PROFILES " +
                                quoted(MOEPLAN_BINARY) + " " + args + " >" + quoted(out.string()) + " 2>" +
                                quoted(err.string());
    const int status = std::system(command.c_str());
    Outcome run;
    if (WIFEXITED(status)) {
      run.exit_code = WEXITSTATUS(status);
      // sh reports a child killed by signal n as exit code 128 + n.
      if (run.exit_code > 128) run.signal = run.exit_code - 128;
    } else if (WIFSIGNALED(status)) {
      run.signal = WTERMSIG(status);
    }
    run.out = read_text(out);
    run.err = read_text(err);
    fs::remove(out);
    fs::remove(err);
    return run;
  }
};

std::string show(const Outcome& run) {
  return "exit " + std::to_string(run.exit_code) + ", signal " + std::to_string(run.signal) + "\nstdout:\n" +
         run.out.substr(0, 2000) + "\nstderr:\n" + run.err.substr(0, 2000);
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

class Cli : public testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(MOEPLAN_BINARY)) GTEST_SKIP() << "moeplan binary not built: " << MOEPLAN_BINARY;
  }
  // plan.json written by `moeplan search --gpus 16` in a fresh folder, read once per test binary.
  static const std::string& searched_plan_text() {
    static const std::string text = [] {
      Workdir dir;
      const Outcome run = dir.moeplan("search --gpus 16");
      if (run.exit_code != 0) return std::string();
      return read_text(dir / "plan.json");
    }();
    return text;
  }
};

TEST_F(Cli, SearchWritesAPlanThatCheckAccepts) {
  Workdir dir;
  const Outcome search = dir.moeplan("search --gpus 16");
  ASSERT_EQ(search.exit_code, 0) << show(search);
  EXPECT_EQ(search.err, "");
  ASSERT_TRUE(fs::exists(dir / "plan.json"));
  EXPECT_NE(search.out.find("wrote plan.json ("), std::string::npos) << show(search);

  const Outcome check = dir.moeplan("check plan.json");
  ASSERT_EQ(check.exit_code, 0) << show(check);
  EXPECT_TRUE(starts_with(check.out, "plan.json: ok: ")) << show(check);
  EXPECT_EQ(check.err, "");

  // What was written is a complete plan for the command line that made it.
  const Plan plan = read_plan_file((dir / "plan.json").string());
  EXPECT_EQ(plan.parallel.world_size, 16);
  EXPECT_EQ(plan.cluster.num_nodes, 2);
  EXPECT_EQ(plan.provenance.command, "moeplan search --gpus 16");
  // No temporary file is left next to it.
  for (const auto& entry : fs::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename(), "plan.json");
}

// The plan is written as soon as it is chosen: a file that cannot be written is one line naming
// it, exit 2, before any table is printed about a plan that went nowhere.
TEST_F(Cli, SearchToAFolderThatIsNotThereStopsBeforeTheTable) {
  Workdir dir;
  const Outcome search = dir.moeplan("search --gpus 16 --out missing/plan.json");
  EXPECT_EQ(search.exit_code, 2) << show(search);
  ASSERT_EQ(search.err_lines().size(), 1u) << show(search);
  EXPECT_TRUE(starts_with(search.err, "moeplan: error: missing/plan.json: ")) << show(search);
  EXPECT_NE(search.out.find("moeplan search: mixtral-8x7b"), std::string::npos) << show(search);
  EXPECT_EQ(search.out.find("wrote"), std::string::npos) << show(search);
  EXPECT_EQ(search.out.find("configurations:"), std::string::npos) << show(search);
  EXPECT_EQ(search.out.find("step(s)"), std::string::npos) << show(search);
  EXPECT_FALSE(fs::exists(dir / "missing"));
}

// A calibrated profile's operation times hold the tensor splits it measured; the table says
// when it shows a plan with another split, which is then estimated from FLOPs.
TEST_F(Cli, SearchSaysWhenAPlansTensorSplitWasNotMeasured) {
  Workdir dir;
  Json profile = read_json_file(test::profile_path("../docs/validation/local-2cpu.json"));
  profile["framework"]["op_times"].erase("tensor_splits");
  std::ofstream(dir / "unsplit.json") << profile.dump();
  const std::string search = "search --gpus 2 --model mixtral-tiny --seq-len 256 --global-batch-tokens 8192 "
                             "--precision fp32 --max-micro-batch 8 --tensor-parallel-degree 2 --instance ";
  const Outcome unsplit = dir.moeplan(search + "unsplit.json --out a.json");
  ASSERT_EQ(unsplit.exit_code, 0) << show(unsplit);
  EXPECT_NE(unsplit.out.find("has no operation times measured at T = 2"), std::string::npos) << show(unsplit);

  // The same profile with operations measured at T = 2 (the unsplit ones halved will do).
  Json split = {{"tensor_parallel_degree", 2}};
  for (const char* name : {"attention_forward", "attention_backward", "expert_forward", "expert_backward", "head"}) {
    split[name] = profile["framework"]["op_times"][name];
    for (Json& point : split[name]) point[1] = point[1].get<double>() / 2;
  }
  profile["framework"]["op_times"]["tensor_splits"] = Json::array({split});
  std::ofstream(dir / "split.json") << profile.dump();
  const Outcome measured = dir.moeplan(search + "split.json --out b.json");
  ASSERT_EQ(measured.exit_code, 0) << show(measured);
  EXPECT_EQ(measured.out.find("no operation times measured"), std::string::npos) << show(measured);
  EXPECT_EQ(measured.out.find("context ranks"), std::string::npos) << show(measured);
  // Context ranks split each sequence, which the operations were not measured on.
  const Outcome context = dir.moeplan(
      "search --gpus 2 --model mixtral-tiny --seq-len 256 --global-batch-tokens 8192 --precision fp32 "
      "--max-micro-batch 8 --context-parallel-degree 2 --instance split.json --out c.json");
  ASSERT_EQ(context.exit_code, 0) << show(context);
  EXPECT_NE(context.out.find("plans with context ranks (C > 1)"), std::string::npos) << show(context);
}

// The one-GPU run recorded in docs/validation/h100: its calibrated profile plans the same layout
// again, at the step time that run was measured against (a change that moves the prediction
// makes the figures of docs/executor.md, "On a GPU", stale). Without a GPU, a one-rank run of a
// GPU profile trains on the CPU; the executor's one-rank trainer refuses recomputation.
TEST_F(Cli, TheRecordedGpuRunIsPlannedAgainFromItsProfile) {
  Workdir dir;
  const std::string record = test::profile_path("../docs/validation/h100/");
  const Outcome search = dir.moeplan(
      "search --gpus 1 --instance " + record + "gpu-here.json --model mixtral-1gpu --seq-len 2048 "
      "--global-batch-tokens 65536 --precision mixed --max-micro-batch 4 --checkpointing none --offload off "
      "--steps 200 --learning-rate 3e-4 --min-learning-rate 3e-5 --warmup-steps 10 --out plan.json");
  ASSERT_EQ(search.exit_code, 0) << show(search);
  const Plan again = read_plan_file((dir / "plan.json").string());
  const Json report = read_json_file(record + "report.json");
  EXPECT_EQ(describe(again.parallel), report["plan"]["parallel"].get<std::string>());
  EXPECT_NEAR(again.prediction.step_time_s, report["predicted"]["step_time_s"].get<double>(), 1e-3);
  EXPECT_EQ(again.cluster.device, DeviceKind::kCuda);
  const Outcome full = dir.moeplan(
      "search --gpus 1 --instance " + record + "gpu-here.json --model mixtral-1gpu --seq-len 2048 "
      "--global-batch-tokens 65536 --precision mixed --checkpointing full --out full.json");
  EXPECT_EQ(full.exit_code, 1) << show(full);
  EXPECT_NE(full.err.find("executor_layouts"), std::string::npos) << show(full);
}

// Dense models are planned like Mixtral, with one expert: no expert parallelism, no router.
// moeplan's executor trains Mixture-of-Experts models only, so they are planned for another
// framework (here any: every layout moeplan models); for `moeplan run`, the default target,
// the search says which rule and which targets.
TEST_F(Cli, DenseModelsArePlannedWithoutExpertParallelism) {
  Workdir dir;
  const Outcome refused = dir.moeplan("search --gpus 64 --model llama-3-8b");
  EXPECT_EQ(refused.exit_code, 1) << show(refused);
  EXPECT_NE(refused.err.find("executor_trains_moe"), std::string::npos) << show(refused);
  EXPECT_NE(refused.err.find("--target any"), std::string::npos) << show(refused);
  for (const char* model : {"llama-3-8b", "llama-2-70b", "gpt3-175b"}) {
    const Outcome search = dir.moeplan(std::string("search --target any --gpus 64 --model ") + model);
    ASSERT_EQ(search.exit_code, 0) << model << show(search);
    const Plan plan = read_plan_file((dir / "plan.json").string());
    EXPECT_EQ(plan.model.name, model);
    EXPECT_EQ(plan.parallel.expert_parallel_degree, 1) << model;
    EXPECT_GT(plan.prediction.tokens_per_s, 0) << model;
    const Outcome check = dir.moeplan("check plan.json");
    EXPECT_EQ(check.exit_code, 0) << model << show(check);
  }
  // A Hugging Face LlamaConfig too.
  const Outcome hf =
      dir.moeplan("search --target any --gpus 64 --model " + test::data_path("hf/llama-2-70b/config.json"));
  EXPECT_EQ(hf.exit_code, 0) << show(hf);
}

// Each Hugging Face architecture moeplan reads plans from its config.json, and `check`
// recomputes the plan's memory (the analytic estimate ranks: the simulator would only change
// which plan wins). Search.CurrentMoeModelsPlanOnH100 and OnA100 plan every shipped profile.
TEST_F(Cli, HuggingFaceMoeConfigsPlanAndCheck) {
  Workdir dir;
  for (const auto& [config, gpus] : {std::pair<std::string, int>{"hf/deepseek-v3/config.json", 256},
                                     {"hf/gpt-oss-120b/config.json", 16},
                                     {"hf/qwen3-30b-a3b/config.json", 8},
                                     {"hf/qwen2-57b-a14b/config.json", 16},
                                     {"hf/mixtral-8x7b/config.json", 8}}) {
    const Outcome search = dir.moeplan("search --target any --estimator analytic --instance p5.48xlarge --model " +
                                       quoted(test::data_path(config)) + " --gpus " + std::to_string(gpus));
    ASSERT_EQ(search.exit_code, 0) << config << show(search);
    const Outcome check = dir.moeplan("check plan.json");
    EXPECT_EQ(check.exit_code, 0) << config << show(check);
  }
}

// The MoE runs kept apart from the main set (docs/validation.md, "MoE runs beyond Mixtral"):
// every one predicted in its published layout, none put over the device by the memory model.
TEST_F(Cli, PublishedMoeRunsArePredictedInTheirOwnLayouts) {
  Workdir dir;
  const std::string cases = test::data_path("../../docs/validation/published/moe-cases.json");
  const Outcome run = dir.moeplan("compare-published " + quoted(cases));
  ASSERT_EQ(run.exit_code, 0) << show(run);
  const size_t n = read_json_file(cases)["cases"].size();
  EXPECT_GE(n, 20u);
  EXPECT_NE(run.out.find("all:      " + std::to_string(n) + " cases, " + std::to_string(n) + " predicted"),
            std::string::npos)
      << run.out;
  EXPECT_EQ(run.out.find("over the device"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("moeplan's memory model"), std::string::npos) << run.out;
}

// The published runs of docs/validation.md: every one predicted in its own layout, within the
// bounds the page states; a case whose published step is moved tenfold breaks them; a bad
// field is named.
TEST_F(Cli, PublishedRunsArePredictedInTheirOwnLayouts) {
  Workdir dir;
  const std::string cases = test::data_path("../../docs/validation/published/cases.json");
  // The bounds moeplan holds today on the whole set and on its held-out part
  // (docs/validation.md, "Published runs at scale").
  const std::string bounds = " --check --max-median-error 0.05 --max-worst-error 0.2 --max-mean-error 0.03";
  const Outcome run = dir.moeplan("compare-published " + quoted(cases) + bounds);
  ASSERT_EQ(run.exit_code, 0) << show(run);
  const Json original = read_json_file(cases);
  const size_t n = original["cases"].size();
  EXPECT_GE(n, 30u);
  EXPECT_NE(run.out.find("all:      " + std::to_string(n) + " cases, " + std::to_string(n) + " predicted"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("held-out: "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("| GPT-3 175B, 64 A100, T8 P8, full recompute | held-out | T8 P8x3 E1 S1 R1 full mbs 1 | 18.130 |"),
            std::string::npos)
      << run.out;
  // Where each step's time goes, by kernel class.
  EXPECT_NE(run.out.find("| case | GEMMs | attention | memory-bound | recompute |"), std::string::npos) << run.out;

  Json moved = original;
  for (Json& c : moved["cases"])
    if (c["model"].get<std::string>().ends_with(".json"))
      c["model"] = (fs::path(cases).parent_path() / c["model"].get<std::string>()).string();
  moved["cases"][0]["published_step_s"] = moved["cases"][0]["published_step_s"].get<double>() * 10;
  std::ofstream(dir / "moved.json") << moved.dump(2);
  const Outcome broken = dir.moeplan("compare-published moved.json" + bounds);
  EXPECT_EQ(broken.exit_code, 1) << show(broken);
  EXPECT_NE(broken.err.find("bound broken"), std::string::npos) << show(broken);

  moved["cases"][1]["gpus"] = 0;
  std::ofstream(dir / "bad.json") << moved.dump(2);
  const Outcome bad = dir.moeplan("compare-published bad.json");
  EXPECT_EQ(bad.exit_code, 2) << show(bad);
  EXPECT_NE(bad.err.find("bad.json: cases[1].gpus"), std::string::npos) << show(bad);
  EXPECT_EQ(bad.err.find("cases[2]"), std::string::npos) << show(bad);

  moved["cases"][1]["gpus"] = original["cases"][1]["gpus"];
  moved["cases"][2]["layout"]["overlap_gradient_sync"] = "no";
  std::ofstream(dir / "bad_sync.json") << moved.dump(2);
  const Outcome bad_sync = dir.moeplan("compare-published bad_sync.json");
  EXPECT_EQ(bad_sync.exit_code, 2) << show(bad_sync);
  EXPECT_NE(bad_sync.err.find("cases[2].layout.overlap_gradient_sync: expected true or false"), std::string::npos)
      << show(bad_sync);
}

TEST_F(Cli, SameCommandGivesTheSameBytesInAnotherFolder) {
  Workdir first;
  Workdir second;
  const std::string args = "search --gpus 16 --explain";
  const Outcome a = first.moeplan(args);
  const Outcome b = second.moeplan(args);
  ASSERT_EQ(a.exit_code, 0) << show(a);
  ASSERT_EQ(b.exit_code, 0) << show(b);
  const std::string plan_a = read_text(first / "plan.json");
  const std::string plan_b = read_text(second / "plan.json");
  ASSERT_FALSE(plan_a.empty());
  EXPECT_TRUE(plan_a == plan_b) << "plan.json differs between two runs of `moeplan " << args << "`";
  EXPECT_EQ(a.out, b.out);
}

TEST_F(Cli, OneGpuHasNoPlanAndSaysByHowMuch) {
  Workdir dir;
  const Outcome run = dir.moeplan("search --gpus 1");
  ASSERT_EQ(run.exit_code, 1) << show(run);
  EXPECT_FALSE(fs::exists(dir / "plan.json"));
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_GE(lines.size(), 2u) << show(run);
  EXPECT_EQ(lines[0], "moeplan: no plan for mixtral-8x7b on 1 GPU(s) of p4d.24xlarge");
  EXPECT_NE(run.err.find("device memory"), std::string::npos) << show(run);
  EXPECT_NE(run.err.find("over by"), std::string::npos) << show(run);
  // 40 GiB minus the 1 GiB headroom of the p4d profile.
  EXPECT_NE(run.err.find("against 39.0 GiB usable (40.0 GiB minus 1.0 GiB headroom)"), std::string::npos)
      << show(run);
}

// The compute bound only prunes candidates that cannot win: simulating every candidate that fits
// chooses the same plan. On two CPU ranks of mixtral-tiny 180 candidates fit and the pruned
// search simulates 5 of them.
TEST_F(Cli, ExhaustiveSearchSimulatesEveryCandidateThatFitsAndChoosesTheSamePlan) {
  Workdir dir;
  const std::string search = "search --gpus 2 --instance local-cpu --model mixtral-tiny --seq-len 256 "
                             "--global-batch-tokens 4096 --precision fp32 --explain --out ";
  const Outcome pruned = dir.moeplan(search + "pruned.json");
  ASSERT_EQ(pruned.exit_code, 0) << show(pruned);
  const Outcome every = dir.moeplan(search + "every.json --exhaustive");
  ASSERT_EQ(every.exit_code, 0) << show(every);
  // A row of --explain: its count.
  auto row = [](const Outcome& run, const std::string& name) -> int64_t {
    for (const std::string& line : lines_of(run.out))
      if (starts_with(line, "  " + name)) return std::stoll(line.substr(line.rfind(' ') + 1));
    return -1;
  };
  const std::string simulated = "simulated (others pruned by a lower bound)";
  EXPECT_GT(row(pruned, simulated), 0) << show(pruned);
  EXPECT_LT(row(pruned, simulated), row(every, simulated)) << show(every);
  EXPECT_EQ(row(every, simulated), row(every, "fit in memory")) << show(every);
  const Plan a = read_plan_file((dir / "pruned.json").string());
  const Plan b = read_plan_file((dir / "every.json").string());
  EXPECT_EQ(a.parallel, b.parallel);
  EXPECT_EQ(a.prediction.step_time_s, b.prediction.step_time_s);
}

TEST_F(Cli, UnknownModelIsOneLineNamingTheFlag) {
  Workdir dir;
  const Outcome run = dir.moeplan("search --gpus 16 --model nosuchmodel");
  ASSERT_EQ(run.exit_code, 2) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_EQ(lines.size(), 1u) << show(run);
  EXPECT_TRUE(starts_with(lines[0], "moeplan: error: --model: no models profile named \"nosuchmodel\" in "))
      << lines[0];
  EXPECT_NE(lines[0].find("mixtral-8x7b"), std::string::npos) << "lists the known models: " << lines[0];
  EXPECT_FALSE(fs::exists(dir / "plan.json"));
}

TEST_F(Cli, GlobalBatchThatIsNotWholeSequencesIsOneLineNamingTheFlag) {
  Workdir dir;
  const Outcome run = dir.moeplan("search --gpus 16 --global-batch-tokens 1000");
  ASSERT_EQ(run.exit_code, 2) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_EQ(lines.size(), 1u) << show(run);
  EXPECT_EQ(lines[0],
            "moeplan: error: --global-batch-tokens: = 1000 is not a multiple of seq-len = 2048 "
            "(the batch is made of whole sequences)");
}

// A global batch only has to split over the data-parallel replicas: 8 sequences on 64 GPUs in
// T8 P8 are one replica's 8 micro-batches.
TEST_F(Cli, GlobalBatchSplitsOverTheReplicasOnly) {
  Workdir dir;
  const Outcome run = dir.moeplan(
      "search --target megatron --gpus 64 --instance p4de.24xlarge --model gpt3-175b --tensor-parallel-degree 8 --pipeline-parallel-degree 8 "
      "--global-batch-tokens 16384 --precision mixed");
  ASSERT_EQ(run.exit_code, 0) << show(run);
  const Plan plan = read_plan_file((dir / "plan.json").string());
  EXPECT_EQ(plan.parallel.replica_degree() * plan.parallel.hybrid_shard_degree * plan.parallel.expert_parallel_degree, 1);
  EXPECT_EQ(plan.parallel.micro_batch_size * plan.parallel.gradient_accumulation_steps, 8);
  // With 16 GPUs in T8 the batch of 8 sequences does not split over 2 replicas of 8 GPUs each
  // with micro-batches of 3: the rule says why.
  const Outcome odd = dir.moeplan(
      "search --target megatron --gpus 16 --instance p4de.24xlarge --model gpt3-175b --tensor-parallel-degree 8 --pipeline-parallel-degree 1 "
      "--global-batch-tokens 6144 --precision mixed --explain");
  EXPECT_EQ(odd.exit_code, 1) << show(odd);
  EXPECT_NE(odd.out.find("global_batch_matches"), std::string::npos) << show(odd);
}

// `search --target X` then `export-launch --to X`: the files land in --out, the launch scripts
// are executable, and what a framework cannot run, or a plan that cannot be read, is refused
// with exit 2 naming the rule or the file.
TEST_F(Cli, ExportLaunchWritesEachFrameworksFilesAndRefusesByRule) {
  Workdir dir;
  const Outcome smp = dir.moeplan("search --target smp --gpus 32 --out smp.json");
  ASSERT_EQ(smp.exit_code, 0) << show(smp);
  EXPECT_NE(smp.out.find("precision mixed"), std::string::npos) << show(smp);
  const Outcome written = dir.moeplan("export-launch smp.json --to smp --out launch-smp");
  ASSERT_EQ(written.exit_code, 0) << show(written);
  const Json settings = read_json_file((dir / "launch-smp/smp.json").string());
  const Plan plan = read_plan_file((dir / "smp.json").string());
  EXPECT_EQ(settings.at("instance_count"), plan.cluster.num_nodes);
  EXPECT_EQ(settings.at("hyperparameters").at("train_batch_size"), plan.parallel.micro_batch_size);
  EXPECT_TRUE(fs::exists(dir / "launch-smp/smp_launch.py"));

  const Outcome megatron = dir.moeplan("search --target megatron --gpus 64 --out m.json");
  ASSERT_EQ(megatron.exit_code, 0) << show(megatron);
  ASSERT_EQ(dir.moeplan("export-launch m.json --to megatron --out launch-m").exit_code, 0);
  const fs::perms mode = fs::status(dir / "launch-m/megatron-launch.sh").permissions();
  EXPECT_NE(mode & fs::perms::owner_exec, fs::perms::none);
  EXPECT_TRUE(fs::exists(dir / "launch-m/megatron-args.txt"));
  // The script hands torchrun every argument of the file, then its own: a torchrun that
  // prints what it was given stands in for the real one.
  fs::create_directory(dir / "bin");
  dir.write("bin/torchrun", "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/../torchrun-args\"\n");
  fs::permissions(dir / "bin/torchrun", fs::perms::owner_all);
  const std::string launch = "cd " + dir.path().string() + " && PATH=" + (dir / "bin").string() +
                             ":$PATH NODE_RANK=1 bash launch-m/megatron-launch.sh --data-path /data/text";
  ASSERT_EQ(std::system(launch.c_str()), 0) << launch;
  const std::string given = test::read_text((dir / "torchrun-args").string());
  EXPECT_NE(given.find("--node-rank\n1\n"), std::string::npos) << given;
  EXPECT_NE(given.find("pretrain_gpt.py\n--num-layers\n32\n--hidden-size\n4096\n"), std::string::npos) << given;
  EXPECT_NE(given.find("--use-distributed-optimizer\n"), std::string::npos) << given;
  EXPECT_NE(given.find("--data-path\n/data/text\n"), std::string::npos) << given;

  // The SMP plan shards parameters over 32 ranks (or more): not a layout Megatron-LM runs.
  const Outcome refused = dir.moeplan("export-launch smp.json --to megatron --out launch-x");
  EXPECT_EQ(refused.exit_code, 2) << show(refused);
  EXPECT_NE(refused.err.find("moeplan: error: smp.json: "), std::string::npos) << show(refused);
  EXPECT_NE(refused.err.find("(rule megatron_"), std::string::npos) << show(refused);
  EXPECT_FALSE(fs::exists(dir / "launch-x"));

  const Outcome missing = dir.moeplan("export-launch nothing.json --to torchtitan");
  EXPECT_EQ(missing.exit_code, 2) << show(missing);
  EXPECT_NE(missing.err.find("nothing.json"), std::string::npos) << show(missing);
  const Outcome unknown = dir.moeplan("export-launch m.json --to deepspeed");
  EXPECT_EQ(unknown.exit_code, 2) << show(unknown);
}

// A Megatron-LM run's log beside the plan it ran: medians after the first (warm-up) iteration,
// errors as `moeplan run` reports them (measured over predicted, less one), the memory report and
// the timers as phases; a torchtitan and an SMP log converted to the plan's step; a bad log
// refused by line.
TEST_F(Cli, CompareLogPutsARunBesideItsPlan) {
  Workdir dir;
  ASSERT_EQ(dir.moeplan("search --target megatron --gpus 64 --out m.json").exit_code, 0);
  const Plan plan = read_plan_file((dir / "m.json").string());
  ASSERT_EQ(plan.training.global_batch_tokens, 2048 * 2048);  // the sample log's global batch size
  const std::string log = test::data_path("logs/megatron.log");
  const Outcome run = dir.moeplan("compare m.json --log " + log);
  ASSERT_EQ(run.exit_code, 0) << show(run);
  EXPECT_NE(run.out.find("(Megatron-LM, median of 3 logged iterations, the first 1 skipped)"), std::string::npos)
      << run.out;
  char row[128];
  std::snprintf(row, sizeof row, "| step time (s) | 31.02 | %.4g | %+.1f%% |", plan.prediction.step_time_s,
                100 * (31.02 / plan.prediction.step_time_s - 1));
  EXPECT_NE(run.out.find(row), std::string::npos) << row << "\n" << run.out;
  EXPECT_NE(run.out.find("| peak allocated per GPU, busiest reporting rank (GiB) | 34.3 |"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("| phase forward-backward (s) | 30.2 |"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("| phase optimizer (s) | 0.3 |"), std::string::npos) << run.out;
  // The framework's TFLOP/s are counted its own way: shown, without an error.
  EXPECT_NE(run.out.find("| TFLOP/s per GPU (as Megatron-LM counts) | 160.1 | "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find(" | - |\n| peak allocated"), std::string::npos) << run.out;

  const TrainingLog titan = read_training_log(test::data_path("logs/torchtitan.log"));
  const validation::LogComparison t = validation::compare_with_log(plan, titan, 1, "torchtitan.log");
  ASSERT_FALSE(t.figures.empty());
  EXPECT_DOUBLE_EQ(t.figures[0].measured, 2048.0 * 2048 / (2205.0 * 64));  // median tps x 64 GPUs
  const TrainingLog smp = read_training_log(test::data_path("logs/smp.log"));
  const validation::LogComparison s = validation::compare_with_log(plan, smp, 1, "smp.log");
  EXPECT_DOUBLE_EQ(s.figures[0].measured, 2048.0 / 1.30);  // sequences per step over median speed
  EXPECT_EQ(s.iterations, 3);
  // The Trainer's one summary line: nothing to skip, a step of 1 / train_steps_per_second.
  const Outcome trainer = dir.moeplan("compare m.json --log " + test::data_path("logs/hf_trainer.log"));
  ASSERT_EQ(trainer.exit_code, 0) << show(trainer);
  EXPECT_NE(trainer.out.find("(Hugging Face Trainer, median of 1 logged iterations, the first 0 skipped)"),
            std::string::npos) << trainer.out;
  EXPECT_NE(trainer.out.find("| step time (s) | 31.25 |"), std::string::npos) << trainer.out;

  const Outcome none_left = dir.moeplan("compare m.json --log " + log + " --skip-iterations 4");
  EXPECT_EQ(none_left.exit_code, 2) << show(none_left);
  EXPECT_NE(none_left.err.find("none left after the 4 skipped"), std::string::npos) << show(none_left);
  dir.write("bad.log", test::read_text(log).substr(0, 600) + " iteration 5/100 | elapsed time per iteration (ms): x |\n");
  const Outcome bad = dir.moeplan("compare m.json --log bad.log");
  EXPECT_EQ(bad.exit_code, 2) << show(bad);
  EXPECT_NE(bad.err.find("moeplan: error: bad.log: line "), std::string::npos) << show(bad);
}

// Time and money: a range of cluster sizes with tokens to train and a deadline; the plan of
// the size chosen is written, and its days and dollars follow from its prediction, the
// profile's price and the goodput model. Bad requests are refused naming the flag.
// A list of capacity factors under a skewed router: each factor's best plan in a table with its
// step and dropped share, the chosen one planned (its factor in plan.json); a list over a range
// of cluster sizes is refused.
TEST_F(Cli, SearchChoosesAmongTheCapacityFactorsListed) {
  Workdir dir;
  const Outcome run = dir.moeplan(
      "search --gpus 8 --model mixtral-tiny --seq-len 256 --estimator analytic --routing skew:2 "
      "--capacity-factor 0,1.25 --max-dropped-fraction 1 --top 2 --out c.json");
  ASSERT_EQ(run.exit_code, 0) << show(run);
  EXPECT_NE(run.out.find("capacity factors (the fastest best plan dropping at most 100.0% of the slots is planned)"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("  dropless "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("  1.25 "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("<- planned"), std::string::npos) << run.out;
  const Plan plan = read_plan_file((dir / "c.json").string());
  EXPECT_TRUE(plan.moe.capacity_factor == 0 || plan.moe.capacity_factor == 1.25) << plan.moe.capacity_factor;
  const Outcome none = dir.moeplan(
      "search --gpus 8 --model mixtral-tiny --seq-len 256 --estimator analytic --routing skew:2 "
      "--capacity-factor 0,1.25 --max-dropped-fraction 0 --top 2 --out d.json");
  ASSERT_EQ(none.exit_code, 0) << show(none);
  EXPECT_EQ(read_plan_file((dir / "d.json").string()).moe.capacity_factor, 0.0);
  const Outcome range = dir.moeplan("search --gpus 16:32 --capacity-factor 0,1.25 --out x.json");
  EXPECT_EQ(range.exit_code, 2) << show(range);
  EXPECT_NE(range.err.find("--capacity-factor: a list of factors"), std::string::npos) << show(range);
}

TEST_F(Cli, SearchPricesClusterSizesAndKeepsToTheDeadline) {
  Workdir dir;
  // 150B tokens: the smallest size is over the 30 days, two larger ones within, the cheaper planned.
  const Outcome run = dir.moeplan("search --gpus 16:64 --train-tokens 150B --deadline-days 30 --objective cost --out c.json");
  ASSERT_EQ(run.exit_code, 0) << show(run);
  EXPECT_NE(run.out.find("(over the deadline)"), std::string::npos) << run.out;
  const size_t chosen = run.out.find("cheapest cluster within 30.0 days: ");
  ASSERT_NE(chosen, std::string::npos) << run.out;
  const Plan plan = read_plan_file((dir / "c.json").string());
  const planner::TrainingTime t =
      planner::training_time(plan.cluster, plan.cluster.num_nodes, 150e9, plan.prediction.tokens_per_s,
                             0, 600);  // bounds: the checkpoint pause only lowers goodput further
  EXPECT_LE(t.seconds, 30 * 86400.0 * 1.01);
  EXPECT_GT(plan.cluster.instance_price_per_hour, 0);
  // The planned size is the cheapest row within the deadline.
  std::istringstream rows(run.out.substr(0, chosen));
  long long cheapest_gpus = 0, within = 0;
  double cheapest = 0;
  for (std::string row; std::getline(rows, row);) {
    const size_t dollar = row.find('$');
    if (dollar == std::string::npos || row.find("(over the deadline)") != std::string::npos) continue;
    const double dollars = std::stod(row.substr(dollar + 1));
    if (within++ == 0 || dollars < cheapest) {
      cheapest = dollars;
      cheapest_gpus = std::stoll(row);
    }
  }
  EXPECT_GE(within, 2) << run.out;
  EXPECT_EQ(plan.parallel.world_size, cheapest_gpus) << run.out;
  char line[128];
  std::snprintf(line, sizeof line, "%lld x p4d.24xlarge (%lld GPUs)", static_cast<long long>(plan.cluster.num_nodes),
                static_cast<long long>(plan.parallel.world_size));
  EXPECT_NE(run.out.find(line, chosen), std::string::npos) << line << "\n" << run.out;
  // One size: each ranked plan's days and dollars.
  const Outcome one = dir.moeplan("search --gpus 64 --train-tokens 300B --top 2 --out o.json");
  ASSERT_EQ(one.exit_code, 0) << show(one);
  EXPECT_NE(one.out.find("to train 3e+11 tokens on 8 x p4d.24xlarge"), std::string::npos) << one.out;

  EXPECT_EQ(dir.moeplan("search --gpus 64:16 --out x.json").exit_code, 2);
  const Outcome deadline = dir.moeplan("search --gpus 16:64 --deadline-days 3 --out x.json");
  EXPECT_EQ(deadline.exit_code, 2) << show(deadline);
  EXPECT_NE(deadline.err.find("--deadline-days: needs --train-tokens"), std::string::npos) << show(deadline);
  const Outcome unpriced = dir.moeplan("search --gpus 2:4 --instance local-cpu --model mixtral-tiny --seq-len 256 "
                                       "--objective cost --out x.json");
  EXPECT_EQ(unpriced.exit_code, 2) << show(unpriced);
  EXPECT_NE(unpriced.err.find("no cost.instance_price_per_hour"), std::string::npos) << show(unpriced);
  // What only a range takes is refused on one size, and what only one size takes on a range.
  const Outcome single = dir.moeplan("search --gpus 64 --train-tokens 1T --deadline-days 30 --out x.json");
  EXPECT_EQ(single.exit_code, 2) << show(single);
  EXPECT_NE(single.err.find("--deadline-days: picks among the sizes of a --gpus range"), std::string::npos) << show(single);
  EXPECT_NE(dir.moeplan("search --gpus 64 --objective cost --out x.json").err.find("--objective: = cost ranks"),
            std::string::npos);
  EXPECT_EQ(dir.moeplan("search --gpus 16:64 --json").exit_code, 2);
  for (const char* bad : {"0", "-1", "abc", "8:", ":8", "8:16:32"})
    EXPECT_EQ(dir.moeplan(std::string("search --out x.json --gpus ") + bad).exit_code, 2) << bad;
  const Outcome late = dir.moeplan("search --gpus 16:32 --train-tokens 1T --deadline-days 1 --out x.json");
  EXPECT_EQ(late.exit_code, 1) << show(late);
  EXPECT_FALSE(fs::exists(dir / "x.json"));
}

TEST_F(Cli, CheckOnATruncatedPlanIsOneLineNamingTheFile) {
  const std::string& text = searched_plan_text();
  ASSERT_FALSE(text.empty());
  Workdir dir;
  dir.write("plan.json", text.substr(0, text.size() / 3));
  const Outcome run = dir.moeplan("check plan.json");
  ASSERT_EQ(run.exit_code, 2) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_EQ(lines.size(), 1u) << show(run);
  EXPECT_TRUE(starts_with(lines[0], "moeplan: error: plan.json: not valid JSON (parse error at line ")) << lines[0];
}

TEST_F(Cli, CheckOnAPlanWithExpertDegreeThreeNamesTheField) {
  const std::string& text = searched_plan_text();
  ASSERT_FALSE(text.empty());
  Json json = parse_json_text(text, "plan.json");
  json["parallel"]["expert_parallel_degree"] = 3;
  Workdir dir;
  dir.write("plan.json", json.dump(2));
  const Outcome run = dir.moeplan("check plan.json");
  ASSERT_EQ(run.exit_code, 2) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_FALSE(lines.empty()) << show(run);
  // One line per broken rule; the first is about the edited field.
  EXPECT_EQ(lines[0],
            "moeplan: error: plan.json: parallel.expert_parallel_degree: = 3 does not divide num_experts = 8 "
            "[expert_degree_divides_experts]");
  for (const std::string& line : lines) EXPECT_TRUE(starts_with(line, "moeplan: error: plan.json: ")) << line;
}

TEST_F(Cli, CheckOnAMissingFileNamesIt) {
  Workdir dir;
  const Outcome run = dir.moeplan("check absent.json");
  ASSERT_EQ(run.exit_code, 2) << show(run);
  EXPECT_EQ(run.err_lines(), std::vector<std::string>{"moeplan: error: absent.json: cannot open file"});
}

// A number beyond a double in a plan is bad input: exit 2 with one line, not an abort.
TEST_F(Cli, CheckOnAPlanWithANumberTooLargeForADoubleIsBadInput) {
  const std::string& text = searched_plan_text();
  ASSERT_FALSE(text.empty());
  std::string edited = text;
  const std::string key = "\"world_size\": 16";
  const size_t at = edited.find(key);
  ASSERT_NE(at, std::string::npos);
  edited.replace(at, key.size(), "\"world_size\": 1e400");
  Workdir dir;
  dir.write("plan.json", edited);
  const Outcome run = dir.moeplan("check plan.json");
  EXPECT_EQ(run.signal, 0) << show(run);
  ASSERT_EQ(run.exit_code, 2) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_EQ(lines.size(), 1u) << show(run);
  EXPECT_TRUE(starts_with(lines[0], "moeplan: error: plan.json: ")) << lines[0];
}

TEST_F(Cli, CheckOnAPlanWhoseMemoryWasEditedByHand) {
  const std::string& text = searched_plan_text();
  ASSERT_FALSE(text.empty());
  Json json = parse_json_text(text, "plan.json");
  // Consistent in itself (items still add up) but not what the memory model gives.
  Json& memory = json["prediction"]["memory"];
  memory["device"]["activations"] = memory["device"]["activations"].get<int64_t>() - 1024;
  memory["device_total_bytes"] = memory["device_total_bytes"].get<int64_t>() - 1024;
  Workdir dir;
  dir.write("plan.json", json.dump(2));
  const Outcome run = dir.moeplan("check plan.json");
  ASSERT_EQ(run.exit_code, 1) << show(run);
  const std::vector<std::string> lines = run.err_lines();
  ASSERT_EQ(lines.size(), 1u) << show(run);
  EXPECT_TRUE(starts_with(lines[0], "moeplan: error: plan.json: prediction.memory.device_total_bytes: = ")) << lines[0];
}

TEST_F(Cli, JsonPlanKeepsEveryCandidateWithinDeviceMemory) {
  Workdir dir;
  const Outcome run = dir.moeplan("search --gpus 16 --json --out ''");
  ASSERT_EQ(run.exit_code, 0) << show(run);
  EXPECT_FALSE(fs::exists(dir / "plan.json")) << "--out '' writes no file";
  // stdout is the plan and nothing else.
  const Json json = parse_json_text(run.out, "stdout");
  const Plan plan = plan_from_json(json, "stdout");
  EXPECT_EQ(plan_to_text(plan), run.out);

  const MemoryBreakdown& memory = plan.prediction.memory;
  EXPECT_GT(memory.device_limit_bytes, 0);
  EXPECT_LE(memory.device_total_bytes, memory.device_limit_bytes);
  EXPECT_LE(memory.host_total_bytes, memory.host_limit_bytes);
  ASSERT_FALSE(plan.alternatives.empty());
  for (size_t i = 0; i < plan.alternatives.size(); ++i) {
    const Alternative& alt = plan.alternatives[i];
    EXPECT_GT(alt.device_peak_bytes, 0) << "alternative " << i;
    EXPECT_LE(alt.device_peak_bytes, memory.device_limit_bytes) << "alternative " << i;
  }
  // The items add up to their totals, counted here from the raw JSON.
  int64_t device_sum = 0;
  for (const auto& [name, bytes] : json["prediction"]["memory"]["device"].items()) device_sum += bytes.get<int64_t>();
  EXPECT_EQ(device_sum, json["prediction"]["memory"]["device_total_bytes"].get<int64_t>());
  int64_t host_sum = 0;
  for (const auto& [name, bytes] : json["prediction"]["memory"]["host"].items()) host_sum += bytes.get<int64_t>();
  EXPECT_EQ(host_sum, json["prediction"]["memory"]["host_total_bytes"].get<int64_t>());
  EXPECT_EQ(json["prediction"]["memory"]["device"].size(), memory.device.size());
}

}  // namespace
}  // namespace moeplan

namespace moeplan {
namespace {

// A plan written to something that is not a regular file (a pipe here; /dev/stdout or
// /dev/null in use) goes through it: renaming a temporary file over it would replace it.
TEST_F(Cli, CompareProfilesFindsTheFigureThatMovedAndWhatItPredicts) {
  Workdir dir;
  const std::string base = test::profile_path("hardware/local-cpu.json");
  Json faster = read_json_file(base);
  for (const char* peak : {"peak_fp32_flops", "peak_bf16_flops"})
    faster["gpu"][peak]["value"] = 2 * faster["gpu"][peak]["value"].get<double>();
  std::ofstream(dir / "faster.json") << faster.dump(2);

  const Outcome same = dir.moeplan("compare-profiles " + base + " " + base + " --quick --check --max-difference 0");
  ASSERT_EQ(same.exit_code, 0) << show(same);
  EXPECT_NE(same.out.find("predicted step time: median |difference| 0.0%, worst +0.0%"), std::string::npos)
      << show(same);

  const Outcome moved = dir.moeplan("compare-profiles " + base + " faster.json --quick --check");
  EXPECT_EQ(moved.exit_code, 1) << show(moved);
  EXPECT_NE(moved.out.find("+100.0%  peak fp32 FLOP/s"), std::string::npos) << show(moved);
  // Twice the multiply rate: every fp32 step of the matrix predicted faster, none by more than half.
  size_t rows = 0;
  for (const std::string& line : lines_of(moved.out)) {
    if (line.rfind("  E", 0) != 0) continue;
    ++rows;
    const double difference = std::stod(line.substr(line.rfind(' ') + 1));
    EXPECT_LT(difference, 0) << line;
    EXPECT_GE(difference, -50) << line;
  }
  EXPECT_EQ(rows, 6u) << show(moved);  // the quick matrix: four of [R, S, E], a tensor split, a pipeline
  EXPECT_NE(moved.err.find("bound broken: predicted step time of E"), std::string::npos) << show(moved);

  const Outcome missing = dir.moeplan("compare-profiles " + base + " none.json");
  EXPECT_EQ(missing.exit_code, 2) << show(missing);
  EXPECT_NE(missing.err.find("none.json"), std::string::npos) << show(missing);
}

TEST(ValidationMatrix, EveryFamilyOfLayoutsWhereTheModelAllowsIt) {
  using validation::MatrixConfig;
  const ModelSpec& tiny = test::model("mixtral-tiny");
  const std::vector<MatrixConfig> full = validation::validation_matrix(2, tiny, 256, false);
  // Experts, shards and replicas first (nine distinct at two ranks), then the splits.
  ASSERT_EQ(full.size(), 13u);
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(full[i].t * full[i].p, 1) << full[i].name;
  std::vector<std::string> names;
  for (size_t i = 9; i < full.size(); ++i) names.push_back(full[i].name);
  EXPECT_EQ(names, (std::vector<std::string>{"E1S1R1T2-none-mbs4", "E1S1R1P2-none-mbs2", "E1S1R1T2-full-mbs2",
                                             "E1S1R1P2-selective-mbs4"}));
  const std::vector<MatrixConfig> quick = validation::validation_matrix(2, tiny, 256, true);
  ASSERT_EQ(quick.size(), 6u);
  EXPECT_EQ(quick[4].t, 2);
  EXPECT_EQ(quick[5].p, 2);
  // Four ranks cannot split two key-value heads: no tensor split, a pipeline of four stages.
  const std::vector<MatrixConfig> four = validation::validation_matrix(4, tiny, 256, true);
  ASSERT_EQ(four.size(), 5u);
  EXPECT_EQ(four.back().p, 4);
  EXPECT_EQ(four.back().t, 1);
  // Nor a sequence of 255 tokens two; eight ranks no pipeline of four blocks.
  EXPECT_EQ(validation::validation_matrix(2, tiny, 255, true).back().p, 2);
  EXPECT_EQ(validation::validation_matrix(2, tiny, 255, true).size(), 5u);
  for (const MatrixConfig& c : validation::validation_matrix(8, tiny, 256, false)) EXPECT_EQ(c.t * c.p, 1) << c.name;
  // A model with multi-token prediction trains without pipeline stages: tensor splits only.
  const std::vector<MatrixConfig> mtp = validation::validation_matrix(2, test::model("deepseek-v3-tiny"), 256, false);
  ASSERT_FALSE(mtp.empty());
  EXPECT_EQ(mtp.back().t, 2);
  for (const MatrixConfig& c : mtp) EXPECT_EQ(c.p, 1) << c.name;
  // The search is pinned to the configuration's degrees.
  const std::vector<std::string> argv =
      validation::pinned_search("moeplan", {2, "mixtral-tiny"}, full[9], "local.json", "plan.json");
  const auto at = std::find(argv.begin(), argv.end(), "--tensor-parallel-degree");
  ASSERT_NE(at, argv.end());
  EXPECT_EQ(*(at + 1), "2");
}

TEST(CliWrite, PlanToAPipeGoesThroughThePipe) {
  const test::TempDir dir;
  const std::string fifo = dir.file("plan.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // The reader gives up after 20 s, so that a broken write fails the test instead of hanging it.
  const std::string command = "timeout 20 cat " + fifo + " > " + dir.file("copy.json") + " & " + std::string(MOEPLAN_BINARY) +
                              " search --gpus 16 --out " + fifo + " > /dev/null; wait";
  ASSERT_EQ(std::system(command.c_str()), 0);
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the pipe was replaced";
  std::ifstream copy(dir.file("copy.json"));
  std::stringstream text;
  text << copy.rdbuf();
  EXPECT_NO_THROW(plan_from_json(Json::parse(text.str()), "copy.json"));
}

}  // namespace
}  // namespace moeplan

namespace moeplan {
namespace {

// A run folder's metrics.jsonl as the executor writes it (three steps of one expert group, two
// micro-batches, one layer of four experts, top-2), summarised and made a routing profile.
TEST_F(Cli, RoutingSummarisesARunAndWritesItsProfile) {
  Workdir dir;
  fs::create_directories(dir / "run");
  std::string lines;
  for (int64_t s = 1; s <= 3; ++s) {
    StepRecord r;
    r.step = s;
    r.tokens = 32;
    r.seconds = 0.5;
    r.exchange_slots = {{{{8, 8, 8, 8}}, {{16, 8, 4, 4}}}};
    r.tokens_per_expert = {{24, 16, 12, 12}};
    lines += to_json_line(r) + "\n";
  }
  std::ofstream(dir / "run" / "metrics.jsonl") << lines;
  const Outcome run = dir.moeplan("routing run --out routing.json");
  ASSERT_EQ(run.exit_code, 0) << show(run);
  EXPECT_NE(run.out.find("steps 1 to 3 (3), 1 MoE layers, 4 experts, top-2; 1 expert group x 2 micro-batches"),
            std::string::npos)
      << run.out;
  // Loads 1.0 and 2.0 in every step: median 1.5, p95 2.0 (at 4.75 of the six sorted, among
  // the 2.0s), 1.0 apart in a step.
  EXPECT_NE(run.out.find("0         1.50   2.00   2.00            1.00        1.50       1.50"), std::string::npos)
      << run.out;
  const RoutingProfile profile = read_routing_profile((dir / "routing.json").string());
  EXPECT_EQ(profile.micro_batches(), 6);
  EXPECT_EQ(profile.experts_per_token, 2);
  EXPECT_EQ(profile.slots[0][1], (std::vector<int64_t>{16, 8, 4, 4}));
  EXPECT_TRUE(profile.step_spread.empty());  // no plan.json beside it to predict the steps with
  // A plan.json that cannot price the steps: the profile is still written, without a spread, and
  // the output says why; --predict fails on it.
  std::ofstream(dir / "run" / "plan.json") << "{}";
  const Outcome unpriced = dir.moeplan("routing run --out unpriced.json");
  ASSERT_EQ(unpriced.exit_code, 0) << show(unpriced);
  EXPECT_NE(unpriced.err.find("unpriced.json is written without a step spread"), std::string::npos) << show(unpriced);
  EXPECT_TRUE(read_routing_profile((dir / "unpriced.json").string()).step_spread.empty());
  EXPECT_EQ(dir.moeplan("routing run --predict").exit_code, 2);

  const Outcome missing = dir.moeplan("routing nowhere");
  EXPECT_EQ(missing.exit_code, 2) << show(missing);
  EXPECT_NE(missing.err.find("nowhere/metrics.jsonl: cannot be read"), std::string::npos) << show(missing);
  const Outcome degree = dir.moeplan("routing run --expert-degree 3");
  EXPECT_EQ(degree.exit_code, 2) << show(degree);
  EXPECT_NE(degree.err.find("--expert-degree: = 3 does not divide"), std::string::npos) << show(degree);
}

}  // namespace
}  // namespace moeplan

namespace moeplan {
namespace {

// Steps predicted from their measured loads (`moeplan routing RUN --predict`): a balanced step is
// the plan's balanced step; one whose busiest rank carries 1.5 times the mean in every block and
// micro-batch adds what the estimate adds for 1.5 everywhere.
TEST_F(Cli, StepsArePredictedFromTheirMeasuredLoads) {
  Workdir dir;
  const Outcome made = dir.moeplan(
      "search --gpus 2 --instance local-cpu --model mixtral-tiny --seq-len 256 --global-batch-tokens 4096 "
      "--precision fp32 --expert-parallel-degree 2 --target moeplan --out plan.json");
  ASSERT_EQ(made.exit_code, 0) << show(made);
  const Plan plan = read_plan_file((dir / "plan.json").string());
  const int64_t layers = plan.model.moe_layers(), ga = plan.parallel.gradient_accumulation_steps;
  ASSERT_EQ(plan.model.num_experts, 8);
  // Slots of one micro-batch over the expert group: 2 ranks x mbs x 256 tokens x top-2.
  const int64_t slots = 2 * plan.parallel.micro_batch_size * 256 * 2;
  const auto step = [&](int64_t n, double measured_s, int64_t first_rank_slots) {
    StepRecord r;
    r.step = n;
    r.seconds = measured_s;
    r.tokens = 2 * plan.parallel.micro_batch_size * 256 * ga;
    const int64_t hot = first_rank_slots / 4, cold = (slots - first_rank_slots) / 4;
    const std::vector<int64_t> table{hot, hot, hot, hot, cold, cold, cold, cold};
    r.exchange_slots = {std::vector<std::vector<std::vector<int64_t>>>(
        static_cast<size_t>(ga), std::vector<std::vector<int64_t>>(static_cast<size_t>(layers), table))};
    std::vector<int64_t> total(8, 0);
    for (size_t e = 0; e < 8; ++e) total[e] = table[e] * ga;
    r.tokens_per_expert.assign(static_cast<size_t>(layers), total);
    return r;
  };
  const std::vector<StepRecord> steps = {step(1, 1.0, slots / 2), step(2, 1.0, slots * 3 / 4)};
  const validation::RoutingCheck check = validation::predict_steps_from_routing(plan, steps, 1, "metrics.jsonl");
  ASSERT_EQ(check.steps.size(), 2u);
  EXPECT_DOUBLE_EQ(check.steps[0].predicted_s, check.balanced_s);
  EXPECT_DOUBLE_EQ(check.steps[0].busiest_load, 1.0);
  EXPECT_DOUBLE_EQ(check.steps[1].busiest_load, 1.5);
  MoeConfig balanced = plan.moe;
  balanced.expert_load_imbalance = 1.0;
  const RunConfig config{plan.model, plan.cluster, plan.parallel, balanced, plan.training};
  const sim::LayoutShapes shapes = sim::layout_shapes(plan.cluster, plan.parallel);
  const MoeConfig hot = with_busiest_rank_load(plan.model, balanced, 2, 1.5);
  const double added = sim::estimate_step({plan.model, plan.cluster, plan.parallel, hot, plan.training}, shapes).step_time_s -
                       sim::estimate_step(config, shapes).step_time_s;
  EXPECT_GT(added, 0.0);
  EXPECT_NEAR(check.steps[1].predicted_s - check.balanced_s, added, 1e-9);
  EXPECT_DOUBLE_EQ(check.median_error_balanced, std::abs(check.balanced_s - 1.0));
  EXPECT_EQ(check.predicted_dropped, -1.0);  // dropless

  // Steps that say how much of the machine a hypervisor took: those it left alone (under 1%) are
  // counted apart; a run that does not say has none.
  EXPECT_EQ(check.undisturbed_steps, 0);
  EXPECT_EQ(validation::format_routing_check(check).find("left alone"), std::string::npos);
  std::vector<StepRecord> stolen = steps;
  stolen[0].steal = 0.0;
  stolen[1].steal = 0.2;
  const validation::RoutingCheck alone = validation::predict_steps_from_routing(plan, stolen, 1, "metrics.jsonl");
  EXPECT_EQ(alone.undisturbed_steps, 1);
  EXPECT_DOUBLE_EQ(alone.undisturbed_median_error, std::abs(check.steps[0].predicted_s - 1.0));
  EXPECT_DOUBLE_EQ(alone.undisturbed_median_error_balanced, std::abs(check.balanced_s - 1.0));
  EXPECT_DOUBLE_EQ(alone.median_error, check.median_error);  // every step still counts in the whole
  EXPECT_NE(validation::format_routing_check(alone).find("over the 1 steps the hypervisor left alone"), std::string::npos)
      << validation::format_routing_check(alone);
  EXPECT_NE(validation::format_routing_check(alone).find("  20.0%\n"), std::string::npos)
      << validation::format_routing_check(alone);

  // At capacity factor 1 the hot micro-batches' four experts each hold 3/16 of the slots against
  // a capacity of 1/8: a quarter of their slots go, an eighth of the two steps' (the balanced
  // step drops none). What the run says it dropped is reported beside it; a run that does not
  // say is refused.
  Plan dropping = plan;
  dropping.moe.capacity_factor = 1.0;
  std::vector<StepRecord> dropped_steps = steps;
  dropped_steps[0].dropped_slots.assign(static_cast<size_t>(layers), 0);
  dropped_steps[1].dropped_slots.assign(static_cast<size_t>(layers), slots * ga / 8);
  const validation::RoutingCheck drops = validation::predict_steps_from_routing(dropping, dropped_steps, 1, "metrics.jsonl");
  EXPECT_NEAR(drops.predicted_dropped, 0.125, 1e-12);
  EXPECT_NEAR(drops.measured_dropped, 0.0625, 1e-12);
  EXPECT_NE(validation::format_routing_check(drops).find("12.50% predicted from the measured loads, 6.25% measured"),
            std::string::npos)
      << validation::format_routing_check(drops);
  EXPECT_THROW(validation::predict_steps_from_routing(dropping, steps, 1, "metrics.jsonl"), InputError);

  // The measured steps' own spread, whatever was predicted: two steps of 1 s leave none; of 1.0,
  // 1.2 and 1.5 s, no one time comes nearer than 1/11 to two of them (1.0909 s to the first two).
  EXPECT_EQ(check.error_floor, 0.0);
  const validation::RoutingCheck spread = validation::predict_steps_from_routing(
      plan, {step(1, 1.0, slots / 2), step(2, 1.2, slots / 2), step(3, 1.5, slots / 2)}, 1, "metrics.jsonl");
  EXPECT_NEAR(spread.error_floor, 1.0 / 11, 1e-12);
  EXPECT_NE(validation::format_routing_check(spread).find("no one step time comes within 9.1% of half of them"),
            std::string::npos)
      << validation::format_routing_check(spread);

  // The same through the command, from the run folder's plan.json and metrics.jsonl.
  fs::create_directories(dir / "run");
  fs::copy_file(dir / "plan.json", dir / "run" / "plan.json");
  std::ofstream(dir / "run" / "metrics.jsonl") << to_json_line(steps[0]) + "\n" + to_json_line(steps[1]) + "\n";
  const Outcome predicted = dir.moeplan("routing run --predict");
  ASSERT_EQ(predicted.exit_code, 0) << show(predicted);
  EXPECT_NE(predicted.out.find("median |error| over 2 steps"), std::string::npos) << predicted.out;
  // The profile it writes keeps how the steps varied beyond their loads: both measured 1.0 s,
  // predicted apart, so over the median of the two ratios one lies below 1 and one above.
  const Outcome profiled = dir.moeplan("routing run --out routing.json");
  ASSERT_EQ(profiled.exit_code, 0) << show(profiled);
  const double r0 = 1.0 / check.steps[0].predicted_s, r1 = 1.0 / check.steps[1].predicted_s;
  const double middle = (r0 + r1) / 2;
  const RoutingProfile written = read_routing_profile((dir / "routing.json").string());
  ASSERT_EQ(written.step_spread.size(), 2u);
  EXPECT_NEAR(written.step_spread[0], r1 / middle, 1e-12);  // the slower prediction, the lower ratio
  EXPECT_NEAR(written.step_spread[1], r0 / middle, 1e-12);
  EXPECT_EQ(written.step_spread, validation::step_spread(check));
  std::ofstream(dir / "run" / "metrics.jsonl", std::ios::trunc) << to_json_line(step(1, 1.0, slots / 2)).substr(0, 40);
  EXPECT_EQ(dir.moeplan("routing run --predict").exit_code, 2);
}

}  // namespace
}  // namespace moeplan
