#include "commands.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/process.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/core/rules.h"
#include "moeplan/core/run_report.h"
#include "moeplan/core/units.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/frameworks/training_log.h"
#include "moeplan/validation/compare_log.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"
#include "moeplan/planner/training_time.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/step.h"

namespace moeplan::cli {

namespace {

double gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

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
                gib(c.memory.device_total), gib(cluster.usable_memory_bytes()));
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

// What a run measured, from its report.json (core/run_report.h).
struct Measured {
  double step_time_s = 0, undisturbed_step_time_s = 0;  // the median step and the lower quartile
  std::vector<double> tokens_per_expert;  // summed over layers
  std::map<std::string, double> phases;   // rank 0's last step, by the simulator's phase names
};

Measured read_measured(const std::string& path, const Plan& plan) {
  const RunReport report = read_run_report(path);
  Measured m;
  m.step_time_s = report.step_time_s;
  m.undisturbed_step_time_s = report.undisturbed_step_time_s;
  Diagnostics d;
  for (size_t l = 0; l < report.tokens_per_expert.size(); ++l) {
    const std::vector<int64_t>& row = report.tokens_per_expert[l];
    if (static_cast<int64_t>(row.size()) != plan.model.num_experts) {
      d.error("measured.tokens_per_expert[" + std::to_string(l) + "]",
              "expected " + std::to_string(plan.model.num_experts) + " counts (the plan's num_experts)");
      break;
    }
    m.tokens_per_expert.resize(row.size(), 0.0);
    for (size_t e = 0; e < row.size(); ++e) m.tokens_per_expert[e] += static_cast<double>(row[e]);
  }
  d.throw_if_any(path);
  for (const auto& [name, seconds] : report.phases()) m.phases[name] = seconds;
  return m;
}

void print_phase_comparison(const sim::StepSimulation& s, const Measured& m, const Plan& plan, const RunConfig& config) {
  std::printf("\nsimulated with the measured expert load");
  if (!config.moe.tokens_per_expert.empty()) {
    double sum = 0, top = 0;
    for (double v : config.moe.tokens_per_expert) {
      sum += v;
      top = std::max(top, v);
    }
    std::printf(" (busiest expert %.2f x the mean)", top * static_cast<double>(config.moe.tokens_per_expert.size()) / sum);
  }
  std::printf(", rank 0, the whole step:\n  %-18s %12s %12s %10s\n", "phase", "simulated", "measured", "measured/sim");
  auto row = [](const std::string& name, double simulated, double measured) {
    char ratio[32] = "-";
    if (simulated > 0) std::snprintf(ratio, sizeof ratio, "%.2f", measured / simulated);
    std::printf("  %-18s %10.3f s %10.3f s %10s\n", name.c_str(), simulated, measured, ratio);
  };
  for (const auto& [name, seconds] : sim::phase_seconds(s, 0)) {
    const auto it = m.phases.find(name);
    const double measured = it == m.phases.end() ? 0.0 : it->second;
    if (seconds == 0 && measured == 0) continue;
    row(name, seconds, measured);
  }
  row("step (median)", s.estimate.step_time_s, m.step_time_s);
  row("step (undisturbed)", s.estimate.step_time_s, m.undisturbed_step_time_s);
  (void)plan;
  std::printf("  (forward and backward include the waits for collectives inside them; the collectives' rows are the "
              "time spent inside each kind)\n");
}

void print_error(const InputError& e) {
  for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
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

}  // namespace

// "N" or "A:B", both at least 1 and A <= B.
std::pair<int64_t, int64_t> parse_gpus(const std::string& spec) {
  const size_t colon = spec.find(':');
  auto count = [&](const std::string& text) -> int64_t {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE || v < 1 || v > (1 << 20))
      throw InputError("--gpus", {{"", "= \"" + spec.substr(0, 32) + "\": expected a GPU count in [1, 1048576] or a range A:B"}});
    return v;
  };
  if (colon == std::string::npos) {
    const int64_t n = count(spec);
    return {n, n};
  }
  const int64_t lo = count(spec.substr(0, colon)), hi = count(spec.substr(colon + 1));
  if (lo > hi) throw InputError("--gpus", {{"", "= \"" + spec + "\": the range's first size exceeds its last"}});
  return {lo, hi};
}

