// Each framework's rules (frameworks/src/<name>/rules.cc): one fault each breaks exactly its
// rule, named by the framework and seen by the search as a bit above the core rules.

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/rules.h"
#include "moeplan/frameworks/framework.h"
#include "framework_rules.h"
#include "rule_cases.h"
#include "test_support.h"

namespace moeplan {
namespace {

using test::describe_violations;
using test::rules_base;
using test::Scenario;

// `change` breaks exactly one rule of the base under a framework's rules (it sets the target,
// and moves what the framework needs elsewhere to where that framework takes it).
struct FrameworkRuleCase {
  const char* name;
  std::function<void(Scenario&)> change;
  const char* rule;       // the rule's name
  const char* field;
  const char* message;    // exact text of the violation
  const char* bad_value;  // the value the change introduced, as the message must show it
};

const FrameworkRuleCase kCases[] = {
    {"SmpModeExpertsWithTensor",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     "smp_expert_with_tensor", "parallel.expert_parallel_degree",
     "= 2 with tensor_parallel_degree = 2: SMP does not combine expert and tensor parallelism (moeplan's "
     "simulator does)",
     "2"},
    {"SmpPipeline",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.parallel.pipeline_parallel_degree = 2;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     "smp_no_pipeline", "parallel.pipeline_parallel_degree", "= 2: SMP v2 has no pipeline parallelism (SMP v1 had)",
     "2"},
    {"SmpPureBf16",
     [](Scenario& s) { s.target = test::framework_rules("smp"); },
     "smp_layouts", "training.precision",
     "= \"bf16\": SMP keeps fp32 parameters (its bf16 = 1 is FSDP mixed precision; plan with mixed and bf16 "
     "gradients)",
     "bf16"},
    {"MegatronHybridSharding",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
     },
     "megatron_layouts", "parallel.hybrid_shard_degree",
     "= 8: Megatron-LM replicates parameters over the data-parallel ranks and shards optimizer states "
     "(distributed_optimizer) instead",
     "8"},
    {"MegatronBalancedRouting",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.moe.load_balancing = LoadBalancing::kBalanced;
     },
     "megatron_routing", "moe.load_balancing", "= \"balanced\": Megatron-LM routes by aux_loss, sinkhorn or none",
     "balanced"},
    {"MegatronRankOrder",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.parallel.placement = *Placement::parse("ERS");
     },
     "framework_rank_order", "parallel.placement",
     "= \"ERS\": Megatron-LM orders ranks tensor innermost, then expert, data and pipeline (PRSET)", "ERS"},
    {"TorchtitanSelectiveCheckpointing",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.parallel.activation_checkpointing = Checkpointing::kSelective;
     },
     "torchtitan_layouts", "parallel.activation_checkpointing",
     "= \"selective\": torchtitan checkpoints whole blocks (full) or operators it picks itself, not a sub-block",
     "selective"},
    {"TorchtitanSinkhorn",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
     },
     "torchtitan_routing", "moe.load_balancing",
     "= \"sinkhorn\": torchtitan's routers balance by a load-balancing loss or expert biases (aux_loss or none)",
     "sinkhorn"},
    {"TorchtitanRankOrder",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.parallel.placement = *Placement::parse("ERS");
     },
     "framework_rank_order", "parallel.placement",
     "= \"ERS\": torchtitan's mesh is pipeline, replicate, shard (experts innermost), tensor (PRSET)", "ERS"},
    // The base's E2: torchtitan's FSDP shards the dense parameters over the expert ranks too.
    {"TorchtitanDenseShardOverExpertRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
     },
     "torchtitan_layouts", "parallel.dense_shard_spans_experts",
     "= false with 2 expert and context ranks to span: torchtitan's FSDP shards the dense parameters over "
     "data_parallel_shard_degree x context_parallel_degree, the expert ranks included",
     "false"},
    {"MegatronDenseShardOverExpertRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.parallel.dense_shard_spans_experts = true;
     },
     "megatron_layouts", "parallel.dense_shard_spans_experts",
     "= true: Megatron-LM keeps the dense parameters whole on the expert and context ranks (its distributed "
     "optimizer shards their states over them)",
     "true"},
    {"MegatronCapacityWithSinkhorn",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.moe.capacity_factor = 1.25;
     },
     "megatron_routing", "moe.capacity_factor",
     "= 1.25 with load_balancing \"sinkhorn\": Megatron-LM drops tokens only with aux_loss or none", "1.25"},
    {"MegatronCapacityWithDeepEp",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.moe.dispatcher = Dispatcher::kDeepEp;
       s.moe.capacity_factor = 1.5;
     },
     "megatron_routing", "moe.capacity_factor",
     "= 1.5 with dispatcher \"deepep\": moeplan exports token dropping with the all-to-all or all-gather "
     "dispatcher",
     "1.5"},
    {"TorchtitanCapacity",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.moe.capacity_factor = 1.25;
     },
     "torchtitan_routing", "moe.capacity_factor", "= 1.25: torchtitan's MoE layers are dropless", "1.25"},
    {"ExecutorPadsInTheAllToAllOnly",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.moe.capacity_factor = 1;
       s.moe.pad_to_capacity = true;
       s.moe.dispatcher = Dispatcher::kAllGather;
     },
     "executor_trains_moe", "moe.pad_to_capacity",
     "= true with dispatcher \"allgather\": the executor pads experts' input in the all-to-all exchange only", "= true"},
    {"SmpCapacity",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.moe.capacity_factor = 1.25;
     },
     "smp_layouts", "moe.capacity_factor", "= 1.25: moeplan exports SMP's MoE layers dropless", "1.25"},
    {"TorchtitanSharedExpertOverlap",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.shared_expert_intermediate_size = 14336;
       s.moe.overlap_shared_expert = true;
     },
     "torchtitan_layouts", "moe.overlap_shared_expert",
     "= true: torchtitan runs its shared experts in turn with the routed ones", "true"},
    {"MegatronSharedExpertOverlapWithDeepEp",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.model.shared_expert_intermediate_size = 14336;
       s.moe.dispatcher = Dispatcher::kDeepEp;
       s.moe.overlap_shared_expert = true;
     },
     "megatron_layouts", "moe.overlap_shared_expert",
     "= true with dispatcher \"deepep\": moeplan exports Megatron-LM's shared-expert overlap with the all-to-all "
     "dispatcher",
     "deepep"},
    {"SmpDenseShardOverExpertRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.parallel.dense_shard_spans_experts = true;
     },
     "smp_layouts", "parallel.dense_shard_spans_experts",
     "= true: SMP shards the dense parameters over hybrid_shard_degree only", "true"},
    {"ExecutorBalancedAssignmentOverContextRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.parallel.context_parallel_degree = 2;
       s.parallel.gradient_accumulation_steps = 256;
       s.moe.load_balancing = LoadBalancing::kBalanced;
     },
     "executor_layouts", "moe.load_balancing",
     "= \"balanced\" with context_parallel_degree = 2: the executor solves the balanced assignment over a whole "
     "sequence on one rank only (use sinkhorn, aux_loss or none)",
     "balanced"},
    {"ExecutorDenseShardOverExpertRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.parallel.dense_shard_spans_experts = true;
     },
     "executor_layouts", "parallel.dense_shard_spans_experts",
     "= true: the executor shards the dense parameters over hybrid_shard_degree only", "true"},
    {"SmpSharedExperts",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.model.shared_expert_intermediate_size = 5632;
     },
     "smp_models", "model.shared_expert_intermediate_size",
     "= 5632: SMP's MoE models (Mixtral) have no shared experts", "5632"},
    {"TorchtitanGatedSharedExpert",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.shared_expert_intermediate_size = 14336;
       s.model.shared_expert_gate = true;
     },
     "torchtitan_models", "model.shared_expert_gate",
     "= true: no torchtitan model gates its shared expert (Qwen2-MoE does)", "true"},
    {"TorchtitanSharedExpertsNotWholeExperts",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.shared_expert_intermediate_size = 5632;
     },
     "torchtitan_models", "model.shared_expert_intermediate_size",
     "= 5632: torchtitan's shared experts are whole experts of the routed width (intermediate_size = 14336)",
     "5632"},
    {"ExecutorSplitsTheVocabularyEvenly",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
       s.model.vocab_size = 32001;
     },
     "executor_tensor_splits", "model.vocab_size",
     "= 32001 is not divisible by tensor_parallel_degree = 2 (the executor splits the embedding and lm head over "
     "the vocabulary)",
     "32001"},
    {"SmpDenseBlocks",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.model.moe_layer_step = 2;
       s.model.moe_layer_offset = 1;
       s.model.dense_intermediate_size = 14336;
     },
     "smp_models", "model.first_dense_layers", "and moe_layer_step: SMP's MoE model (Mixtral) has experts in every block",
     "moe_layer_step"},
    {"TorchtitanDenseBlocks",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.first_dense_layers = 3;
       s.model.dense_intermediate_size = 14336;
     },
     "torchtitan_models", "model.first_dense_layers",
     "= 3 with moe_layer_step = 1: torchtitan's deepseek_v3 puts dense blocks first only, and its llama4 and qwen3 as "
     "moeplan writes them have experts in every block",
     "= 3"},
    {"ExecutorModeLatentValuesWiderThanHeads",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.num_key_value_heads = 32;
       s.model.kv_lora_rank = 512;
       s.model.qk_rope_head_dim = 64;
       s.model.v_head_dim = 192;
     },
     "executor_trains_moe", "model.v_head_dim",
     "= 192 over head_dim = 128: the executor's latent attention pads values to the query and key width, not the other "
     "way",
     "192"},
    {"ExecutorModeMultiTokenPredictionPastTheSequence",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.mtp_layers = 1;
       s.training.seq_len = 2;
       s.training.global_batch_tokens =  // every rank reads (T = P = 1)
           s.parallel.world_size * s.parallel.micro_batch_size * s.parallel.gradient_accumulation_steps * 2;
     },
     "executor_trains_moe", "training.seq_len",
     "= 2 with mtp_layers = 1: the deepest multi-token prediction module would have no token to predict", "= 2"},
    {"SmpMultiTokenPrediction",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.model.mtp_layers = 2;
     },
     "smp_models", "model.mtp_layers", "= 2: SMP's models predict the next token only", "= 2"},
    {"TorchtitanMultiTokenPrediction",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.mtp_layers = 1;
     },
     "torchtitan_models", "model.mtp_layers",
     "= 1: torchtitan's job configs (TOML) train next-token prediction only; its multi-token prediction is set in the "
     "Python model config, which moeplan does not write",
     "= 1"},
    {"ExecutorModeAttentionSinks",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.attention_sinks = true;
     },
     "executor_trains_moe", "model.attention_sinks",
     "is set: the executor trains Mixtral-style blocks (GPT-OSS's attention sinks, biases and clamped gate are "
     "planned and simulated only)",
     "is set"},
    {"TorchtitanExpertBiases",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.expert_bias = true;
     },
     "torchtitan_models", "model.expert_bias",
     "is set: moeplan writes torchtitan's llama3, llama4, qwen3 and deepseek_v3 models, not its gpt_oss", "gpt_oss"},
    {"SmpClampedGate",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.model.glu_limit = 7;
     },
     "smp_models", "model.glu_limit", "is set: SMP's models are not GPT-OSS", "GPT-OSS"},
    {"SmpExpertsWeightedByTheirOwnProbability",
     [](Scenario& s) {
       s.target = test::framework_rules("smp");
       s.training.precision = Precision::kMixed;
       s.training.fp32_gradients = false;
       s.model.norm_topk_prob = false;
     },
     "smp_models", "model.norm_topk_prob",
     "= false: SMP's MoE model (Mixtral) renormalises the chosen experts' weights", "renormalises"},
    {"MegatronSigmoidScoresNotRenormalised",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.model.router_scoring = RouterScoring::kSigmoid;
       s.model.norm_topk_prob = false;
     },
     "megatron_models", "model.norm_topk_prob",
     "= false with sigmoid scoring: Megatron-LM renormalises the chosen experts' scores", "sigmoid"},
    {"MegatronBiasesOnSomeLinearLayers",
     [](Scenario& s) {
       s.target = test::framework_rules("megatron");
       s.training.precision = Precision::kMixed;
       s.parallel.hybrid_shard_degree = 1;
       s.model.expert_bias = true;
     },
     "megatron_models", "model.output_bias",
     "= false with expert_bias = true: Megatron-LM puts biases on every linear layer or on none", "expert_bias"},
    {"ExecutorModeSigmoidRouterWithSinkhorn",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.router_scoring = RouterScoring::kSigmoid;
       s.moe.load_balancing = LoadBalancing::kSinkhorn;
     },
     "executor_trains_moe", "moe.load_balancing",
     "= \"sinkhorn\" with sigmoid scoring: the executor balances a sigmoid router by its bias, with aux_loss or none",
     "sigmoid"},
    {"ExecutorModeGroupsUnderSoftmax",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.router_groups = 2;
     },
     "executor_trains_moe", "model.router_groups",
     "= 2 with softmax scoring: the executor limits the choice to groups under sigmoid scoring only (DeepSeek-V3's); "
     "its softmax router takes the top-k over every expert",
     "= 2"},
    {"TorchtitanGroupsWithoutLatentAttention",
     [](Scenario& s) {
       s.target = test::framework_rules("torchtitan");
       s.parallel.dense_shard_spans_experts = true;  // its FSDP spans the expert ranks
       s.training.precision = Precision::kMixed;
       s.moe.load_balancing = LoadBalancing::kAuxLoss;
       s.model.router_groups = 2;
     },
     "torchtitan_models", "model.router_groups", "= 2: torchtitan routes within groups in its deepseek_v3 only", "= 2"},
    {"ExecutorModeGeluModel",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.mlp = Mlp::kGelu;
     },
     "executor_trains_moe", "model.mlp", "= \"gelu\": the executor trains SwiGLU feed-forward layers only", "gelu"},
    {"ExecutorModeZLossAcrossStages",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.moe.z_loss_coef = 0.001;
       s.parallel.pipeline_parallel_degree = 2;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     "executor_pipeline_limits", "moe.z_loss_coef",
     "= 0.001 with pipeline_parallel_degree = 2: the executor trains the z-loss without pipeline stages only (use 0)",
     "0.001"},
    {"ExecutorModeDistributedOptimizer",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.parallel.distributed_optimizer = true;
     },
     "executor_layouts", "parallel.distributed_optimizer",
     "= true: the executor shards optimizer states over hybrid_shard_degree only (use S instead)", "true"},
    {"ExecutorModeVocabularyOverTensorRanks",
     [](Scenario& s) {
       s.target = test::framework_rules("moeplan");
       s.model.vocab_size = 32001;
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     "executor_tensor_splits", "model.vocab_size",
     "= 32001 is not divisible by tensor_parallel_degree = 2 (the executor splits the embedding and lm head over the "
     "vocabulary)",
     "32001"},
};

