// torchtitan: the layouts it runs, as rules (rules.h TargetRules).
#include <algorithm>
#include <array>
#include <string>
#include <string_view>

#include "moeplan/core/rules.h"
#include "torchtitan.h"

namespace moeplan::frameworks {
// Its own namespace: the frameworks' files may be compiled together (unity builds).
namespace torchtitan_rules {
namespace {

enum : int {
  kLayouts,
  kRouting,
  kRankOrder,
  kModels,
  kCount
};
constexpr std::array<std::string_view, kCount> kNames = {
    "torchtitan_layouts",
    "torchtitan_routing",
    "framework_rank_order",
    "torchtitan_models",
};
static_assert(kCount <= kMaxTargetRules);

// torchtitan: FSDP2 (sharded over data_parallel_shard_degree, replicated over
// data_parallel_replicate_degree), tensor parallelism with sequence parallelism, pipeline
// stages, expert parallelism inside the sharded ranks; its mesh is pipeline, replicate, shard,
// tensor outermost first; fp32 parameters with bf16 compute; full or no activation
// checkpointing of blocks.
void check(const RunConfig& c, RuleSink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t tp = p.tensor_parallel_degree;
  if (tp > 1 && !p.sequence_parallel)
    sink(kLayouts, "parallel.sequence_parallel", [&] {
      return "= false with tensor_parallel_degree = " + rule_number(tp) +
             ": torchtitan's tensor parallelism always splits the sequence (sequence parallelism)";
    });
  if (overlaps_shared_expert(c.model, c.moe, p))
    sink(kLayouts, "moe.overlap_shared_expert", [&] {
      return std::string("= true: torchtitan runs its shared experts in turn with the routed ones");
    });
  if (c.moe.overlap_exchange)
    sink(kLayouts, "moe.overlap_exchange", [&] {
      return std::string("= true: torchtitan runs each micro-batch's exchanges on its own compute chain");
    });
  if (c.moe.dispatcher == Dispatcher::kDeepEp)
    sink(kLayouts, "moe.dispatcher",
         [&] { return std::string("= \"deepep\": moeplan exports torchtitan's all-to-all dispatch only"); });
  if (p.activation_checkpointing == Checkpointing::kSelective ||
      p.activation_checkpointing == Checkpointing::kAttentionCore ||
      p.activation_checkpointing == Checkpointing::kLatentUpProjections)
    sink(kLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) +
             ": torchtitan checkpoints whole blocks (full) or operators it picks itself, not a sub-block";
    });
  if (c.training.seq_len % (2 * std::max<int64_t>(1, tp)) != 0)
    sink(kLayouts, "training.seq_len", [&] {
      return "= " + rule_number(c.training.seq_len) + " is not a multiple of 2 x tensor_parallel_degree = " +
             rule_number(2 * tp) + " (torchtitan's sequence split)";
    });
  if (p.activation_offloading)
    sink(kLayouts, "parallel.activation_offloading",
         [&] { return std::string("= true: torchtitan does not offload activations"); });
  if (p.distributed_optimizer)
    sink(kLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: torchtitan (FSDP2) shards optimizer states with the parameters over "
                         "hybrid_shard_degree");
    });
  if (p.first_stage_layers > 0 || p.last_stage_layers > 0)
    sink(kLayouts, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] { return std::string("is set: moeplan exports equal pipeline stages to torchtitan"); });
  if (c.training.precision == Precision::kMixed && !c.training.fp32_gradients)
    sink(kLayouts, "training.fp32_gradients", [&] {
      return std::string("= false: torchtitan reduces gradients in fp32 (mixed_precision_reduce)");
    });
  // Its mixed precision is FSDP's: without sharding, tensor or pipeline parallelism trains in
  // fp32, and replicas over them are DDP, which it runs on one mesh dimension only.
  // (FSDP shards over the context ranks too: dp_shard x cp.)
  if (p.hybrid_shard_degree * p.expert_data_degree() * p.context_parallel_degree == 1 &&
      (tp > 1 || p.pipeline_parallel_degree > 1))
    sink(kLayouts, "parallel.hybrid_shard_degree", [&] {
      return std::string("= 1 with expert_parallel_degree = 1 under tensor or pipeline parallelism: torchtitan "
                         "applies mixed precision and replicas through FSDP, so the shard degree must exceed 1");
    });
  // FSDP2 shards every parameter over dp_shard x cp, and the expert ranks come out of dp_shard:
  // the dense parameters are sharded over the expert and context ranks too.
  if (const int64_t spanned = p.expert_data_degree() * p.context_parallel_degree;
      spanned > 1 && !p.dense_shard_spans_experts)
    sink(kLayouts, "parallel.dense_shard_spans_experts", [&] {
      return "= false with " + rule_number(spanned) +
             " expert and context ranks to span: torchtitan's FSDP shards the dense parameters over "
             "data_parallel_shard_degree x context_parallel_degree, the expert ranks included";
    });
  if (c.training.precision == Precision::kBf16)
    sink(kLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": torchtitan keeps fp32 parameters and computes in bf16 (plan with mixed)");
    });
  if (!ranks_ordered(p, Placement{}))
    sink(kRankOrder, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() +
             "\": torchtitan's mesh is pipeline, replicate, shard (experts innermost), tensor (PRSET)";
    });
  if (c.moe.load_balancing == LoadBalancing::kSinkhorn || c.moe.load_balancing == LoadBalancing::kBalanced)
    sink(kRouting, "moe.load_balancing", [&] {
      return "= \"" + std::string(name_of(kLoadBalancingNames, c.moe.load_balancing)) +
             "\": torchtitan's routers balance by a load-balancing loss or expert biases (aux_loss or none)";
    });
  if (c.moe.capacity_factor > 0)
    sink(kRouting, "moe.capacity_factor", [&] {
      return "= " + rule_number(c.moe.capacity_factor) + ": torchtitan's MoE layers are dropless";
    });
  if (c.moe.global_token_shuffle)
    sink(kRouting, "moe.global_token_shuffle",
         [&] { return std::string("= true: torchtitan has no global token shuffle"); });
  // Its models: llama3 (dense), llama4 (MoE, with a shared expert or not), qwen3 (q/k norms, no
  // shared experts), deepseek_v3.
  const ModelSpec& m = c.model;
  if (m.shared_expert_gate)
    sink(kModels, "model.shared_expert_gate",
         [&] { return std::string("= true: no torchtitan model gates its shared expert (Qwen2-MoE does)"); });
  if (m.qkv_bias)
    sink(kModels, "model.qkv_bias", [&] { return std::string("= true: no torchtitan model has attention biases"); });
  // deepseek_v3 (latent attention) puts dense blocks first (n_dense_layers) and routes within
  // groups (n_expert_groups, n_limited_groups); moeplan writes llama4 and qwen3 with experts in
  // every block.
  if (m.has_dense_layers() && (!m.mla() || m.moe_layer_step > 1))
    sink(kModels, "model.first_dense_layers", [&] {
      return "= " + rule_number(m.first_dense_layers) + " with moe_layer_step = " + rule_number(m.moe_layer_step) +
             ": torchtitan's deepseek_v3 puts dense blocks first only, and its llama4 and qwen3 as moeplan writes "
             "them have experts in every block";
    });
  if (m.router_groups > 1 && !m.mla())
    sink(kModels, "model.router_groups", [&] {
      return "= " + rule_number(m.router_groups) + ": torchtitan routes within groups in its deepseek_v3 only";
    });
  if (const char* field = gpt_oss_variant_field(m))
    sink(kModels, field, [&] {
      return std::string("is set: moeplan writes torchtitan's llama3, llama4, qwen3 and deepseek_v3 models, not its gpt_oss");
    });
  if (m.mtp_layers > 0)
    sink(kModels, "model.mtp_layers", [&] {
      return "= " + rule_number(m.mtp_layers) +
             ": torchtitan's job configs (TOML) train next-token prediction only; its multi-token prediction "
             "is set in the Python model config, which moeplan does not write";
    });
  if (m.mla() && m.qk_norm)
    sink(kModels, "model.qk_norm", [&] { return std::string("= true: torchtitan's deepseek_v3 has no q/k norms"); });
  if (m.qk_norm && m.shared_experts())
    sink(kModels, "model.qk_norm", [&] {
      return std::string("= true with shared experts: torchtitan's qwen3 has q/k norms and no shared experts");
    });
  if (m.shared_experts() && m.shared_expert_intermediate_size % m.intermediate_size != 0)
    sink(kModels, "model.shared_expert_intermediate_size", [&] {
      return "= " + rule_number(m.shared_expert_intermediate_size) +
             ": torchtitan's shared experts are whole experts of the routed width (intermediate_size = " +
             rule_number(m.intermediate_size) + ")";
    });
}

}  // namespace
}  // namespace torchtitan_rules

const TargetRules kTorchtitanRules{.names = torchtitan_rules::kNames, .check = torchtitan_rules::check};

}  // namespace moeplan::frameworks
