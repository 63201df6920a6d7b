#include "moeplan/core/routing_summary.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/moe_load.h"

namespace moeplan {

namespace {

// The steps that count, checked: per-micro-batch counts of one shape in each.
std::vector<const StepRecord*> usable_steps(const std::vector<StepRecord>& steps, int64_t from_step,
                                            const std::string& origin) {
  std::vector<const StepRecord*> out;
  for (const StepRecord& s : steps) {
    if (s.step < from_step) continue;
    if (s.tokens_per_expert.empty() || s.tokens_per_expert.front().empty())
      throw InputError(origin, {{"step " + std::to_string(s.step), "counts no expert (tokens_per_expert is empty)"}});
    if (s.exchange_slots.empty() || s.exchange_slots.front().empty())
      throw InputError(origin, {{"step " + std::to_string(s.step), "has no per-micro-batch expert counts "
                                                                    "(exchange_slots): a run of an older moeplan"}});
    if (!out.empty() && (s.exchange_slots.size() != out.front()->exchange_slots.size() ||
                         s.exchange_slots.front().size() != out.front()->exchange_slots.front().size() ||
                         s.tokens_per_expert.size() != out.front()->tokens_per_expert.size() ||
                         s.tokens_per_expert.front().size() != out.front()->tokens_per_expert.front().size()))
      throw InputError(origin, {{"step " + std::to_string(s.step), "counts another shape of groups, micro-batches, "
                                                                    "layers or experts than step " +
                                                                        std::to_string(out.front()->step)}});
    out.push_back(&s);
  }
  if (out.empty())
    throw InputError(origin, {{"", "has no step from step " + std::to_string(from_step) + " on"}});
  return out;
}

// The slots layer 0 of a step routed; an InputError where they do not fit in 64 bits.
int64_t layer_slots(const StepRecord& s, const std::string& origin) {
  int64_t slots = 0;
  for (int64_t c : s.tokens_per_expert.front())
    if (__builtin_add_overflow(slots, c, &slots))
      throw InputError(origin, {{"step " + std::to_string(s.step), "routes more slots than 64 bits count"}});
  return slots;
}

double busiest_of(const std::vector<int64_t>& counts, int64_t degree) {
  return busiest_rank_load(slot_shares(counts), degree);
}

// Loads [step][micro-batch] of the layers in `layers` (each micro-batch of each group and
// layer one entry) into a spread.
RoutingSpread spread_of(const std::vector<std::vector<double>>& by_step) {
  RoutingSpread s;
  std::vector<double> all, ranges;
  for (const std::vector<double>& step : by_step) {
    all.insert(all.end(), step.begin(), step.end());
    const auto [lo, hi] = std::minmax_element(step.begin(), step.end());
    ranges.push_back(*hi - *lo);
  }
  s.median = quantile(all, 0.5);
  s.p95 = quantile(all, 0.95);
  s.max = *std::max_element(all.begin(), all.end());
  s.within_step = quantile(ranges, 0.5);
  const size_t tenth = std::max<size_t>(1, by_step.size() / 10);
  std::vector<double> first, last;
  for (size_t i = 0; i < tenth; ++i) {
    first.insert(first.end(), by_step[i].begin(), by_step[i].end());
    last.insert(last.end(), by_step[by_step.size() - 1 - i].begin(), by_step[by_step.size() - 1 - i].end());
  }
  s.first = quantile(first, 0.5);
  s.last = quantile(last, 0.5);
  return s;
}

}  // namespace

RoutingSummary summarise_routing(const std::vector<StepRecord>& steps, int64_t from_step, int64_t expert_degree,
                                 const std::string& origin) {
  const std::vector<const StepRecord*> used = usable_steps(steps, from_step, origin);
  const StepRecord& first = *used.front();
  RoutingSummary r;
  r.steps = static_cast<int64_t>(used.size());
  r.first_step = first.step;
  r.last_step = used.back()->step;
  r.groups = static_cast<int64_t>(first.exchange_slots.size());
  r.micro_batches = static_cast<int64_t>(first.exchange_slots.front().size());
  r.num_experts = static_cast<int64_t>(first.tokens_per_expert.front().size());
  const int64_t slots = layer_slots(first, origin);
  r.experts_per_token = first.tokens > 0 ? slots / first.tokens : 0;
  if (first.tokens <= 0 || slots % first.tokens != 0 || r.experts_per_token < 1)
    throw InputError(origin, {{"step " + std::to_string(first.step),
                               "routes " + std::to_string(slots) + " slots in layer 0 for " +
                                   std::to_string(first.tokens) + " tokens: not a whole number per token"}});
  r.expert_degree = expert_degree > 0 ? expert_degree : r.num_experts;
  if (r.num_experts % r.expert_degree != 0)
    throw InputError("--expert-degree", {{"", "= " + std::to_string(expert_degree) + " does not divide the run's " +
                                                  std::to_string(r.num_experts) + " experts"}});
  const size_t layers = first.tokens_per_expert.size();
  std::vector<std::vector<std::vector<double>>> per_layer(layers);  // [layer][step][group x micro-batch]
  std::vector<std::vector<double>> every_layer;                      // [step][layer x group x micro-batch]
  for (const StepRecord* s : used) {
    std::vector<double>& step_all = every_layer.emplace_back();
    for (size_t l = 0; l < layers; ++l) {
      std::vector<double>& loads = per_layer[l].emplace_back();
      for (const auto& group : s->exchange_slots)
        for (const auto& micro_batch : group) loads.push_back(busiest_of(micro_batch[l], r.expert_degree));
      step_all.insert(step_all.end(), loads.begin(), loads.end());
    }
  }
  for (const auto& layer : per_layer) r.layers.push_back(spread_of(layer));
  r.all = spread_of(every_layer);
  const size_t ranks = first.exchange_seconds.size();
  for (size_t rank = 0; rank < ranks; ++rank) {
    std::vector<double> seconds;
    for (const StepRecord* s : used)
      if (s->exchange_seconds.size() == ranks) seconds.push_back(s->exchange_seconds[rank]);
    r.exchange_seconds.push_back(median(seconds));
  }
  std::vector<double> step_seconds, undisturbed_seconds;
  double dropped = 0, all_slots = 0;
  bool drops = false;
  for (const StepRecord* s : used) {
    step_seconds.push_back(s->seconds);
    if (undisturbed(*s)) undisturbed_seconds.push_back(s->seconds);
    drops = drops || !s->dropped_slots.empty();
    dropped += static_cast<double>(s->total_dropped());
    all_slots += static_cast<double>(s->total_slots());
  }
  r.step_median_s = median(step_seconds);
  r.step_p95_s = quantile(step_seconds, 0.95);
  r.undisturbed_steps = static_cast<int64_t>(undisturbed_seconds.size());
  if (!undisturbed_seconds.empty()) {
    r.undisturbed_median_s = median(undisturbed_seconds);
    r.undisturbed_p95_s = quantile(undisturbed_seconds, 0.95);
  }
  if (drops && all_slots > 0) r.dropped_fraction = dropped / all_slots;
  return r;
}

RoutingProfile measured_routing_profile(const std::vector<StepRecord>& steps, int64_t from_step,
                                        const std::string& source) {
  const std::vector<const StepRecord*> used = usable_steps(steps, from_step, source);
  RoutingProfile p;
  p.kind = RoutingKind::kMeasured;
  p.source = source;
  const StepRecord& first = *used.front();
  p.num_experts = static_cast<int64_t>(first.tokens_per_expert.front().size());
  const int64_t slots = layer_slots(first, source);
  p.experts_per_token = first.tokens > 0 ? std::max<int64_t>(1, slots / first.tokens) : 1;
  p.slots.resize(first.tokens_per_expert.size());
  for (const StepRecord* s : used)
    for (const auto& group : s->exchange_slots)
      for (const auto& micro_batch : group)
        for (size_t l = 0; l < p.slots.size(); ++l) p.slots[l].push_back(micro_batch[l]);
  return p;
}

std::string format_routing_summary(const RoutingSummary& r) {
  std::string out;
  char line[256];
  const bool ranks = r.expert_degree < r.num_experts;
  std::snprintf(line, sizeof line,
                "steps %lld to %lld (%lld), %zu MoE layers, %lld experts, top-%lld; %lld expert group%s x %lld "
                "micro-batch%s a step\n",
                static_cast<long long>(r.first_step), static_cast<long long>(r.last_step),
                static_cast<long long>(r.steps), r.layers.size(), static_cast<long long>(r.num_experts),
                static_cast<long long>(r.experts_per_token), static_cast<long long>(r.groups),
                r.groups == 1 ? "" : "s", static_cast<long long>(r.micro_batches), r.micro_batches == 1 ? "" : "es");
  out += line;
  if (ranks)
    std::snprintf(line, sizeof line, "busiest of %lld expert-parallel ranks over the mean, per micro-batch:\n",
                  static_cast<long long>(r.expert_degree));
  else
    std::snprintf(line, sizeof line, "busiest expert over the mean, per micro-batch:\n");
  out += line;
  out += "layer   median    p95    max   within a step   first 10%   last 10%\n";
  const auto row = [&](const std::string& name, const RoutingSpread& s) {
    std::snprintf(line, sizeof line, "%-6s %7.2f %6.2f %6.2f %15.2f %11.2f %10.2f\n", name.c_str(), s.median, s.p95,
                  s.max, s.within_step, s.first, s.last);
    out += line;
  };
  for (size_t l = 0; l < r.layers.size(); ++l) row(std::to_string(l), r.layers[l]);
  row("all", r.all);
  if (!r.exchange_seconds.empty()) {
    out += "seconds inside the expert exchanges a step (median over the steps), by rank:";
    for (size_t rank = 0; rank < r.exchange_seconds.size(); ++rank) {
      std::snprintf(line, sizeof line, " %zu: %.3f", rank, r.exchange_seconds[rank]);
      out += line;
    }
    out += "\n";
  }
  std::snprintf(line, sizeof line, "step time: median %.3f s, p95 %.3f s\n", r.step_median_s, r.step_p95_s);
  out += line;
  if (r.undisturbed_steps > 0) {
    std::snprintf(line, sizeof line,
                  "step time over the %lld steps the hypervisor left alone (steal under %.0f%%): median %.3f s, p95 %.3f s\n",
                  static_cast<long long>(r.undisturbed_steps), 100 * kUndisturbedSteal, r.undisturbed_median_s,
                  r.undisturbed_p95_s);
    out += line;
  }
  if (r.dropped_fraction >= 0) {
    std::snprintf(line, sizeof line, "slots dropped at capacity: %.2f%%\n", 100 * r.dropped_fraction);
    out += line;
  }
  return out;
}

}  // namespace moeplan
