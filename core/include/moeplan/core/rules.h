#pragma once
// The validity rules of a model and a parallel configuration, in one place. The planner, the
// executor and the CLI all use these functions; the search uses the mask form, which builds
// no strings.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan {

// Where a plan will train. Each framework runs only some of the layouts moeplan models; its
// rules below keep a search to those and make an exporter refuse the others by name.
enum class Target : uint8_t {
  kAny,         // every layout moeplan models (published runs of any framework)
  kMoeplan,     // what `moeplan run` trains
  kMegatron,    // Megatron-LM (Megatron-Core)
  kSmp,         // the SageMaker model parallelism library v2
  kTorchtitan,  // torchtitan
};
inline constexpr std::array<std::pair<std::string_view, Target>, 5> kTargetNames{{{"any", Target::kAny},
                                                                                   {"moeplan", Target::kMoeplan},
                                                                                   {"megatron", Target::kMegatron},
                                                                                   {"smp", Target::kSmp},
                                                                                   {"torchtitan", Target::kTorchtitan}}};

enum class Rule : uint8_t {
  // Model
  kTopKWithinExperts,
  kKvHeadsDivideHeads,
  kHeadDimEven,
  kModelSize,
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
  kSequenceParallelNeedsTensor,
  kExpertTensorNeedsSequenceParallel,
  kSmpExpertWithTensor,
  kPipelineDividesLayers,
  kVirtualStagesFitThePipeline,
  // Batch and sequence
  kSeqLenWithinPositions,
  kMicroBatchTokens,
  kGlobalBatchMatches,
  // Activation checkpointing and offloading
  kOffloadNeedsCheckpointing,
  kHorizonPositive,
  kHorizonWithinLayers,
  // MoE
  kLoadImbalanceRange,
  kTokenShuffleNeedsExperts,
  kTokenCountsMatchExperts,
  // Training schedule
  kMinLrWithinLr,
  kWarmupWithinSteps,
  // Precision
  kFp8NeedsHardware,
  // What moeplan's executor trains (Target::kMoeplan)
  kExecutorTrainsMoe,
  kExecutorPipelineLimits,
  kExecutorLayouts,
  kExecutorTensorSplits,
  // What the other frameworks run (RunConfig::target)
  kSmpNoPipeline,
  kSmpLayouts,
  kMegatronLayouts,
  kMegatronRouting,
  kTorchtitanLayouts,
  kTorchtitanRouting,
  kFrameworkRankOrder,
  kCount
};
inline constexpr int kRuleCount = static_cast<int>(Rule::kCount);
using RuleMask = uint64_t;
static_assert(kRuleCount <= 64, "RuleMask is too narrow");

inline constexpr RuleMask rule_bit(Rule r) { return RuleMask{1} << static_cast<int>(r); }

// Stable name of a rule, used by --explain and in tests ("expert_degree_divides_experts").
std::string_view rule_name(Rule rule);

struct Violation {
  Rule rule;
  std::string field;    // field path, e.g. "parallel.expert_parallel_degree"
  std::string message;  // the value and the rule, e.g. "= 3 does not divide num_experts = 8"
  std::string to_string() const { return field + " " + message; }
};

struct RunConfig {
  const ModelSpec& model;
  const ClusterSpec& cluster;
  const ParallelConfig& parallel;
  const MoeConfig& moe;
  const TrainingConfig& training;
  // The framework's rules applied too. kMoeplan: only what `moeplan run` trains (Mixture-of-
  // Experts SwiGLU models; no distributed optimizer, attention-core recomputation, uneven stages
  // or FP8); the search sets it for plans meant for `moeplan run`, and the executor checks
  // every plan it is given with it.
  Target target = Target::kAny;
};

// Every violated rule of the model alone.
std::vector<Violation> validate_model(const ModelSpec& model);
// Every violated rule of the whole configuration (model rules included).
std::vector<Violation> validate(const RunConfig& config);
// The same rules as bits, without building messages.
RuleMask violated_rules(const RunConfig& config);

}  // namespace moeplan
