#include "moeplan/planner/sweep.h"

namespace moeplan::planner {

namespace {

// The model states a checkpoint saves, per GPU: parameters, master weights, optimizer states.
double checkpoint_bytes(const Candidate& c) {
  return static_cast<double>(c.memory.parameters + c.memory.master_weights + c.memory.optimizer_states);
}

// Lower is better. Without tokens to train, the rate: seconds or dollars per token.
double score(const SizeResult& size, const TrainingGoal& goal) {
  const double per_s = size.result.ranked.front().estimate.tokens_per_s;
  if (goal.objective == Objective::kTime) return goal.tokens > 0 ? size.time.seconds : 1.0 / per_s;
  const double dollars_per_s =
      static_cast<double>(size.cluster.num_nodes) * size.cluster.instance_price_per_hour / 3600.0;
  return goal.tokens > 0 ? size.time.dollars : dollars_per_s / per_s;  // cost and tokens-per-dollar rank alike
}

}  // namespace

TrainingTime training_time_of(const ClusterSpec& cluster, const Candidate& candidate, const TrainingGoal& goal) {
  return training_time(cluster, cluster.num_nodes, goal.tokens, candidate.estimate.tokens_per_s,
                       checkpoint_bytes(candidate), goal.restart_minutes * 60.0);
}

SweepResult sweep_cluster_sizes(const ModelSpec& model, const ClusterSpec& largest, const SearchOptions& options,
                                const std::vector<int64_t>& sizes, const TrainingGoal& goal,
                                const std::function<void(const SizeResult&)>& on_size) {
  SweepResult sweep;
  for (const int64_t gpus : sizes) {
    SizeResult size{gpus, size_cluster(largest, gpus), options, {}, {}, false};
    size.options.gpus = gpus;
    size.result = search(model, size.cluster, size.options);
    if (!size.result.ranked.empty()) {
      size.time = training_time_of(size.cluster, size.result.ranked.front(), goal);
      size.in_time = goal.deadline_days <= 0 || size.time.seconds <= goal.deadline_days * 86400.0;
    }
    if (on_size) on_size(size);
    if (size.in_time && (!sweep.chosen || score(size, goal) < score(sweep.sizes[*sweep.chosen], goal)))
      sweep.chosen = sweep.sizes.size();
    sweep.sizes.push_back(std::move(size));
  }
  return sweep;
}

}  // namespace moeplan::planner
