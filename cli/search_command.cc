// `moeplan search`: the planner's search request, from the command line; the ranked table (or
// the plan as JSON, or a range's cluster sizes) on stdout, and the plan written.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "choice.h"
#include "command.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/planner/request.h"
#include "moeplan/planner/search.h"
#include "moeplan/planner/sweep.h"
#include "moeplan/simulator/op_costs.h"

namespace moeplan::cli {

namespace {

constexpr NameTable<bool, 2> kOnOff{{{"on", true}, {"off", false}}};
// Mixed precision's gradients: kept and reduced in fp32 (true) or in bf16.
constexpr NameTable<bool, 2> kGradientNames{{{"fp32", true}, {"bf16", false}}};

struct Search {
  planner::SearchRequest request;
  std::string gpus;  // "N" or a range "A:B" of cluster sizes
  bool explain = false;
  bool json = false;
  std::string out = "plan.json";
  std::string command;  // the command line, recorded in the plan
};

// The cluster, the profiles, the time and cost inputs and the training schedule.
void add_setting_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  TrainingConfig& training = r.options.training;
  cmd.add_option("--gpus", s.gpus, "Number of GPUs (ranks), or a range A:B of cluster sizes to search (whole nodes)")
      ->required();
  cmd.add_option("--train-tokens", r.goal.tokens,
                 "Tokens to train (e.g. 1T, 300B, 2.5e12): prints each plan's days and dollars")
      ->transform(CLI::AsNumberWithUnit(std::map<std::string, double>{{"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"T", 1e12}},
                                        CLI::AsNumberWithUnit::CASE_SENSITIVE))
      ->check(CLI::Range(0.0, 1e18));
  add_choice(cmd, "--objective", r.goal.objective, planner::kObjectiveNames,
             "What ranks the cluster sizes of a --gpus range: time, cost or tokens-per-dollar")
      ->capture_default_str();
  cmd.add_option("--deadline-days", r.goal.deadline_days,
                 "With --train-tokens: only cluster sizes that train them within this many days")
      ->check(CLI::Range(0.0, 1e6));
  cmd.add_option("--restart-minutes", r.goal.restart_minutes,
                 "Minutes a restart after a node failure takes (detect, replace, reload)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e5));
  cmd.add_option("--instance", r.instance, "Hardware profile name or .json file")->capture_default_str();
  cmd.add_option("--model", r.model, "Model profile name, or a profile or Hugging Face config.json file")
      ->capture_default_str();
  cmd.add_option("--profiles", r.profiles, "Folder with hardware/ and models/ profiles");
  cmd.add_option("--seq-len", training.seq_len, "Sequence length (block size)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  cmd.add_option("--global-batch-tokens", training.global_batch_tokens,
                 "Tokens per optimizer step (default: 4Mi rounded up to gpus x seq-len)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  add_choice(cmd, "--precision", r.precision, kPrecisionNames,
             "bf16 (parameters and moments too), mixed (fp32 parameters, bf16 compute) or fp32 (default: mixed for "
             "megatron, smp and torchtitan, whose bf16 training keeps fp32 parameters; bf16 otherwise)");
  cmd.add_option("--steps", training.steps, "Training steps (the length of the learning-rate schedule)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd.add_option("--learning-rate", training.learning_rate, "Peak learning rate")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  cmd.add_option("--min-learning-rate", training.min_learning_rate, "Learning rate at the end of the cosine decay")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  cmd.add_option("--warmup-steps", training.warmup_steps, "Linear warmup steps")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
}

// The degrees and layout choices a user may fix, and the target framework.
void add_layout_options(CLI::App& cmd, Search& s) {
  planner::SearchOptions& o = s.request.options;
  planner::SearchOptions::Pins& pin = o.pins;
  const auto degree = CLI::Range(int64_t{1}, int64_t{1} << 20);
  cmd.add_option("--expert-parallel-degree", pin.expert_parallel_degree, "Fix E instead of searching it")->check(degree);
  cmd.add_option("--hybrid-shard-degree", pin.hybrid_shard_degree, "Fix S instead of searching it")->check(degree);
  cmd.add_option("--tensor-parallel-degree", pin.tensor_parallel_degree, "Fix T instead of searching it")->check(degree);
  cmd.add_option("--pipeline-parallel-degree", pin.pipeline_parallel_degree, "Fix P instead of searching it")
      ->check(degree);
  cmd.add_option("--virtual-pipeline-degree", pin.virtual_pipeline_degree,
                 "Fix the interleaved chunks per pipeline stage (1: plain 1F1B)")
      ->check(degree);
  add_choice(cmd, "--sequence-parallel", pin.sequence_parallel, kOnOff, "Fix sequence parallelism (with T > 1)");
  // Empty: not fixed, as if not given.
  cmd.add_option(
         "--placement",
         [&pin](const CLI::results_t& text) {
           pin.placement = text.front().empty() ? std::nullopt : std::optional<std::string>(text.front());
           return true;
         },
         "Fix the placement: R, S, E (and P, T) outermost first, e.g. RSE or PRSET; SMP's cluster, spread or "
         "D/P/T letters")
      ->type_name("TEXT");
  o.target = Target::kMoeplan;  // what `moeplan run` trains, unless asked for another framework
  add_choice(cmd, "--target", o.target, kTargetNames,
             "Where the plan trains, and so which layouts are searched: moeplan (what `moeplan run` trains), "
             "megatron (Megatron-LM), smp (SageMaker model parallelism v2), torchtitan, or any (every layout "
             "moeplan models); `moeplan export-launch` writes the other frameworks' files",
             {Target::kMoeplan, Target::kMegatron, Target::kSmp, Target::kTorchtitan, Target::kAny})
      ->capture_default_str();
  add_choice(cmd, "--checkpointing", pin.checkpointing, kCheckpointingNames,
             "Fix activation checkpointing (selective: the MoE sub-block; attention_core: Megatron's selective "
             "recomputation)");
  add_choice(cmd, "--distributed-optimizer", pin.distributed_optimizer, kOnOff,
             "Fix the distributed optimizer (states sharded over the replicas, ZeRO-1)");
  cmd.add_option("--first-stage-layers", pin.first_stage_layers, "Fix the blocks of the first pipeline stage")
      ->check(degree);
  cmd.add_option("--last-stage-layers", pin.last_stage_layers, "Fix the blocks of the last pipeline stage")
      ->check(degree);
}

// What the framework runs, offloading, and the expert load.
void add_framework_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  planner::SearchOptions::Pins& pin = r.options.pins;
  cmd.add_flag("--fp8", r.options.training.fp8, "FP8 GEMMs (Transformer Engine's recipe; GPUs with FP8 tensor cores)");
  add_choice(cmd, "--gradients", r.fp32_gradients, kGradientNames,
             "Mixed precision's gradients: fp32 or bf16 (default: bf16 for smp, whose FSDP reduces in bf16; fp32 "
             "otherwise)");
  add_choice(cmd, "--load-balancing", r.load_balancing, kLoadBalancingNames,
             "The router's load balancing: sinkhorn, balanced, aux_loss or none (default: aux_loss for megatron and "
             "torchtitan, sinkhorn, SMP's default, otherwise)");
  add_choice(cmd, "--kernels", r.kernels, kKernelNames, "What the framework runs: fused or eager (default: the profile's)");
  add_choice(cmd, "--attention", r.attention, kAttentionKernelNames,
             "Attention kernel: flash or unfused (default: the profile's)");
  add_choice(cmd, "--offload", pin.offloading, kOnOff, "Fix activation offloading");
  cmd.add_option("--loading-horizon", pin.loading_horizon, "Fix the offload loading horizon")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  cmd.add_option("--micro-batch", pin.micro_batch_size, "Fix the micro-batch size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd.add_option("--expert-load-imbalance", r.options.moe.expert_load_imbalance,
                 "Tokens of the busiest expert over the mean")
      ->capture_default_str()->check(CLI::Range(1.0, 1e6));
  cmd.add_option("--tokens-per-expert", r.options.moe.tokens_per_expert,
                 "Token counts per expert, e.g. measured (comma-separated); overrides the imbalance")
      ->delimiter(',')->check(CLI::Range(0.0, 1e18));
}

// How the search ranks, and what it prints and writes.
void add_output_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  cmd.add_option("--max-micro-batch", r.options.max_micro_batch, "Largest micro-batch size tried")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--top", r.top, "Candidates shown")->capture_default_str()->check(CLI::Range(1, 1000));
  add_choice(cmd, "--estimator", r.options.estimator, planner::kEstimatorNames,
             "Rank by the step simulator or the analytic estimate")
      ->capture_default_str();
  cmd.add_flag_callback("--exhaustive", [&r] { r.options.prune = false; },
                        "Simulate every candidate that fits instead of pruning by the compute bound");
  cmd.add_flag("--explain", s.explain, "Show how many candidates each rule or limit removed");
  cmd.add_flag("--json", s.json, "Print the plan as JSON instead of the table");
  cmd.add_option("--out", s.out, "Plan file to write (empty: none)")->capture_default_str();
  cmd.add_option("--data", r.options.training.data,
                 "Folder written by `moeplan data prepare` that the plan trains on (`moeplan run` takes it)");
}

void print_table(const planner::SearchResult& result, const ClusterSpec& cluster, size_t top) {
  std::printf("\n  #   E   S   R   T     P  place  ckpt       offload  mbs   ga  step(s)  compute  recomp.  waiting   tokens/s  TFLOP/s/GPU   MFU  mem(GiB)\n");
  for (size_t i = 0; i < result.ranked.size() && i < top; ++i) {
    const planner::Candidate& c = result.ranked[i];
    const ParallelConfig& p = c.parallel;
    const std::string offload =
        p.activation_offloading ? "h" + std::to_string(p.activation_loading_horizon) : "-";
    const sim::StepEstimate& e = c.estimate;
    const std::string tensor = std::to_string(p.tensor_parallel_degree) + (p.sequence_parallel ? "s" : "");
    const std::string pipeline = std::to_string(p.pipeline_parallel_degree) +
                                 (p.virtual_pipeline_degree > 1 ? "x" + std::to_string(p.virtual_pipeline_degree) : "");
    std::printf("%3zu %3lld %3lld %3lld %3s %5s  %-5s  %-9s  %-7s %4lld %4lld %8.3f %8.3f %8.3f %8.3f %10.0f %12.1f %5.1f%% %6.1f/%.1f\n", i + 1,
                static_cast<long long>(p.expert_parallel_degree), static_cast<long long>(p.hybrid_shard_degree),
                static_cast<long long>(p.replica_degree()), tensor.c_str(), pipeline.c_str(), p.placement.to_string().c_str(),
                std::string(name_of(kCheckpointingNames, p.activation_checkpointing)).c_str(), offload.c_str(),
                static_cast<long long>(p.micro_batch_size), static_cast<long long>(p.gradient_accumulation_steps),
                e.step_time_s, e.compute_s, e.recompute_s, e.exposed_comm_s, e.tokens_per_s, e.tflops_per_gpu, 100.0 * e.mfu,
                in_gib(c.memory.device_total), in_gib(cluster.usable_memory_bytes()));
  }
}

void print_explain(const planner::SearchStats& s) {
  std::printf("\nwhy candidates were removed (a candidate counts once for each rule it breaks):\n");
  std::printf("  %-40s %10lld\n", "enumerated", static_cast<long long>(s.enumerated));
  std::printf("  %-40s %10lld\n", "duplicate placement (same group shapes)",
              static_cast<long long>(s.duplicate_placements));
  for (int r = 0; r < kRuleCount; ++r) {
    const int64_t n = s.rejected_by_rule[static_cast<size_t>(r)];
    if (n > 0) std::printf("  rule %-35s %10lld\n", std::string(rule_name(static_cast<Rule>(r))).c_str(),
                           static_cast<long long>(n));
  }
  std::printf("  %-40s %10lld\n", "valid by every rule", static_cast<long long>(s.rule_valid));
  std::printf("  %-40s %10lld\n", "limit device memory", static_cast<long long>(s.over_device_memory));
  std::printf("  %-40s %10lld\n", "limit host memory (offload)", static_cast<long long>(s.over_host_memory));
  std::printf("  %-40s %10lld\n", "fit in memory", static_cast<long long>(s.fitting));
  std::printf("  %-40s %10lld\n", "simulated (others pruned by a lower bound)", static_cast<long long>(s.simulated));
}

// A calibrated profile's operation times hold the splits it measured; a plan with another
// T > 1 is estimated from FLOPs and the matrix-multiply curve instead, which on CPU ranks has
// been far less close (docs/validation.md, "What is still off"). Said when the table shows
// such a plan.
void note_unmeasured_splits(const planner::SearchResult& result, const RunConfig& setting, size_t top) {
  if (!sim::op_times_apply(setting)) return;
  for (size_t i = 0; i < std::min(top, result.ranked.size()); ++i) {
    const RunConfig c{setting.model, setting.cluster, result.ranked[i].parallel, setting.moe, setting.training};
    if (sim::op_times_apply(c)) continue;
    std::printf("\nnote: %s has no operation times measured at T = %lld; such plans are estimated from FLOPs and\n"
                "      its matrix-multiply curve, less closely (docs/validation.md); pin --tensor-parallel-degree\n"
                "      to a split it measured\n",
                setting.cluster.name.c_str(), static_cast<long long>(c.parallel.tensor_parallel_degree));
    return;
  }
}

std::string days_text(double seconds) {
  if (!std::isfinite(seconds)) return "never";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds / 86400.0);
  return text;
}

std::string dollars_text(double dollars) {
  if (dollars < 0) return "-";
  char text[32];
  std::snprintf(text, sizeof text, "$%.0f", dollars);
  return text;
}

// Each ranked plan's days and dollars to train the tokens asked for.
void print_training_time(const planner::SearchResult& result, const ClusterSpec& cluster,
                         const planner::TrainingGoal& goal, size_t top) {
  std::printf("\nto train %.3g tokens on %lld x %s (%s per instance-hour, %.2g node failures per node-hour, "
              "restart %.0f min):\n  #       days  goodput  checkpoint every   instance-hours      dollars\n",
              goal.tokens, static_cast<long long>(cluster.num_nodes), cluster.name.c_str(),
              cluster.instance_price_per_hour > 0 ? dollars_text(cluster.instance_price_per_hour).c_str() : "no price",
              cluster.node_failures_per_hour, goal.restart_minutes);
  for (size_t i = 0; i < result.ranked.size() && i < top; ++i) {
    const planner::TrainingTime t = planner::training_time_of(cluster, result.ranked[i], goal);
    std::printf("%3zu %10s  %6.1f%%  %12.1f min  %15.0f %12s\n", i + 1, days_text(t.seconds).c_str(), 100 * t.goodput,
                t.checkpoint_interval_s / 60.0, t.instance_hours, dollars_text(t.dollars).c_str());
  }
}

// One size of a range: its best plan's rate, days and dollars, or that it has none.
void print_size(const planner::SizeResult& size, const planner::TrainingGoal& goal) {
  const long long gpus = size.gpus, nodes = size.cluster.num_nodes;
  if (size.result.ranked.empty()) {
    std::printf("%6lld %10lld  no plan (`moeplan search --gpus %lld --explain` says why)\n", gpus, nodes, gpus);
    return;
  }
  const planner::Candidate& best = size.result.ranked.front();
  const bool tokens = goal.tokens > 0;
  std::printf("%6lld %10lld  %-48s %10.0f %9s  %6.1f%% %12s%s\n", gpus, nodes, describe(best.parallel).c_str(),
              best.estimate.tokens_per_s, tokens ? days_text(size.time.seconds).c_str() : "-", 100 * size.time.goodput,
              tokens ? dollars_text(size.time.dollars).c_str() : "-", size.in_time ? "" : "  (over the deadline)");
}

// What a range searches, and its table's head; each size's row follows as it is searched.
void print_sizes_head(const planner::PreparedSearch& s) {
  const double tokens = s.goal.tokens;
  std::printf("moeplan search: %s on %s, %lld to %lld GPUs, global batch %lld tokens%s\n", s.model.name.c_str(),
              s.cluster.name.c_str(), static_cast<long long>(s.sizes.front()), static_cast<long long>(s.sizes.back()),
              static_cast<long long>(s.options.training.global_batch_tokens),
              tokens > 0 ? (", " + std::to_string(static_cast<long long>(tokens)) + " tokens to train").c_str() : "");
  std::printf("\n  GPUs  instances  plan                                              tokens/s      days  goodput      dollars\n");
}

// A range of cluster sizes: the size the objective picks among those within the deadline,
// written as the plan.
int report_sizes(const Search& c, const planner::SearchOutcome& found) {
  const planner::TrainingGoal& goal = found.search.goal;
  if (!found.plan) {
    std::fprintf(stderr, "moeplan: no cluster size of %s %s\n", c.gpus.c_str(),
                 goal.deadline_days > 0 ? "trains the tokens within the deadline" : "has a plan");
    return kExitNoPlan;
  }
  const planner::SizeResult& chosen = found.sweep.sizes[*found.sweep.chosen];
  std::printf("\n%s cluster%s: %lld x %s (%lld GPUs), %s", goal.objective == planner::Objective::kTime ? "fastest" : "cheapest",
              goal.deadline_days > 0 ? (" within " + days_text(goal.deadline_days * 86400.0) + " days").c_str() : "",
              static_cast<long long>(chosen.cluster.num_nodes), chosen.cluster.name.c_str(),
              static_cast<long long>(chosen.gpus), describe(found.plan->parallel).c_str());
  if (goal.tokens > 0)
    std::printf(", %s days, %s", days_text(chosen.time.seconds).c_str(), dollars_text(chosen.time.dollars).c_str());
  std::printf("\n");
  if (!c.out.empty()) {
    write_file_atomic(c.out, plan_to_text(*found.plan));
    std::printf("wrote %s\n", c.out.c_str());
  }
  return kExitOk;
}

// What one size searches, before it does.
void print_setting(const planner::PreparedSearch& s) {
  const ParamCounts params = count_parameters(s.model);
  std::printf("moeplan search: %s (%.1fB parameters, %.1fB active per token) on %lld x %s (%lld x %s)\n",
              s.model.name.c_str(), static_cast<double>(params.total()) / 1e9,
              static_cast<double>(params.active()) / 1e9, static_cast<long long>(s.cluster.num_nodes),
              s.cluster.name.c_str(), static_cast<long long>(s.options.gpus), s.cluster.gpu_name.c_str());
  std::printf("global batch %lld tokens (seq-len %lld), precision %s, expert load imbalance %.2f\n",
              static_cast<long long>(s.options.training.global_batch_tokens),
              static_cast<long long>(s.options.training.seq_len),
              std::string(name_of(kPrecisionNames, s.options.training.precision)).c_str(),
              s.options.moe.expert_load_imbalance);
}

// One cluster size: the ranked table (or the plan as JSON), and the plan written.
int report_one_size(const Search& c, const planner::SearchOutcome& found) {
  const planner::PreparedSearch& s = found.search;
  const planner::SearchResult& result = found.result;
  const size_t top = static_cast<size_t>(c.request.top);
  if (!c.json) std::printf("%s\n", planner::describe(result.stats).c_str());
  if (c.explain) print_explain(result.stats);
  if (!found.plan) {
    std::fprintf(stderr, "moeplan: no plan for %s on %lld GPU(s) of %s\n", s.model.name.c_str(),
                 static_cast<long long>(s.options.gpus), s.cluster.name.c_str());
    for (const std::string& line : planner::explain_no_plan(result, s.cluster))
      std::fprintf(stderr, "moeplan:   %s\n", line.c_str());
    return kExitNoPlan;
  }
  const std::string text = plan_to_text(*found.plan);
  if (c.json) {
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    print_table(result, s.cluster, top);
    if (s.goal.tokens > 0) print_training_time(result, s.cluster, s.goal, top);
    note_unmeasured_splits(result, RunConfig{s.model, s.cluster, ParallelConfig{}, s.options.moe, s.options.training},
                           top);
  }
  if (!c.out.empty()) {
    write_file_atomic(c.out, text);
    if (!c.json) std::printf("\nwrote %s (%s)\n", c.out.c_str(), describe(found.plan->parallel).c_str());
  }
  return kExitOk;
}

int run_search(Search& c) {
  try {
    planner::SearchProgress progress;
    progress.prepared = [&c](const planner::PreparedSearch& s) {
      if (s.gpus.is_range()) print_sizes_head(s);
      else if (!c.json) print_setting(s);
    };
    progress.size_searched = [&c](const planner::SizeResult& size) { print_size(size, c.request.goal); };
    c.request.gpus = planner::parse_gpu_range(c.gpus);
    if (c.request.gpus.is_range() && (c.json || c.explain))
      throw InputError("--gpus", {{"", "= " + c.gpus + ": a range prints its own table; --json and --explain take one size"}});
    const planner::SearchOutcome found = planner::plan_search(c.request, c.command, progress);
    return found.search.gpus.is_range() ? report_sizes(c, found) : report_one_size(c, found);
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

}  // namespace

Command add_search_command(CLI::App& app, const Invocation& invocation) {
  auto search = std::make_shared<Search>();
  search->command = invocation.text();
  CLI::App* cmd = app.add_subcommand("search", "Search parallel configurations and write the best as a plan");
  add_setting_options(*cmd, *search);
  add_layout_options(*cmd, *search);
  add_framework_options(*cmd, *search);
  add_output_options(*cmd, *search);
  return {cmd, [search] { return run_search(*search); }};
}

}  // namespace moeplan::cli
