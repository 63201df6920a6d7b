#include "moeplan/planner/search.h"

#include <gtest/gtest.h>

#include <array>
#include <set>

#include "framework_rules.h"
#include "moeplan/planner/capacity.h"
#include "test_support.h"

namespace moeplan::planner {
namespace {

// Every search here plans Mixtral 8x7B on p4d.24xlarge nodes.
const ModelSpec& mixtral() { return test::model("mixtral-8x7b"); }
ClusterSpec p4d(int64_t gpus) { return test::hardware("p4d.24xlarge", gpus); }

TEST(Search, SixteenA100sGiveAValidPlanThatFits) {
  const ClusterSpec cluster = p4d(16);
  const SearchOptions options = test::search_options(16);
  const SearchResult result = search(mixtral(), cluster, options);
  ASSERT_FALSE(result.ranked.empty());
  double previous = result.ranked.front().estimate.tokens_per_s;
  for (const Candidate& c : result.ranked) {
    EXPECT_LE(c.memory.device_total, cluster.usable_memory_bytes()) << describe(c.parallel);
    EXPECT_LE(c.estimate.tokens_per_s, previous);
    previous = c.estimate.tokens_per_s;
    EXPECT_TRUE(validate({mixtral(), cluster, c.parallel, options.moe, options.training}).empty());
  }
  const Plan plan = make_plan(mixtral(), cluster, options, result, "test");
  int64_t sum = 0;
  for (const MemoryItem& item : plan.prediction.memory.device) sum += item.bytes;
  EXPECT_EQ(sum, plan.prediction.memory.device_total_bytes);
  EXPECT_LE(plan.prediction.memory.device_total_bytes, plan.prediction.memory.device_limit_bytes);
  EXPECT_EQ(plan.cluster.num_nodes, 2);
  EXPECT_EQ(plan.parallel.world_size, 16);
  EXPECT_GT(plan.prediction.tokens_per_s, 0);
  EXPECT_LT(plan.prediction.mfu, 1.0);
}

TEST(Search, PinnedChoicesAreKeptAndTheRestSearched) {
  SearchOptions options = test::search_options(16);
  options.pins.expert_parallel_degree = 4;
  options.pins.checkpointing = Checkpointing::kFull;
  options.pins.offloading = true;
  options.pins.loading_horizon = 2;
  options.pins.placement = "RES";
  const SearchResult r = search(mixtral(), p4d(16), options);
  ASSERT_FALSE(r.ranked.empty());
  std::set<int64_t> shard_degrees;
  for (const Candidate& c : r.ranked) {
    EXPECT_EQ(c.parallel.expert_parallel_degree, 4);
    EXPECT_EQ(c.parallel.activation_checkpointing, Checkpointing::kFull);
    EXPECT_TRUE(c.parallel.activation_offloading);
    EXPECT_EQ(c.parallel.activation_loading_horizon, 2);
    EXPECT_EQ(c.parallel.placement.to_string(), "RES");
    shard_degrees.insert(c.parallel.hybrid_shard_degree);
  }
  EXPECT_EQ(r.stats.enumerated, r.stats.duplicate_placements + r.stats.rule_rejected + r.stats.rule_valid);
  // A pinned value the rules forbid leaves nothing, and the rule says why.
  options.pins.expert_parallel_degree = 3;
  const SearchResult none = search(mixtral(), p4d(16), options);
  EXPECT_TRUE(none.ranked.empty());
  EXPECT_EQ(none.stats.rule_valid, 0);
  EXPECT_GT(none.stats.rejected_by_rule[static_cast<size_t>(Rule::kExpertDegreeDividesExperts)], 0);
}

// Parallel folding is a choice of the search where the framework runs it: with T = 2, Megatron-LM's
// plans include experts whole on each rank with the tensor ranks in the expert group (E beyond
// the data-parallel ranks), and so do moeplan's executor's. Qwen3-235B-A22B's published layout on
// 256 H100 (T2 P8 E32 ETP1, 16 data-parallel ranks) plans within the device.
TEST(Search, FoldsTheTensorRanksIntoTheExpertGroupWhereTheFrameworkDoes) {
  auto folded_plans = [](Target target) {
    SearchOptions options = test::search_options(16);
    options.estimator = Estimator::kAnalytic;
    options.keep = 400;
    options.pins.tensor_parallel_degree = 2;
    options.moe.load_balancing = LoadBalancing::kAuxLoss;
    options.training.precision = Precision::kMixed;
    options.target = target;
    const SearchResult r = search(test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), options);
    EXPECT_FALSE(r.ranked.empty());
    int folded = 0;
    for (const Candidate& c : r.ranked)
      if (c.parallel.expert_fold() > 1) {
        ++folded;
        EXPECT_EQ(c.parallel.expert_parallel_degree, 2 * c.parallel.expert_data_degree());
      }
    return folded;
  };
  EXPECT_GT(folded_plans(test::framework_rules("megatron")), 0);
  EXPECT_GT(folded_plans(test::framework_rules("moeplan")), 0);

