// Megatron-LM (Megatron-Core). Its rules are in rules.cc.
#include "megatron.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::frameworks {

// Listed in frameworks/CMakeLists.txt (MOEPLAN_FRAMEWORKS) by its folder's name.
extern const Framework megatron_framework;
const Framework megatron_framework{
    .name = "megatron",
    .title = "Megatron-LM",
    .target = &kMegatronRules,
    // bf16 training keeps fp32 parameters, gradients and optimizer states; the router is
    // balanced by an auxiliary loss (--moe-router-load-balancing-type aux_loss).
    .defaults = {.precision = Precision::kMixed, .fp32_gradients = true, .load_balancing = LoadBalancing::kAuxLoss},
    // Every layout is tried; its rules remove what it does not run.
    .capabilities = {.dense_shard_span = FrameworkCapabilities::DenseShardSpan::kNever},
    .export_launch = export_megatron,
    .read_log_line = read_megatron_log_line,
    .log_lines = "Megatron-LM (\"iteration N/M | ... elapsed time per iteration (ms): ...\")",
};

}  // namespace moeplan::frameworks
