#include "moeplan/planner/memory_model.h"

#include <gtest/gtest.h>

#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan::planner {
namespace {

const ModelSpec& mixtral() { return test::model("mixtral-8x7b"); }
ClusterSpec p4d_two_nodes() { return test::hardware("p4d.24xlarge", 16); }

struct Layout {
  ParallelConfig parallel;
  MoeConfig moe;
  TrainingConfig training;
  MemoryEstimate estimate() const { return estimate_memory({mixtral(), p4d_two_nodes(), parallel, moe, training}); }
};

Layout layout(int64_t e, int64_t s, Checkpointing ckpt, Precision precision = Precision::kBf16) {
  Layout x;
  x.parallel.world_size = 16;
  x.parallel.expert_parallel_degree = e;
  x.parallel.hybrid_shard_degree = s;
  x.parallel.activation_checkpointing = ckpt;
  x.parallel.micro_batch_size = 1;
  x.parallel.gradient_accumulation_steps = 128;
  x.training.seq_len = 2048;
  x.training.global_batch_tokens = 16 * 128 * 2048;
  x.training.precision = precision;
  return x;
}

// Flat parameters of Mixtral 8x7B (see model_spec_test for the counts): embedding
// 131,072,000; per block dense 41,984,000 (attention 41,943,040 + norms 8,192 + router 32,768)
// and experts (8/E) x 176,160,768; head 131,076,096 (final norm 4,096 + lm head). Each is
// padded to a multiple of S and split.

// E1 S16 R1: 8,192,000 + 32 x (2,624,000 + 88,080,384) + 8,192,256 = 2,918,924,544 params.
// bf16 model states: 2 (params) + 2 (grads) + 4 (two moments) = 8 bytes each.
TEST(MemoryModel, ModelStatesFullShardE1S16) {
  const MemoryEstimate m = layout(1, 16, Checkpointing::kFull).estimate();
  EXPECT_EQ(shard_sizes(mixtral(), 1, 16).shard_params, 2'918'924'544);
  EXPECT_EQ(m.parameters, 5'837'849'088);
  EXPECT_EQ(m.gradients, 5'837'849'088);
  EXPECT_EQ(m.optimizer_states, 11'675'698'176);
  EXPECT_EQ(m.master_weights, 0);
  EXPECT_EQ(m.model_states(), 23'351'396'352);
}

// E8 S2 R1: 65,536,000 + 32 x (20,992,000 + 88,080,384) + 65,538,048 = 3,621,390,336 params,
// x 8 bytes = 28,971,122,688.
TEST(MemoryModel, ModelStatesExpertParallelE8S2) {
  EXPECT_EQ(shard_sizes(mixtral(), 8, 2).shard_params, 3'621'390'336);
  EXPECT_EQ(layout(8, 2, Checkpointing::kFull).estimate().model_states(), 28'971'122'688);
}

// E2 S4 R2: 32,768,000 + 32 x (10,496,000 + 176,160,768) + 32,769,024 = 6,038,553,600 params,
// x 8 bytes = 48,308,428,800. Replicas do not change a rank's share.
TEST(MemoryModel, ModelStatesReplicatedE2S4R2) {
  EXPECT_EQ(shard_sizes(mixtral(), 2, 4).shard_params, 6'038'553'600);
  const Layout x = layout(2, 4, Checkpointing::kFull);
  EXPECT_EQ(x.parallel.replica_degree(), 2);
  EXPECT_EQ(x.estimate().model_states(), 48'308'428'800);
}

// Mixed precision, E8 S2: bf16 copy 2 + fp32 master 4 + fp32 grads 4 + fp32 moments 8 = 18 bytes
// per parameter: 3,621,390,336 x 18 = 65,185,026,048.
TEST(MemoryModel, ModelStatesMixedPrecision) {
  const MemoryEstimate m = layout(8, 2, Checkpointing::kFull, Precision::kMixed).estimate();
  EXPECT_EQ(m.master_weights, 14'485'561'344);
  EXPECT_EQ(m.model_states(), 65'185'026'048);
}

// Padding: with S = 3 the embedding 131,072,000 / 3 = 43,690,666.7 rounds up to 43,690,667.
TEST(MemoryModel, FlatParametersArePaddedToTheShardDegree) {
  const ShardSizes s = shard_sizes(mixtral(), 8, 3);
  // 43,690,667 + 32 x (13,994,667 + 58,720,256) + 43,692,032 = 2,414,260,235
  EXPECT_EQ(s.shard_params, 2'414'260'235);
}

// One block, one sequence of 2048 tokens, bf16 (2 bytes), top-2 of 8 experts, uniform routing
// (4096 token-expert slots):
//   block input   2048 x 4096 x 2                                       = 16,777,216
//   attention     2048 x (2x4096 + 2x4096 + 2x1024) x 2 + 2048 x 32 x 4 = 75,759,616
//   moe           2048 x 2x4096 x 2 + 2048 x 8 x 4 + 4096 x (4096 x 2 + 4) + 4096 x 3x14336 x 2
//                 = 33,554,432 + 65,536 + 33,570,816 + 352,321,536      = 419,512,320
// (per slot the expert's input and its fp32 routing weight, which scales the activation: the
// combine keeps no expert output)
TEST(MemoryModel, ActivationsPerBlock) {
  const BlockActivations b = block_activations(mixtral(), 1, 2048, 4096, 2);
  EXPECT_EQ(b.block_input, 16'777'216);
  EXPECT_EQ(b.attention, 75'759'616);
  EXPECT_EQ(b.moe, 419'512'320);
  EXPECT_EQ(b.full(), 495'271'936);
}

// The same block run by eager kernels, bf16, unfused attention:
//   RMSNorm: its input and an fp32 reciprocal per row           2048 x 4    =       8,192
//   probabilities, fp32 and bf16    1 x 32 x 2048 x 2048 x (4 + 2)          = 805,306,368
//   attention   2048 x (2x4096 + 4x4096) x 2 + 8,192 + 805,306,368          = 905,977,856
//   moe         2048 x 2x4096 x 2 + 8,192 + 2048 x 8 x 4
//               + 4096 x (4096 + 4x14336) x 2 + 2 x 2048 x 4096 x 2         = 570,499,072
// With scaled-dot-product (flash) attention, as moeplan's executor runs it: q, the kv-width k
// and v, the output and its o_proj copy, and the fp32 log-sum-exp per head and token:
//   2048 x 2x4096 x 2 + 8,192 + 2048 x (3x4096 + 2x1024) x 2 + 2048 x 32 x 4 =  92,545,024
TEST(MemoryModel, ActivationsPerBlockWithEagerKernels) {
  const BlockActivations b = block_activations(mixtral(), 1, 2048, 4096, 2, Kernels::kEager);
  EXPECT_EQ(b.block_input, 16'777'216);
  EXPECT_EQ(b.attention, 905'977'856);
  EXPECT_EQ(b.moe, 570'499'072);
  // In fp32 the probabilities are kept once: 2 micro-batch sequences of 1024 tokens,
  // 2 x 32 x 1024 x 1024 x 4 = 268,435,456.
  const BlockActivations fp32 = block_activations(mixtral(), 2, 1024, 4096, 4, Kernels::kEager);
  EXPECT_EQ(fp32.attention, 2048 * (2 * 4096 + 4 * 4096) * 4 + 2048 * 4 + 268'435'456);
  const BlockActivations flash =
      block_activations(mixtral(), 1, 2048, 4096, 2, Kernels::kEager, AttentionKernel::kFlash, TensorSplit{});
  EXPECT_EQ(flash.attention, 92'545'024);
  EXPECT_EQ(flash.moe, b.moe);
}

// A shared expert of Mixtral's width with a gate, and q/k norms, on the block above:
//   attention  + q and k's norm inputs   2048 x (4096 + 1024) x 2              =  20,971,520
//   moe        + 2048 x 14336 x (2 x 2 + 2)  (w1, w3 outputs, their product's
//                 fc2 input: as a routed slot)                                = 176,160,768
//              + the gate: its output kept and an fp32 value  2048 x (8192 + 4) =  16,785,408
TEST(MemoryModel, SharedExpertsAndQkNormsPerBlock) {
  ModelSpec m = mixtral();
  m.shared_expert_intermediate_size = 14336;
  m.shared_expert_gate = true;
  m.qk_norm = true;
  const BlockActivations b = block_activations(m, 1, 2048, 4096, 2);
  EXPECT_EQ(b.block_input, 16'777'216);
  EXPECT_EQ(b.attention, 75'759'616 + 20'971'520);
  EXPECT_EQ(b.moe, 419'512'320 + 176'160'768 + 16'785'408);
}

// Shared experts are dense parameters: split over the tensor ranks and sharded over S, never
// over the expert ranks. E8 S2, per block 41,984,000 + 3 x 4096 x 14336 + 4096 (gate) + 2 x 128
// (q/k norms) = 218,149,120 dense: 65,536,000 + 32 x (109,074,560 + 88,080,384) + 65,538,048.
TEST(MemoryModel, SharedExpertsAreDenseParameters) {
  ModelSpec m = mixtral();
  m.shared_expert_intermediate_size = 14336;
  m.shared_expert_gate = true;
  m.qk_norm = true;
  EXPECT_EQ(count_parameters(m).dense_per_layer(), 218'149'120);
  EXPECT_EQ(shard_sizes(m, 8, 2).shard_params, 6'440'032'256);
}

// Latent attention keeps, per token: the norm's input and output (2 x 7168), q and k (128 heads x
// 192) and v (x 128), the core's output as o_proj's input (128 x 128), the query latent (1536,
// normed and not), the key-value latent with its rotary key (576) and normed (512), and the
// core's fp32 statistic per head: 4096 x 201,344 bytes in bf16.
TEST(MemoryModel, LatentAttentionKeepsItsLatentsAndEveryHeadsKeysAndValues) {
  const ModelSpec& m = test::model("deepseek-v3");
  const BlockActivations b = block_activations(m, 1, 4096, 8 * 4096, 2, Kernels::kFused, AttentionKernel::kFlash);
  EXPECT_EQ(b.attention, 4096 * (2 * 7168 * 2 + (128 * 192 * 2 + 128 * 128) * 2 + 128 * 128 * 2 +
                                 1536 * 4 + 576 * 2 + 512 * 2 + 128 * 4));
  EXPECT_EQ(b.attention, 4096 * 201'344);
  // Its down projections and latent norms are whole on every tensor-parallel rank: one MoE
  // block at T = 2 holds half of the rest and one expert's half (E = 256).
  const ParamCounts p = count_parameters(m);
  const int64_t whole = 7168 * (1536 + 512 + 64) + 1536 + 512;
  EXPECT_EQ(p.tensor_replicated_per_layer, whole);
  const ShardSizes one = stage_shard_sizes(m, {1, 1}, 256, 1, 2, 1, false);
  EXPECT_EQ(one.local_params, (p.dense_per_layer() - whole + 1) / 2 + whole + p.expert / 2);
  // Of it, the up projections' every-head q (192 wide), k (192) and v (128): what latent_up
  // checkpointing drops and remakes.
  EXPECT_EQ(b.latent_up, int64_t{4096} * 128 * (192 + 192 + 128) * 2);
  EXPECT_EQ(block_activations(test::model("mixtral-8x7b"), 1, 4096, 8 * 4096, 2, Kernels::kFused, AttentionKernel::kFlash)
                .latent_up,
            0);
}

// Multi-token prediction weighs on the last stage: its MoE block (4 of 256 experts at E = 64),
// its projection and norms, and under a pipeline the embedding again, where the stage without
// it held the larger of the embedding and the head. On one stage its second loss keeps logits
// of its own, and its block activations like the others.
TEST(MemoryModel, MultiTokenPredictionWeighsOnTheLastStage) {
  const ModelSpec& m = test::model("deepseek-v3");
  ModelSpec without = m;
  without.mtp_layers = 0;
  ParallelConfig p;
  p.pipeline_parallel_degree = 2;
  p.first_stage_layers = 31;
  p.last_stage_layers = 30;
  const ParamCounts c = count_parameters(m);
  const ShardSizes last = stage_shard_sizes(m, stage_block_counts(m, p, 1), 64, 1, 1, 2, true);
  const ShardSizes before = stage_shard_sizes(without, stage_block_counts(without, p, 1), 64, 1, 1, 2, true);
  EXPECT_EQ(last.local_params - before.local_params,
            c.dense_per_layer() + 4 * c.expert + c.mtp_projection + 129280 * 7168);
  EXPECT_EQ(busiest_stage(m, p).moe_layers, 31);

  // Mixtral with a vocabulary of 256,000 and nothing sharded (E8 S1 R2), where the loss's
  // logits outweigh what a block's backward holds.
  const Layout x = layout(8, 1, Checkpointing::kFull);
  ModelSpec base = mixtral();
  base.vocab_size = 256'000;
  ModelSpec mtp = base;
  mtp.mtp_layers = 1;
  const MemoryEstimate plain = estimate_memory({base, p4d_two_nodes(), x.parallel, x.moe, x.training});
  const MemoryEstimate with = estimate_memory({mtp, p4d_two_nodes(), x.parallel, x.moe, x.training});
  ASSERT_GT(plain.logits, 0);
  // A second set of logits and log-probabilities (2,048 tokens x 256,000 x 6 bytes) and the
  // projection's joined input (2,048 x 8,192 x 2 bytes).
  EXPECT_EQ(with.logits - plain.logits, int64_t{2048} * 256'000 * 6 + int64_t{2048} * 8192 * 2);
  EXPECT_GT(with.activations, plain.activations);
  EXPECT_EQ(shard_sizes(mtp, 8, 2).shard_params - shard_sizes(base, 8, 2).shard_params,
            (41'984'000 + 2 * 4096 * 4096 + 3 * 4096) / 2 + 88'080'384);
}

// Parallel folding: Qwen3-235B-A22B's experts whole on each rank (ETP 1) with T = 2, so E = 32
// over 16 data-parallel ranks holds 4 experts a rank, all their width, where E = 16 with the
// experts split over T (ETP 2) holds 8 experts' halves: the same expert parameters. The dense
// part stays split over T. The distributed optimizer shards the dense states over the mesh's
// E (16) x R, not over E.
TEST(MemoryModel, FoldedExpertsAreWholeAndTheirRanksAreTheMeshs) {
  const ModelSpec& m = test::model("qwen3-235b-a22b");
  const ParamCounts c = count_parameters(m);
  const ShardSizes split = stage_shard_sizes(m, {1, 1}, 16, 1, 2, 1, false);
  const ShardSizes folded = stage_shard_sizes(m, {1, 1}, 32, 1, 2, 1, false, 1);
  EXPECT_EQ(folded.local_params, split.local_params);
  EXPECT_EQ(folded.local_params - (c.dense_per_layer() + 1) / 2, 4 * c.expert);

  ParallelConfig p;
  p.world_size = 256;
  p.tensor_parallel_degree = 2;
  p.sequence_parallel = true;
  p.pipeline_parallel_degree = 8;
  p.expert_parallel_degree = 32;
  p.expert_tensor_parallel_degree = 1;
  p.first_stage_layers = p.last_stage_layers = 11;
  p.micro_batch_size = 1;
  p.gradient_accumulation_steps = 128;
  p.distributed_optimizer = true;
  EXPECT_EQ(p.expert_fold(), 2);
  EXPECT_EQ(p.expert_data_degree(), 16);
  EXPECT_EQ(p.replica_degree(), 1);
  TrainingConfig t;
  t.seq_len = 4096;
  t.global_batch_tokens = int64_t{2048} * 4096;
  t.precision = Precision::kMixed;
  t.fp32_gradients = false;  // Megatron-Bridge reduces them in bf16
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kBalanced;
  const ClusterSpec cluster = test::hardware("dgx-h100", 256);
  const RunConfig config{m, cluster, p, moe, t};
  EXPECT_EQ(violated_rules(config), RuleMask{0});
  const MemoryEstimate memory = estimate_memory(config);
  // Master weights (fp32) of one stage of 32 ranks: the dense part over the mesh's 16 E ranks,
  // the experts' over R = 1.
  ParallelConfig one = p;
  one.world_size = 32;
  one.pipeline_parallel_degree = 1;
  one.first_stage_layers = one.last_stage_layers = 0;
  one.virtual_pipeline_degree = 1;
  const MemoryEstimate stage = estimate_memory({m, test::hardware("dgx-h100", 32), one, moe, t});
  const ShardSizes sizes = stage_shard_sizes(m, busiest_stage(m, one), 32, 1, 2, 1, true, 1);
  const int64_t dense = sizes.shard_params - sizes.shard_expert_params;
  EXPECT_EQ(stage.master_weights, 4 * ((dense + 15) / 16 + sizes.shard_expert_params));
  EXPECT_LT(memory.device_total, cluster.usable_memory_bytes());
}

// Under a pipeline, multi-token prediction's block is the last stage's, which keeps one
// micro-batch in flight under 1F1B: the first stage's four micro-batches of its own 8 blocks stay
// the larger, so the activations are the same as without it (not 9 blocks x 4).
TEST(MemoryModel, MultiTokenPredictionOnTheLastStageKeepsOneMicroBatch) {
  Layout x = layout(2, 1, Checkpointing::kNone);
  x.parallel.pipeline_parallel_degree = 4;
  x.parallel.gradient_accumulation_steps = 64;
  ModelSpec mtp = mixtral();
  mtp.mtp_layers = 1;
  const MemoryEstimate plain = x.estimate();
  const MemoryEstimate with = estimate_memory({mtp, p4d_two_nodes(), x.parallel, x.moe, x.training});
  EXPECT_EQ(with.activations, plain.activations);
  EXPECT_GE(with.device_total, plain.device_total);
}

// The distributed optimizer splits the dense parameters' master weights and moments over E x R
// (Megatron-Core's data-parallel group) and the experts' over R (its expert data-parallel
// group): E8 S1 R2 keeps 1/16 of the one and 1/2 of the other; the gradients stay whole.
TEST(MemoryModel, DistributedOptimizerShardsDenseStatesOverTheExpertRanksToo) {
  Layout x = layout(8, 1, Checkpointing::kFull, Precision::kMixed);
  const MemoryEstimate whole = x.estimate();
  x.parallel.distributed_optimizer = true;
  const MemoryEstimate split = x.estimate();
  const ShardSizes sizes = shard_sizes(mixtral(), 8, 1);
  const int64_t experts = sizes.shard_expert_params, dense = sizes.shard_params - experts;
  EXPECT_EQ(experts, int64_t{32} * 176'160'768);
  const int64_t kept = (dense + 15) / 16 + (experts + 1) / 2;
  EXPECT_EQ(split.master_weights, 4 * kept);
  EXPECT_EQ(split.optimizer_states, 8 * kept);
  EXPECT_EQ(split.gradients, whole.gradients);
  EXPECT_EQ(whole.master_weights, 4 * sizes.shard_params);
}

// Dense blocks among MoE blocks hold no experts: Mixtral with its first 8 blocks dense (width
// 14,336) on 4 stages puts them all on the first stage, which then holds far less than the
// others; the busiest stage is a stage of MoE blocks, as with no dense blocks.
TEST(MemoryModel, DenseBlocksLightenTheirStage) {
  ModelSpec m = mixtral();
  m.first_dense_layers = 8;
  m.dense_intermediate_size = 14336;
  // 8 x (41,984,000 - 32,768 + 176,160,768) = 1,744,896,000 per rank before sharding, E1 T1.
  ParallelConfig p;
  p.pipeline_parallel_degree = 4;
  const ShardSizes first = stage_shard_sizes(m, stage_block_counts(m, p, 0), 1, 1, 1, 4, false);
  EXPECT_EQ(first.local_params, 8 * (41'984'000 - 32'768 + 176'160'768));
  const ShardSizes last = stage_shard_sizes(m, stage_block_counts(m, p, 3), 1, 1, 1, 4, false);
  EXPECT_EQ(last.local_params, 8 * (41'984'000 + int64_t{8} * 176'160'768));
  EXPECT_EQ(busiest_stage(m, p).moe_layers, 8);
  EXPECT_EQ(shard_sizes(m, 1, 1, 1, 4).local_params, shard_sizes(mixtral(), 1, 1, 1, 4).local_params);
  // One stage: 8 blocks' experts fewer in every item that counts them.
  Layout x = layout(8, 2, Checkpointing::kNone);
  const MemoryEstimate all = x.estimate();
  const MemoryEstimate mixed = estimate_memory({m, p4d_two_nodes(), x.parallel, x.moe, x.training});
  EXPECT_LT(mixed.parameters, all.parameters);
  EXPECT_LT(mixed.activations, all.activations);  // a dense block keeps no router or dispatch copies
  EXPECT_GT(mixed.activations, all.activations * 24 / 32);
}

// 32 blocks: none keeps every block (32 x 495,271,936); full keeps block inputs and recomputes
// one block (32 x 16,777,216 + 495,271,936); selective keeps attention plus the MoE input and
// recomputes one MoE sub-block (32 x 92,536,832 + 419,512,320).
TEST(MemoryModel, ActivationsWithAndWithoutCheckpointing) {
  EXPECT_EQ(layout(8, 2, Checkpointing::kNone).estimate().activations, 15'848'701'952);
  EXPECT_EQ(layout(8, 2, Checkpointing::kFull).estimate().activations, 1'032'142'848);
  EXPECT_EQ(layout(8, 2, Checkpointing::kSelective).estimate().activations, 3'380'690'944);
}

// latent_up checkpointing (Megatron-Core's mla_up_proj): every block of DeepSeek-V3 (its 3 dense
// ones and the multi-token prediction block too, all with latent attention) drops its heads' q,
// k and v, and the block in backward holds one block's again.
TEST(MemoryModel, LatentUpCheckpointingDropsEveryBlocksQueriesKeysAndValues) {
  const ModelSpec& m = test::model("deepseek-v3");
  ParallelConfig p;
  p.world_size = 8;
  p.expert_parallel_degree = 8;
  p.micro_batch_size = 1;
  TrainingConfig t;
  t.seq_len = 4096;
  t.global_batch_tokens = 8 * 4096;
  MoeConfig moe;
  moe.load_balancing = LoadBalancing::kBalanced;
  const ClusterSpec cluster = test::hardware("p5.48xlarge", 8);
  const MemoryEstimate none = estimate_memory({m, cluster, p, moe, t});
  p.activation_checkpointing = Checkpointing::kLatentUpProjections;
  const MemoryEstimate latent = estimate_memory({m, cluster, p, moe, t});
  const int64_t per_block = int64_t{4096} * 128 * (192 + 192 + 128) * 2;
  EXPECT_EQ(none.activations - latent.activations, (m.blocks() - 1) * per_block);
  EXPECT_EQ(latent.activation_working_set, per_block);
}

// The middle stages need not be alike: DeepSeek-V3 (its first 3 blocks dense) on 4 stages of
// 1 / 29 / 29 / 2 blocks puts 2 dense blocks on stage 1 and 29 MoE blocks on stage 2; with two
// micro-batches in flight on both, stage 2's expert parameters decide.
TEST(MemoryModel, TheMiddleStageWithTheMostExpertBlocksIsCounted) {
  ModelSpec m = test::model("deepseek-v3");
  m.mtp_layers = 0;
  ParallelConfig p;
  p.world_size = 256;
  p.expert_parallel_degree = 64;
  p.pipeline_parallel_degree = 4;
  p.first_stage_layers = 1;
  p.last_stage_layers = 2;
  p.micro_batch_size = 1;
  p.gradient_accumulation_steps = 2;
  TrainingConfig t;
  t.seq_len = 4096;
  t.global_batch_tokens = 64 * 2 * 4096;
  t.precision = Precision::kMixed;
  ASSERT_EQ(stage_block_counts(m, p, 1).moe_layers, 27);
  ASSERT_EQ(stage_block_counts(m, p, 2).moe_layers, 29);
  const MemoryEstimate memory = estimate_memory({m, test::hardware("p5.48xlarge", 256), p, {}, t});
  const ShardSizes stage2 = stage_shard_sizes(m, stage_block_counts(m, p, 2), 64, 1, 1, 4, false);
  EXPECT_EQ(memory.parameters, 2 * stage2.shard_params);
}

// Offload with horizon 2 keeps 3 block inputs on the device (the one in use and two
// prefetched) and all 32 on the host.
TEST(MemoryModel, OffloadMovesBlockInputsToTheHost) {
  Layout x = layout(8, 2, Checkpointing::kFull);
  x.parallel.activation_offloading = true;
  x.parallel.activation_loading_horizon = 2;
  const MemoryEstimate m = x.estimate();
  EXPECT_EQ(m.activations, 3 * 16'777'216 + 495'271'936);
  EXPECT_EQ(m.offloaded_activations, 32 * 16'777'216);
}

// Selective checkpointing offloads the MoE sub-block's input (block-input sized); attention's
// activations stay for all 32 blocks: 32 x 75,759,616 + 3 x 16,777,216 + one MoE sub-block
// (419,512,320) on the device, 32 block inputs on the host.
TEST(MemoryModel, SelectiveOffloadKeepsAttentionOnTheDevice) {
  Layout x = layout(8, 2, Checkpointing::kSelective);
  x.parallel.activation_offloading = true;
  x.parallel.activation_loading_horizon = 2;
  const MemoryEstimate m = x.estimate();
  EXPECT_EQ(m.activations, 32 * 75'759'616LL + 3 * 16'777'216LL + 419'512'320LL);
  EXPECT_EQ(m.offloaded_activations, 32 * 16'777'216);
}

// Expert imbalance: the busiest rank gets 1.5 x the mean of 4096 slots = 6144, so the expert
// activations and the receive buffer grow by half.
TEST(MemoryModel, ImbalanceGrowsExpertActivationsAndDispatchBuffers) {
  Layout x = layout(8, 2, Checkpointing::kNone);
  const MemoryEstimate uniform = x.estimate();
  x.moe.expert_load_imbalance = 1.5;
  const MemoryEstimate skewed = x.estimate();
  EXPECT_EQ(skewed.activations - uniform.activations, int64_t{32} * 2048 * (4096 * 2 + 4 + 3 * 14336 * 2));
  EXPECT_EQ(uniform.moe_dispatch_buffers, (4096 + 4096) * 4096 * 2);
  EXPECT_EQ(skewed.moe_dispatch_buffers, (4096 + 6144) * 4096 * 2);
}

// DeepEP's buffers, allocated once as Megatron-Core's flex dispatcher sizes them: inside a node
// (E8) 10 channels x 8 NVLink peers x (5 ints + 256 tokens x (4096 x 2 bytes + 8 bytes of source
// + 128 top-k indices and weights x 12 bytes + 128 scales x 4 bytes)) = 209,880,640, rounded up
// to 128 bytes: 209,880,704. Persistent, so outside the fragmentation of the transient items.
TEST(MemoryModel, DeepEpKeepsItsBuffersForTheStep) {
  Layout x = layout(8, 2, Checkpointing::kFull);
  const MemoryEstimate nccl = x.estimate();
  EXPECT_EQ(nccl.communication_buffers, 0);
  x.moe.dispatcher = Dispatcher::kDeepEp;
  const MemoryEstimate deepep = x.estimate();
  EXPECT_EQ(deepep.communication_buffers, 209'880'704);
  EXPECT_EQ(deepep.device_total - nccl.device_total, 209'880'704);
  // Over two nodes (E16): each NVLink peer's ring also counts 2 RDMA peers' heads (288 tokens of
  // 10,248 bytes), and each of the 2 RDMA peers has a send and a receive ring of 140 tokens with
  // 16 bytes more each, and 1 MiB: 236,116,224 + 58,529,920.
  x.parallel.expert_parallel_degree = 16;
  x.parallel.hybrid_shard_degree = 1;
  EXPECT_EQ(x.estimate().communication_buffers, 236'116'224 + 58'529'920);
}

// Every item of E8 S2 with full checkpointing, and the total:
//   model states 28,971,122,688
//   gathered: 2 units of the largest flat parameter (a block: 41,984,000 + 176,160,768 =
//     218,144,768) in bf16 = 872,579,072; gradient buffer: one unit = 436,289,536
//   activations 1,032,142,848; dispatch (4096 sent + 4096 received) x 4096 x 2 = 67,108,864
//   logits 2048 x 32000 x (2 + 4) = 393,216,000 are freed before a block's backward, whose
//     recompute (495,271,936), gathered units, gradient buffer and dispatch buffers hold more:
//     they add 0; framework 1,610,612,736 (profile)
//   fragmentation 0.1 x (872,579,072 + 436,289,536 + 1,032,142,848 + 67,108,864)
//     = 0.1 x 2,408,120,320 = 240,812,032
//   total 33,230,667,776
TEST(MemoryModel, DeviceTotalIsTheSumOfItems) {
  const MemoryEstimate m = layout(8, 2, Checkpointing::kFull).estimate();
  EXPECT_EQ(m.gathered_parameters, 872'579'072);
  EXPECT_EQ(m.gradient_buffers, 436'289'536);
  EXPECT_EQ(m.moe_dispatch_buffers, 67'108'864);
  EXPECT_EQ(m.logits, 0);
  EXPECT_EQ(m.framework_overhead, 1'610'612'736);
  EXPECT_EQ(m.fragmentation, 240'812'032);
  EXPECT_EQ(m.device_total, 33'230'667'776);
  int64_t sum = 0;
  for (const MemoryItem& item : m.device_items()) sum += item.bytes;
  EXPECT_EQ(sum, m.device_total);
}

// The logits count where they outweigh a block's backward: without checkpointing, sharding or
// expert parallelism a block's backward holds nothing beyond the kept activations, so all
// 2048 x 32000 x (2 + 4) bytes count; with full checkpointing the recomputed block
// (495,271,936 bytes) holds more, and they count nothing.
TEST(MemoryModel, LogitsCountOnlyOverABlocksBackward) {
  EXPECT_EQ(layout(1, 1, Checkpointing::kNone).estimate().logits, 393'216'000);
  EXPECT_EQ(layout(1, 1, Checkpointing::kFull).estimate().logits, 0);
}

// Without sharding nothing is gathered: the rank holds its whole share.
TEST(MemoryModel, NoGatherBuffersWithoutSharding) {
  const MemoryEstimate m = layout(8, 1, Checkpointing::kFull).estimate();
  EXPECT_EQ(m.gathered_parameters, 0);
  EXPECT_EQ(m.gradient_buffers, 0);
}

TEST(MemoryModel, HostLimitIsSharedByTheNodesRanks) {
  EXPECT_EQ(host_limit_bytes(p4d_two_nodes(), 16), p4d_two_nodes().host_memory_bytes / 8);
  EXPECT_EQ(host_limit_bytes(p4d_two_nodes(), 2), p4d_two_nodes().host_memory_bytes / 2);
}

}  // namespace
}  // namespace moeplan::planner
