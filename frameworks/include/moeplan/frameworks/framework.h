#pragma once
// The training frameworks moeplan knows, each in one place: SageMaker's model parallelism
// library v2 (smp), Megatron-LM (megatron), torchtitan (torchtitan) and moeplan's own executor
// (moeplan). An entry holds everything of its framework that moeplan uses: the settings a plan for it starts from, what the search tries for it, the files that launch
// a plan in it, the reader of its training log and its rules (the layouts it runs). Each is
// defined in its own folder, frameworks/src/<name>/, and listed once, by that name, in
// frameworks/CMakeLists.txt (MOEPLAN_FRAMEWORKS).

#include <span>
#include <string_view>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/rules.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/frameworks/training_log.h"

namespace moeplan {

// What a plan for the framework trains with unless told otherwise (--precision, --gradients,
// --load-balancing).
struct FrameworkDefaults {
  Precision precision = Precision::kBf16;
  bool fp32_gradients = true;  // false: gradients reduced in bf16
  LoadBalancing load_balancing = LoadBalancing::kSinkhorn;
};

// The layouts the search tries for the framework before its rules are asked: a choice the
// framework never runs is not enumerated at all.
struct FrameworkCapabilities {
  // Recomputing only the attention core (Checkpointing::kAttentionCore), tried where attention
  // is unfused.
  bool attention_core_recomputation = true;
  // Recomputing latent attention's up projections (Checkpointing::kLatentUpProjections), tried
  // with latent-attention models.
  bool latent_up_recomputation = true;
  // End stages a block or two lighter than the others, tried where the pipeline degree does not
  // divide the blocks.
  bool uneven_pipeline_stages = true;
  // Optimizer states sharded over the data-parallel replicas, tried where there are some.
  bool distributed_optimizer = true;
  // Routed experts outside the tensor split, the tensor ranks folded into the expert group
  // (expert_tensor_parallel_degree = 1 under T > 1), tried with MoE models.
  bool expert_tensor_folding = true;
  // Each sequence split over context-parallel ranks (context_parallel_degree > 1), tried where
  // the sequence is long enough (SearchOptions::min_context_chunk).
  bool context_parallelism = true;
  // The dense parameters sharded over the expert and context ranks too
  // (ParallelConfig::dense_shard_spans_experts), where there are some: never; always (FSDP2 over
  // a shard dimension the expert ranks come out of); or both tried.
  enum class DenseShardSpan : uint8_t { kNever, kAlways, kEither };
  DenseShardSpan dense_shard_span = DenseShardSpan::kEither;
};

struct Framework {
  std::string_view name;   // as --target and --to spell it, e.g. "megatron"
  std::string_view title;  // what it is, for help texts, e.g. "Megatron-LM"
  // Its rules (frameworks/src/<name>/rules.cc), which the search, `check`, the exporter and
  // `moeplan run` apply; null for "any".
  Target target = nullptr;
  FrameworkDefaults defaults;
  FrameworkCapabilities capabilities;
  // The files that launch a plan in it, for a plan that keeps its rules; problems it cannot
  // express go to `problems`. Null: it has none (moeplan trains a plan itself).
  std::vector<launch::LaunchFile> (*export_launch)(const Plan& plan, Diagnostics& problems) = nullptr;
  // Reads `line` into `log` when it is one of the lines the framework prints while it trains,
  // and says whether it was (a line of its that carries nothing to read counts too); throws
  // InputError naming the line when it starts like one but does not read. Null: moeplan reads
  // no log of it.
  bool (*read_log_line)(const LogLine& line, TrainingLog& log) = nullptr;
  // Its lines as a user would recognise them, for the error on a log that holds no one's.
  std::string_view log_lines = {};
};

// Every framework, in the order a log line is offered to their readers.
std::span<const Framework* const> all_frameworks();
// The framework a plan targets. No target (null: no framework's limits) has an entry of its own
// ("any": moeplan's defaults, every layout tried, nothing exported, no log) that
// all_frameworks() does not list.
const Framework& framework(Target target);
// moeplan's own executor: what `moeplan run` trains and `moeplan search` plans for by default.
const Framework& executor_framework();
// The framework named `name` (as --target spells it, "any" included); null when none is.
const Framework* find_framework(std::string_view name);

// Sets the framework's defaults: precision, gradient precision, load balancing.
void apply_defaults(const Framework& framework, TrainingConfig& training, MoeConfig& moe);

}  // namespace moeplan
