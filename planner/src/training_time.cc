#include "moeplan/planner/training_time.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moeplan::planner {

std::vector<int64_t> cluster_sizes(int64_t min_gpus, int64_t max_gpus, int64_t gpus_per_node) {
  std::vector<int64_t> out;
  if (gpus_per_node < 1) return out;
  auto whole = [&](int64_t g) { return g >= min_gpus && g <= max_gpus && g % gpus_per_node == 0; };
  auto add = [&](int64_t g) {
    if (whole(g) && std::find(out.begin(), out.end(), g) == out.end()) out.push_back(g);
  };
  add(min_gpus);
  for (int64_t nodes = 1; nodes * gpus_per_node <= max_gpus; nodes *= 2) {
    add(nodes * gpus_per_node);
    add(3 * nodes * gpus_per_node);
  }
  add(max_gpus);
  std::sort(out.begin(), out.end());
  return out;
}

TrainingTime training_time(const ClusterSpec& cluster, int64_t nodes, double tokens, double tokens_per_s,
                           double state_bytes_per_gpu, double restart_s) {
  TrainingTime t;
  const double failures_per_s = cluster.node_failures_per_hour * static_cast<double>(nodes) / 3600.0;
  if (cluster.pcie_bandwidth_bytes_per_s > 0) t.checkpoint_pause_s = state_bytes_per_gpu / cluster.pcie_bandwidth_bytes_per_s;
  if (failures_per_s > 0) {
    double checkpoint_cost = 1.0;
    if (t.checkpoint_pause_s > 0) {
      t.checkpoint_interval_s = std::sqrt(2.0 * t.checkpoint_pause_s / failures_per_s);
      checkpoint_cost = 1.0 + t.checkpoint_pause_s / t.checkpoint_interval_s;
    }
    t.goodput = std::max(0.0, 1.0 - failures_per_s * (restart_s + t.checkpoint_interval_s / 2.0)) / checkpoint_cost;
  }
  if (t.goodput <= 0 || tokens_per_s <= 0) {
    t.goodput = 0;
    t.seconds = std::numeric_limits<double>::infinity();
  } else {
    t.seconds = tokens / tokens_per_s / t.goodput;
  }
  t.failures = failures_per_s * t.seconds;
  t.instance_hours = t.seconds / 3600.0 * static_cast<double>(nodes);
  if (cluster.instance_price_per_hour > 0) t.dollars = t.instance_hours * cluster.instance_price_per_hour;
  return t;
}

}  // namespace moeplan::planner