  SearchOptions options = test::search_options(256, 4096);
  options.estimator = Estimator::kAnalytic;
  options.keep = 1;
  options.training.global_batch_tokens = int64_t{2048} * 4096;
  options.training.precision = Precision::kMixed;
  options.training.fp32_gradients = false;
  options.moe.load_balancing = LoadBalancing::kBalanced;
  SearchOptions::Pins& pin = options.pins;
  pin.tensor_parallel_degree = 2;
  pin.sequence_parallel = true;
  pin.pipeline_parallel_degree = 8;
  pin.virtual_pipeline_degree = 4;
  pin.first_stage_layers = pin.last_stage_layers = 11;
  pin.expert_parallel_degree = 32;
  pin.expert_tensor_parallel_degree = 1;
  pin.hybrid_shard_degree = 1;
  pin.micro_batch_size = 1;
  pin.distributed_optimizer = true;
  const SearchResult r = search(test::model("qwen3-235b-a22b"), test::hardware("dgx-h100", 256), options);
  ASSERT_FALSE(r.ranked.empty()) << r.stats.over_device_memory << " over the device";
  EXPECT_EQ(r.ranked.front().parallel.expert_data_degree(), 16);
  EXPECT_EQ(r.ranked.front().parallel.data_parallel_degree(), 16);
}

// Mixtral on 16 H100 with 8192-token sequences, every layout without pipeline stages that the
// target runs, ranked by the estimate whatever its memory.
SearchOptions every_layout_on_two_p5_nodes(Target target) {
  SearchOptions options = test::search_options(16, 8192);
  options.estimator = Estimator::kAnalytic;
  options.keep = 2000;
  options.pins.pipeline_parallel_degree = 1;
  options.moe.load_balancing = LoadBalancing::kAuxLoss;
  options.training.precision = Precision::kMixed;
  options.target = target;
  options.ignore_memory_limits = true;
  return options;
}

// Context parallelism is a choice of the search where the framework splits sequences and each
// rank keeps at least min_context_tokens of one: for 8192-token sequences Megatron-LM's plans on
// 16 H100 include C = 2 and C = 4 (not 8: 1024 tokens a rank), and so do moeplan's executor's. The
// sequences read per step follow C: W / (C T P) readers take the global batch.
TEST(Search, SplitsSequencesOverContextRanksWhereTheFrameworkDoes) {
  auto context_degrees = [](Target target) {
    const SearchOptions options = every_layout_on_two_p5_nodes(target);
    const SearchResult r = search(test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), options);
    EXPECT_FALSE(r.ranked.empty());
    std::set<int64_t> seen;
    for (const Candidate& c : r.ranked) {
      seen.insert(c.parallel.context_parallel_degree);
      const ParallelConfig& p = c.parallel;
      EXPECT_EQ(p.data_parallel_degree() * p.micro_batch_size * p.gradient_accumulation_steps * 8192,
                options.training.global_batch_tokens)
          << describe(p);
    }
    return seen;
  };
  EXPECT_EQ(context_degrees(test::framework_rules("megatron")), (std::set<int64_t>{1, 2, 4}));
  EXPECT_EQ(context_degrees(test::framework_rules("moeplan")), (std::set<int64_t>{1, 2, 4}));
}

