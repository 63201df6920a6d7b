#pragma once
// The validity rules of a model and a parallel configuration that hold for every plan, and the
// hook through which a framework adds its own (TargetRules; each framework's are in
// frameworks/src/<name>/rules.cc). The planner, the executor and the CLI all use these
// functions; the search uses the mask form, which builds no strings.

#include <array>
#include <cassert>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan {

enum class Rule : uint8_t {
  // Model
  kTopKWithinExperts,
  kKvHeadsDivideHeads,
  kHeadDimEven,
  kModelSize,
  kMoeLayerPattern,
  kLatentAttentionShape,
  kRouterGroups,
  kBlockVariants,
  // Cluster and world size
  kWorldSizeFitsCluster,
  kWholeNodes,
  // Degrees
  kExpertDegreeDividesExperts,
  kExpertDegreeDividesWorld,
  kShardDegreeResolved,
  kShardExpertDividesWorld,
  kTensorDividesHeads,
  kTensorDividesIntermediate,
  kExpertTensorFolds,
  kExpertSpansContext,
  kSequenceParallelNeedsTensor,
  kExpertTensorNeedsSequenceParallel,
  kPipelineDividesLayers,
  kVirtualStagesFitThePipeline,
  kGroupsShareOneShape,
  // Batch and sequence
  kSeqLenWithinPositions,
  kMicroBatchTokens,
  kGlobalBatchMatches,
  kContextSplitsSequence,
  kContextNeedsFlashAttention,
  // Activation checkpointing and offloading
  kOffloadNeedsCheckpointing,
  kLatentUpNeedsLatentAttention,
  kHorizonPositive,
  kHorizonWithinLayers,
  // MoE
  kLoadImbalanceRange,
  kTokenShuffleNeedsExperts,
  kExchangeOverlapSchedule,
  kTokenCountsMatchExperts,
  kDeepEpLayout,
  kCapacityNeedsFactor,
  // Training schedule
  kMinLrWithinLr,
  kWarmupWithinSteps,
  // Precision
  kFp8NeedsHardware,
  kCount
};
// The rules above hold for every plan. The target framework's own rules follow them: its rule i
// is Rule(kRuleCount + i), named by the framework (TargetRules).
inline constexpr int kRuleCount = static_cast<int>(Rule::kCount);
inline constexpr int kMaxTargetRules = 8;
inline constexpr int kRuleBits = kRuleCount + kMaxTargetRules;
using RuleMask = uint64_t;
static_assert(kRuleBits <= 64, "RuleMask is too narrow");

inline constexpr RuleMask rule_bit(Rule r) { return RuleMask{1} << static_cast<int>(r); }
inline constexpr Rule target_rule(int i) { return static_cast<Rule>(kRuleCount + i); }

struct Violation {
  Rule rule;
  std::string field;      // field path, e.g. "parallel.expert_parallel_degree"
  std::string message;    // the value and the rule, e.g. "= 3 does not divide num_experts = 8"
  std::string_view name;  // the rule's stable name, e.g. "expert_degree_divides_experts"
  std::string to_string() const { return field + " " + message; }
};

struct RunConfig;

// Where a framework's rules report what a configuration breaks: as bits, building no message
// (the search), or as violations with their messages.
class RuleSink {
 public:
  RuleSink(RuleMask& mask, std::span<const std::string_view> names) : mask_(&mask), names_(names) {}
  RuleSink(std::vector<Violation>& out, std::span<const std::string_view> names) : out_(&out), names_(names) {}
  // The framework's rule `i` is broken at `field`; make() says how, called only when kept.
  template <class F>
  void operator()(int i, const char* field, F&& make) {
    assert(i >= 0 && static_cast<size_t>(i) < names_.size() && "a rule the framework names");
    if (out_)
      out_->push_back({target_rule(i), field, make(), names_[static_cast<size_t>(i)]});
    else
      *mask_ |= rule_bit(target_rule(i));
  }

 private:
  RuleMask* mask_ = nullptr;
  std::vector<Violation>* out_ = nullptr;
  std::span<const std::string_view> names_;
};

// What a framework runs, as rules (each framework's own, frameworks/src/<name>/rules.cc): its
// rules keep a search to the layouts it runs and make its exporter refuse the others by name.
struct TargetRules {
  std::span<const std::string_view> names;  // rule i is Rule(kRuleCount + i), i < kMaxTargetRules
  void (*check)(const RunConfig& config, RuleSink& sink) = nullptr;
};

// Where a plan will train: the framework's rules, or null for no framework's limits (every
// layout moeplan models, as published runs of any framework used).
using Target = const TargetRules*;

// Stable name of a rule, used by --explain and in tests ("expert_degree_divides_experts"); a
// target rule is named by its framework's rules (empty without them).
std::string_view rule_name(Rule rule, Target target = nullptr);

// For rule messages: "= \"full\"" (a configuration's activation checkpointing).
std::string checkpointing_name(const ParallelConfig& p);
// For rule messages: a number as written, without trailing zeros ("8", "0.001").
inline std::string rule_number(int64_t v) { return std::to_string(v); }
std::string rule_number(double v);
// Whether the mesh dimensions of more than one rank come in `order` (outermost first); the
// dimensions of degree 1 may sit anywhere. Allocation-free: the search calls it per candidate.
bool ranks_ordered(const ParallelConfig& p, const Placement& order);

struct RunConfig {
  const ModelSpec& model;
  const ClusterSpec& cluster;
  const ParallelConfig& parallel;
  const MoeConfig& moe;
  const TrainingConfig& training;
  // The framework's rules applied too (null: none). The search sets them for the framework it
  // plans for, and the executor checks every plan it is given with its own (frameworks/).
  Target target = nullptr;
};

// Every violated rule of the model alone.
std::vector<Violation> validate_model(const ModelSpec& model);
// Every violated rule of the whole configuration (model rules included).
std::vector<Violation> validate(const RunConfig& config);
// The same rules as bits, without building messages.
RuleMask violated_rules(const RunConfig& config);

}  // namespace moeplan