class FrameworkRule : public testing::TestWithParam<FrameworkRuleCase> {};

// Multi-token prediction over pipeline stages trains in the executor (the last stage keeps a
// copy of the embedding).
TEST(FrameworkRules, ExecutorTakesMultiTokenPredictionOverStages) {
  Scenario s = rules_base();
  s.target = test::framework_rules("moeplan");
  s.model.mtp_layers = 1;
  s.parallel.pipeline_parallel_degree = 2;
  s.parallel.hybrid_shard_degree = 4;
  s.parallel.gradient_accumulation_steps = 256;
  EXPECT_EQ(violated_rules(s.config()), RuleMask{0}) << describe_violations(validate(s.config()));
}

// GPT-OSS's pattern of attention, the window on every other block, trains in the executor: the
// moeplan target takes it (its sinks stay refused, above).
TEST(FrameworkRules, ExecutorTakesAWindowOnSomeBlocks) {
  Scenario s = rules_base();
  s.target = test::framework_rules("moeplan");
  s.model.sliding_window = 128;
  s.model.full_attention_step = 2;
  EXPECT_EQ(violated_rules(s.config()), RuleMask{0}) << describe_violations(validate(s.config()));
}

TEST_P(FrameworkRule, BreaksExactlyItsRule) {
  const FrameworkRuleCase& c = GetParam();
  Scenario s = rules_base();
  c.change(s);
  ASSERT_NE(s.target, nullptr);
  const std::vector<Violation> violations = validate(s.config());
  ASSERT_EQ(violations.size(), 1u) << describe_violations(violations);
  const Violation& v = violations.front();
  EXPECT_EQ(v.name, c.rule);
  EXPECT_EQ(rule_name(v.rule, s.target), c.rule);
  EXPECT_GE(static_cast<int>(v.rule), kRuleCount);  // a target rule, after the core ones
  EXPECT_EQ(v.field, c.field);
  EXPECT_EQ(v.message, c.message);
  EXPECT_NE(v.message.find(c.bad_value), std::string::npos) << v.message;
  EXPECT_EQ(violated_rules(s.config()), rule_bit(v.rule));
  // Without the framework's rules the same configuration is valid.
  s.target = nullptr;
  EXPECT_EQ(violated_rules(s.config()), RuleMask{0}) << describe_violations(validate(s.config()));
}

