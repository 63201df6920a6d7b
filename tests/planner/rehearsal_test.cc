// The plans `moeplan run --rehearse` derives from a cluster plan: the shrunk model, the same
// layout, the one-rank reference, and the memory figure a CPU rank is held to.
#include "moeplan/planner/rehearsal.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "moeplan/core/errors.h"
#include "moeplan/core/moe_load.h"
#include "moeplan/core/rules.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan::planner {
namespace {

// The [R, S, E] plan `moeplan search --gpus 16` gives with T = P = 1.
Plan cluster_plan() {
  SearchOptions o = test::search_options(16);
  o.pins.tensor_parallel_degree = 1;
  o.pins.pipeline_parallel_degree = 1;
  o.estimator = Estimator::kAnalytic;
  const ModelSpec& m = test::model("mixtral-8x7b");
  const ClusterSpec c = test::hardware("p4d.24xlarge", 16);
  const SearchResult r = search(m, c, o);
  if (r.ranked.empty()) throw std::runtime_error("no [R, S, E] plan for Mixtral 8x7B on 16 A100s");
  return make_plan(m, c, o, r, "moeplan search --gpus 16");
}

TEST(Rehearsal, MixtralShrinksByWidthAndKeepsExpertsAndTopK) {
  const ModelSpec& full = test::model("mixtral-8x7b");
  const ModelSpec m = shrink_model(full, {32, 2}, 512, 64);
  EXPECT_EQ(m.hidden_size, 128);
  EXPECT_EQ(m.intermediate_size, 448);
  // 4 x 4 <= 32 divides both head counts; head_dim takes 32 / 4.
  EXPECT_EQ(m.num_attention_heads, 8);
  EXPECT_EQ(m.num_key_value_heads, 2);
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_EQ(m.num_attention_heads * m.head_dim, m.hidden_size);
  EXPECT_EQ(m.num_layers, 2);
  EXPECT_EQ(m.vocab_size, 512);
  EXPECT_EQ(m.num_experts, full.num_experts);
  EXPECT_EQ(m.experts_per_token, full.experts_per_token);
  EXPECT_EQ(m.rope_theta, full.rope_theta);
  EXPECT_TRUE(validate_model(m).empty());
  // Shared experts and Qwen3's q/k norms: the shared width shrinks with the experts'.
  ModelSpec shared = full;
  shared.shared_expert_intermediate_size = 28672;
  shared.qk_norm = true;
  const ModelSpec small = shrink_model(shared, {32, 2}, 512, 64);
  EXPECT_EQ(small.shared_expert_intermediate_size, 896);
  EXPECT_TRUE(small.qk_norm);
  EXPECT_TRUE(validate_model(small).empty());
  // Width 1 changes only layers and vocabulary.
  const ModelSpec same = shrink_model(full, {1, 32}, full.vocab_size, 2048);
  EXPECT_EQ(same.hidden_size, full.hidden_size);
  EXPECT_EQ(same.head_dim, full.head_dim);
  EXPECT_EQ(same.num_attention_heads, full.num_attention_heads);
}

TEST(Rehearsal, SizesThatDoNotDivideAreRefusedNamingTheFlag) {
  const ModelSpec& full = test::model("mixtral-8x7b");
  auto message = [&](const Shrink& s) {
    try {
      shrink_model(full, s, 512, 64);
    } catch (const InputError& e) {
      std::string all;
      for (const std::string& l : e.lines()) all += l + "\n";
      return all;
    }
    return std::string();
  };
  EXPECT_NE(message({3, 2}).find("--shrink-width"), std::string::npos);  // 4096 / 3
  EXPECT_NE(message({3, 2}).find("hidden_size"), std::string::npos);
  EXPECT_NE(message({32, 0}).find("--shrink-layers"), std::string::npos);
  EXPECT_NE(message({32, 33}).find("--shrink-layers"), std::string::npos);
  EXPECT_EQ(message({64, 4}), "");  // 64 wide, 4 layers
}

TEST(Rehearsal, KeepsTheLayoutAndTheOneRankReferenceTrainsTheSameBatch) {
  const Plan plan = cluster_plan();
  const Plan small = rehearsal_plan(plan, {}, 512, 64, 2);
  EXPECT_EQ(small.parallel, plan.parallel);
  EXPECT_EQ(small.moe, plan.moe);
  EXPECT_EQ(small.cluster.gpus_per_node, plan.cluster.gpus_per_node);
  EXPECT_EQ(small.cluster.num_nodes, plan.cluster.num_nodes);
  EXPECT_EQ(small.cluster.kernels, Kernels::kEager);
  EXPECT_EQ(small.training.seq_len, 64);
  EXPECT_EQ(small.training.precision, Precision::kFp32);
  EXPECT_EQ(small.training.steps, 2);
  const ParallelConfig& p = plan.parallel;
  EXPECT_EQ(small.training.global_batch_tokens, 64 * p.micro_batch_size * p.gradient_accumulation_steps * 16);
  EXPECT_TRUE(validate({small.model, small.cluster, small.parallel, small.moe, small.training}).empty());
  // Its prediction is the memory model's for the shrunk layout, recomputed.
  EXPECT_EQ(small.prediction.memory.device_total_bytes,
            estimate_memory({small.model, small.cluster, small.parallel, small.moe, small.training}).device_total);
  EXPECT_LT(small.prediction.memory.device_total_bytes, plan.prediction.memory.device_total_bytes);

  const Plan one = reference_plan(small);
  EXPECT_EQ(one.parallel.world_size, 1);
  EXPECT_EQ(one.parallel.expert_parallel_degree, 1);
  EXPECT_EQ(one.parallel.hybrid_shard_degree, 1);
  EXPECT_EQ(one.parallel.micro_batch_size, p.micro_batch_size);
  EXPECT_EQ(one.parallel.gradient_accumulation_steps, p.gradient_accumulation_steps * 16);
  EXPECT_EQ(one.training.global_batch_tokens, small.training.global_batch_tokens);
  EXPECT_EQ(one.model, small.model);
  EXPECT_TRUE(validate({one.model, one.cluster, one.parallel, one.moe, one.training}).empty());
}

// The default 16-GPU plan pipelines its blocks over P stages of V chunks each: the shrunk model
// keeps a multiple of P x V blocks (at least --shrink-layers), and the one-rank reference trains
// W / (T P) readers' micro-batches.
TEST(Rehearsal, APipelineKeepsABlockForEveryChunk) {
  SearchOptions o = test::search_options(16);
  o.estimator = Estimator::kAnalytic;
  o.pins.pipeline_parallel_degree = 2;
  o.pins.virtual_pipeline_degree = 4;
  o.pins.tensor_parallel_degree = 2;
  const ModelSpec& m = test::model("mixtral-8x7b");
  const ClusterSpec c = test::hardware("p4d.24xlarge", 16);
  const SearchResult r = search(m, c, o);
  ASSERT_FALSE(r.ranked.empty());
  const Plan plan = make_plan(m, c, o, r, "moeplan search --gpus 16");
  ASSERT_EQ(plan.parallel.pipeline_parallel_degree * plan.parallel.virtual_pipeline_degree, 8);
  for (const auto& [asked, kept] : {std::pair<int64_t, int64_t>{2, 8}, {8, 8}, {9, 16}}) {
    const Plan small = rehearsal_plan(plan, {32, asked, 0}, 512, 64, 2);
    EXPECT_EQ(small.model.num_layers, kept) << "--shrink-layers " << asked;
    EXPECT_EQ(small.parallel, plan.parallel);
    EXPECT_TRUE(validate({small.model, small.cluster, small.parallel, small.moe, small.training}).empty());
    const Plan one = reference_plan(small);
    EXPECT_EQ(one.parallel.gradient_accumulation_steps, plan.parallel.gradient_accumulation_steps * 16 / 4);
    EXPECT_EQ(one.training.global_batch_tokens, small.training.global_batch_tokens);
  }
  // At most --shrink-micro-batches a step, in whole rounds of P for the interleaved schedule;
  // 32 unless asked.
  ASSERT_GT(plan.parallel.gradient_accumulation_steps, 32);
  EXPECT_EQ(rehearsal_plan(plan, {}, 512, 64, 2).parallel.gradient_accumulation_steps, 32);
  for (const auto& [cap, kept] : {std::pair<int64_t, int64_t>{32, 32}, {5, 6}, {1, 2}}) {
    const Plan small = rehearsal_plan(plan, {32, 2, cap}, 512, 64, 2);
    EXPECT_EQ(small.parallel.gradient_accumulation_steps, kept) << "--shrink-micro-batches " << cap;
    EXPECT_EQ(small.training.global_batch_tokens, 64 * plan.parallel.micro_batch_size * kept * 4);
    EXPECT_TRUE(validate({small.model, small.cluster, small.parallel, small.moe, small.training}).empty());
  }
}

TEST(Rehearsal, MeasuredLoadOfTheBusiestExpertRankRaisesItsMemory) {
  Plan plan = cluster_plan();
  plan.parallel.expert_parallel_degree = 4;
  plan.parallel.hybrid_shard_degree = 4;
  const Plan small = rehearsal_plan(plan, {}, 512, 64, 2);
  // One expert rank computed 1.3 times the mean rows: the model sees exactly that rank load.
  const Plan loaded = with_measured_load(small, 1.3);
  EXPECT_NEAR(busiest_expert_rank_load(loaded.model, loaded.moe, 4), 1.3, 1e-12);
  ASSERT_EQ(loaded.moe.tokens_per_expert.size(), 8u);
  EXPECT_EQ(loaded.moe.tokens_per_expert[0], loaded.moe.tokens_per_expert[1]);  // rank 0's two experts
  EXPECT_GT(predicted_cpu_tensor_bytes(loaded), predicted_cpu_tensor_bytes(small));
  // The mean load is the figure with none given; with E = 1 every rank computes every row.
  EXPECT_EQ(predicted_cpu_tensor_bytes(with_measured_load(small, 1.0)), predicted_cpu_tensor_bytes(small));
  plan.parallel.expert_parallel_degree = 1;
  plan.parallel.hybrid_shard_degree = 16;
  const Plan one_group = rehearsal_plan(plan, {}, 512, 64, 2);
  EXPECT_EQ(predicted_cpu_tensor_bytes(with_measured_load(one_group, 1.3)), predicted_cpu_tensor_bytes(one_group));
}

TEST(Rehearsal, CpuFigureLeavesOutTheGpuFrameworkAndFragmentation) {
  const Plan small = rehearsal_plan(cluster_plan(), {}, 512, 64, 2);
  int64_t overhead = 0, fragmentation = 0;
  for (const MemoryItem& item : small.prediction.memory.device) {
    if (item.name == "framework_overhead") overhead = item.bytes;
    if (item.name == "fragmentation") fragmentation = item.bytes;
  }
  EXPECT_GT(overhead, 0);
  EXPECT_GT(fragmentation, 0);
  EXPECT_EQ(predicted_cpu_tensor_bytes(small), small.prediction.memory.device_total_bytes - overhead - fragmentation);
}

}  // namespace
}  // namespace moeplan::planner
