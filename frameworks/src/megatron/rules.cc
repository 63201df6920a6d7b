// Megatron-LM: the layouts it runs, as rules (rules.h TargetRules).
#include <array>
#include <string>
#include <string_view>

#include "moeplan/core/rules.h"
#include "megatron.h"

namespace moeplan::frameworks {
// Its own namespace: the frameworks' files may be compiled together (unity builds).
namespace megatron_rules {
namespace {

enum : int {
  kLayouts,
  kRouting,
  kRankOrder,
  kModels,
  kCount
};
constexpr std::array<std::string_view, kCount> kNames = {
    "megatron_layouts",
    "megatron_routing",
    "framework_rank_order",
    "megatron_models",
};
static_assert(kCount <= kMaxTargetRules);

// Megatron-LM (Megatron-Core): tensor, sequence, pipeline (interleaved, uneven ends), expert
// and data parallelism, the distributed optimizer. Parameters are replicated over the data-
// parallel ranks (no hybrid sharding); ranks are ordered tensor innermost, then expert, data,
// pipeline (its default order "tp-cp-ep-dp-pp"); routing by its own load-balancing types.
void check(const RunConfig& c, RuleSink& sink) {
  const ParallelConfig& p = c.parallel;
  // Its flex dispatcher runs DeepEP over the ETP x EP ranks and asserts that there are several;
  // moeplan prices DeepEP over the expert group with whole experts on each rank.
  if (c.moe.dispatcher == Dispatcher::kDeepEp && (p.expert_parallel_degree <= 1 || p.expert_tensor_degree() > 1))
    sink(kLayouts, "moe.dispatcher", [&] {
      return "= \"deepep\" with expert_parallel_degree = " + rule_number(p.expert_parallel_degree) +
             " and expert_tensor_parallel_degree = " + rule_number(p.expert_tensor_degree()) +
             ": moeplan exports Megatron-LM's flex dispatcher with E > 1 and each expert whole on a rank (ETP 1)";
    });
  // --moe-shared-expert-overlap works with the all-to-all dispatcher.
  if (overlaps_shared_expert(c.model, c.moe, p) && c.moe.dispatcher != Dispatcher::kAllToAll)
    sink(kLayouts, "moe.overlap_shared_expert", [&] {
      return "= true with dispatcher \"" + std::string(name_of(kDispatcherNames, c.moe.dispatcher)) +
             "\": moeplan exports Megatron-LM's shared-expert overlap with the all-to-all dispatcher";
    });
  if (p.hybrid_shard_degree > 1)
    sink(kLayouts, "parallel.hybrid_shard_degree", [&] {
      return "= " + rule_number(p.hybrid_shard_degree) +
             ": Megatron-LM replicates parameters over the data-parallel ranks and shards optimizer states "
             "(distributed_optimizer) instead";
    });
  if (p.dense_shard_spanning())
    sink(kLayouts, "parallel.dense_shard_spans_experts", [&] {
      return std::string("= true: Megatron-LM keeps the dense parameters whole on the expert and context ranks "
                         "(its distributed optimizer shards their states over them)");
    });
  if (p.activation_offloading)
    sink(kLayouts, "parallel.activation_offloading", [&] {
      return std::string("= true: moeplan exports no activation offloading to Megatron-LM (its CPU offloading has "
                         "no loading horizon)");
    });
  if (c.training.precision == Precision::kBf16)
    sink(kLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": Megatron-LM keeps fp32 main parameters and optimizer states (its --bf16 is "
                         "mixed precision; plan with mixed)");
    });
  // Interleaving with uneven ends: every stage's blocks split into the V chunks evenly.
  if (const int64_t vp = p.virtual_pipeline_degree; vp > 1 && (p.first_stage_layers > 0 || p.last_stage_layers > 0)) {
    const int64_t others = p.pipeline_parallel_degree - (p.first_stage_layers > 0) - (p.last_stage_layers > 0);
    const int64_t middle =
        others > 0 ? (c.model.num_layers - p.first_stage_layers - p.last_stage_layers) / others : vp;
    if (p.first_stage_layers % vp != 0 || p.last_stage_layers % vp != 0 || middle % vp != 0)
      sink(kLayouts, "parallel.virtual_pipeline_degree", [&] {
        return "= " + rule_number(vp) + " with first_stage_layers = " + rule_number(p.first_stage_layers) +
               ", last_stage_layers = " + rule_number(p.last_stage_layers) + " and " + rule_number(middle) +
               " blocks on each other stage: Megatron-LM splits every stage into equal chunks";
      });
  }
  if (!ranks_ordered(p, Placement{}))  // the default placement: P, R, S, E, T outermost first
    sink(kRankOrder, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() +
             "\": Megatron-LM orders ranks tensor innermost, then expert, data and pipeline (PRSET)";
    });
  // Its linear layers take biases all or none (--disable-bias-linear), q, k and v's also alone
  // (--add-qkv-bias): o_proj's and the experts' go together, and with q, k and v's.
  const ModelSpec& m = c.model;
  if (m.output_bias != m.expert_bias)
    sink(kModels, "model.output_bias", [&] {
      return std::string("= ") + (m.output_bias ? "true" : "false") + " with expert_bias = " +
             (m.expert_bias ? "true" : "false") + ": Megatron-LM puts biases on every linear layer or on none";
    });
  else if (m.output_bias && !m.qkv_bias)
    sink(kModels, "model.qkv_bias", [&] {
      return std::string("= false with output_bias and expert_bias: Megatron-LM's biases on every linear layer "
                         "include q, k and v's");
    });
  // Megatron-Core renormalises a sigmoid router's top-k scores always (topk_routing_with_score_function).
  if (m.router_scoring == RouterScoring::kSigmoid && !m.norm_topk_prob)
    sink(kModels, "model.norm_topk_prob", [&] {
      return std::string("= false with sigmoid scoring: Megatron-LM renormalises the chosen experts' scores");
    });
  if (c.moe.load_balancing == LoadBalancing::kBalanced)
    sink(kRouting, "moe.load_balancing", [&] {
      return std::string("= \"balanced\": Megatron-LM routes by aux_loss, sinkhorn or none");
    });
  if (c.moe.global_token_shuffle)
    sink(kRouting, "moe.global_token_shuffle",
         [&] { return std::string("= true: Megatron-LM has no global token shuffle"); });
  // --moe-expert-capacity-factor: Megatron-Core drops tokens with aux_loss (or its sequence and
  // global variants) or no load-balancing loss (TransformerConfig.__post_init__).
  if (c.moe.capacity_factor > 0 && c.moe.load_balancing != LoadBalancing::kAuxLoss &&
      c.moe.load_balancing != LoadBalancing::kNone)
    sink(kRouting, "moe.capacity_factor", [&] {
      return "= " + rule_number(c.moe.capacity_factor) + " with load_balancing \"" +
             std::string(name_of(kLoadBalancingNames, c.moe.load_balancing)) +
             "\": Megatron-LM drops tokens only with aux_loss or none";
    });
  if (c.moe.capacity_factor > 0 && c.moe.dispatcher == Dispatcher::kDeepEp)
    sink(kRouting, "moe.capacity_factor", [&] {
      return "= " + rule_number(c.moe.capacity_factor) +
             " with dispatcher \"deepep\": moeplan exports token dropping with the all-to-all or all-gather dispatcher";
    });
}

}  // namespace
}  // namespace megatron_rules

const TargetRules kMegatronRules{.names = megatron_rules::kNames, .check = megatron_rules::check};

}  // namespace moeplan::frameworks
