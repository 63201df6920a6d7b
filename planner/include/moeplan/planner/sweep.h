#pragma once
// Days and dollars: how long each plan takes to train a number of tokens, and, over a range of
// cluster sizes, the best plan of each size and the size an objective picks among those that
// keep to a deadline.

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/planner/search.h"
#include "moeplan/planner/training_time.h"

namespace moeplan::planner {

// What ranks the cluster sizes of a range: the days to train (time), the dollars (cost), or
// the tokens each dollar buys (tokens-per-dollar, which ranks as cost does).
enum class Objective : uint8_t { kTime, kCost, kTokensPerDollar };
inline constexpr std::array<std::pair<std::string_view, Objective>, 3> kObjectiveNames{
    {{"time", Objective::kTime}, {"cost", Objective::kCost}, {"tokens-per-dollar", Objective::kTokensPerDollar}}};

struct TrainingGoal {
  double tokens = 0;  // tokens to train; 0: not asked
  Objective objective = Objective::kTime;
  double deadline_days = 0;  // 0: none
  double restart_minutes = 10;  // a restart after a node failure: detect, replace, reload
};

// The days and dollars of one candidate on its cluster (every node of it) for the goal's tokens.
TrainingTime training_time_of(const ClusterSpec& cluster, const Candidate& candidate, const TrainingGoal& goal);

// One cluster size of a range, searched.
struct SizeResult {
  int64_t gpus = 0;
  ClusterSpec cluster;
  SearchOptions options;
  SearchResult result;  // no ranked candidate: no plan at this size
  TrainingTime time;    // of the best plan
  bool in_time = false;  // it has a plan, and that plan keeps to the deadline
};

struct SweepResult {
  std::vector<SizeResult> sizes;
  std::optional<size_t> chosen;  // the size the objective picks among those in time
};

// Searches `largest` resized to each of `sizes` (size_cluster) with `options`; `on_size` is told
// of each size as soon as it is searched (a range takes a while).
SweepResult sweep_cluster_sizes(const ModelSpec& model, const ClusterSpec& largest, const SearchOptions& options,
                                const std::vector<int64_t>& sizes, const TrainingGoal& goal,
                                const std::function<void(const SizeResult&)>& on_size = {});

}  // namespace moeplan::planner
