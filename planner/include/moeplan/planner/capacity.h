#pragma once
// Token dropping as a choice among the capacity factors a user lists (`search --capacity-factor
// 0,1.25,1.5`, 0 dropless): each is searched in turn, and the plan is the best plan of the
// factor whose best plan is fastest among those that drop at most a given share of the slots.
// Dropping changes what is trained, so no factor the user did not list is tried, and the bound
// on the dropped share is what keeps a choice by speed from always dropping the most.

#include <optional>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/planner/search.h"

namespace moeplan::planner {

struct CapacityChoice {
  double factor = 0;  // 0: dropless
  SearchOptions options;
  SearchResult result;  // no ranked candidate: no plan at this factor
  // Of its best plan: the step it is ranked by (the drawn quantile under routing, else the
  // step), and the share of the slots predicted dropped (the draws' mean under routing, else
  // at the options' expert load).
  double step_s = 0;
  double dropped_fraction = 0;
  bool allowed = false;  // it has a plan, dropping at most the bound
};

struct CapacityChoices {
  std::vector<CapacityChoice> factors;  // in the order listed
  std::optional<size_t> chosen;         // the fastest allowed; ties: the one listed first
  double max_dropped_fraction = 0;
};

// Searches `options` at each of `factors` (a factor of 0 also leaves the drop policy and
// padding at their defaults, which only a factor takes).
CapacityChoices choose_capacity_factor(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                                       const std::vector<double>& factors, double max_dropped_fraction);

}  // namespace moeplan::planner
