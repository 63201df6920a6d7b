#pragma once
// The configuration search: enumerate expert-parallel degree, hybrid-shard degree, mesh
// placement, activation checkpointing, offloading with its loading horizon and micro-batch
// size; reject by the validity rules and the memory limits; rank the rest by predicted
// tokens per second.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/analytic.h"

namespace moeplan::planner {

enum class Estimator : uint8_t { kAnalytic, kSimulator };
inline constexpr std::array<std::pair<std::string_view, Estimator>, 2> kEstimatorNames{
    {{"simulator", Estimator::kSimulator}, {"analytic", Estimator::kAnalytic}}};

// Which step of the draws under a routing profile ranks the plans: the median or the p95.
enum class RankBy : uint8_t { kMedian, kP95 };
inline constexpr std::array<std::pair<std::string_view, RankBy>, 2> kRankByNames{
    {{"p50", RankBy::kMedian}, {"p95", RankBy::kP95}}};

struct SearchOptions {
  int64_t gpus = 16;
  TrainingConfig training;  // seq_len, global_batch_tokens, precision and the schedule
  MoeConfig moe;
  int64_t max_micro_batch = 64;
  std::vector<int64_t> loading_horizons = {1, 2, 4};
  size_t keep = 10;  // ranked candidates returned
  // kSimulator: the analytic estimate orders the candidates that fit, a lower bound (the busiest
  // rank's compute) prunes them, and the discrete-event simulator ranks the rest.
  Estimator estimator = Estimator::kSimulator;
  bool prune = true;  // false: simulate every candidate that fits (to check the bound)
  // With pruning, the simulator ranks at most this many candidates, taken in the analytic
  // estimate's order (best first) among those the bound does not prune.
  int64_t max_simulated = 20000;
  // Context parallelism is tried at powers of two C that leave each rank at least this many
  // tokens of a sequence (two chunks of half as many: shorter ones leave flash attention's tiles
  // and the exchange's messages too small to pay).
  int64_t min_context_tokens = 2048;
  // How the context-parallel ranks pass keys and values (--context-exchange).
  ContextExchange context_exchange = ContextExchange::kRing;
  // Choices the user fixed (SMP's knobs); unset ones are searched.
  struct Pins {
    std::optional<int64_t> expert_parallel_degree, hybrid_shard_degree, micro_batch_size, loading_horizon;
    std::optional<int64_t> tensor_parallel_degree, pipeline_parallel_degree, virtual_pipeline_degree;
    std::optional<int64_t> expert_tensor_parallel_degree, context_parallel_degree;
    std::optional<bool> sequence_parallel, distributed_optimizer, dense_shard_spans_experts;
    std::optional<int64_t> first_stage_layers, last_stage_layers;
    std::optional<Checkpointing> checkpointing;
    std::optional<bool> offloading;
    std::optional<std::string> placement;  // any form Placement::parse reads
  } pins;
  // Rank candidates whatever the memory model says of them (to time a layout known to have run).
  bool ignore_memory_limits = false;
  // Only plans this framework runs (its rules, frameworks/; null: every layout moeplan models):
  // `moeplan search` plans for moeplan's executor unless asked for another framework.
  Target target = nullptr;
  // Rank by steps drawn under this routing (balanced, skew:X or a routing profile file;
  // core/routing_profile.h) instead of the plan's own: the best `routing_pool` by the plan's own
  // routing, and an eighth as many (at least 2) of the best of each expert degree, are drawn
  // `routing_draws` times each (sim/routing.h) and ordered by `rank_by`; those whose busiest
  // rank no longer fits the device at the p99 load are dropped. Empty: not drawn.
  std::string routing;
  RankBy rank_by = RankBy::kMedian;
  int64_t routing_draws = 16;
  int64_t routing_pool = 32;
};

// A candidate's step over draws under SearchOptions::routing.
struct RoutedFigures {
  double median_s = 0, p95_s = 0;
  double load_p99 = 1;          // the busiest expert-parallel rank's load over the mean, p99
  int64_t tail_device_bytes = 0;  // the busiest rank's memory at that load
  double dropped_fraction = 0;    // of the slots, at the capacity factor (0 when dropless)
  double ranked_s(RankBy by) const { return by == RankBy::kP95 ? p95_s : median_s; }
};

struct Candidate {
  ParallelConfig parallel;
  MemoryEstimate memory;
  sim::StepEstimate estimate;
  int64_t index = 0;  // position in enumeration order; breaks ties deterministically
  bool simulated = false;  // estimate comes from the step simulator
  std::optional<RoutedFigures> routed = std::nullopt;  // under SearchOptions::routing
};

struct SearchStats {
  int64_t enumerated = 0;
  int64_t duplicate_placements = 0;  // placements whose groups have the shapes of an earlier one's
  std::array<int64_t, kRuleBits> rejected_by_rule{};  // a candidate counts once per rule it breaks
  Target target = nullptr;  // whose rules the target rules (from kRuleCount on) are
  int64_t rule_rejected = 0;  // candidates that break at least one rule
  int64_t rule_valid = 0;     // enumerated = duplicate_placements + rule_rejected + rule_valid
  int64_t over_device_memory = 0;
  int64_t over_host_memory = 0;
  int64_t fitting = 0;  // rule-valid and within both memory limits
  int64_t simulated = 0;  // fitting candidates the step simulator ran (the rest were pruned)
  int64_t unsimulated = 0;  // of the rest, those past options.max_simulated (not pruned by the bound): dropped
  int64_t over_device_at_tail = 0;  // of those drawn under SearchOptions::routing, over the device at the p99 load
  // Among rule-valid candidates that do not fit: the one closest to each limit.
  std::optional<Candidate> closest_over_device;
  std::optional<Candidate> closest_over_host;
};

struct SearchResult {
  std::vector<Candidate> ranked;  // best first, at most options.keep
  SearchStats stats;
};

// The profile's cluster sized for `gpus` GPUs (whole nodes, or part of one node).
ClusterSpec size_cluster(ClusterSpec profile, int64_t gpus);
// 4 Mi tokens (a common global batch for models of this size), rounded up to a multiple of
// gpus x seq_len so that every rank gets whole sequences.
int64_t default_global_batch_tokens(int64_t gpus, int64_t seq_len);

SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options);
// The rules of what `moeplan run` trains (frameworks/src/moeplan), for SearchOptions::target.
Target executor_target();

// "N configurations: V valid, F fit in memory, S simulated (the rest pruned by a lower bound)".
std::string stats_text(const SearchStats& stats);

// Memory and time prediction of one configuration, as written into plan.json.
Prediction predict(const RunConfig& config, Estimator estimator = Estimator::kSimulator);

// The plan for the best candidate, with the next ones as alternatives.
Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
               const SearchResult& result, const std::string& command);

// Why nothing fits, one line per limit, with the closest candidate and the shortfall.
std::vector<std::string> explain_no_plan(const SearchResult& result, const ClusterSpec& cluster);

}  // namespace moeplan::planner
