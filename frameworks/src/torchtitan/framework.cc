// torchtitan. Its rules are in rules.cc.
#include "moeplan/frameworks/framework.h"
#include "torchtitan.h"

namespace moeplan::frameworks {

// Listed in frameworks/CMakeLists.txt (MOEPLAN_FRAMEWORKS) by its folder's name.
extern const Framework torchtitan_framework;
const Framework torchtitan_framework{
    .name = "torchtitan",
    .title = "PyTorch's torchtitan",
    .target = &kTorchtitanRules,
    // FSDP's mixed precision: fp32 parameters and gradients, bf16 compute; its MoE router is
    // balanced by an auxiliary loss.
    .defaults = {.precision = Precision::kMixed, .fp32_gradients = true, .load_balancing = LoadBalancing::kAuxLoss},
    // Every layout is tried; its rules remove what it does not run.
    .capabilities = {.latent_up_recomputation = false, .dense_shard_span = FrameworkCapabilities::DenseShardSpan::kAlways},
    .export_launch = export_torchtitan,
    .read_log_line = read_torchtitan_log_line,
    .log_lines = "torchtitan (\"step: N  loss: ...  tps: ...\")",
};

}  // namespace moeplan::frameworks
