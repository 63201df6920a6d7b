#include "moeplan/planner/search_report.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/core/units.h"
#include "moeplan/simulator/op_costs.h"

namespace moeplan::planner {

namespace {

// Appends printf-formatted text to `out`.
[[gnu::format(printf, 2, 3)]] void add(std::string& out, const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  if (n > 0) {
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(n) + 1);
    std::vsnprintf(out.data() + at, static_cast<size_t>(n) + 1, format, again);
    out.resize(at + static_cast<size_t>(n));
  }
  va_end(again);
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

// What one size searches, before it does.
std::string setting_text(const PreparedSearch& s) {
  std::string out;
  const ParamCounts params = count_parameters(s.model);
  add(out, "moeplan search: %s (%.1fB parameters, %.1fB active per token) on %lld x %s (%lld x %s)\n",
      s.model.name.c_str(), static_cast<double>(params.total()) / 1e9, static_cast<double>(params.active()) / 1e9,
      static_cast<long long>(s.cluster.num_nodes), s.cluster.name.c_str(), static_cast<long long>(s.options.gpus),
      s.cluster.gpu_name.c_str());
  add(out, "global batch %lld tokens (seq-len %lld), precision %s, expert load imbalance %.2f\n",
      static_cast<long long>(s.options.training.global_batch_tokens), static_cast<long long>(s.options.training.seq_len),
      std::string(name_of(kPrecisionNames, s.options.training.precision)).c_str(), s.options.moe.expert_load_imbalance);
  return out;
}

// What a range searches, and its table's head; each size's row follows as it is searched.
std::string sizes_head_text(const PreparedSearch& s) {
  std::string out;
  const double tokens = s.goal.tokens;
  add(out, "moeplan search: %s on %s, %lld to %lld GPUs, global batch %lld tokens%s\n", s.model.name.c_str(),
      s.cluster.name.c_str(), static_cast<long long>(s.sizes.front()), static_cast<long long>(s.sizes.back()),
      static_cast<long long>(s.options.training.global_batch_tokens),
      tokens > 0 ? (", " + std::to_string(static_cast<long long>(tokens)) + " tokens to train").c_str() : "");
  add(out, "\n  GPUs  instances  plan                                              tokens/s      days  goodput      dollars\n");
  return out;
}

// One size of a range: its best plan's rate, days and dollars, or that it has none.
std::string size_row_text(const SizeResult& size, const TrainingGoal& goal) {
  std::string out;
  const long long gpus = size.gpus, nodes = size.cluster.num_nodes;
  if (size.result.ranked.empty()) {
    add(out, "%6lld %10lld  no plan (`moeplan search --gpus %lld --explain` says why)\n", gpus, nodes, gpus);
    return out;
  }
  const Candidate& best = size.result.ranked.front();
  const bool tokens = goal.tokens > 0;
  add(out, "%6lld %10lld  %-48s %10.0f %9s  %6.1f%% %12s%s\n", gpus, nodes, describe(best.parallel).c_str(),
      best.estimate.tokens_per_s, tokens ? days_text(size.time.seconds).c_str() : "-", 100 * size.time.goodput,
      tokens ? dollars_text(size.time.dollars).c_str() : "-", size.in_time ? "" : "  (over the deadline)");
  return out;
}

void add_table(std::string& out, const SearchResult& result, const ClusterSpec& cluster, size_t top) {
  add(out, "\n  #   E      S   R     T     P   C  place  ckpt       offload  mbs   ga  step(s)  compute  recomp.  waiting   "
           "tokens/s  TFLOP/s/GPU   MFU  mem(GiB)\n");
  for (size_t i = 0; i < result.ranked.size() && i < top; ++i) {
    const Candidate& c = result.ranked[i];
    const ParallelConfig& p = c.parallel;
    const std::string offload = p.activation_offloading ? "h" + std::to_string(p.activation_loading_horizon) : "-";
    const sim::StepEstimate& e = c.estimate;
    // T, "s" with sequence parallelism, "/1" with the experts outside the split (folded).
    const std::string tensor = std::to_string(p.tensor_parallel_degree) + (p.sequence_parallel ? "s" : "") +
                               (p.expert_tensor_fold() > 1 ? "/" + std::to_string(p.expert_tensor_degree()) : "");
    // S, and "/" the dense parameters' shard where it spans the expert and context ranks.
    const std::string shard = std::to_string(p.hybrid_shard_degree) +
                              (p.dense_shard_spanning() ? "/" + std::to_string(p.dense_shard_degree()) : "");
    const std::string pipeline = std::to_string(p.pipeline_parallel_degree) +
                                 (p.virtual_pipeline_degree > 1 ? "x" + std::to_string(p.virtual_pipeline_degree) : "");
    add(out,
        "%3zu %3lld %6s %3lld %5s %5s %3lld  %-5s  %-9s  %-7s %4lld %4lld %8.3f %8.3f %8.3f %8.3f %10.0f %12.1f "
        "%5.1f%% %6.1f/%.1f\n",
        i + 1, static_cast<long long>(p.expert_parallel_degree), shard.c_str(), static_cast<long long>(p.replica_degree()), tensor.c_str(), pipeline.c_str(),
        static_cast<long long>(p.context_parallel_degree), p.placement.to_string().c_str(),
        std::string(name_of(kCheckpointingNames, p.activation_checkpointing)).c_str(), offload.c_str(),
        static_cast<long long>(p.micro_batch_size), static_cast<long long>(p.gradient_accumulation_steps),
        e.step_time_s, e.compute_s, e.recompute_s, e.exposed_comm_s, e.tokens_per_s, e.tflops_per_gpu, 100.0 * e.mfu,
        in_gib(c.memory.device_total), in_gib(cluster.usable_memory_bytes()));
  }
}

// Under --routing: each ranked plan's step under the plan's own routing beside the draws'.
void add_routed_table(std::string& out, const SearchResult& result, const SearchOptions& options,
                      const ClusterSpec& cluster, size_t top) {
  if (options.routing.empty()) return;
  add(out, "\nunder routing %s (%lld draws a plan, ranked by the %s step; balanced: the plan's own routing):\n",
      options.routing.c_str(), static_cast<long long>(options.routing_draws),
      std::string(name_of(kRankByNames, options.rank_by)).c_str());
  const bool drops = options.moe.capacity_factor > 0;
  add(out, "  #  balanced(s)   p50(s)   p95(s)  p95 vs balanced  busiest rank p99  mem at p99(GiB)%s\n",
      drops ? "  dropped" : "");
  for (size_t i = 0; i < result.ranked.size() && i < top; ++i) {
    const Candidate& c = result.ranked[i];
    if (!c.routed) continue;
    const RoutedFigures& r = *c.routed;
    add(out, "%3zu %12.3f %8.3f %8.3f %15.1f%% %17.2f %11.1f/%.1f", i + 1, c.estimate.step_time_s, r.median_s,
        r.p95_s, 100.0 * (r.p95_s / c.estimate.step_time_s - 1.0), r.load_p99, in_gib(r.tail_device_bytes),
        in_gib(cluster.usable_memory_bytes()));
    if (drops) add(out, " %7.2f%%", 100.0 * r.dropped_fraction);
    add(out, "\n");
  }
  if (result.stats.over_device_at_tail > 0)
    add(out, "  (%lld of the plans drawn no longer fit the device at the p99 load and are left out)\n",
        static_cast<long long>(result.stats.over_device_at_tail));
}

void add_explain(std::string& out, const SearchStats& s) {
  add(out, "\nwhy candidates were removed (a candidate counts once for each rule it breaks):\n");
  add(out, "  %-40s %10lld\n", "enumerated", static_cast<long long>(s.enumerated));
  add(out, "  %-40s %10lld\n", "duplicate placement (same group shapes)", static_cast<long long>(s.duplicate_placements));
  for (int r = 0; r < kRuleBits; ++r) {
    const int64_t n = s.rejected_by_rule[static_cast<size_t>(r)];
    if (n > 0)
      add(out, "  rule %-35s %10lld\n", std::string(rule_name(static_cast<Rule>(r), s.target)).c_str(),
          static_cast<long long>(n));
  }
  add(out, "  %-40s %10lld\n", "valid by every rule", static_cast<long long>(s.rule_valid));
  add(out, "  %-40s %10lld\n", "limit device memory", static_cast<long long>(s.over_device_memory));
  add(out, "  %-40s %10lld\n", "limit host memory (offload)", static_cast<long long>(s.over_host_memory));
  add(out, "  %-40s %10lld\n", "fit in memory", static_cast<long long>(s.fitting));
  add(out, "  %-40s %10lld\n", "simulated (others pruned by a lower bound)", static_cast<long long>(s.simulated));
  if (s.over_device_at_tail > 0)
    add(out, "  %-40s %10lld\n", "over the device at the p99 routing load", static_cast<long long>(s.over_device_at_tail));
}

// Each ranked plan's days and dollars to train the tokens asked for.
void add_training_time(std::string& out, const SearchResult& result, const ClusterSpec& cluster,
                       const TrainingGoal& goal, size_t top) {
  add(out,
      "\nto train %.3g tokens on %lld x %s (%s per instance-hour, %.2g node failures per node-hour, restart %.0f min):\n"
      "  #       days  goodput  checkpoint every   instance-hours      dollars\n",
      goal.tokens, static_cast<long long>(cluster.num_nodes), cluster.name.c_str(),
      cluster.instance_price_per_hour > 0 ? dollars_text(cluster.instance_price_per_hour).c_str() : "no price",
      cluster.node_failures_per_hour, goal.restart_minutes);
  for (size_t i = 0; i < result.ranked.size() && i < top; ++i) {
    const TrainingTime t = training_time_of(cluster, result.ranked[i], goal);
    add(out, "%3zu %10s  %6.1f%%  %12.1f min  %15.0f %12s\n", i + 1, days_text(t.seconds).c_str(), 100 * t.goodput,
        t.checkpoint_interval_s / 60.0, t.instance_hours, dollars_text(t.dollars).c_str());
  }
}

// A calibrated profile's operation times hold the splits it measured; a plan with another
// T > 1, or with context ranks (the operations were measured on whole sequences), is estimated
// from FLOPs and the matrix-multiply curve instead, which on CPU ranks has been far less close
// (docs/validation.md, "What is still off"). Said, once for each, when the table shows such a plan.
void add_unmeasured_splits(std::string& out, const SearchResult& result, const RunConfig& setting, size_t top) {
  if (!sim::op_times_apply(setting)) return;
  bool split_said = false, context_said = false;
  for (size_t i = 0; i < std::min(top, result.ranked.size()); ++i) {
    const RunConfig c{setting.model, setting.cluster, result.ranked[i].parallel, setting.moe, setting.training};
    if (sim::op_times_apply(c)) continue;
    if (c.parallel.context_parallel_degree > 1) {
      if (!context_said)
        add(out,
            "\nnote: %s's operation times were measured on whole sequences; plans with context ranks (C > 1)\n"
            "      are estimated from FLOPs and its matrix-multiply curve, less closely (docs/validation.md)\n",
            setting.cluster.name.c_str());
      context_said = true;
    } else if (!split_said) {
      add(out,
          "\nnote: %s has no operation times measured at T = %lld; such plans are estimated from FLOPs and\n"
          "      its matrix-multiply curve, less closely (docs/validation.md); pin --tensor-parallel-degree\n"
          "      to a split it measured\n",
          setting.cluster.name.c_str(), static_cast<long long>(c.parallel.tensor_parallel_degree));
      split_said = true;
    }
  }
}

// A range of cluster sizes: the size the objective picks among those within the deadline, and
// the file its plan went to.
SearchReport report_sizes(const SearchOutcome& found, const ReportOptions& options, const Print& print) {
  SearchReport report;
  std::string out;
  const TrainingGoal& goal = found.search.goal;
  if (!found.plan) {
    add(report.err, "moeplan: no cluster size of %s %s\n", found.search.gpus.text.c_str(),
        goal.deadline_days > 0 ? "trains the tokens within the deadline" : "has a plan");
    report.exit_code = kExitNoPlan;
    return report;
  }
  const SizeResult& chosen = found.sweep.sizes[*found.sweep.chosen];
  const std::string within = goal.deadline_days > 0 ? " within " + days_text(goal.deadline_days * 86400.0) + " days" : "";
  const std::string cost =
      goal.tokens > 0 ? ", " + days_text(chosen.time.seconds) + " days, " + dollars_text(chosen.time.dollars) : "";
  add(out, "\n%s cluster%s: %lld x %s (%lld GPUs), %s%s\n", goal.objective == Objective::kTime ? "fastest" : "cheapest",
      within.c_str(), static_cast<long long>(chosen.cluster.num_nodes), chosen.cluster.name.c_str(),
      static_cast<long long>(chosen.gpus), describe(found.plan->parallel).c_str(), cost.c_str());
  print(out);
  if (!options.out.empty()) print("wrote " + options.out + "\n");
  return report;
}

// The capacity factors listed, each with its best plan, its step and its dropped share.
std::string capacity_text(const CapacityChoices& c, bool routed) {
  std::string out;
  add(out, "capacity factors (the fastest best plan dropping at most %.1f%% of the slots is planned):\n",
      100 * c.max_dropped_fraction);
  add(out, "  factor    best plan                                  %-10s  dropped\n", routed ? "step (s)*" : "step (s)");
  for (size_t i = 0; i < c.factors.size(); ++i) {
    const CapacityChoice& f = c.factors[i];
    const std::string factor = f.factor > 0 ? rule_number(f.factor) : "dropless";
    if (f.result.ranked.empty()) {
      add(out, "  %-9s no plan\n", factor.c_str());
      continue;
    }
    add(out, "  %-9s %-42s %10.3f  %6.2f%%%s\n", factor.c_str(), describe(f.result.ranked.front().parallel).c_str(),
        f.step_s, 100 * f.dropped_fraction,
        c.chosen == i ? "  <- planned" : f.allowed ? "" : "  (drops more than allowed)");
  }
  if (routed) add(out, "  * the drawn quantile the search ranks by (--rank-by)\n");
  return out + "\n";
}

// One cluster size: the ranked table (or the plan as JSON), and the file the plan went to.
SearchReport report_one_size(const SearchOutcome& found, int64_t top_shown, const ReportOptions& options,
                             const Print& print) {
  SearchReport report;
  std::string out;
  const PreparedSearch& s = found.search;
  const SearchResult& result = found.result;
  const size_t top = static_cast<size_t>(top_shown);
  if (!options.json && !found.capacity.factors.empty())
    out += capacity_text(found.capacity, !s.options.routing.empty());
  if (!options.json) add(out, "%s\n", stats_text(result.stats).c_str());
  if (options.explain) add_explain(out, result.stats);
  if (!found.plan) {
    print(out);
    add(report.err, "moeplan: no plan for %s on %lld GPU(s) of %s\n", s.model.name.c_str(),
        static_cast<long long>(s.options.gpus), s.cluster.name.c_str());
    for (const std::string& line : explain_no_plan(result, s.cluster)) add(report.err, "moeplan:   %s\n", line.c_str());
    report.exit_code = kExitNoPlan;
    return report;
  }
  if (options.json) {
    out += plan_to_text(*found.plan);
  } else {
    // Shown in this order: the table, the days and dollars, the note.
    std::string times, note, table;
    if (s.goal.tokens > 0) add_training_time(times, result, s.cluster, s.goal, top);
    add_unmeasured_splits(note, result, RunConfig{s.model, s.cluster, ParallelConfig{}, s.options.moe, s.options.training},
                          top);
    add_table(table, result, s.cluster, top);
    add_routed_table(table, result, s.options, s.cluster, top);
    out += table + times + note;
  }
  print(out);
  if (!options.out.empty() && !options.json)
    print("\nwrote " + options.out + " (" + describe(found.plan->parallel) + ")\n");
  return report;
}

}  // namespace

SearchReport search_and_report(const SearchRequest& request, const ReportOptions& options, const std::string& command,
                               const Print& print) {
  const GpuRange gpus = parse_gpu_range(request.gpus);
  if (gpus.is_range() && (options.json || options.explain))
    throw InputError("--gpus", {{"", "= " + gpus.text + ": a range prints its own table; --json and --explain take one size"}});
  SearchProgress progress;
  progress.prepared = [&](const PreparedSearch& s) {
    if (s.gpus.is_range()) print(sizes_head_text(s));
    else if (!options.json) print(setting_text(s));
  };
  progress.size_searched = [&](const SizeResult& size) { print(size_row_text(size, request.goal)); };
  const SearchOutcome found = plan_search(request, command, progress);
  // The plan is written as soon as it is chosen; what is printed about it is made from the
  // outcome afterwards, and a file that cannot be written stops the command before it.
  if (found.plan && !options.out.empty()) write_file_atomic(options.out, plan_to_text(*found.plan));
  return gpus.is_range() ? report_sizes(found, options, print) : report_one_size(found, request.top, options, print);
}

}  // namespace moeplan::planner