// Where the dense shard spans the expert and context ranks is the framework's choice: torchtitan's
// FSDP always spans them, Megatron-LM never does, and "any" tries both.
TEST(Search, ShardsDenseParametersOverTheExpertRanksWhereTheFrameworkDoes) {
  auto spans = [](Target target) {
    const SearchOptions options = every_layout_on_two_p5_nodes(target);
    const SearchResult r = search(test::model("mixtral-8x7b"), test::hardware("p5.48xlarge", 16), options);
    EXPECT_FALSE(r.ranked.empty());
    std::set<bool> seen;
    for (const Candidate& c : r.ranked) {
      const ParallelConfig& p = c.parallel;
      // Where there is nothing to span the flag stays off: one candidate per layout.
      if (p.expert_data_degree() * p.context_parallel_degree == 1) EXPECT_FALSE(p.dense_shard_spans_experts);
      else seen.insert(p.dense_shard_spans_experts);
      // FSDP over the expert ranks shards the optimizer states already: no distributed
      // optimizer on top unless both are pinned.
      EXPECT_FALSE(p.dense_shard_spanning() && p.distributed_optimizer) << describe(p);
    }
    return seen;
  };
  EXPECT_EQ(spans(test::framework_rules("torchtitan")), (std::set<bool>{true}));
  EXPECT_EQ(spans(test::framework_rules("megatron")), (std::set<bool>{false}));
  EXPECT_EQ(spans(nullptr), (std::set<bool>{false, true}));
}

// The simulator ranks at most max_simulated candidates, the analytic estimate's best first; the
// others the bound does not prune are counted apart. Without pruning every candidate runs.
TEST(Search, SimulatesAtMostTheCapInTheAnalyticOrder) {
  SearchOptions options = test::search_options(16);
  options.max_simulated = 3;
  const SearchResult capped = search(mixtral(), p4d(16), options);
  EXPECT_EQ(capped.stats.simulated, 3);
  EXPECT_GT(capped.stats.unsimulated, 0);
  ASSERT_FALSE(capped.ranked.empty());
  options.max_simulated = 1'000'000;
  const SearchResult all = search(mixtral(), p4d(16), options);
  EXPECT_GT(all.stats.simulated, 3);
  EXPECT_EQ(all.stats.unsimulated, 0);
  // The analytic estimate's best three hold the simulator's best here.
  EXPECT_EQ(capped.ranked.front().parallel, all.ranked.front().parallel);
}

// A depth no pipeline degree divides (DeepSeek-V3's 61 blocks) still pipelines: equal middle
// stages and the rest on the end stages, the last (with the head) the lighter when the rest is
// odd; two stages split 31 / 30.
TEST(Search, UnevenEndStagesSplitAnOddDepth) {
  for (const int64_t stages : {int64_t{2}, int64_t{8}}) {
    SearchOptions options = test::search_options(256, 4096);
    options.estimator = Estimator::kAnalytic;
    options.keep = 50;
    options.ignore_memory_limits = true;
    options.target = test::framework_rules("megatron");
    options.training.precision = Precision::kMixed;
    options.pins.pipeline_parallel_degree = stages;
    options.pins.virtual_pipeline_degree = 1;
    const SearchResult r = search(test::model("deepseek-v3"), test::hardware("p5.48xlarge", 256), options);
    ASSERT_FALSE(r.ranked.empty()) << stages;
    std::set<std::pair<int64_t, int64_t>> ends;
    for (const Candidate& c : r.ranked) ends.insert({c.parallel.first_stage_layers, c.parallel.last_stage_layers});
    const std::set<std::pair<int64_t, int64_t>> expected =
        stages == 2 ? std::set<std::pair<int64_t, int64_t>>{{31, 30}} : std::set<std::pair<int64_t, int64_t>>{{7, 6}, {4, 3}};
    for (const auto& e : ends) EXPECT_TRUE(expected.count(e)) << stages << ": " << e.first << "/" << e.second;
  }
}