// The model states a checkpoint saves, per GPU: parameters, master weights, optimizer states.
double checkpoint_bytes(const planner::Candidate& c) {
  return static_cast<double>(c.memory.parameters + c.memory.master_weights + c.memory.optimizer_states);
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
void print_training_time(const planner::SearchResult& result, const ClusterSpec& cluster, const SearchArgs& args) {
  std::printf("\nto train %.3g tokens on %lld x %s (%s per instance-hour, %.2g node failures per node-hour, "
              "restart %.0f min):\n  #       days  goodput  checkpoint every   instance-hours      dollars\n",
              args.train_tokens, static_cast<long long>(cluster.num_nodes), cluster.name.c_str(),
              cluster.instance_price_per_hour > 0 ? dollars_text(cluster.instance_price_per_hour).c_str() : "no price",
              cluster.node_failures_per_hour, args.restart_minutes);
  for (size_t i = 0; i < result.ranked.size() && i < static_cast<size_t>(args.top); ++i) {
    const planner::Candidate& c = result.ranked[i];
    const planner::TrainingTime t = planner::training_time(cluster, cluster.num_nodes, args.train_tokens,
                                                           c.estimate.tokens_per_s, checkpoint_bytes(c),
                                                           args.restart_minutes * 60.0);
    std::printf("%3zu %10s  %6.1f%%  %12.1f min  %15.0f %12s\n", i + 1, days_text(t.seconds).c_str(), 100 * t.goodput,
                t.checkpoint_interval_s / 60.0, t.instance_hours, dollars_text(t.dollars).c_str());
  }
}

// A range of cluster sizes: the best plan of each, its days and dollars for the tokens asked
// for, and the size the objective picks among those within the deadline, written as the plan.
int search_sizes(const SearchArgs& args, const ModelSpec& model, const ClusterSpec& largest,
                 const planner::SearchOptions& options, const std::vector<int64_t>& sizes) {
  const double tokens = args.train_tokens > 0 ? args.train_tokens : 0;
  std::printf("moeplan search: %s on %s, %lld to %lld GPUs, global batch %lld tokens%s\n", model.name.c_str(),
              largest.name.c_str(), static_cast<long long>(sizes.front()), static_cast<long long>(sizes.back()),
              static_cast<long long>(options.training.global_batch_tokens),
              tokens > 0 ? (", " + std::to_string(static_cast<long long>(tokens)) + " tokens to train").c_str() : "");
  std::printf("\n  GPUs  instances  plan                                              tokens/s      days  goodput      dollars\n");
  struct Row {
    int64_t gpus;
    ClusterSpec cluster;
    planner::SearchOptions options;
    planner::SearchResult result;
    planner::TrainingTime time;
  };
  std::optional<Row> chosen;
  auto score = [&](const Row& r) {
    const double per_s = r.result.ranked.front().estimate.tokens_per_s;
    if (args.objective == "time") return tokens > 0 ? r.time.seconds : 1.0 / per_s;
    const double dollars_per_s = static_cast<double>(r.cluster.num_nodes) * r.cluster.instance_price_per_hour / 3600.0;
    return tokens > 0 ? r.time.dollars : dollars_per_s / per_s;  // cost and tokens-per-dollar rank alike
  };
  for (const int64_t gpus : sizes) {
    Row row{gpus, planner::size_cluster(largest, gpus), options, {}, {}};
    row.options.gpus = gpus;
    row.result = planner::search(model, row.cluster, row.options);
    if (row.result.ranked.empty()) {
      std::printf("%6lld %10lld  no plan (`moeplan search --gpus %lld --explain` says why)\n", static_cast<long long>(gpus),
                  static_cast<long long>(row.cluster.num_nodes), static_cast<long long>(gpus));
      continue;
    }
    const planner::Candidate& best = row.result.ranked.front();
    row.time = planner::training_time(row.cluster, row.cluster.num_nodes, tokens, best.estimate.tokens_per_s,
                                      checkpoint_bytes(best), args.restart_minutes * 60.0);
    const bool in_time = args.deadline_days <= 0 || row.time.seconds <= args.deadline_days * 86400.0;
    std::printf("%6lld %10lld  %-48s %10.0f %9s  %6.1f%% %12s%s\n", static_cast<long long>(gpus),
                static_cast<long long>(row.cluster.num_nodes), describe(best.parallel).c_str(), best.estimate.tokens_per_s,
                tokens > 0 ? days_text(row.time.seconds).c_str() : "-", 100 * row.time.goodput,
                tokens > 0 ? dollars_text(row.time.dollars).c_str() : "-", in_time ? "" : "  (over the deadline)");
    if (in_time && (!chosen || score(row) < score(*chosen))) chosen = std::move(row);
  }
  if (!chosen) {
    std::fprintf(stderr, "moeplan: no cluster size of %s %s\n", args.gpus.c_str(),
                 args.deadline_days > 0 ? "trains the tokens within the deadline" : "has a plan");
    return kExitNoPlan;
  }
  const Plan plan = planner::make_plan(model, chosen->cluster, chosen->options, chosen->result, args.command);
  const char* what = args.objective == "time" ? "fastest" : "cheapest";
  std::printf("\n%s cluster%s: %lld x %s (%lld GPUs), %s", what,
              args.deadline_days > 0 ? (" within " + days_text(args.deadline_days * 86400.0) + " days").c_str() : "",
              static_cast<long long>(chosen->cluster.num_nodes), chosen->cluster.name.c_str(),
              static_cast<long long>(chosen->gpus), describe(plan.parallel).c_str());
  if (tokens > 0)
    std::printf(", %s days, %s", days_text(chosen->time.seconds).c_str(), dollars_text(chosen->time.dollars).c_str());
  std::printf("\n");
  if (!args.out.empty()) {
    write_file_atomic(args.out, plan_to_text(plan));
    std::printf("wrote %s\n", args.out.c_str());
  }
  return kExitOk;
}

int run_search(const SearchArgs& args) {
  try {
    const auto [min_gpus, max_gpus] = parse_gpus(args.gpus);
    if (args.deadline_days > 0 && args.train_tokens <= 0)
      throw InputError("--deadline-days", {{"", "needs --train-tokens (the tokens to train within it)"}});
    const std::string dir = profile_dir(args.profiles);
    const ModelSpec model = load_model(args.model, dir);
    const ClusterSpec instance = load_hardware(args.instance, dir);
    const bool range = min_gpus != max_gpus;
    if (range && (args.json || args.explain))
      throw InputError("--gpus", {{"", "= " + args.gpus + ": a range prints its own table; --json and --explain take one size"}});
    if (!range && args.deadline_days > 0)
      throw InputError("--deadline-days", {{"", "picks among the sizes of a --gpus range (A:B)"}});
    if (!range && args.objective != "time")
      throw InputError("--objective", {{"", "= " + args.objective + " ranks the sizes of a --gpus range (A:B)"}});
    // A range plans every size for the batch of its largest whole-node size, so their days compare.
    const std::vector<int64_t> sizes =
        range ? planner::cluster_sizes(min_gpus, max_gpus, instance.gpus_per_node) : std::vector<int64_t>{max_gpus};
    if (sizes.empty())
      throw InputError("--gpus", {{"", "= " + args.gpus + " holds no whole number of " + instance.name + " instances (" +
                                           std::to_string(instance.gpus_per_node) + " GPUs each)"}});
    const int64_t batch_gpus = sizes.back();
    if (args.objective != "time" && instance.instance_price_per_hour <= 0)
      throw InputError("--objective", {{"", "= " + args.objective + " needs the instance's price: " + instance.name +
                                                 " has no cost.instance_price_per_hour"}});
    ClusterSpec cluster = planner::size_cluster(instance, max_gpus);
    // What the training framework runs: its kernel set (the attention kernel follows it unless
    // given).
    for (const auto& [name, value] : kKernelNames)
      if (name == args.kernels) {
        cluster.kernels = value;
        cluster.attention = value == Kernels::kFused ? AttentionKernel::kFlash : AttentionKernel::kUnfused;
      }
    for (const auto& [name, value] : kAttentionKernelNames)
      if (name == args.attention) cluster.attention = value;

    planner::SearchOptions options;
    options.gpus = max_gpus;
    options.training.fp8 = args.fp8;
    options.training.seq_len = args.seq_len;
    options.training.steps = args.steps;
    options.training.learning_rate = args.learning_rate;
    options.training.min_learning_rate = args.min_learning_rate;
    options.training.warmup_steps = args.warmup_steps;
    if (args.min_learning_rate > args.learning_rate)
      throw InputError("--min-learning-rate", {{"", "must not exceed --learning-rate"}});
    options.training.global_batch_tokens = args.global_batch_tokens > 0
                                               ? args.global_batch_tokens
                                               : planner::default_global_batch_tokens(batch_gpus, args.seq_len);
    for (const auto& [name, value] : kTargetNames)
      if (name == args.target) options.target = value;
    // Megatron-LM's, torchtitan's and SMP's bf16 training keeps fp32 parameters and optimizer
    // states; SMP's reduces gradients in bf16.
    const bool keeps_fp32 = options.target != Target::kAny && options.target != Target::kMoeplan;
    const std::string precision = !args.precision.empty() ? args.precision : keeps_fp32 ? "mixed" : "bf16";
    options.training.fp32_gradients =
        args.gradients.empty() ? options.target != Target::kSmp : args.gradients == "fp32";
    for (const auto& [name, value] : kPrecisionNames)
      if (name == precision) options.training.precision = value;
    const bool aux_loss = options.target == Target::kMegatron || options.target == Target::kTorchtitan;
    const std::string routing = !args.load_balancing.empty() ? args.load_balancing : aux_loss ? "aux_loss" : "sinkhorn";
    for (const auto& [name, value] : kLoadBalancingNames)
      if (name == routing) options.moe.load_balancing = value;
    options.moe.expert_load_imbalance = args.expert_load_imbalance;
    options.moe.tokens_per_expert = args.tokens_per_expert;
    if (!args.tokens_per_expert.empty()) {
      const RunConfig probe{model, cluster, ParallelConfig{}, options.moe, options.training};
      for (const Violation& v : validate(probe))
        if (v.rule == Rule::kTokenCountsMatchExperts)
          throw InputError("--tokens-per-expert", {{"", v.message}});
    }
    options.moe.aux_loss_coef = model.router_aux_loss_coef;
    if (!args.data.empty()) {
      if (!std::filesystem::exists(args.data + "/manifest.json"))
        throw InputError("--data", {{"", args.data + " has no manifest.json; prepare it with `moeplan data prepare`"}});
      options.training.data = args.data;
    }
    options.max_micro_batch = args.max_micro_batch;
    options.estimator = args.estimator == "analytic" ? planner::Estimator::kAnalytic : planner::Estimator::kSimulator;
    options.keep = static_cast<size_t>(std::max<int64_t>(args.top, 5));
    planner::SearchOptions::Pins& pin = options.pins;
    if (args.expert_parallel_degree > 0) pin.expert_parallel_degree = args.expert_parallel_degree;
    if (args.hybrid_shard_degree > 0) pin.hybrid_shard_degree = args.hybrid_shard_degree;
    if (args.micro_batch_size > 0) pin.micro_batch_size = args.micro_batch_size;
    if (args.loading_horizon > 0) pin.loading_horizon = args.loading_horizon;
    if (!args.offloading.empty()) pin.offloading = args.offloading == "on";
    if (args.tensor_parallel_degree > 0) pin.tensor_parallel_degree = args.tensor_parallel_degree;
    if (args.pipeline_parallel_degree > 0) pin.pipeline_parallel_degree = args.pipeline_parallel_degree;
    if (args.virtual_pipeline_degree > 0) pin.virtual_pipeline_degree = args.virtual_pipeline_degree;
    if (!args.sequence_parallel.empty()) pin.sequence_parallel = args.sequence_parallel == "on";
    if (!args.distributed_optimizer.empty()) pin.distributed_optimizer = args.distributed_optimizer == "on";
    if (args.first_stage_layers > 0) pin.first_stage_layers = args.first_stage_layers;
    if (args.last_stage_layers > 0) pin.last_stage_layers = args.last_stage_layers;
    if (!args.placement.empty()) {
      if (!Placement::parse(args.placement))
        throw InputError("--placement", {{"", "= \"" + args.placement.substr(0, 16) +
                                                  "\": expected R, S and E once each and P and T at most once, "
                                                  "outermost first (e.g. RSE or PRSET), or SMP's cluster, spread "
                                                  "or a string of D, P and T"}});
      pin.placement = args.placement;
    }
    for (const auto& [name, value] : kCheckpointingNames)
      if (name == args.checkpointing) pin.checkpointing = value;

    // Whole sequences; whether they split over a layout's data-parallel replicas (W / (T x P)
    // readers) is the global-batch rule's to say, layout by layout.
    if (options.training.global_batch_tokens % args.seq_len != 0)
      throw InputError("--global-batch-tokens",
                       {{"", "= " + std::to_string(options.training.global_batch_tokens) +
                                 " is not a multiple of seq-len = " + std::to_string(args.seq_len) +
                                 " (the batch is made of whole sequences)"}});

    if (range) return search_sizes(args, model, cluster, options, sizes);

    const ParamCounts params = count_parameters(model);
    if (!args.json) {
      std::printf("moeplan search: %s (%.1fB parameters, %.1fB active per token) on %lld x %s (%lld x %s)\n",
                  model.name.c_str(), static_cast<double>(params.total()) / 1e9,
                  static_cast<double>(params.active()) / 1e9, static_cast<long long>(cluster.num_nodes),
                  cluster.name.c_str(), static_cast<long long>(max_gpus), cluster.gpu_name.c_str());
      std::printf("global batch %lld tokens (seq-len %lld), precision %s, expert load imbalance %.2f\n",
                  static_cast<long long>(options.training.global_batch_tokens),
                  static_cast<long long>(args.seq_len), precision.c_str(), args.expert_load_imbalance);
    }

    const planner::SearchResult result = planner::search(model, cluster, options);
    const planner::SearchStats& s = result.stats;
    if (!args.json)
      std::printf("%lld configurations: %lld valid, %lld fit in memory, %lld simulated (the rest pruned by a lower bound)\n",
                  static_cast<long long>(s.enumerated), static_cast<long long>(s.rule_valid),
                  static_cast<long long>(s.fitting), static_cast<long long>(s.simulated));
    if (args.explain) print_explain(s);
    if (result.ranked.empty()) {
      std::fprintf(stderr, "moeplan: no plan for %s on %lld GPU(s) of %s\n", model.name.c_str(),
                   static_cast<long long>(max_gpus), cluster.name.c_str());
      for (const std::string& line : planner::explain_no_plan(result, cluster))
        std::fprintf(stderr, "moeplan:   %s\n", line.c_str());
      return kExitNoPlan;
    }

    const Plan plan = planner::make_plan(model, cluster, options, result, args.command);
    const std::string text = plan_to_text(plan);
    if (args.json) {
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      print_table(result, cluster, static_cast<size_t>(args.top));
      if (args.train_tokens > 0) print_training_time(result, cluster, args);
      note_unmeasured_splits(result, RunConfig{model, cluster, ParallelConfig{}, options.moe, options.training},
                             static_cast<size_t>(args.top));
    }
    if (!args.out.empty()) {
      write_file_atomic(args.out, text);
      if (!args.json) std::printf("\nwrote %s (%s)\n", args.out.c_str(), describe(plan.parallel).c_str());
    }
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

int run_check(const CheckArgs& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
    const planner::MemoryEstimate memory = planner::estimate_memory(config);
    std::vector<std::string> problems;
    const int64_t limit = plan.cluster.usable_memory_bytes();
    if (memory.device_total > limit)
      problems.push_back("parallel: needs " + std::to_string(memory.device_total) +
                         " bytes of device memory per GPU, over the usable " + std::to_string(limit));
    const int64_t host_limit = planner::host_limit_bytes(plan.cluster, plan.parallel.world_size);
    if (memory.offloaded_activations > host_limit)
      problems.push_back("parallel.activation_offloading: offloads " +
                         std::to_string(memory.offloaded_activations) + " bytes per rank, over the host's " +
                         std::to_string(host_limit));
    if (memory.device_total != plan.prediction.memory.device_total_bytes)
      problems.push_back("prediction.memory.device_total_bytes: = " +
                         std::to_string(plan.prediction.memory.device_total_bytes) +
                         " but the memory model gives " + std::to_string(memory.device_total) +
                         " for this configuration (edited by hand, or written by another version)");
    for (const std::string& p : problems) std::fprintf(stderr, "moeplan: error: %s: %s\n", args.plan.c_str(), p.c_str());
    if (!problems.empty()) return kExitNoPlan;
    std::printf("%s: ok: %s on %lld x %s, %.1f of %.1f GiB per GPU\n", args.plan.c_str(),
                describe(plan.parallel).c_str(), static_cast<long long>(plan.cluster.num_nodes),
                plan.cluster.name.c_str(), gib(memory.device_total), gib(limit));
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

int run_export_launch(const ExportLaunchArgs& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    Target target = Target::kAny;
    for (const auto& [name, value] : kTargetNames)
      if (name == args.to) target = value;
    const std::vector<launch::LaunchFile> files = launch::export_launch(plan, target, args.plan);
    std::error_code ec;
    std::filesystem::create_directories(args.out, ec);
    if (ec) throw InputError("--out", {{"", args.out + ": cannot create the folder: " + ec.message()}});
    for (const launch::LaunchFile& f : files) {
      const std::string path = (std::filesystem::path(args.out) / f.name).string();
      write_file_atomic(path, f.text);
      if (f.name.ends_with(".sh"))
        std::filesystem::permissions(path, std::filesystem::perms::owner_exec | std::filesystem::perms::group_exec,
                                     std::filesystem::perm_options::add);
      std::printf("wrote %s\n", path.c_str());
    }
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  } catch (const std::system_error& e) {
    std::fprintf(stderr, "moeplan: error: export-launch: %s\n", e.what());
    return kExitBadInput;
  }
}

int run_compare_log(const CompareLogArgs& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    const TrainingLog log = read_training_log(args.log);
    const validation::LogComparison c = validation::compare_with_log(plan, log, args.skip, args.log);
    const std::string text = validation::format_log_comparison(c, args.plan, args.log);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

Trace simulated_trace(const Plan& plan, const RunConfig& config, const sim::StepSimulation& s) {
  // The memory curve: what the memory model says a rank holds throughout the step, plus the
  // activations the simulated blocks keep.
  const planner::MemoryEstimate m = planner::estimate_memory(config);
  const double resident = static_cast<double>(m.model_states() + m.gathered_parameters + m.gradient_buffers +
                                              m.moe_dispatch_buffers + m.framework_overhead);
  Trace trace = sim::step_trace(s, resident);
  trace.plan = describe(plan.parallel);
  trace.world_size = plan.parallel.world_size;
  return trace;
}

void write_simulated_trace(const Plan& plan, const std::string& path) {
  const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  sim::StepSimOptions options;
  options.all_micro_batches = true;  // a measured step shows every micro-batch
  write_file_atomic(path, to_json(simulated_trace(plan, config, sim::simulate_step(config, options))).dump() + "\n");
}

int run_simulate(const SimulateArgs& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    Measured measured;
    MoeConfig moe = plan.moe;
    if (!args.measured.empty()) {
      measured = read_measured(args.measured, plan);
      if (!measured.tokens_per_expert.empty()) moe.tokens_per_expert = measured.tokens_per_expert;
    }
    const RunConfig config{plan.model, plan.cluster, plan.parallel, moe, plan.training};
    sim::StepSimOptions options;
    options.all_ranks = args.all_ranks;
    options.all_micro_batches = args.all_micro_batches || !args.measured.empty();
    const sim::StepSimulation s = sim::simulate_step(config, options);
    const sim::StepEstimate& e = s.estimate;
    std::printf("%s: %s on %lld x %s\n", args.plan.c_str(), describe(plan.parallel).c_str(),
                static_cast<long long>(plan.cluster.num_nodes), plan.cluster.name.c_str());
    std::printf("simulated %zu of %lld ranks, %lld of %lld micro-batches: %zu ops, %llu events\n", s.ranks.size(),
                static_cast<long long>(plan.parallel.world_size), static_cast<long long>(s.micro_batches),
                static_cast<long long>(plan.parallel.gradient_accumulation_steps), s.graph.ops().size(),
                static_cast<unsigned long long>(s.times.events));
    std::printf("step %.3f s, %.0f tokens/s, %.1f TFLOP/s per GPU, MFU %.1f%%\n", e.step_time_s, e.tokens_per_s,
                e.tflops_per_gpu, 100.0 * e.mfu);
    std::printf("busiest rank: compute %.3f s, recompute %.3f s, optimizer %.3f s, waiting on communication %.3f s\n",
                e.compute_s, e.recompute_s, e.optimizer_s, e.exposed_comm_s);
    // The step by what it spends (the busiest rank's view, as shares of the step).
    auto part = [&](const char* name, double seconds) {
      std::printf("  %-34s %10.3f s %6.1f%%\n", name, seconds, 100.0 * seconds / e.step_time_s);
    };
    std::printf("where the step goes:\n");
    part("GEMMs", e.gemm_s);
    part("attention core", e.attention_s);
    part("memory-bound kernels", e.memory_bound_s);
    part("recomputation", e.recompute_s);
    part("optimizer", e.optimizer_s);
    part("compute slowed beside communication", e.contention_s);
    part("exposed communication", e.exposed_comm_s - e.pipeline_bubble_s);
    part("pipeline bubble", e.pipeline_bubble_s);
    if (plan.parallel.pipeline_parallel_degree > 1)
      std::printf("pipeline: %lld stages of %lld blocks (%lld chunks each), 1F1B over %lld micro-batches, bubble %.3f s "
                  "(in the waiting); the ranks and trace are one stage's, the last\n",
                  static_cast<long long>(plan.parallel.pipeline_parallel_degree),
                  static_cast<long long>(plan.model.num_layers / plan.parallel.pipeline_parallel_degree),
                  static_cast<long long>(plan.parallel.virtual_pipeline_degree),
                  static_cast<long long>(plan.parallel.gradient_accumulation_steps), e.pipeline_bubble_s);
    if (plan.cluster.num_nodes > 1)
      std::printf("node 0 network card busy %.3f s (%.0f%% of the step)\n", s.nic_busy_s,
                  100.0 * s.nic_busy_s / e.step_time_s);
    if (!args.measured.empty()) print_phase_comparison(s, measured, plan, config);
    if (!args.trace.empty()) {
      write_file_atomic(args.trace, to_json(simulated_trace(plan, config, s)).dump() + "\n");
      std::printf("wrote %s\n", args.trace.c_str());
    }
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

}  // namespace moeplan::cli

namespace moeplan::cli {

namespace {

// Runs a sibling executable (next to the real path of this one) in this process's place.
int exec_sibling(const char* name, const char* command, const char* built_with, const std::vector<std::string>& args,
                 const char* argv0) {
  const std::string self = this_program_path().value_or(argv0);
  const auto slash = self.rfind('/');
  const std::string tool = (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/" + name;
  std::vector<std::string> argv{tool};
  argv.insert(argv.end(), args.begin(), args.end());
  replace_this_process(tool, argv);
  std::fprintf(stderr, "moeplan: error: %s: cannot run %s (%s); it is built with %s\n", command, tool.c_str(),
               std::strerror(errno), built_with);
  return kExitBadInput;
}

}  // namespace

int run_data(const std::vector<std::string>& args, const char* argv0) {
  return exec_sibling("moeplan-data", "data", "the executor", args, argv0);
}

int run_view(const std::vector<std::string>& args, const char* argv0) {
  return exec_sibling("moeplan-view", "view", "the viewer (Qt6: apt-get install qt6-base-dev)", args, argv0);
}

}  // namespace moeplan::cli
