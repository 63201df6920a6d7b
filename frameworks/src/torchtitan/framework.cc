// torchtitan. Its rules, in core/rules.cc check_torchtitan: Rule::kTorchtitanLayouts,
// Rule::kTorchtitanRouting, Rule::kFrameworkRankOrder.
#include "moeplan/frameworks/framework.h"
#include "torchtitan.h"

namespace moeplan::frameworks {

extern const Framework kTorchtitan;
const Framework kTorchtitan{
    .name = "torchtitan",
    .title = "PyTorch's torchtitan",
    .target = Target::kTorchtitan,
    // FSDP's mixed precision: fp32 parameters and gradients, bf16 compute; its MoE router is
    // balanced by an auxiliary loss.
    .defaults = {.precision = Precision::kMixed, .fp32_gradients = true, .load_balancing = LoadBalancing::kAuxLoss},
    // Every layout is tried; its rules remove what it does not run.
    .capabilities = {},
    .export_launch = export_torchtitan,
    .read_log_line = read_torchtitan_log_line,
    .log_lines = "torchtitan (\"step: N  loss: ...  tps: ...\")",
};

}  // namespace moeplan::frameworks
