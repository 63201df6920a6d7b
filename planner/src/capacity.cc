#include "moeplan/planner/capacity.h"

#include "moeplan/core/moe_load.h"

namespace moeplan::planner {

CapacityChoices choose_capacity_factor(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                                       const std::vector<double>& factors, double max_dropped_fraction) {
  CapacityChoices out;
  out.max_dropped_fraction = max_dropped_fraction;
  for (const double factor : factors) {
    CapacityChoice c;
    c.factor = factor;
    c.options = options;
    c.options.moe.capacity_factor = factor;
    if (!(factor > 0)) {
      c.options.moe.drop_policy = MoeConfig{}.drop_policy;
      c.options.moe.pad_to_capacity = false;
    }
    c.result = search(model, cluster, c.options);
    if (!c.result.ranked.empty()) {
      const Candidate& best = c.result.ranked.front();
      c.step_s = best.routed ? best.routed->ranked_s(options.rank_by) : best.estimate.step_time_s;
      c.dropped_fraction = best.routed ? best.routed->dropped_fraction : dropped_fraction(model, c.options.moe);
      c.allowed = c.dropped_fraction <= max_dropped_fraction;
    }
    if (c.allowed && (!out.chosen || c.step_s < out.factors[*out.chosen].step_s)) out.chosen = out.factors.size();
    out.factors.push_back(std::move(c));
  }
  return out;
}

}  // namespace moeplan::planner
