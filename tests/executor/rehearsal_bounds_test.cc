// What a rehearsal compares its layout with one rank by (rehearsal_bounds.h, routing_record.h):
// the rounding budgets of a small model worked by hand, the AdamW arithmetic the state check
// redoes against the executor's own AdamW, a replayed routing that reproduces a forward pass bit
// for bit, and a routing record written, read and replayed.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "moeplan/core/errors.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/model/routing_record.h"
#include "moeplan/executor/rehearsal/rehearsal_bounds.h"
#include "moeplan/executor/training/optimizer.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

using test::input_error_of;

ModelSpec bounds_spec() {
  ModelSpec s = test::model("mixtral-tiny");
  s.vocab_size = 50;
  s.hidden_size = 16;
  s.intermediate_size = 24;
  s.num_layers = 2;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.head_dim = 8;
  s.num_experts = 4;
  s.experts_per_token = 2;
  s.initializer_range = 0.3;  // routing far from uniform
  return s;
}

TEST(RoundingBudget, SmallModelByHand) {
  // H 16, intermediate 24, q width 4 x 8 = 32, key-value width 2 x 8 = 16, head_dim 8, T 9,
  // E 4, k 2, vocabulary 50, 2 layers, 36 tokens a step, 1000 parameters.
  // Up to a router: (H + 3H + hd + 2T + q + 2 + H + H) / 2 = (16+48+8+18+32+2+16+16) / 2 = 78.
  // The rest of a block: (E + k + 2H + I + k + 2) / 2 = (4+2+32+24+2+2) / 2 = 33.
  // Backward of a block: (H + 2I + H + 2E + H + H + hd + 4T + q + 2kv + H + 4) / 2
  //   = (16+48+16+8+16+16+8+36+32+32+16+4) / 2 = 124.
  const RoundingBudget b = rounding_budget(bounds_spec(), 9, 36, 1000);
  ASSERT_EQ(b.router.size(), 2u);
  EXPECT_DOUBLE_EQ(b.router[0], 78);
  EXPECT_DOUBLE_EQ(b.router[1], 78 + 33 + 78);
  EXPECT_DOUBLE_EQ(b.logits, 2 * 111 + (16 + 16 + 50) / 2.0);  // 263
  EXPECT_DOUBLE_EQ(b.backward, (50 + 16) / 2.0 + 2 * 124);     // 281
  EXPECT_DOUBLE_EQ(b.tokens, 18);
  EXPECT_DOUBLE_EQ(b.loss_mean, 18);
  EXPECT_DOUBLE_EQ(b.router_rows, 36);
  EXPECT_DOUBLE_EQ(b.parameters, 500);
}

TEST(RoundingBound, LambdaFromTheFalseAlarmProbability) {
  // 2 m exp(-lambda^2 / 2) = p: one comparison at 1e-6 gives sqrt(2 ln 2e6) = 5.3868.
  const RoundingBound one(1, 1e-6);
  EXPECT_NEAR(one.lambda(), 5.3868, 1e-4);
  // lambda u sqrt(2 K): K = 50 gives 10 lambda u.
  EXPECT_DOUBLE_EQ(one.of(50), 10 * one.lambda() * kUnitRoundoff);
  // A million times the comparisons: lambda grows by sqrt(2 ln 1e6) only in quadrature.
  EXPECT_NEAR(RoundingBound(1e6, 1e-6).lambda(), std::sqrt(2 * std::log(2e12)), 1e-12);
}

