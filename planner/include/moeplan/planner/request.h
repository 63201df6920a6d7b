#pragma once
// A search as a user asks for it: the profiles by name, one cluster size or a range of them,
// the planner's options with the choices a framework makes left open, and what training the
// tokens may take in days and dollars. `moeplan search` fills one from its flags and the
// validation matrix from its configurations; plan_search loads the profiles, decides every
// default, checks what the flags cannot check alone, searches and makes the plan. Its errors
// name the `moeplan search` flag of the field at fault.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/planner/capacity.h"
#include "moeplan/planner/search.h"
#include "moeplan/planner/sweep.h"

namespace moeplan::planner {

// The cluster sizes asked for: one (min == max) or a range A:B of whole-node sizes.
struct GpuRange {
  int64_t min = 0, max = 0;
  std::string text;  // as written ("16:256"), for messages
  bool is_range() const { return min != max; }
};

// "N" or "A:B", each in [1, 2^20] and A <= B; throws InputError naming --gpus.
GpuRange parse_gpu_range(const std::string& text);

struct SearchRequest {
  // Profile names or .json files, found in `profiles` (profile_files.h; empty: the default).
  std::string instance = "p4d.24xlarge";
  std::string model = "mixtral-8x7b";
  std::string profiles;
  std::string gpus;  // "N" or a range "A:B" of cluster sizes (parse_gpu_range)
  // options.gpus follows `gpus` and options.keep `top`; training.global_batch_tokens 0: the
  // default for the largest size (a range plans every size for the same batch, so that their
  // days compare); moe.aux_loss_coef is the model's.
  SearchOptions options;
  // Unset: the target framework's (frameworks/: Framework::defaults).
  std::optional<Precision> precision;
  std::optional<bool> fp32_gradients;
  std::optional<LoadBalancing> load_balancing;
  // What the framework runs (unset: the profile's); the attention kernel follows the kernels
  // unless given.
  std::optional<Kernels> kernels;
  std::optional<AttentionKernel> attention;
  int64_t top = 5;  // candidates wanted; the search keeps enough for the plan's alternatives too
  TrainingGoal goal;
  // Capacity factors to choose among (capacity.h), 0 dropless; one: options.moe's factor; none:
  // options.moe's as it is. A choice drops at most max_dropped_fraction of the slots.
  std::vector<double> capacity_factors;
  double max_dropped_fraction = 0.01;
};

// A request with its profiles loaded and every default decided: what search and
// sweep_cluster_sizes take.
struct PreparedSearch {
  ModelSpec model;
  ClusterSpec cluster;          // sized for the largest size, running the request's kernels
  GpuRange gpus;
  std::vector<int64_t> sizes;   // the cluster sizes searched: the one size, or a range's
  SearchOptions options;        // for the largest size
  TrainingGoal goal;
};

// Throws InputError naming the flag at fault.
PreparedSearch prepare_search(const SearchRequest& request);

// What a search is told as it goes (a range of sizes takes a while).
struct SearchProgress {
  std::function<void(const PreparedSearch&)> prepared;     // the profiles loaded, before any search
  std::function<void(const SizeResult&)> size_searched;    // each size of a range, once searched
};

struct SearchOutcome {
  PreparedSearch search;
  SearchResult result;       // one size: its ranked candidates (a range: empty)
  SweepResult sweep;         // a range: each size (one size: empty)
  std::optional<Plan> plan;  // the best plan, or the best of the size the objective picked; none: no plan
  CapacityChoices capacity;  // capacity factors listed: each searched (search.options is the chosen one's)
};

// The request prepared, searched (each size of a range) and its plan made, recording `command`
// as the command that made it. Throws InputError naming the flag at fault.
SearchOutcome plan_search(const SearchRequest& request, const std::string& command,
                          const SearchProgress& progress = {});

}  // namespace moeplan::planner
