// `moeplan simulate plan.json`: one training step of a plan, where its time goes, and beside a
// run's measured phases.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/moe_load.h"
#include "moeplan/core/routing_profile.h"
#include "moeplan/core/run_report.h"
#include "moeplan/core/trace.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/routing.h"
#include "moeplan/simulator/step.h"

namespace moeplan::cli {

namespace {

struct Simulate {
  std::string plan;
  std::string trace;  // Chrome trace to write; empty: none
  bool all_ranks = false;
  bool all_micro_batches = false;
  std::string measured;  // a run's report.json: simulate with its expert load, compare phases
  std::string routing;   // a routing profile: the step over draws from it
  int64_t draws = 32;
};

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

void print_phase_comparison(const sim::StepSimulation& s, const Measured& m, const RunConfig& config) {
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
  std::printf("  (forward and backward include the waits for collectives inside them; the collectives' rows are the "
              "time spent inside each kind)\n");
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

// The step by what it spends (the busiest rank's view, as shares of the step).
void print_step(const Plan& plan, const sim::StepSimulation& s) {
  const sim::StepEstimate& e = s.estimate;
  std::printf("step %.3f s, %.0f tokens/s, %.1f TFLOP/s per GPU, MFU %.1f%%\n", e.step_time_s, e.tokens_per_s,
              e.tflops_per_gpu, 100.0 * e.mfu);
  std::printf("busiest rank: compute %.3f s, recompute %.3f s, optimizer %.3f s, waiting on communication %.3f s\n",
              e.compute_s, e.recompute_s, e.optimizer_s, e.exposed_comm_s);
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
}

// One micro-batch on the first simulated rank by operation, forward, backward and recompute
// together: each kernel of the model's blocks (latent attention's projections, shared experts,
// the router, token permutation, the experts' GEMMs), and the collectives on its chain by kind
// (the token dispatch and combine, tensor-parallel and context-parallel exchanges), from the
// step's trace. A steady micro-batch (the second) where more than one was simulated.
void print_operations(const sim::StepSimulation& s, size_t top) {
  if (s.ranks.empty()) return;
  const std::string micro_batch = s.micro_batches > 1 ? "mb1." : "mb0.";
  std::map<std::string, int64_t> by_name;
  int64_t total = 0;
  for (const TraceEvent& e : sim::step_trace(s).events) {
    // The compute chain and the exchanges on it (not the gathers, gradient syncs and copies
    // that run beside it).
    if (e.rank != s.ranks.front() || e.name.rfind(micro_batch, 0) != 0 ||
        (e.stream != TraceStream::kCompute && e.stream != TraceStream::kExpertComm))
      continue;
    std::string name = e.name.substr(micro_batch.size());
    if (name.size() > 1 && name[0] == 'L' && std::isdigit(static_cast<unsigned char>(name[1])) &&
        name.find('.') != std::string::npos)
      name = name.substr(name.find('.') + 1);
    // A kernel's name ends in the op it belongs to (".attn_fwd", ".experts_bwd", ...).
    if (e.category == "compute" && name.rfind('.') != std::string::npos) name = name.substr(0, name.rfind('.'));
    else if (e.category != "compute") name += " (" + e.category + ")";
    by_name[name] += e.duration_ns;
    total += e.duration_ns;
  }
  if (total <= 0) return;
  std::vector<std::pair<std::string, int64_t>> rows(by_name.begin(), by_name.end());
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::printf("one micro-batch on rank %lld by operation (forward, backward and recompute; collectives from arrival, "
              "an overlapped exchange's exposed part only):\n",
              static_cast<long long>(s.ranks.front()));
  int64_t shown = 0;
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    std::printf("  %-34s %10.3f ms %6.1f%%\n", rows[i].first.c_str(), 1e-6 * static_cast<double>(rows[i].second),
                100.0 * static_cast<double>(rows[i].second) / static_cast<double>(total));
    shown += rows[i].second;
  }
  if (rows.size() > top)
    std::printf("  %-34s %10.3f ms %6.1f%%\n", ("the other " + std::to_string(rows.size() - top)).c_str(),
                1e-6 * static_cast<double>(total - shown),
                100.0 * static_cast<double>(total - shown) / static_cast<double>(total));
}

// The step over draws from a routing profile beside the plan's own routing, and the memory of
// the busiest rank at the p99 load.
void print_routing(const Plan& plan, const RunConfig& config, double step_s, const Simulate& args) {
  const RoutingProfile profile = routing_profile_from_spec(args.routing);
  const ModelSpec& m = plan.model;
  const std::vector<Diagnostic> problems =
      routing_mismatches(profile, m.num_experts, m.experts_per_token, m.moe_layers(), "");
  if (!problems.empty()) throw InputError("--routing", problems);
  const sim::RoutedStep r = sim::simulate_routing(config, sim::layout_shapes(plan.cluster, plan.parallel), step_s,
                                                  profile, args.draws, static_cast<uint64_t>(plan.moe.random_seed));
  const auto change = [&](double x) { return 100.0 * (x / r.base_step_s - 1.0); };
  std::printf("routing %s, %lld draws: step median %.3f s (%+.1f%%), p95 %.3f s (%+.1f%%), against %.3f s under the "
              "plan's own routing (busiest expert-parallel rank at %.2f x the mean)\n",
              describe_routing(profile).c_str(), static_cast<long long>(args.draws), r.median_s, change(r.median_s),
              r.p95_s, change(r.p95_s), r.base_step_s, r.base_load);
  const auto gib = [](int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); };
  const int64_t own = planner::estimate_memory(config).device_total;
  const int64_t at_tail = planner::estimate_memory_at_load(config, r.load_p99).device_total;
  std::printf("  busiest expert-parallel rank of a micro-batch's MoE block: median %.2f, p99 %.2f x the mean; memory "
              "per GPU at the p99 load %.1f GiB (%.1f GiB under the plan's own routing, %.1f GiB on the device)\n",
              r.load_median, r.load_p99, gib(at_tail), gib(own), gib(plan.cluster.usable_memory_bytes()));
  if (config.moe.capacity_factor > 0)
    std::printf("  capacity factor %g (%s): %.2f%% of the slots dropped over the draws, %.2f%% under the plan's own "
                "routing\n",
                config.moe.capacity_factor, config.moe.pad_to_capacity ? "padded" : "not padded",
                100.0 * r.dropped_fraction, 100.0 * dropped_fraction(m, config.moe));
}

int run_simulate(const Simulate& args) {
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
    std::printf("%s: %s on %lld x %s\n", args.plan.c_str(), describe(plan.parallel).c_str(),
                static_cast<long long>(plan.cluster.num_nodes), plan.cluster.name.c_str());
    std::printf("simulated %zu of %lld ranks, %lld of %lld micro-batches: %zu ops, %llu events\n", s.ranks.size(),
                static_cast<long long>(plan.parallel.world_size), static_cast<long long>(s.micro_batches),
                static_cast<long long>(plan.parallel.gradient_accumulation_steps), s.graph.ops().size(),
                static_cast<unsigned long long>(s.times.events));
    print_step(plan, s);
    if (plan.parallel.expert_parallel_degree > 1)
      std::printf("token exchange: %s over the %lld ranks of each expert group\n",
                  std::string(name_of(kDispatcherNames, plan.moe.dispatcher)).c_str(),
                  static_cast<long long>(plan.parallel.expert_parallel_degree));
    print_operations(s, 24);
    if (!args.routing.empty()) print_routing(plan, config, s.estimate.step_time_s, args);
    if (!args.measured.empty()) print_phase_comparison(s, measured, config);
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

}  // namespace

void write_simulated_trace(const Plan& plan, const std::string& path) {
  const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  sim::StepSimOptions options;
  options.all_micro_batches = true;  // a measured step shows every micro-batch
  write_file_atomic(path, to_json(simulated_trace(plan, config, sim::simulate_step(config, options))).dump() + "\n");
}

Command add_simulate_command(CLI::App& app) {
  auto args = std::make_shared<Simulate>();
  CLI::App* cmd = app.add_subcommand("simulate", "Simulate one training step of a plan");
  cmd->add_option("plan", args->plan, "plan.json")->required();
  cmd->add_option("--trace", args->trace, "Write the step as a Chrome trace (Perfetto, chrome://tracing)");
  cmd->add_flag("--all-ranks", args->all_ranks, "Simulate every rank, not one node");
  cmd->add_flag("--all-micro-batches", args->all_micro_batches, "Simulate every micro-batch, not two");
  cmd->add_option("--measured", args->measured,
                  "A run's report.json: simulate with its measured expert load and compare phase by phase");
  cmd->add_option("--routing", args->routing,
                  "balanced, skew:X (the busiest expert X times the mean) or a routing profile file: the step over "
                  "draws of each micro-batch's expert loads from it");
  cmd->add_option("--draws", args->draws, "Steps drawn under --routing")->capture_default_str()->check(CLI::Range(1, 1000));
  return {cmd, [args] { return run_simulate(*args); }};
}

}  // namespace moeplan::cli