INSTANTIATE_TEST_SUITE_P(Frameworks, FrameworkRule, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<FrameworkRuleCase>& param) {
                           return std::string(param.param.name);
                         });

// Every rule of every framework has a one-fault case above, and its names are snake case and
// unique within it.
TEST(FrameworkRules, EveryRuleHasAOneFaultCase) {
  for (const Framework* f : all_frameworks()) {
    SCOPED_TRACE(std::string(f->name));
    ASSERT_NE(f->target, nullptr);
    ASSERT_NE(f->target->check, nullptr);
    ASSERT_LE(f->target->names.size(), static_cast<size_t>(kMaxTargetRules));
    std::set<std::string_view> names(f->target->names.begin(), f->target->names.end());
    EXPECT_EQ(names.size(), f->target->names.size());
    for (const std::string_view name : f->target->names) {
      EXPECT_EQ(name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string_view::npos) << name;
      bool covered = false;
      for (const FrameworkRuleCase& c : kCases) {
        Scenario s = rules_base();
        c.change(s);
        covered |= s.target == f->target && c.rule == name;
      }
      EXPECT_TRUE(covered) << name << " has no one-fault case";
    }
  }
  EXPECT_EQ(rule_name(target_rule(0), nullptr), "");  // a target rule without its framework has no name
}

}  // namespace
}  // namespace moeplan