// T, P, E, S and the placement are chosen together: the joint best is at least as fast as the
// best of each part of the space, and the ranking mixes the degrees.
TEST(Search, ChoosesAmongTensorPipelineExpertAndShardJointly) {
  SearchOptions options = test::search_options(16);
  options.keep = 120;  // each layout with and without the distributed optimizer and the dense shard spanning E
  const SearchResult joint = search(mixtral(), p4d(16), options);
  ASSERT_FALSE(joint.ranked.empty());
  std::set<std::array<int64_t, 4>> degrees;
  for (const Candidate& c : joint.ranked)
    degrees.insert({c.parallel.tensor_parallel_degree, c.parallel.pipeline_parallel_degree,
                    c.parallel.expert_parallel_degree, c.parallel.hybrid_shard_degree});
  EXPECT_GE(degrees.size(), 5u);
  const double best = joint.ranked.front().estimate.tokens_per_s;
  auto best_with = [&](auto pin) {
    SearchOptions o = test::search_options(16);
    pin(o.pins);
    const SearchResult r = search(mixtral(), p4d(16), o);
    return r.ranked.empty() ? 0.0 : r.ranked.front().estimate.tokens_per_s;
  };
  const double rse = best_with([](SearchOptions::Pins& p) {
    p.tensor_parallel_degree = 1;
    p.pipeline_parallel_degree = 1;
  });
  const double no_experts = best_with([](SearchOptions::Pins& p) { p.expert_parallel_degree = 1; });
  const double no_pipeline = best_with([](SearchOptions::Pins& p) { p.pipeline_parallel_degree = 1; });
  EXPECT_GT(rse, 0);
  EXPECT_GE(best, rse);
  EXPECT_GE(best, no_experts);
  EXPECT_GE(best, no_pipeline);
}

// SMP's rule: no expert parallelism together with tensor parallelism in SMP mode.
TEST(Search, SmpModeKeepsExpertAndTensorParallelismApart) {
  SearchOptions options = test::search_options(32);
  options.keep = 50;
  options.target = test::framework_rules("smp");
  // SMP's bf16 = 1: fp32 parameters, bf16 compute and gradient reduction.
  options.training.precision = Precision::kMixed;
  options.training.fp32_gradients = false;
  const SearchResult r = search(mixtral(), p4d(32), options);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) {
    EXPECT_FALSE(c.parallel.expert_parallel_degree > 1 && c.parallel.tensor_parallel_degree > 1) << describe(c.parallel);
    EXPECT_EQ(c.parallel.pipeline_parallel_degree, 1) << describe(c.parallel);
  }
  EXPECT_GT(r.stats.rejected_by_rule[static_cast<size_t>(test::framework_rule("smp", "smp_expert_with_tensor"))], 0);
}

// Eight tensor-parallel ranks on 8-GPU nodes: the placement the search keeps puts each
// tensor group inside a node; SMP's "cluster" pins the order R, S, E, P, T.
TEST(Search, PlacementKeepsTensorGroupsInsideANode) {
  SearchOptions options = test::search_options(16);
  options.pins.tensor_parallel_degree = 8;
  options.pins.pipeline_parallel_degree = 2;
  const SearchResult r = search(mixtral(), p4d(16), options);
  ASSERT_FALSE(r.ranked.empty());
  const Candidate& best = r.ranked.front();
  EXPECT_FALSE(sim::group_shape(p4d(16), best.parallel, MeshDim::kTensor).crosses_nodes()) << describe(best.parallel);
  options.pins.placement = "cluster";
  const SearchResult cluster = search(mixtral(), p4d(16), options);
  ASSERT_FALSE(cluster.ranked.empty());
  for (const Candidate& c : cluster.ranked) EXPECT_EQ(c.parallel.placement.to_string(), "RSEPT");
  // "spread" puts the tensor group farthest apart, across nodes, and is slower.
  options.pins.placement = "spread";
  const SearchResult spread = search(mixtral(), p4d(16), options);
  ASSERT_FALSE(spread.ranked.empty());
  EXPECT_TRUE(sim::group_shape(p4d(16), spread.ranked.front().parallel, MeshDim::kTensor).crosses_nodes());
  EXPECT_LT(spread.ranked.front().estimate.tokens_per_s, best.estimate.tokens_per_s);
}