// Two steps of the executor's AdamW (fused, fp32) on random values: each step's state follows
// from the one before within the rounding the checks allow, and a state one element off does not.
void expect_adamw_steps_within_rounding(bool masks) {
  torch::manual_seed(5);
  const int64_t n = 4096;
  torch::Tensor p = torch::randn({n}) * 0.02;
  const AdamWSettings settings{0.9, 0.95, 1e-8, 0.1};
  AdamW adam =
      masks ? AdamW::with_decay_runs({p}, {runs_of(torch::rand({n}) < 0.5)}, settings) : AdamW({p}, {true}, settings);
  for (int64_t step = 1; step <= 2; ++step) {
    const torch::Tensor p_prev = p.clone(), m_prev = adam.exp_avg()[0].clone(), v_prev = adam.exp_avg_sq()[0].clone();
    // Gradients of every size, some exactly zero.
    torch::Tensor g = torch::randn({n}) * torch::pow(10.0, torch::randint(-8, 0, {n}).to(torch::kFloat));
    g.index_put_({torch::indexing::Slice(0, 16)}, 0.0);
    const double lr = 1e-3 * static_cast<double>(step);
    adam.step({g}, lr);
    const torch::Tensor m = adam.exp_avg()[0], v = adam.exp_avg_sq()[0];
    const RecoveredGradient recovered = recovered_gradient(m, m_prev, 0.9);
    EXPECT_TRUE(((recovered.gradient - g.to(torch::kDouble)).abs() <= recovered.error).all().item<bool>());
    const AdamWStep a{lr, 0.9, 0.95, 1e-8, 0.1, step, true};
    EXPECT_LE(second_moment_mismatch(v, v_prev, recovered, a), 1.0);
    if (!masks) {
      EXPECT_LE(parameter_mismatch(p, p_prev, m, v, a), 1.0);
      // Without decay the same state is not AdamW's step.
      EXPECT_GT(parameter_mismatch(p, p_prev, m, v, AdamWStep{lr, 0.9, 0.95, 1e-8, 0.1, step, false}), 1.0);
    }
    // Saved one element off.
    EXPECT_GT(parameter_mismatch(torch::roll(p, 1), p_prev, m, v, a), 1.0);
    EXPECT_GT(second_moment_mismatch(torch::roll(v, 1), v_prev, recovered, a), 1.0);
  }
}

TEST(AdamWState, EachStepFollowsFromTheOneBeforeWithinRounding) { expect_adamw_steps_within_rounding(false); }
TEST(AdamWState, SecondMomentsFollowWithDecayMasks) { expect_adamw_steps_within_rounding(true); }

ParameterSet random_model(const ModelSpec& s) {
  ParameterSet p = ParameterSet::on_meta(mixtral_parameters(s));
  p.materialize(11, torch::kFloat);
  return p;
}

// The experts route() chose in each layer of a forward pass, replayed.
RouteOverride replay_of(const ForwardResult& out, int64_t k, LoadBalancing method) {
  return [&out, k, method](int64_t layer, const torch::Tensor&) {
    const torch::Tensor& logits = out.router_logits[static_cast<size_t>(layer)];
    return ChosenExperts{route(logits, k, method).experts,
                         std::get<1>(torch::topk(torch::softmax(logits, -1, torch::kFloat), k, -1)), {}};
  };
}

TEST(RoutingReplay, ReplayingRoutesOwnChoiceGivesTheSameForwardBitForBit) {
  const ModelSpec s = bounds_spec();
  const ParameterSet p = random_model(s);
  const MixtralWeights w = MixtralWeights::bind(s, p.tensors());
  torch::manual_seed(3);
  const torch::Tensor ids = torch::randint(s.vocab_size, {2, 9}, torch::kLong);
  for (const LoadBalancing method : {LoadBalancing::kAuxLoss, LoadBalancing::kSinkhorn}) {
    const ForwardResult own = mixtral_forward(s, w, ids, method);
    const ForwardResult replayed = mixtral_forward(s, w, ids, method, replay_of(own, s.experts_per_token, method));
    EXPECT_TRUE(torch::equal(own.logits, replayed.logits));
    EXPECT_TRUE(torch::equal(own.tokens_per_expert, replayed.tokens_per_expert));
    ASSERT_EQ(replayed.top_k.size(), 2u);
    MoeConfig moe;
    moe.load_balancing = method;
    EXPECT_EQ(mixtral_loss(s, moe, own, ids).aux.item<double>(), mixtral_loss(s, moe, replayed, ids).aux.item<double>());
    // One token of layer 0 sent to another expert: another function.
    const ForwardResult moved = mixtral_forward(s, w, ids, method, [&](int64_t layer, const torch::Tensor& logits) {
      ChosenExperts c = replay_of(own, s.experts_per_token, method)(layer, logits);
      if (layer == 0) {
        const int64_t a = c.experts[0][0].item<int64_t>(), b = c.experts[0][1].item<int64_t>();
        int64_t other = 0;
        while (other == a || other == b) ++other;
        c.experts[0][0] = other;
      }
      return c;
    });
    EXPECT_FALSE(torch::equal(own.logits, moved.logits));
    EXPECT_FALSE(torch::equal(own.tokens_per_expert, moved.tokens_per_expert));
  }
}

