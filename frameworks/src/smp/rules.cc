// SageMaker's model parallelism library v2: the layouts it runs, as rules (rules.h TargetRules).
#include <array>
#include <string>
#include <string_view>

#include "moeplan/core/rules.h"
#include "smp.h"

namespace moeplan::frameworks {
// Its own namespace: the frameworks' files may be compiled together (unity builds).
namespace smp_rules {
namespace {

enum : int {
  kExpertWithTensor,
  kNoPipeline,
  kLayouts,
  kModels,
  kCount
};
constexpr std::array<std::string_view, kCount> kNames = {
    "smp_expert_with_tensor",
    "smp_no_pipeline",
    "smp_layouts",
    "smp_models",
};
static_assert(kCount <= kMaxTargetRules);

// SageMaker's model parallelism library v2 (SMP v2): PyTorch FSDP with hybrid sharding,
// expert parallelism and Transformer Engine's tensor parallelism. No pipeline (SMP v1 had
// one); optimizer states are sharded with the parameters; its example training script
// (aws/amazon-sagemaker-examples, model_parallel_v2/shared-scripts) checkpoints whole
// transformer layers.
void check(const RunConfig& c, RuleSink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t e = p.expert_parallel_degree, tp = p.tensor_parallel_degree;
  if (e > 1 && tp > 1)
    sink(kExpertWithTensor, "parallel.expert_parallel_degree", [&] {
      return "= " + rule_number(e) + " with tensor_parallel_degree = " + rule_number(tp) +
             ": SMP does not combine expert and tensor parallelism (moeplan's simulator does)";
    });
  if (p.pipeline_parallel_degree > 1)
    sink(kNoPipeline, "parallel.pipeline_parallel_degree", [&] {
      return "= " + rule_number(p.pipeline_parallel_degree) + ": SMP v2 has no pipeline parallelism (SMP v1 had)";
    });
  if (p.distributed_optimizer)
    sink(kLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: SMP (FSDP) shards optimizer states with the parameters over hybrid_shard_degree");
    });
  // SMP v2's context parallelism (2.4.0 and later) is Transformer Engine's, for its dense models;
  // moeplan does not export it.
  if (p.context_parallel_degree > 1)
    sink(kLayouts, "parallel.context_parallel_degree", [&] {
      return "= " + rule_number(p.context_parallel_degree) + ": moeplan exports SMP plans without context parallelism";
    });
  if (p.dense_shard_spanning())
    sink(kLayouts, "parallel.dense_shard_spans_experts", [&] {
      return std::string("= true: SMP shards the dense parameters over hybrid_shard_degree only");
    });
  if (c.moe.overlap_exchange)
    sink(kLayouts, "moe.overlap_exchange", [&] {
      return std::string("= true: SMP runs each micro-batch's exchanges on its own compute chain");
    });
  if (c.moe.dispatcher == Dispatcher::kDeepEp)
    sink(kLayouts, "moe.dispatcher",
         [&] { return std::string("= \"deepep\": SMP's MoE layers dispatch by all-to-all or all-gather"); });
  if (c.moe.capacity_factor > 0)
    sink(kLayouts, "moe.capacity_factor", [&] {
      return "= " + rule_number(c.moe.capacity_factor) + ": moeplan exports SMP's MoE layers dropless";
    });
  if (p.activation_checkpointing == Checkpointing::kSelective ||
      p.activation_checkpointing == Checkpointing::kAttentionCore ||
      p.activation_checkpointing == Checkpointing::kLatentUpProjections)
    sink(kLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) + ": SMP's activation_checkpointing recomputes whole transformer layers (full)";
    });
  // SMP's bf16 = 1 is FSDP's mixed precision: fp32 parameters, bf16 compute and gradient
  // reduction (MixedPrecision(param_dtype=bf16, reduce_dtype=bf16) in its example script).
  if (c.training.precision == Precision::kBf16)
    sink(kLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": SMP keeps fp32 parameters (its bf16 = 1 is FSDP mixed precision; plan with "
                         "mixed and bf16 gradients)");
    });
  if (c.training.precision == Precision::kMixed && c.training.fp32_gradients)
    sink(kLayouts, "training.fp32_gradients", [&] {
      return std::string("= true: SMP's mixed precision reduces gradients in bf16 (plan with bf16 gradients)");
    });
  // The models SMP v2 accelerates: Llama, Mistral, Mixtral, GPT-NeoX (its documentation's
  // "Supported models"); none with shared experts, q/k norms, attention biases or dense blocks among
  // MoE blocks.
  const ModelSpec& m = c.model;
  if (m.shared_experts())
    sink(kModels, "model.shared_expert_intermediate_size", [&] {
      return "= " + rule_number(m.shared_expert_intermediate_size) + ": SMP's MoE models (Mixtral) have no shared experts";
    });
  if (m.qk_norm)
    sink(kModels, "model.qk_norm", [&] { return std::string("= true: SMP's models have no q/k norms"); });
  if (m.qkv_bias)
    sink(kModels, "model.qkv_bias", [&] { return std::string("= true: SMP's models have no attention biases"); });
  if (m.mla())
    sink(kModels, "model.kv_lora_rank", [&] { return "= " + rule_number(m.kv_lora_rank) + ": SMP's models have no latent attention"; });
  if (m.router_scoring != RouterScoring::kSoftmax || m.router_groups > 1)
    sink(kModels, m.router_groups > 1 ? "model.router_groups" : "model.router_scoring",
         [&] { return std::string("set: SMP's MoE model (Mixtral) routes by a softmax over every expert"); });
  if (!m.norm_topk_prob)
    sink(kModels, "model.norm_topk_prob",
         [&] { return std::string("= false: SMP's MoE model (Mixtral) renormalises the chosen experts' weights"); });
  if (const char* field = gpt_oss_variant_field(m))
    sink(kModels, field, [&] { return std::string("is set: SMP's models are not GPT-OSS"); });
  if (m.mtp_layers > 0)
    sink(kModels, "model.mtp_layers",
         [&] { return "= " + rule_number(m.mtp_layers) + ": SMP's models predict the next token only"; });
  if (m.has_dense_layers())
    sink(kModels, "model.first_dense_layers",
         [&] { return std::string("and moe_layer_step: SMP's MoE model (Mixtral) has experts in every block"); });
}

}  // namespace
}  // namespace smp_rules

const TargetRules kSmpRules{.names = smp_rules::kNames, .check = smp_rules::check};

}  // namespace moeplan::frameworks
