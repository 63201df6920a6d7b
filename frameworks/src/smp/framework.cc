// SageMaker's model parallelism library v2. Its rules are in rules.cc.
#include "moeplan/frameworks/framework.h"
#include "smp.h"

namespace moeplan::frameworks {

// Listed in frameworks/CMakeLists.txt (MOEPLAN_FRAMEWORKS) by its folder's name.
extern const Framework smp_framework;
const Framework smp_framework{
    .name = "smp",
    .title = "SageMaker model parallelism v2",
    .target = &kSmpRules,
    // FSDP's mixed precision with the script's bf16 = 1: fp32 parameters and optimizer states,
    // gradients reduced in bf16; its MoE router balances by Sinkhorn.
    .defaults = {.precision = Precision::kMixed, .fp32_gradients = false, .load_balancing = LoadBalancing::kSinkhorn},
    // Every layout is tried but folding (its experts and tensor ranks never combine) and context
    // parallelism (not exported); its rules remove what it does not run.
    .capabilities = {.latent_up_recomputation = false,
                     .expert_tensor_folding = false,
                     .context_parallelism = false,
                     .dense_shard_span = FrameworkCapabilities::DenseShardSpan::kNever},
    .export_launch = export_smp,
    .read_log_line = read_smp_log_line,
    .log_lines = "SMP's example script (\"Batch N Loss: ..., Speed: ... samples/sec\") or the Hugging Face Trainer "
                 "({'train_runtime': ..., 'train_steps_per_second': ...})",
};

}  // namespace moeplan::frameworks
