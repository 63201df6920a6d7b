// The frameworks' registry: one entry per framework, named as --target names it; the settings a
// plan for it starts from; what the search leaves untried for it, refused by its own rules.
#include "moeplan/frameworks/framework.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "moeplan/core/errors.h"
#include "moeplan/frameworks/training_log.h"
#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan {
namespace {

TEST(Frameworks, EachHasOneEntryFoundByItsNameAndItsRules) {
  std::set<std::string_view> names;
  std::set<Target> targets;
  for (const Framework* f : all_frameworks()) {
    EXPECT_TRUE(names.insert(f->name).second) << f->name;
    EXPECT_NE(f->target, nullptr) << f->name;
    EXPECT_TRUE(targets.insert(f->target).second) << f->name;
    EXPECT_EQ(&framework(f->target), f) << f->name;
    EXPECT_EQ(find_framework(f->name), f) << f->name;
  }
  EXPECT_EQ(names, (std::set<std::string_view>{"smp", "megatron", "torchtitan", "moeplan"}));
  EXPECT_EQ(executor_framework().name, "moeplan");
  // `any` stands for no framework: found by its name and by no rules, listed with none.
  EXPECT_EQ(framework(nullptr).name, "any");
  EXPECT_EQ(find_framework("any"), &framework(nullptr));
  EXPECT_EQ(find_framework("pytorch"), nullptr);
}

TEST(Frameworks, LaunchFilesAndLogsAreTheOtherFrameworks) {
  for (const Framework* f : all_frameworks()) {
    const bool other = f != &executor_framework();
    EXPECT_EQ(f->export_launch != nullptr, other) << f->name;
    EXPECT_EQ(f->read_log_line != nullptr, other) << f->name;
    EXPECT_EQ(f->log_lines.empty(), !other) << f->name;
  }
  EXPECT_EQ(framework(nullptr).export_launch, nullptr);
  EXPECT_EQ(framework(nullptr).read_log_line, nullptr);
}

// A log with no framework's lines is refused naming every framework's, in the registry's order.
TEST(Frameworks, ALogOfNoFrameworkNamesEveryFrameworksLines) {
  try {
    parse_training_log("epoch 1 done\n", "run.log");
    FAIL() << "a log without iteration lines must be refused";
  } catch (const InputError& e) {
    ASSERT_EQ(e.lines().size(), 1u);
    EXPECT_EQ(e.lines()[0],
              "run.log: holds no iteration line of Megatron-LM (\"iteration N/M | ... elapsed time per iteration (ms): "
              "...\"), torchtitan (\"step: N  loss: ...  tps: ...\"), SMP's example script (\"Batch N Loss: ..., "
              "Speed: ... samples/sec\") or the Hugging Face Trainer ({'train_runtime': ..., "
              "'train_steps_per_second': ...})");
  }
}

// What `moeplan search --target X` trains with unless told otherwise: Megatron-LM's, torchtitan's
// and SMP's bf16 keep fp32 parameters (mixed); SMP reduces gradients in bf16; Megatron-LM and
// torchtitan balance experts with an auxiliary loss.
TEST(Frameworks, DefaultsAreWhatAPlanForTheFrameworkStartsFrom) {
  struct Expected {
    std::string_view name;
    Precision precision;
    bool fp32_gradients;
    LoadBalancing load_balancing;
  };
  for (const Expected& e : {Expected{"any", Precision::kBf16, true, LoadBalancing::kSinkhorn},
                            Expected{"moeplan", Precision::kBf16, true, LoadBalancing::kSinkhorn},
                            Expected{"megatron", Precision::kMixed, true, LoadBalancing::kAuxLoss},
                            Expected{"smp", Precision::kMixed, false, LoadBalancing::kSinkhorn},
                            Expected{"torchtitan", Precision::kMixed, true, LoadBalancing::kAuxLoss}}) {
    TrainingConfig training;
    training.precision = Precision::kFp32;
    training.fp32_gradients = !e.fp32_gradients;
    MoeConfig moe;
    moe.load_balancing = LoadBalancing::kNone;
    const TrainingConfig untouched = training;
    apply_defaults(*find_framework(e.name), training, moe);
    SCOPED_TRACE(std::string(e.name));
    EXPECT_EQ(training.precision, e.precision);
    EXPECT_EQ(training.fp32_gradients, e.fp32_gradients);
    EXPECT_EQ(moe.load_balancing, e.load_balancing);
    EXPECT_EQ(training.seq_len, untouched.seq_len);  // nothing else changes
  }
}

// A search for each framework with its defaults finds plans that keep its rules; what the search
// does not try for it, its own rules refuse (the capabilities save the search time and change
// no plan it finds).
TEST(Frameworks, WhatTheSearchLeavesUntriedTheFrameworksRulesRefuse) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p5.48xlarge", 16);
  for (const Framework* f : all_frameworks()) {
    planner::SearchOptions options = test::search_options(16);
    apply_defaults(*f, options.training, options.moe);
    options.target = f->target;
    const planner::SearchResult result = planner::search(model, cluster, options);
    ASSERT_FALSE(result.ranked.empty()) << f->name;
    const ParallelConfig found = result.ranked.front().parallel;
    // The rules only the framework's target adds.
    auto own_rules = [&](const ParallelConfig& p) {
      const RunConfig config{model, cluster, p, options.moe, options.training, f->target};
      const RunConfig anywhere{model, cluster, p, options.moe, options.training, nullptr};
      return violated_rules(config) & ~violated_rules(anywhere);
    };
    ASSERT_EQ(own_rules(found), 0u) << f->name;
    const FrameworkCapabilities& can = f->capabilities;
    ParallelConfig p = found;
    p.activation_checkpointing = Checkpointing::kAttentionCore;
    if (!can.attention_core_recomputation) {
      EXPECT_NE(own_rules(p), 0u) << f->name << ": attention core";
    }
    p = found;
    p.first_stage_layers = 1;
    if (!can.uneven_pipeline_stages) {
      EXPECT_NE(own_rules(p), 0u) << f->name << ": uneven stages";
    }
    p = found;
    p.distributed_optimizer = true;
    if (!can.distributed_optimizer) {
      EXPECT_NE(own_rules(p), 0u) << f->name << ": distributed optimizer";
    }
  }
}

}  // namespace
}  // namespace moeplan