TEST(Search, EveryCandidateIsAccountedFor) {
  const SearchResult r = search(mixtral(), p4d(16), test::search_options(16));
  const SearchStats& s = r.stats;
  EXPECT_EQ(s.enumerated, s.duplicate_placements + s.rule_rejected + s.rule_valid);
  EXPECT_GE(s.rule_valid, s.fitting);
  EXPECT_GE(s.over_device_memory + s.over_host_memory, s.rule_valid - s.fitting);
  // The three rules that shape this space all removed something.
  EXPECT_GT(s.rejected_by_rule[static_cast<size_t>(Rule::kExpertDegreeDividesExperts)], 0);
  EXPECT_GT(s.rejected_by_rule[static_cast<size_t>(Rule::kShardExpertDividesWorld)], 0);
  EXPECT_GT(s.rejected_by_rule[static_cast<size_t>(Rule::kOffloadNeedsCheckpointing)], 0);
}

TEST(Search, OneGpuCannotHoldMixtral8x7bAndSaysByHowMuch) {
  const ClusterSpec cluster = p4d(1);
  const SearchResult r = search(mixtral(), cluster, test::search_options(1));
  EXPECT_TRUE(r.ranked.empty());
  ASSERT_TRUE(r.stats.closest_over_device.has_value());
  // bf16 model states of 46.7B parameters alone are 8 bytes each: ~348 GiB.
  EXPECT_GT(r.stats.closest_over_device->memory.model_states(), int64_t{46'700'000'000} * 8);
  const auto lines = explain_no_plan(r, cluster);
  ASSERT_FALSE(lines.empty());
  EXPECT_NE(lines[0].find("device memory"), std::string::npos);
  EXPECT_NE(lines[0].find("over by"), std::string::npos);
}

TEST(Search, IsDeterministic) {
  const ClusterSpec cluster = p4d(16);
  const SearchOptions options = test::search_options(16);
  const std::string a = plan_to_text(make_plan(mixtral(), cluster, options, search(mixtral(), cluster, options), "x"));
  const std::string b = plan_to_text(make_plan(mixtral(), cluster, options, search(mixtral(), cluster, options), "x"));
  EXPECT_EQ(a, b);
}

TEST(Search, WrittenPlanReadsBackEqual) {
  const ClusterSpec cluster = p4d(16);
  const SearchOptions options = test::search_options(16);
  const Plan plan = make_plan(mixtral(), cluster, options, search(mixtral(), cluster, options), "x");
  const Plan back = plan_from_json(Json::parse(plan_to_text(plan)), "plan.json");
  EXPECT_EQ(back, plan);
  EXPECT_EQ(plan_to_text(back), plan_to_text(plan));
}

TEST(Search, MorePrecisionNeedsMoreGpus) {
  // fp32 master weights and moments take 18 bytes per parameter: 46.7B x 18 = 841 GB, more
  // than the 16 x 40 GiB = 687 GB of two p4d nodes, so only bf16 states (8 bytes) fit there.
  SearchOptions options = test::search_options(16);
  options.training.precision = Precision::kMixed;
  EXPECT_TRUE(search(mixtral(), p4d(16), options).ranked.empty());
  SearchOptions bigger = test::search_options(64);
  bigger.training.precision = Precision::kMixed;
  EXPECT_FALSE(search(mixtral(), p4d(64), bigger).ranked.empty());
}

// The executor trains neither the distributed optimizer nor attention-core recomputation nor
// uneven stages: a search in executor mode leaves them out, one for Megatron-Core tries them
// where they can win (unfused attention, replicas).
TEST(Search, ExecutorModeKeepsToWhatTheExecutorTrains) {
  ClusterSpec cluster = p4d(16);
  cluster.kernels = Kernels::kEager;
  cluster.attention = AttentionKernel::kUnfused;
  SearchOptions options = test::search_options(16);
  options.estimator = Estimator::kAnalytic;
  options.keep = 1000000;
  auto tried = [&](const SearchResult& r) {
    std::pair<bool, bool> seen{false, false};
    for (const Candidate& c : r.ranked) {
      seen.first |= c.parallel.distributed_optimizer;
      seen.second |= c.parallel.activation_checkpointing == Checkpointing::kAttentionCore;
    }
    return seen;
  };
  EXPECT_EQ(tried(search(mixtral(), cluster, options)), std::make_pair(true, true));
  options.target = executor_target();
  EXPECT_EQ(tried(search(mixtral(), cluster, options)), std::make_pair(false, false));
}

TEST(Search, DefaultGlobalBatchIsWholeSequencesPerRank) {
  EXPECT_EQ(default_global_batch_tokens(16, 2048), 4'194'304);
  EXPECT_EQ(default_global_batch_tokens(3, 2048), 4'196'352);  // 683 x 3 x 2048
  EXPECT_EQ(default_global_batch_tokens(4096, 2048), 4096 * 2048);
}

}  // namespace
}  // namespace moeplan::planner

