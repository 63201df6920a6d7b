#pragma once
// `moeplan compare-published`: moeplan's prediction for published training runs beside their
// published step times, the fit part and the held-out part of the set summarised on their own.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/planner/search.h"

namespace moeplan::validation {

// One published training run (an entry of cases.json) and the layout it used.
struct PublishedCase {
  std::string name, part, source, note;
  std::string model, instance;
  int64_t gpus = 0, seq_len = 0, global_batch_sequences = 0;
  Precision precision = Precision::kBf16;
  bool fp8 = false, fp32_gradients = true;
  bool overlap_exchange = false;  // moe.overlap_exchange: Megatron-Core's merged 1F1B
  bool overlap_shared_expert = false;  // moe.overlap_shared_expert: --moe-shared-expert-overlap
  ContextExchange context_exchange = ContextExchange::kRing;  // under context parallelism
  Dispatcher dispatcher = Dispatcher::kAllToAll;              // moe.dispatcher
  std::optional<Kernels> kernels;
  std::optional<AttentionKernel> attention;
  std::optional<bool> overlap_gradient_sync;
  planner::SearchOptions::Pins pins;
  double published_step_s = 0;
  // Per-GPU memory where the source gives it, of a stage that holds blocks only (GiB; 0: not
  // published): parameters with gradients and optimizer states, and the activations kept.
  double published_states_gib = 0, published_activations_gib = 0;
};

// Reads cases.json; throws InputError naming the case and the field at fault.
std::vector<PublishedCase> read_published_cases(const std::string& path);

struct ComparePublishedOptions {
  std::string cases;  // JSON list of published runs (docs/validation/published/cases.json)
  std::string profiles;
  bool check = false;
  double max_median_error = 0.25, max_worst_error = 0.5, max_mean_error = 1.0;
  std::vector<std::string> fit;  // kernel-model numbers fitted on the fit part, per chip
};

// The kernel-model numbers --fit may name, in the order --help lists them.
std::vector<std::string> fit_parameter_names();

// Prints the table; returns an exit code (moeplan/core/exit_codes.h): with check, kExitNoPlan
// when a bound is broken.
int compare_published(const ComparePublishedOptions& options);

}  // namespace moeplan::validation