TEST(RoutingRecord, TheReferenceReplaysWhatTheLayoutRecorded) {
  const test::TempDir dir;
  const ModelSpec s = bounds_spec();
  const int64_t k = s.experts_per_token, tokens = 8;
  torch::manual_seed(9);
  // Two ranks of a layout: rank 0 routed micro-batch 0, rank 1 micro-batch 1, both layers.
  std::vector<torch::Tensor> logits;
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t l = 0; l < 2; ++l) logits.push_back(torch::randn({tokens, s.num_experts}));
  for (int64_t rank = 0; rank < 2; ++rank) {
    RoutingRecorder recorder(dir.file("routing"), rank);
    for (int64_t l = 0; l < 2; ++l) {
      const torch::Tensor& z = logits[static_cast<size_t>(2 * rank + l)];
      torch::Tensor chosen = route(z, k, LoadBalancing::kAuxLoss).experts;
      // Rank 1 sends layer 1's first token elsewhere than its logits say.
      if (rank == 1 && l == 1) {
        int64_t other = 0;
        while (other == chosen[0][0].item<int64_t>() || other == chosen[0][1].item<int64_t>()) ++other;
        chosen[0][1] = other;
      }
      recorder.add(rank, l, z, chosen);
    }
    recorder.write(1);
  }
  EXPECT_TRUE(std::filesystem::exists(dir.file("routing/step-00000001/rank-00001.safetensors")));
  RoutingReplay replay(dir.file("routing"), dir.file("routing-replay.json"), s, LoadBalancing::kAuxLoss);
  EXPECT_NE(input_error_of([&] { replay.start_step(2); }).find("no routing record of step 2"),
            std::string::npos);
  replay.start_step(1);
  // The reference's own logits: the layout's plus 1e-3 in every element of micro-batch 0.
  const torch::Tensor noise = torch::full({tokens, s.num_experts}, 1e-3);
  const ChosenExperts c = replay.micro_batch(0)(0, logits[0] + noise);
  EXPECT_TRUE(torch::equal(c.experts, route(logits[0], k, LoadBalancing::kAuxLoss).experts));
  replay.micro_batch(0)(1, logits[1]);
  replay.micro_batch(1)(0, logits[2]);
  replay.micro_batch(1)(1, logits[3]);
  replay.micro_batch(2)(0, logits[0]);  // never recorded: routed by the reference itself
  replay.finish_step();
  const std::vector<ReplayedStep> steps = read_replayed_steps(dir.file("routing-replay.json"));
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].step, 1);
  EXPECT_EQ(steps[0].slots, 5 * tokens * k);
  EXPECT_EQ(steps[0].unrecorded, 1);
  EXPECT_EQ(steps[0].unlike_route, 1);  // the one slot rank 1 moved
  EXPECT_EQ(steps[0].near_ties, 1);     // the reference's own routing would not have moved it
  // RMS over tokens of the difference's norm: sqrt(4 experts x 1e-6) = 2e-3 (to the rounding
  // of the fp32 sum z + 1e-3, at most 2^-24 of |z| < 8 in each element).
  EXPECT_NEAR(steps[0].logit_difference[0], 2e-3, 1e-6);
  EXPECT_EQ(steps[0].logit_difference_micro_batch[0], 0);
  EXPECT_EQ(steps[0].logit_difference[1], 0);
}

TEST(RehearsalFault, TheTestHookNamesKnownFaultsOnly) {
  ::unsetenv(kRehearsalFaultVariable);
  EXPECT_EQ(rehearsal_fault_from_environment(), RehearsalFault::kNone);
  ::setenv(kRehearsalFaultVariable, "shard-off-by-one", 1);
  EXPECT_EQ(rehearsal_fault_from_environment(), RehearsalFault::kShardOffByOne);
  ::setenv(kRehearsalFaultVariable, "everything", 1);
  EXPECT_NE(input_error_of([] { rehearsal_fault_from_environment(); }).find("expert-on-wrong-rank"),
            std::string::npos);
  ::unsetenv(kRehearsalFaultVariable);
}

}  // namespace
}  // namespace moeplan::executor