namespace moeplan::planner {
namespace {

// Under balanced routing the draws change nothing: the same plans in the same order, each
// drawn step its own.
TEST(SearchRouting, BalancedDrawsKeepTheRanking) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  SearchOptions options = test::search_options(16);
  options.estimator = Estimator::kAnalytic;  // the draws are what is tested
  options.routing_pool = 8;
  const SearchResult plain = search(model, cluster, options);
  options.routing = "balanced";
  const SearchResult drawn = search(model, cluster, options);
  ASSERT_EQ(drawn.ranked.size(), plain.ranked.size());
  for (size_t i = 0; i < plain.ranked.size(); ++i) {
    EXPECT_EQ(drawn.ranked[i].parallel, plain.ranked[i].parallel) << i;
    ASSERT_TRUE(drawn.ranked[i].routed.has_value());
    EXPECT_EQ(drawn.ranked[i].routed->median_s, plain.ranked[i].estimate.step_time_s);
    EXPECT_EQ(drawn.ranked[i].routed->p95_s, plain.ranked[i].estimate.step_time_s);
    EXPECT_EQ(drawn.ranked[i].routed->tail_device_bytes, plain.ranked[i].memory.device_total);
  }
}

// Skewed routing on 64 H100: the plans come ordered by the quantile asked for, expert-parallel
// plans pay for the wait, and the busiest rank's memory at the p99 load is what is checked.
TEST(SearchRouting, SkewRanksByTheQuantileAskedFor) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p5.48xlarge", 64);
  SearchOptions options = test::search_options(64);
  options.estimator = Estimator::kAnalytic;  // the draws are what is tested; the simulator takes longer
  options.routing = "skew:1.3";
  options.routing_pool = 12;
  options.routing_draws = 8;
  for (RankBy by : {RankBy::kMedian, RankBy::kP95}) {
    options.rank_by = by;
    const SearchResult r = search(model, cluster, options);
    ASSERT_FALSE(r.ranked.empty());
    for (size_t i = 0; i < r.ranked.size(); ++i) {
      const Candidate& c = r.ranked[i];
      ASSERT_TRUE(c.routed.has_value());
      if (i > 0) {
        EXPECT_LE(r.ranked[i - 1].routed->ranked_s(by), c.routed->ranked_s(by));
      }
      EXPECT_GE(c.routed->p95_s, c.routed->median_s);
      EXPECT_LE(c.routed->tail_device_bytes, cluster.usable_memory_bytes());
      if (c.parallel.expert_parallel_degree > 1) {
        EXPECT_GT(c.routed->median_s, c.estimate.step_time_s) << describe(c.parallel);
        EXPECT_GT(c.routed->load_p99, 1.0);
        EXPECT_GE(c.routed->tail_device_bytes, c.memory.device_total);
      }
    }
  }
}

