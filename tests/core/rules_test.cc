#include "moeplan/core/rules.h"

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moeplan/planner/search.h"
#include "rule_cases.h"
#include "test_support.h"

namespace moeplan {
namespace {

using test::Scenario;
using test::rules_base;
using test::describe_violations;

TEST(Rules, BaseIsValid) {
  const Scenario s = rules_base();
  ASSERT_EQ(s.cluster.world_size(), 16);
  ASSERT_EQ(s.parallel.replica_degree(), 1);
  const std::vector<Violation> violations = validate(s.config());
  EXPECT_TRUE(violations.empty()) << describe_violations(violations);
  EXPECT_EQ(violated_rules(s.config()), RuleMask{0});
  EXPECT_TRUE(validate_model(s.model).empty());
}

// One fault each. `change` breaks exactly one rule of the base; where that rule can only be
// reached by moving a second field (offloading is off in the base, the global batch is tied
// to mbs and seq_len), the second field is moved to where it is valid on its own.
struct RuleCase {
  const char* name;
  std::function<void(Scenario&)> change;
  Rule rule;
  const char* field;
  const char* message;    // exact text of the violation
  const char* bad_value;  // the value the change introduced, as the message must show it
};

const RuleCase kCases[] = {
    {"KvHeadsDoNotDivideHeads", [](Scenario& s) { s.model.num_key_value_heads = 5; },
     Rule::kKvHeadsDivideHeads, "model.num_key_value_heads",
     "= 5 does not divide num_attention_heads = 32", "5"},
    {"ZeroKvHeads", [](Scenario& s) { s.model.num_key_value_heads = 0; },
     Rule::kKvHeadsDivideHeads, "model.num_key_value_heads",
     "= 0 does not divide num_attention_heads = 32", "0"},
    {"OddHeadDim", [](Scenario& s) { s.model.head_dim = 127; },
     Rule::kHeadDimEven, "model.head_dim",
     "= 127 is odd; rotary embeddings rotate pairs of dimensions", "127"},
    // 2 x 32000 x 4096 + 1e6 x (4 x 4096 x 4096 + 8 x 3 x 4096 x 14336)
    //   = 262,144,000 + 1e6 x 1,476,395,008 = 1,476,395,270,144,000 > 1e15.
    {"MillionLayersIsTooBig", [](Scenario& s) { s.model.num_layers = 1'000'000; },
     Rule::kModelSize, "model.num_layers",
     "and the other sizes give about 1476395270144000 parameters, over the supported 1000000000000000",
     "1476395270144000"},
    {"DenseBlocksWithoutTheirWidth", [](Scenario& s) { s.model.first_dense_layers = 1; },
     Rule::kMoeLayerPattern, "model.dense_intermediate_size",
     "must give the width of the dense blocks' feed-forward layer", "width"},
    {"EveryBlockDense",
     [](Scenario& s) {
       s.model.first_dense_layers = 32;
       s.model.dense_intermediate_size = 14336;
     },
     Rule::kMoeLayerPattern, "model.first_dense_layers",
     "= 32 with moe_layer_step = 1 leaves no MoE block among num_layers = 32", "= 32"},
    {"OffsetPastTheStep", [](Scenario& s) { s.model.moe_layer_offset = 2; },
     Rule::kMoeLayerPattern, "model.moe_layer_offset", "= 2 must lie in [0, moe_layer_step = 1)", "= 2"},
    {"QueryLatentWithoutKeyValueLatent", [](Scenario& s) { s.model.q_lora_rank = 1536; },
     Rule::kLatentAttentionShape, "model.q_lora_rank",
     "= 1536 without kv_lora_rank: latent attention's widths need its key-value latent", "1536"},
    {"LatentAttentionWithGroupedKeys",
     [](Scenario& s) {
       s.model.kv_lora_rank = 512;
       s.model.qk_rope_head_dim = 64;
       s.model.v_head_dim = 128;
     },
     Rule::kLatentAttentionShape, "model.num_key_value_heads",
     "= 8: latent attention makes a key and a value for every head (num_attention_heads = 32)", "= 8"},
    {"LatentAttentionWithQkNorms",
     [](Scenario& s) {
       s.model.num_key_value_heads = 32;
       s.model.kv_lora_rank = 512;
       s.model.qk_rope_head_dim = 64;
       s.model.v_head_dim = 128;
       s.model.qk_norm = true;
     },
     Rule::kLatentAttentionShape, "model.qk_norm",
     "= true with latent attention, which norms its latents and has no projection biases", "= true"},
    {"MultiTokenPredictionAfterADenseBlock",
     [](Scenario& s) {
       s.model.moe_layer_step = 2;  // blocks 0, 2, ..., 30 have experts; block 31 is dense
       s.model.dense_intermediate_size = 14336;
       s.model.mtp_layers = 1;
     },
     Rule::kMoeLayerPattern, "model.mtp_layers",
     "= 1 after a dense last block: a multi-token prediction block is of the last block's kind, and only MoE ones are "
     "modelled",
     "= 1"},
    {"FullAttentionStepWithoutAWindow", [](Scenario& s) { s.model.full_attention_step = 2; },
     Rule::kBlockVariants, "model.full_attention_step", "= 2 without sliding_window: the other blocks need a window",
     "= 2"},
    {"ClampedGateOnAGeluLayer",
     [](Scenario& s) {
       s.model.mlp = Mlp::kGelu;
       s.model.glu_limit = 7;
     },
     Rule::kBlockVariants, "model.glu_limit",
     "= 7 with mlp = \"gelu\": the clamped gate is a gated (SwiGLU-shaped) layer", "= 7"},
    // The base recomputes whole blocks, their exchanges too: Megatron-Core's merged 1F1B does not.
    {"OverlappedExchangesRecomputed", [](Scenario& s) { s.moe.overlap_exchange = true; },
     Rule::kExchangeOverlapSchedule, "moe.overlap_exchange",
     "= true needs activation_checkpointing that keeps the MoE sub-block (Megatron-Core's merged 1F1B schedule)",
     "= true"},
    {"LatentUpWithoutLatentAttention",
     [](Scenario& s) { s.parallel.activation_checkpointing = Checkpointing::kLatentUpProjections; },
     Rule::kLatentUpNeedsLatentAttention, "parallel.activation_checkpointing",
     "= \"latent_up\" with a model without latent attention (kv_lora_rank = 0): it recomputes latent attention's up "
     "projections",
     "latent_up"},
    // Parallel folding, from the base's E2 S8 with T = 4 (readers 4, ga 512): ETP strictly
    // between 1 and T, a fold that does not divide E, and E not directly outside T.
    {"ExpertTensorSplitBetweenOneAndT",
     [](Scenario& s) {
       s.parallel.tensor_parallel_degree = 4;
       s.parallel.sequence_parallel = true;
       s.parallel.expert_parallel_degree = 4;
       s.parallel.expert_tensor_parallel_degree = 2;
       s.parallel.hybrid_shard_degree = 2;
       s.parallel.gradient_accumulation_steps = 512;
     },
     Rule::kExpertTensorFolds, "parallel.expert_tensor_parallel_degree",
     "= 2 with tensor_parallel_degree = 4: moeplan splits routed experts over all T ranks or over none (1, every "
     "tensor rank folded into the expert group)",
     "= 2"},
    {"FoldedTensorRanksDoNotDivideTheExpertGroup",
     [](Scenario& s) {
       s.parallel.tensor_parallel_degree = 4;
       s.parallel.sequence_parallel = true;
       s.parallel.expert_tensor_parallel_degree = 1;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 512;
     },
     Rule::kExpertTensorFolds, "parallel.expert_parallel_degree",
     "= 2 with expert_tensor_parallel_degree = 1: the expert group takes all 4 tensor-parallel ranks, so "
     "tensor_parallel_degree = 4 must divide it",
     "= 2"},
    {"FoldedExpertsAwayFromTheTensorRanks",
     [](Scenario& s) {
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.expert_tensor_parallel_degree = 1;
       s.parallel.placement = *Placement::parse("ERS");
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kExpertTensorFolds, "parallel.placement",
     "= \"ERS\" with expert_tensor_parallel_degree = 1: the expert group folds the tensor-parallel ranks in, so E must "
     "come directly outside T (as in \"PRSET\")",
     "ERS"},
    // Context parallelism: the expert group spans the C ranks (Megatron-Core, torchtitan).
    {"ExpertGroupNarrowerThanTheContextRanks",
     [](Scenario& s) {
       s.parallel.context_parallel_degree = 4;
       s.parallel.gradient_accumulation_steps = 512;
     },
     Rule::kExpertSpansContext, "parallel.expert_parallel_degree",
     "= 2 with context_parallel_degree = 4: the expert group spans the context-parallel ranks, so 4 must divide it",
     "= 2"},
    {"ExpertsAwayFromTheContextRanks",
     [](Scenario& s) {
       s.parallel.context_parallel_degree = 2;
       s.parallel.placement = *Placement::parse("ERS");
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kExpertSpansContext, "parallel.placement",
     "= \"ERS\" with context_parallel_degree = 2: the expert group spans the context-parallel ranks (directly "
     "outside T), so E must come directly outside T (as in \"PRSET\")",
     "ERS"},
    {"SequenceNotInTwoChunksPerContextRank",
     [](Scenario& s) {
       s.parallel.context_parallel_degree = 2;
       s.training.seq_len = 2050;
       s.training.global_batch_tokens = 8 * 128 * 2050;
     },
     Rule::kContextSplitsSequence, "parallel.context_parallel_degree",
     "= 2: seq_len = 2050 must split into 2 x 2 equal chunks", "2050"},
    {"ContextParallelismWithUnfusedAttention",
     [](Scenario& s) {
       s.parallel.context_parallel_degree = 2;
       s.parallel.gradient_accumulation_steps = 256;
       s.cluster.attention = AttentionKernel::kUnfused;
     },
     Rule::kContextNeedsFlashAttention, "parallel.context_parallel_degree",
     "= 2 on a cluster whose attention is unfused: context parallelism runs flash attention on each chunk of keys and "
     "values as it arrives",
     "= 2"},
    // DeepEP across nodes needs GPU-initiated RDMA, which EFA (p4d) does not offer: E2 outermost
    // pairs ranks 8 apart, on the two nodes.
    {"DeepEpAcrossEfa",
     [](Scenario& s) {
       s.moe.dispatcher = Dispatcher::kDeepEp;
       s.parallel.placement = *Placement::parse("ESR");
     },
     Rule::kDeepEpLayout, "moe.dispatcher",
     "= \"deepep\" with an expert group across nodes of p4d.24xlarge (EFA): DeepEP across nodes needs a network that "
     "lets GPUs post RDMA themselves (InfiniBand or RoCE)",
     "deepep"},
    // Padding to a capacity that is not set.
    {"PaddingWithoutCapacity", [](Scenario& s) { s.moe.pad_to_capacity = true; }, Rule::kCapacityNeedsFactor,
     "moe.pad_to_capacity", "= true needs moe.capacity_factor > 0 (without it no token is dropped)", "capacity"},
    // DeepEP sizes its buffers from a table of group sizes: 12 experts over the 12 ranks of a
    // node (two nodes of 12, E12 S2) is not among them.
    {"DeepEpGroupSizeOutsideItsTable",
     [](Scenario& s) {
       s.moe.dispatcher = Dispatcher::kDeepEp;
       s.model.num_experts = 12;
       s.cluster.gpus_per_node = 12;
       s.parallel.world_size = 24;
       s.parallel.expert_parallel_degree = 12;
       s.parallel.hybrid_shard_degree = 2;
       s.training.global_batch_tokens = 24 * 128 * 2048;
     },
     Rule::kDeepEpLayout, "moe.dispatcher",
     "= \"deepep\" with an expert group of 12 ranks: DeepEP runs groups of 2, 4, 8, 16, 24, 32, 64, 128, 144 or 160",
     "deepep"},
    // 24 ranks on two nodes of 12, E8 S3: expert groups 0-7 and 16-23 inside a node, 8-15 four
    // ranks on each (the shard groups differ too, because of them: the innermost is named).
    {"ExpertGroupsStraddleNodesUnevenly",
     [](Scenario& s) {
       s.cluster.gpus_per_node = 12;
       s.parallel.world_size = 24;
       s.parallel.expert_parallel_degree = 8;
       s.parallel.hybrid_shard_degree = 3;
       s.training.global_batch_tokens = 24 * 128 * 2048;
     },
     Rule::kGroupsShareOneShape, "parallel.expert_parallel_degree",
     "= 8: groups of ranks 1 apart fall on nodes of 12 GPUs in different shapes (not every group has as many ranks on "
     "each node), which moeplan would cost as one",
     "= 8"},
    {"RouterGroupsSplitAnExpert", [](Scenario& s) { s.model.router_groups = 3; },
     Rule::kRouterGroups, "model.router_groups", "= 3 does not divide num_experts = 8", "= 3"},
    {"ClusterOfOneNode", [](Scenario& s) { s.cluster.num_nodes = 1; },
     Rule::kWorldSizeFitsCluster, "parallel.world_size",
     "= 16 exceeds the cluster's 1 x 8 GPUs", "1 x 8"},
    {"NodesOfFourGpus", [](Scenario& s) { s.cluster.gpus_per_node = 4; },
     Rule::kWorldSizeFitsCluster, "parallel.world_size",
     "= 16 exceeds the cluster's 2 x 4 GPUs", "2 x 4"},
    {"ThirdNodeIdle", [](Scenario& s) { s.cluster.num_nodes = 3; },
     Rule::kWholeNodes, "parallel.world_size",
     "= 16 leaves GPUs of a 3-node cluster idle; use whole nodes (a multiple of 8)", "3-node"},
    {"SevenExperts", [](Scenario& s) { s.model.num_experts = 7; },
     Rule::kExpertDegreeDividesExperts, "parallel.expert_parallel_degree",
     "= 2 does not divide num_experts = 7", "7"},
    {"UnresolvedShardDegree", [](Scenario& s) { s.parallel.hybrid_shard_degree = 0; },
     Rule::kShardDegreeResolved, "parallel.hybrid_shard_degree",
     "= 0 must be a resolved degree of at least 1 (0, full sharding, is written as "
     "world_size / expert_parallel_degree)",
     "= 0"},
    {"NegativeShardDegree", [](Scenario& s) { s.parallel.hybrid_shard_degree = -1; },
     Rule::kShardDegreeResolved, "parallel.hybrid_shard_degree",
     "= -1 must be a resolved degree of at least 1 (0, full sharding, is written as "
     "world_size / expert_parallel_degree)",
     "-1"},
    {"ShardThree", [](Scenario& s) { s.parallel.hybrid_shard_degree = 3; },
     Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree",
     "= 3 times expert_parallel_degree = 2 does not divide world_size = 16", "3"},
    {"ShardTimesExpertsOverWorld", [](Scenario& s) { s.parallel.hybrid_shard_degree = 16; },
     Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree",
     "= 16 times expert_parallel_degree = 2 does not divide world_size = 16", "16"},
    // Tensor and pipeline parallelism: T = 2 (or P = 2) over S = 4 keeps S x E x T x P = 16;
    // only 8 ranks then read data, so the batch takes 256 micro-batches.
    {"TensorDoesNotDivideKvHeads",
     [](Scenario& s) {
       s.model.num_key_value_heads = 1;
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kTensorDividesHeads, "parallel.tensor_parallel_degree",
     "= 2 must be at least 1 and divide num_key_value_heads = 1 (and num_attention_heads = 32)", "1"},
    {"TensorParallelZero", [](Scenario& s) { s.parallel.tensor_parallel_degree = 0; },
     Rule::kTensorDividesHeads, "parallel.tensor_parallel_degree",
     "= 0 must be at least 1 and divide num_key_value_heads = 8 (and num_attention_heads = 32)", "0"},
    {"TensorDoesNotDivideIntermediate",
     [](Scenario& s) {
       s.model.intermediate_size = 14335;
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kTensorDividesIntermediate, "parallel.tensor_parallel_degree",
     "= 2 does not divide intermediate_size = 14335", "14335"},
    {"TensorDoesNotDivideTheSharedExperts",
     [](Scenario& s) {
       s.model.shared_expert_intermediate_size = 5631;
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kTensorDividesIntermediate, "parallel.tensor_parallel_degree",
     "= 2 does not divide shared_expert_intermediate_size = 5631", "5631"},
    {"SequenceParallelWithoutTensor", [](Scenario& s) { s.parallel.sequence_parallel = true; },
     Rule::kSequenceParallelNeedsTensor, "parallel.sequence_parallel",
     "= true needs tensor_parallel_degree > 1 (it splits along the sequence over the tensor-parallel ranks)",
     "true"},
    {"ExpertsUnderTensorWithoutSequenceParallel",
     [](Scenario& s) {
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kExpertTensorNeedsSequenceParallel, "parallel.sequence_parallel",
     "= false with tensor_parallel_degree = 2 and an MoE model: the tokens are routed per rank, so sequence "
     "parallelism is needed",
     "false"},
    {"PipelineDoesNotDivideLayers",
     [](Scenario& s) {
       s.model.num_layers = 31;
       s.parallel.pipeline_parallel_degree = 2;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kPipelineDividesLayers, "parallel.pipeline_parallel_degree",
     "= 2 must be at least 1 and divide num_layers = 31 (equal stages; first_stage_layers and last_stage_layers set "
     "uneven ends)",
     "31"},
    {"UnevenEndsLeaveAnUnequalMiddle",
     [](Scenario& s) {
       s.parallel.pipeline_parallel_degree = 4;
       s.parallel.first_stage_layers = 7;
       s.parallel.last_stage_layers = 6;
       s.parallel.hybrid_shard_degree = 2;
       s.parallel.gradient_accumulation_steps = 512;
     },
     Rule::kPipelineDividesLayers, "parallel.first_stage_layers",
     "= 7: with first_stage_layers = 7 and last_stage_layers = 6 the other 2 of pipeline_parallel_degree = 4 stages "
     "must share the rest of num_layers = 32 equally, each at least one block",
     "= 7"},
    {"VirtualStagesDoNotDivideTheStage",
     [](Scenario& s) {
       s.parallel.pipeline_parallel_degree = 2;
       s.parallel.virtual_pipeline_degree = 3;
       s.parallel.hybrid_shard_degree = 4;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kVirtualStagesFitThePipeline, "parallel.virtual_pipeline_degree",
     "= 3 must be at least 1 and divide the blocks of a stage (num_layers = 32 / pipeline_parallel_degree = 2), "
     "with gradient_accumulation_steps = 256 a multiple of pipeline_parallel_degree",
     "3"},
    {"VirtualStagesWithoutAPipeline", [](Scenario& s) { s.parallel.virtual_pipeline_degree = 2; },
     Rule::kVirtualStagesFitThePipeline, "parallel.virtual_pipeline_degree",
     "= 2 needs pipeline_parallel_degree > 1 (it splits pipeline stages into chunks)",
     "2"},
    {"PipelineParallelZero", [](Scenario& s) { s.parallel.pipeline_parallel_degree = 0; },
     Rule::kPipelineDividesLayers, "parallel.pipeline_parallel_degree",
     "= 0 must be at least 1 and divide num_layers = 32 (equal stages; first_stage_layers and last_stage_layers set "
     "uneven ends)",
     "0"},
    {"ShardTimesTensorOverWorld",
     [](Scenario& s) {
       s.parallel.tensor_parallel_degree = 2;
       s.parallel.sequence_parallel = true;
       s.parallel.gradient_accumulation_steps = 256;
     },
     Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree",
     "= 8 times expert_parallel_degree = 2, tensor_parallel_degree = 2 does not divide world_size = 16", "8"},
    {"ShortPositionTable", [](Scenario& s) { s.model.max_position_embeddings = 1024; },
     Rule::kSeqLenWithinPositions, "training.seq_len",
     "= 2048 exceeds the model's max_position_embeddings = 1024", "1024"},
    // 8193 x 2048 = 16,779,264 > 16,777,216 tokens; the global batch follows (16 x 8193 x 128 x
    // 2048) so that only the micro-batch rule breaks.
    {"MicroBatchOverSixteenMiTokens",
     [](Scenario& s) {
       s.parallel.micro_batch_size = 8193;
       s.training.global_batch_tokens = int64_t{16} * 8193 * 128 * 2048;
     },
     Rule::kMicroBatchTokens, "parallel.micro_batch_size",
     "= 8193 times seq_len = 2048 exceeds the supported 16777216 tokens per micro-batch", "8193"},
    {"GlobalBatchOffByOne", [](Scenario& s) { s.training.global_batch_tokens = 4'194'305; },
     Rule::kGlobalBatchMatches, "training.global_batch_tokens",
     "= 4194305 does not equal world_size x micro_batch_size x gradient_accumulation_steps x "
     "seq_len = 16 x 1 x 128 x 2048 = 4194304",
     "4194305"},
    {"HalfTheAccumulation", [](Scenario& s) { s.parallel.gradient_accumulation_steps = 64; },
     Rule::kGlobalBatchMatches, "training.global_batch_tokens",
     "= 4194304 does not equal world_size x micro_batch_size x gradient_accumulation_steps x "
     "seq_len = 16 x 1 x 64 x 2048 = 2097152",
     "x 64 x"},
    {"DoubleSequence", [](Scenario& s) { s.training.seq_len = 4096; },
     Rule::kGlobalBatchMatches, "training.global_batch_tokens",
     "= 4194304 does not equal world_size x micro_batch_size x gradient_accumulation_steps x "
     "seq_len = 16 x 1 x 128 x 4096 = 8388608",
     "4096"},
    {"OffloadWithoutCheckpointing",
     [](Scenario& s) {
       s.parallel.activation_offloading = true;
       s.parallel.activation_checkpointing = Checkpointing::kNone;
     },
     Rule::kOffloadNeedsCheckpointing, "parallel.activation_offloading",
     "= true needs activation_checkpointing full or selective (only checkpointed block inputs are offloaded)",
     "= true"},
    {"Fp8OnAnA100", [](Scenario& s) { s.training.fp8 = true; }, Rule::kFp8NeedsHardware, "training.fp8",
     "= true needs FP8 tensor cores; the cluster's A100-SXM4-40GB has none (gpu.peak_fp8_flops)", "= true"},
    {"OffloadHorizonZero",
     [](Scenario& s) {
       s.parallel.activation_offloading = true;
       s.parallel.activation_loading_horizon = 0;
     },
     Rule::kHorizonPositive, "parallel.activation_loading_horizon",
     "= 0 must be at least 1 with offloading", "= 0"},
    {"OffloadHorizonNegative",
     [](Scenario& s) {
       s.parallel.activation_offloading = true;
       s.parallel.activation_loading_horizon = -3;
     },
     Rule::kHorizonPositive, "parallel.activation_loading_horizon",
     "= -3 must be at least 1 with offloading", "-3"},
    {"OffloadHorizonPastLastLayer",
     [](Scenario& s) {
       s.parallel.activation_offloading = true;
       s.parallel.activation_loading_horizon = 33;
     },
     Rule::kHorizonWithinLayers, "parallel.activation_loading_horizon",
     "= 33 exceeds num_layers = 32", "33"},
    // The busiest expert takes at most num_experts / top_k = 8 / 2 = 4 times the mean.
    {"ImbalanceOverFour", [](Scenario& s) { s.moe.expert_load_imbalance = 4.5; },
     Rule::kLoadImbalanceRange, "moe.expert_load_imbalance",
     "= 4.5 must be in [1, num_experts / experts_per_token] = [1, 4]", "4.5"},
    {"ImbalanceUnderOne", [](Scenario& s) { s.moe.expert_load_imbalance = 0.5; },
     Rule::kLoadImbalanceRange, "moe.expert_load_imbalance",
     "= 0.5 must be in [1, num_experts / experts_per_token] = [1, 4]", "0.5"},
    {"ShuffleWithoutExpertParallelism",
     [](Scenario& s) {
       s.moe.global_token_shuffle = true;
       s.parallel.expert_parallel_degree = 1;
     },
     Rule::kTokenShuffleNeedsExperts, "moe.global_token_shuffle",
     "= true needs expert_parallel_degree > 1 (it shuffles tokens across the expert-parallel group)",
     "= true"},
    {"TokenCountsForTooFewExperts", [](Scenario& s) { s.moe.tokens_per_expert = {1, 1, 1, 1, 1, 1, 1}; },
     Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert", "has 7 counts for num_experts = 8", "7"},
    // Top-2 routing gives no expert more than half the slots: 9 of 17 is impossible.
    {"TokenCountsAboveOneOverTopK", [](Scenario& s) { s.moe.tokens_per_expert = {9, 1, 1, 1, 1, 1, 1, 2}; },
     Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert",
     "must have a positive total and no expert above 1/experts_per_token of it (total 17, largest 9)", "9"},
    {"MinLearningRateAboveLearningRate", [](Scenario& s) { s.training.min_learning_rate = 1e-3; },
     Rule::kMinLrWithinLr, "training.min_learning_rate",
     "= 0.001 exceeds learning_rate = 0.0001", "0.001"},
    {"WarmupLongerThanRun", [](Scenario& s) { s.training.warmup_steps = 101; },
     Rule::kWarmupWithinSteps, "training.warmup_steps",
     "= 101 exceeds steps = 100", "101"},
};

class OneFault : public testing::TestWithParam<RuleCase> {};

TEST_P(OneFault, BreaksExactlyItsRule) {
  const RuleCase& c = GetParam();
  Scenario s = rules_base();
  c.change(s);
  const std::vector<Violation> violations = validate(s.config());
  ASSERT_EQ(violations.size(), 1u) << describe_violations(violations);
  const Violation& v = violations.front();
  EXPECT_EQ(v.rule, c.rule) << "got " << rule_name(v.rule) << ", expected " << rule_name(c.rule);
  EXPECT_EQ(v.name, rule_name(c.rule));
  EXPECT_EQ(v.field, c.field);
  EXPECT_EQ(v.message, c.message);
  EXPECT_NE(v.message.find(c.bad_value), std::string::npos) << v.message;
  EXPECT_EQ(violated_rules(s.config()), rule_bit(c.rule));
}

INSTANTIATE_TEST_SUITE_P(Rules, OneFault, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<RuleCase>& param) { return std::string(param.param.name); });

// Two rules cannot break alone. top-k > num_experts empties the imbalance range [1, n/k];
// E not dividing W means S x E cannot divide W either (and S < 1 is its own rule). Every other
// rule has a single-fault case above.
TEST(Rules, EveryRuleThatCanBreakAloneHasAOneFaultCase) {
  std::set<Rule> covered;
  for (const RuleCase& c : kCases) covered.insert(c.rule);
  for (int r = 0; r < kRuleCount; ++r) {
    const auto rule = static_cast<Rule>(r);
    if (rule == Rule::kTopKWithinExperts || rule == Rule::kExpertDegreeDividesWorld) continue;
    EXPECT_TRUE(covered.contains(rule)) << rule_name(rule) << " has no one-fault case";
  }
  EXPECT_EQ(covered.size(), static_cast<size_t>(kRuleCount - 2));
  EXPECT_GE(std::size(kCases), 20u);
}

TEST(Rules, TopKOverExpertsAlsoEmptiesTheImbalanceRange) {
  Scenario s = rules_base();
  s.model.experts_per_token = 9;
  const std::vector<Violation> model_only = validate_model(s.model);
  ASSERT_EQ(model_only.size(), 1u) << describe_violations(model_only);
  EXPECT_EQ(model_only[0].rule, Rule::kTopKWithinExperts);
  EXPECT_EQ(model_only[0].field, "experts_per_token");  // no "model." prefix outside a run config
  EXPECT_EQ(model_only[0].message, "= 9 exceeds num_experts = 8");

  const std::vector<Violation> all = validate(s.config());
  ASSERT_EQ(all.size(), 2u) << describe_violations(all);
  EXPECT_EQ(all[0].rule, Rule::kTopKWithinExperts);
  EXPECT_EQ(all[0].field, "model.experts_per_token");
  EXPECT_EQ(all[1].rule, Rule::kLoadImbalanceRange);
  // 8 / 9 = 0.888889 (std::to_string keeps six decimals).
  EXPECT_EQ(all[1].message, "= 1 must be in [1, num_experts / experts_per_token] = [1, 0.888889]");
  EXPECT_EQ(violated_rules(s.config()), rule_bit(Rule::kTopKWithinExperts) | rule_bit(Rule::kLoadImbalanceRange));
}

TEST(Rules, ExpertDegreeNotDividingWorldAlsoBreaksShardTimesExpert) {
  Scenario s = rules_base();
  s.model.num_experts = 24;  // so that E = 3 divides the experts
  s.parallel.expert_parallel_degree = 3;
  const std::vector<Violation> all = validate(s.config());
  ASSERT_EQ(all.size(), 2u) << describe_violations(all);
  EXPECT_EQ(all[0].rule, Rule::kExpertDegreeDividesWorld);
  EXPECT_EQ(all[0].field, "parallel.expert_parallel_degree");
  EXPECT_EQ(all[0].message, "= 3 does not divide world_size = 16");
  EXPECT_EQ(all[1].rule, Rule::kShardExpertDividesWorld);
  EXPECT_EQ(all[1].message, "= 8 times expert_parallel_degree = 3 does not divide world_size = 16");
  EXPECT_EQ(violated_rules(s.config()),
            rule_bit(Rule::kExpertDegreeDividesWorld) | rule_bit(Rule::kShardExpertDividesWorld));
}

TEST(Rules, ZeroExpertDegreeDividesNothing) {
  Scenario s = rules_base();
  s.parallel.expert_parallel_degree = 0;
  const std::vector<Violation> all = validate(s.config());
  ASSERT_EQ(all.size(), 2u) << describe_violations(all);
  EXPECT_EQ(all[0].rule, Rule::kExpertDegreeDividesExperts);
  EXPECT_EQ(all[0].message, "= 0 does not divide num_experts = 8");
  EXPECT_EQ(all[1].rule, Rule::kExpertDegreeDividesWorld);
  EXPECT_EQ(all[1].message, "= 0 does not divide world_size = 16");
  EXPECT_EQ(violated_rules(s.config()),
            rule_bit(Rule::kExpertDegreeDividesExperts) | rule_bit(Rule::kExpertDegreeDividesWorld));
}

TEST(Rules, SeveralFaultsAreAllReportedInRuleOrder) {
  Scenario s = rules_base();
  s.model.num_key_value_heads = 5;
  s.parallel.expert_parallel_degree = 3;  // divides neither 8 experts nor 16 ranks, nor does 8 x 3
  s.parallel.sequence_parallel = true;  // without tensor parallelism
  s.parallel.activation_offloading = true;
  s.parallel.activation_checkpointing = Checkpointing::kNone;
  s.training.warmup_steps = 200;
  const std::vector<Violation> all = validate(s.config());
  const std::vector<std::pair<Rule, std::string>> expected = {
      {Rule::kKvHeadsDivideHeads, "model.num_key_value_heads"},
      {Rule::kExpertDegreeDividesExperts, "parallel.expert_parallel_degree"},
      {Rule::kExpertDegreeDividesWorld, "parallel.expert_parallel_degree"},
      {Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree"},
      {Rule::kSequenceParallelNeedsTensor, "parallel.sequence_parallel"},
      {Rule::kOffloadNeedsCheckpointing, "parallel.activation_offloading"},
      {Rule::kWarmupWithinSteps, "training.warmup_steps"},
  };
  ASSERT_EQ(all.size(), expected.size()) << describe_violations(all);
  RuleMask mask = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(all[i].rule, expected[i].first) << i << ": " << rule_name(all[i].rule);
    EXPECT_EQ(all[i].field, expected[i].second) << i;
    mask |= rule_bit(expected[i].first);
  }
  EXPECT_EQ(all[1].message, "= 3 does not divide num_experts = 8");
  EXPECT_EQ(all[6].message, "= 200 exceeds steps = 100");
  EXPECT_EQ(violated_rules(s.config()), mask);
}

// Changes that look risky but keep the configuration valid: the rules must not fire.
TEST(Rules, ValidVariantsOfTheBaseStayValid) {
  const std::vector<std::pair<const char*, std::function<void(Scenario&)>>> variants = {
      {"offload with horizon 32", [](Scenario& s) {
         s.parallel.activation_offloading = true;
         s.parallel.activation_loading_horizon = 32;
       }},
      {"E8 S2 ESR", [](Scenario& s) {
         s.parallel.expert_parallel_degree = 8;
         s.parallel.hybrid_shard_degree = 2;
         s.parallel.placement = *Placement::parse("ESR");
       }},
      {"E1 S1 R16", [](Scenario& s) {
         s.parallel.expert_parallel_degree = 1;
         s.parallel.hybrid_shard_degree = 1;
       }},
      {"E4 over two data-parallel ranks and the two tensor ranks (ETP 1)", [](Scenario& s) {
         s.parallel.tensor_parallel_degree = 2;
         s.parallel.sequence_parallel = true;
         s.parallel.expert_parallel_degree = 4;
         s.parallel.expert_tensor_parallel_degree = 1;
         s.parallel.hybrid_shard_degree = 4;
         s.parallel.gradient_accumulation_steps = 256;
       }},
      {"horizon 0 without offloading", [](Scenario& s) { s.parallel.activation_loading_horizon = 0; }},
      {"imbalance at its maximum 4", [](Scenario& s) { s.moe.expert_load_imbalance = 4.0; }},
      {"shuffle with E = 2", [](Scenario& s) { s.moe.global_token_shuffle = true; }},
      {"min lr equal to lr", [](Scenario& s) { s.training.min_learning_rate = s.training.learning_rate; }},
      {"warmup equal to steps", [](Scenario& s) { s.training.warmup_steps = s.training.steps; }},
      {"seq_len at the position limit", [](Scenario& s) {
         s.training.seq_len = 32768;
         s.parallel.gradient_accumulation_steps = 8;  // 16 x 1 x 8 x 32768 = 4,194,304
       }},
      {"16 Mi tokens per micro-batch exactly", [](Scenario& s) {
         s.parallel.micro_batch_size = 8192;
         s.training.global_batch_tokens = int64_t{16} * 8192 * 128 * 2048;
       }},
      {"world inside one node", [](Scenario& s) {
         s.cluster.num_nodes = 1;
         s.parallel.world_size = 8;
         s.parallel.hybrid_shard_degree = 4;
         s.training.global_batch_tokens = 8 * 128 * 2048;
       }},
  };
  for (const auto& [name, change] : variants) {
    Scenario s = rules_base();
    change(s);
    const std::vector<Violation> violations = validate(s.config());
    EXPECT_TRUE(violations.empty()) << name << ":" << describe_violations(violations);
    EXPECT_EQ(violated_rules(s.config()), RuleMask{0}) << name;
  }
}

TEST(Rules, NamesAreStableUniqueAndSnakeCase) {
  EXPECT_EQ(rule_name(Rule::kExpertDegreeDividesExperts), "expert_degree_divides_experts");
  EXPECT_EQ(rule_name(Rule::kShardExpertDividesWorld), "shard_expert_divides_world");
  EXPECT_EQ(rule_name(Rule::kWarmupWithinSteps), "warmup_within_steps");
  std::set<std::string_view> names;
  for (int r = 0; r < kRuleCount; ++r) {
    const std::string_view name = rule_name(static_cast<Rule>(r));
    EXPECT_FALSE(name.empty()) << r;
    EXPECT_EQ(name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string_view::npos) << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kRuleCount));
}

}  // namespace
}  // namespace moeplan
