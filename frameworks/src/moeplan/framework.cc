// moeplan's own executor (`moeplan run`). Its rules are in rules.cc.
#include "moeplan/frameworks/framework.h"
#include "moeplan.h"

namespace moeplan::frameworks {

// Listed in frameworks/CMakeLists.txt (MOEPLAN_FRAMEWORKS) by its folder's name.
extern const Framework moeplan_framework;
const Framework moeplan_framework{
    .name = "moeplan",
    .title = "what `moeplan run` trains",
    .target = &kMoeplanRules,
    // It computes and keeps everything in bf16 (or fp32); Sinkhorn routing needs no loss
    // trained through the pipeline stages.
    .defaults = {.precision = Precision::kBf16, .fp32_gradients = true, .load_balancing = LoadBalancing::kSinkhorn},
    // What its rule executor_layouts refuses is not tried at all: the executor recomputes whole
    // blocks or MoE sub-blocks, runs equal stages, shards optimizer states over
    // hybrid_shard_degree only and keeps the dense parameters whole on the expert ranks.
    .capabilities = {.attention_core_recomputation = false,
                     .latent_up_recomputation = false,
                     .uneven_pipeline_stages = false,
                     .distributed_optimizer = false,
                     .dense_shard_span = FrameworkCapabilities::DenseShardSpan::kNever},
    // `moeplan run` trains a plan itself, and writes its own metrics: nothing to export or read.
    .export_launch = nullptr,
    .read_log_line = nullptr,
    .log_lines = "",
};

}  // namespace moeplan::frameworks