// Capacity factors listed for Mixtral 8x7B on 16 A100 under a skewed router (the busiest expert
// 1.5 times the mean): dropless drops
// nothing, factor 1 drops the hot experts' excess; with no dropping allowed the dropless plan is
// planned, with any allowed the fastest best plan is.
TEST(SearchRouting, CapacityFactorsListedAreEachSearched) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  SearchOptions options = test::search_options(16);
  options.estimator = Estimator::kAnalytic;
  options.routing = "skew:1.5";
  options.routing_pool = 4;
  options.routing_draws = 4;
  const std::vector<double> factors{0, 1.0, 1.5};
  const CapacityChoices strict = choose_capacity_factor(model, cluster, options, factors, 0.0);
  ASSERT_EQ(strict.factors.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const CapacityChoice& c = strict.factors[i];
    EXPECT_EQ(c.options.moe.capacity_factor, factors[i]);
    ASSERT_FALSE(c.result.ranked.empty()) << factors[i];
    EXPECT_GT(c.step_s, 0);
    EXPECT_EQ(c.step_s, c.result.ranked.front().routed->median_s);
  }
  EXPECT_EQ(strict.factors[0].dropped_fraction, 0.0);
  EXPECT_GT(strict.factors[1].dropped_fraction, 0.0);
  EXPECT_GE(strict.factors[1].dropped_fraction, strict.factors[2].dropped_fraction);
  EXPECT_EQ(strict.chosen, std::optional<size_t>(0));
  const CapacityChoices any = choose_capacity_factor(model, cluster, options, factors, 1.0);
  ASSERT_TRUE(any.chosen.has_value());
  for (const CapacityChoice& c : any.factors) EXPECT_LE(any.factors[*any.chosen].step_s, c.step_s);
}

// The plans drawn include the best of every expert degree, not only the best by the balanced
// step: on 64 A100 the best few balanced plans are all expert-parallel, and under skew the plan
// that waits for nobody (E1) wins although its balanced step is behind theirs.
TEST(SearchRouting, EveryExpertDegreeIsDrawn) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 64);
  SearchOptions options = test::search_options(64);
  options.estimator = Estimator::kAnalytic;
  options.routing_pool = 4;
  options.routing_draws = 8;
  const SearchResult balanced = search(model, cluster, options);
  for (size_t i = 0; i < 4 && i < balanced.ranked.size(); ++i)
    ASSERT_GT(balanced.ranked[i].parallel.expert_parallel_degree, 1) << "the case needs expert-parallel leaders";
  options.routing = "skew:2";
  const SearchResult skewed = search(model, cluster, options);
  ASSERT_FALSE(skewed.ranked.empty());
  EXPECT_EQ(skewed.ranked.front().parallel.expert_parallel_degree, 1) << describe(skewed.ranked.front().parallel);
}

TEST(SearchRouting, BadRoutingIsRefusedNamingTheFlag) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  SearchOptions options = test::search_options(16);
  options.routing = "skew:one";
  try {
    search(model, cluster, options);
    FAIL() << "skew:one was taken";
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), "--routing");
  }
  options.routing = "skew:8";  // the busiest of 8 experts cannot take 8 times the mean
  try {
    search(model, cluster, options);
    FAIL() << "skew:8 was taken for 8 experts";
  } catch (const InputError& e) {
    EXPECT_EQ(e.lines().front(), "--routing: = skew:8: the busiest of 8 experts takes less than 8 times the mean share");
  }
}

}  // namespace
}  // namespace moeplan::planner
