#pragma once
// How long, and at what price, a plan trains a number of tokens on its cluster, counting the
// time node failures and checkpoints take from training (goodput).
//
// Checkpoints are asynchronous (PyTorch's distributed checkpoint, as torchtitan, Megatron-Core
// and SMP save them): training pauses while each GPU copies its model states to host memory,
// and the write to storage runs beside training. A failure loses the work since the last
// checkpoint, half an interval on average, and the restart. With failures at rate L over the
// cluster, a pause of w per checkpoint every D seconds and a restart of u, the fraction of
// wall-clock time that trains is (1 - L (u + D / 2)) / (1 + w / D) (the expected effective
// training time ratio of Kokolis et al. 2024, "Revisiting Reliability in Large-Scale Machine
// Learning Research Clusters"), and D is Young's optimum sqrt(2 w / L) (J. W. Young 1974,
// "A first order approximation to the optimum checkpoint interval").

#include <cstdint>
#include <vector>

#include "moeplan/core/cluster_spec.h"

namespace moeplan::planner {

struct TrainingTime {
  double checkpoint_pause_s = 0;     // training paused per checkpoint
  double checkpoint_interval_s = 0;  // between checkpoints; 0 where nothing fails
  double failures = 0;               // expected over the run
  double goodput = 1;                // fraction of wall-clock time that trains; 0: never finishes
  double seconds = 0;                // wall clock to train the tokens (infinite when goodput is 0)
  double instance_hours = 0;
  double dollars = -1;               // negative: the profile has no price
};

// Whole-node cluster sizes from `min_gpus` to `max_gpus` that a range search tries: 2^k and
// 3 x 2^k nodes (sizes whose degrees split evenly), and both ends where they are whole nodes.
std::vector<int64_t> cluster_sizes(int64_t min_gpus, int64_t max_gpus, int64_t gpus_per_node);

// `tokens` at `tokens_per_s` (a plan's prediction) on `nodes` instances of `cluster`, each GPU
// holding `state_bytes_per_gpu` of model states to checkpoint; a restart takes `restart_s`.
TrainingTime training_time(const ClusterSpec& cluster, int64_t nodes, double tokens, double tokens_per_s,
                           double state_bytes_per_gpu, double restart_s);

}  // namespace moeplan::planner
