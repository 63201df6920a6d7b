#include "moeplan/validation/routing_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/moe_load.h"
#include "moeplan/simulator/routing.h"
#include "moeplan/simulator/step.h"

namespace moeplan::validation {

namespace {

// One expert group's micro-batches of a step as shares per [layer][micro-batch][expert].
StepRouting group_shares(const std::vector<std::vector<std::vector<int64_t>>>& micro_batches, size_t layers) {
  StepRouting out(layers);
  for (const auto& table : micro_batches)
    for (size_t l = 0; l < layers; ++l) out[l].push_back(slot_shares(table[l]));
  return out;
}

}  // namespace

RoutingCheck predict_steps_from_routing(const Plan& plan, const std::vector<StepRecord>& steps, int64_t from_step,
                                        const std::string& origin) {
  // The plan under balanced routing: what the draws add to.
  MoeConfig balanced = plan.moe;
  balanced.tokens_per_expert.clear();
  balanced.expert_load_imbalance = 1.0;
  const RunConfig config{plan.model, plan.cluster, plan.parallel, balanced, plan.training};
  sim::StepSimOptions all;
  all.all_micro_batches = true;
  RoutingCheck out;
  out.balanced_s = sim::simulate_step(config, all).estimate.step_time_s;
  sim::RoutingDelay delay(config, sim::layout_shapes(plan.cluster, plan.parallel));
  // The decoder's blocks with experts, then the multi-token prediction blocks' (a run's rows).
  const auto layers = static_cast<size_t>(plan.model.moe_blocks());
  std::vector<double> errors, balanced_errors, undisturbed_errors, undisturbed_balanced_errors, measured,
      undisturbed_measured;
  const bool dropping = plan.moe.capacity_factor > 0;
  double predicted_dropped = 0, measured_dropped = 0, all_slots = 0;
  for (const StepRecord& s : steps) {
    if (s.step < from_step || s.skipped) continue;
    const std::string at = "step " + std::to_string(s.step);
    if (s.exchange_slots.empty())
      throw InputError(origin, {{at, "has no per-micro-batch expert counts (exchange_slots)"}});
    if (s.tokens_per_expert.size() != layers || layers == 0 ||
        s.tokens_per_expert.front().size() != static_cast<size_t>(plan.model.num_experts))
      throw InputError(origin, {{at, "counts " + std::to_string(s.tokens_per_expert.size()) +
                                         " blocks of experts; the plan's model has " + std::to_string(layers) + " MoE blocks of " +
                                         std::to_string(plan.model.num_experts)}});
    if (!(s.seconds > 0)) throw InputError(origin, {{at, "step_s = 0: a measured step takes time"}});
    PredictedStep p;
    p.step = s.step;
    p.measured_s = s.seconds;
    // The slowest group's difference from the balanced step (below it when dropping leaves
    // every rank computing less).
    double slowest = -std::numeric_limits<double>::infinity(), load_sum = 0, blocks = 0;
    for (const auto& group : s.exchange_slots) {
      const StepRouting shares = group_shares(group, layers);
      slowest = std::max(slowest, delay.delay_s(shares));
      for (size_t l = 0; l < layers; ++l)
        for (size_t m = 0; m < shares[l].size(); ++m) {
          load_sum += busiest_rank_load(shares[l][m], delay.expert_degree(), plan.moe);
          blocks += 1;
          if (!dropping) continue;
          double slots = 0;
          for (int64_t c : group[m][l]) slots += static_cast<double>(c);
          predicted_dropped += dropped_fraction(shares[l][m], plan.moe) * slots;
        }
    }
    if (dropping) {
      if (s.dropped_slots.size() != layers)
        throw InputError(origin, {{at, "has no dropped_slots per layer, and the plan drops at capacity factor " +
                                           std::to_string(plan.moe.capacity_factor)}});
      measured_dropped += static_cast<double>(s.total_dropped());
      all_slots += static_cast<double>(s.total_slots());
    }
    p.predicted_s = out.balanced_s + slowest;
    p.busiest_load = blocks > 0 ? load_sum / blocks : 1.0;
    errors.push_back(std::abs(p.predicted_s / p.measured_s - 1.0));
    balanced_errors.push_back(std::abs(out.balanced_s / p.measured_s - 1.0));
    p.steal = s.steal;
    measured.push_back(s.seconds);
    if (undisturbed(s)) {
      undisturbed_errors.push_back(errors.back());
      undisturbed_balanced_errors.push_back(balanced_errors.back());
      undisturbed_measured.push_back(s.seconds);
    }
    out.steps.push_back(p);
  }
  if (out.steps.empty()) throw InputError(origin, {{"", "has no step from step " + std::to_string(from_step) + " on"}});
  out.median_error = median(errors);
  out.median_error_balanced = median(balanced_errors);
  out.error_floor = median_error_floor(measured);
  out.undisturbed_error_floor = median_error_floor(undisturbed_measured);
  out.undisturbed_steps = static_cast<int64_t>(undisturbed_errors.size());
  if (!undisturbed_errors.empty()) {
    out.undisturbed_median_error = median(undisturbed_errors);
    out.undisturbed_median_error_balanced = median(undisturbed_balanced_errors);
  }
  if (dropping && all_slots > 0) {
    out.predicted_dropped = predicted_dropped / all_slots;
    out.measured_dropped = measured_dropped / all_slots;
  }
  return out;
}

std::vector<double> step_spread(const RoutingCheck& c) {
  std::vector<double> ratios;
  for (const PredictedStep& s : c.steps)
    if (s.predicted_s > 0) ratios.push_back(s.measured_s / s.predicted_s);
  if (ratios.empty()) return ratios;
  const double middle = median(ratios);
  // A profile holds ratios up to 100 (a step a hundred times its median is a stall, not spread).
  for (double& r : ratios) r = std::min(r / middle, 100.0);
  std::sort(ratios.begin(), ratios.end());
  return ratios;
}

std::string format_routing_check(const RoutingCheck& c) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "step predicted from its measured expert loads (balanced: %.3f s)\n", c.balanced_s);
  out += line;
  out += "  step   busiest rank   predicted (s)   measured (s)   error   steal\n";
  for (const PredictedStep& s : c.steps) {
    char steal[16] = "-";
    if (s.steal) std::snprintf(steal, sizeof steal, "%.1f%%", 100.0 * *s.steal);
    std::snprintf(line, sizeof line, "%6lld %14.3f %15.3f %14.3f %+7.1f%% %7s\n", static_cast<long long>(s.step),
                  s.busiest_load, s.predicted_s, s.measured_s, 100.0 * (s.predicted_s / s.measured_s - 1.0), steal);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "median |error| over %zu steps: %.1f%% from the measured loads, %.1f%% with balanced routing\n",
                c.steps.size(), 100.0 * c.median_error, 100.0 * c.median_error_balanced);
  out += line;
  std::snprintf(line, sizeof line, "  the steps' own spread: no one step time comes within %.1f%% of half of them\n",
                100.0 * c.error_floor);
  out += line;
  if (c.undisturbed_steps > 0) {
    std::snprintf(line, sizeof line,
                  "median |error| over the %lld steps the hypervisor left alone (steal under %.0f%%): %.1f%% from the "
                  "measured loads, %.1f%% with balanced routing\n",
                  static_cast<long long>(c.undisturbed_steps), 100 * kUndisturbedSteal, 100.0 * c.undisturbed_median_error,
                  100.0 * c.undisturbed_median_error_balanced);
    out += line;
    std::snprintf(line, sizeof line, "  their own spread: no one step time comes within %.1f%% of half of them\n",
                  100.0 * c.undisturbed_error_floor);
    out += line;
  }
  if (c.measured_dropped >= 0) {
    std::snprintf(line, sizeof line, "slots dropped at capacity: %.2f%% predicted from the measured loads, %.2f%% measured\n",
                  100.0 * c.predicted_dropped, 100.0 * c.measured_dropped);
    out += line;
  }
  return out;
}

}  // namespace moeplan::validation
