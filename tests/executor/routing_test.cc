// Router losses on crafted logits, worked by hand; load balancing on random logits.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "moeplan/executor/model/routing.h"

namespace moeplan::executor {
namespace {

// Four tokens, two experts. ln 3 vs 0 gives probabilities 0.75 / 0.25.
torch::Tensor crafted_logits() {
  const double l3 = std::log(3.0);
  return torch::tensor({l3, 0.0, l3, 0.0, 0.0, l3, l3, 0.0}, torch::kFloat).view({4, 2});
}

TEST(RouterLoss, AuxLossTop1ByHand) {
  // Top-1 picks expert 0 for tokens 1, 2, 4 and expert 1 for token 3: f = (3/4, 1/4).
  // Mean probabilities P = ((.75+.75+.25+.75)/4, (.25+.25+.75+.25)/4) = (.625, .375).
  // aux = E * sum f P = 2 * (.75 * .625 + .25 * .375) = 2 * .5625 = 1.125.
  EXPECT_NEAR(load_balancing_loss({crafted_logits()}, 1).item<double>(), 1.125, 1e-6);
}

TEST(RouterLoss, AuxLossTop2ByHand) {
  // Top-2 of two experts: slot 0 as above f0 = (.75, .25), slot 1 the other expert f1 = (.25, .75).
  // sum = (.75*.625 + .25*.375) + (.25*.625 + .75*.375) = .5625 + .4375 = 1; times E = 2.
  EXPECT_NEAR(load_balancing_loss({crafted_logits()}, 2).item<double>(), 2.0, 1e-6);
}

TEST(RouterLoss, AuxLossConcatenatesLayers) {
  // A second layer with uniform logits: P = (.5, .5). Top-1 ties go to expert 0 (topk keeps the
  // first), so over 8 tokens f = (7/8, 1/8), P = ((.625*4 + .5*4)/8, (.375*4 + .5*4)/8) = (.5625, .4375).
  // aux = 2 * (7/8 * .5625 + 1/8 * .4375) = 2 * (.4921875 + .0546875) = 1.09375.
  const torch::Tensor uniform = torch::zeros({4, 2});
  EXPECT_NEAR(load_balancing_loss({crafted_logits(), uniform}, 1).item<double>(), 1.09375, 1e-6);
}

TEST(RouterLoss, ZLossByHand) {
  // logsumexp(ln 3, 0) = ln 4 for every crafted token; logsumexp(0, 0) = ln 2.
  const double ln4 = std::log(4.0), ln2 = std::log(2.0);
  EXPECT_NEAR(router_z_loss({crafted_logits()}).item<double>(), ln4 * ln4, 1e-6);
  EXPECT_NEAR(router_z_loss({crafted_logits(), torch::zeros({4, 2})}).item<double>(), (ln4 * ln4 + ln2 * ln2) / 2, 1e-6);
}

// A pipeline's stages each sum their layers' part: two stages' sums added give the losses of all
// the layers at once.
TEST(RouterLoss, SumsOfStagesGiveTheLossesOfAllLayers) {
  torch::manual_seed(3);
  const std::vector<torch::Tensor> layers{torch::randn({6, 4}), torch::randn({6, 4}), torch::randn({6, 4})};
  const double aux = load_balancing_loss(layers, 2).item<double>(), z = router_z_loss(layers).item<double>();
  const torch::Tensor sums = router_loss_sums({layers[0]}, 2, 4) + router_loss_sums({layers[1], layers[2]}, 2, 4);
  const auto [aux_of_sums, z_of_sums] = router_losses_of_sums(sums, 2, 4);
  EXPECT_NEAR(aux_of_sums, aux, 1e-6);
  EXPECT_NEAR(z_of_sums, z, 1e-5);
  // One stage alone is another set of layers: its losses are not all of them.
  const auto [aux_first, z_first] = router_losses_of_sums(router_loss_sums({layers[0]}, 2, 4), 2, 4);
  EXPECT_GT(std::abs(aux_first - aux) + std::abs(z_first - z), 1e-4);
  EXPECT_EQ(router_losses_of_sums(router_loss_sums({}, 2, 4), 2, 4), std::make_pair(0.0, 0.0));
}

TEST(Routing, TopKRenormalisesTheChosenProbabilities) {
  const torch::Tensor logits = torch::tensor({0.0, std::log(2.0), std::log(5.0)}, torch::kFloat).view({1, 3});
  const Routing r = route(logits, 2, LoadBalancing::kAuxLoss);
  // Probabilities 1/8, 2/8, 5/8: top-2 are experts 2 and 1, renormalised to 5/7 and 2/7.
  EXPECT_EQ(r.experts[0][0].item<int64_t>(), 2);
  EXPECT_EQ(r.experts[0][1].item<int64_t>(), 1);
  EXPECT_NEAR(r.weights[0][0].item<double>(), 5.0 / 7, 1e-6);
  EXPECT_NEAR(r.weights[0][1].item<double>(), 2.0 / 7, 1e-6);
}

// DeepSeekMoE's, DeepSeek-V2's and Qwen2-MoE's routers (norm_topk_prob false): each chosen
// expert keeps its own probability, times the scaling; a sigmoid router's keep their scores.
TEST(Routing, WithoutRenormalisingEachExpertKeepsItsOwnProbability) {
  const torch::Tensor logits = torch::tensor({0.0, std::log(2.0), std::log(5.0)}, torch::kFloat).view({1, 3});
  RouterShape router{2};
  router.renormalise = false;
  router.scaling = 3.0;
  const Routing r = route(logits, router, LoadBalancing::kAuxLoss);
  // Probabilities 1/8, 2/8, 5/8: experts 2 and 1, weighted 5/8 and 2/8, times 3.
  EXPECT_EQ(r.experts[0][0].item<int64_t>(), 2);
  EXPECT_EQ(r.experts[0][1].item<int64_t>(), 1);
  EXPECT_NEAR(r.weights[0][0].item<double>(), 3 * 5.0 / 8, 1e-6);
  EXPECT_NEAR(r.weights[0][1].item<double>(), 3 * 2.0 / 8, 1e-6);
  EXPECT_TRUE(torch::allclose(route_to(logits, r.experts, router).weights, r.weights, 1e-6, 1e-6));
  // Sinkhorn's choice, weighted likewise by the softmax probabilities of the chosen.
  const Routing s = route(logits, router, LoadBalancing::kSinkhorn);
  const torch::Tensor probs = torch::softmax(logits, 1);
  EXPECT_TRUE(torch::allclose(s.weights, torch::gather(probs, 1, s.experts) * 3.0, 1e-6, 1e-6));
  // Sigmoid scores: sigmoid(0) = 1/2, sigmoid(log 2) = 2/3, sigmoid(log 5) = 5/6.
  router.scoring = RouterScoring::kSigmoid;
  router.scaling = 1.0;
  const Routing g = route(logits, router, LoadBalancing::kAuxLoss);
  EXPECT_NEAR(g.weights[0][0].item<double>(), 5.0 / 6, 1e-6);
  EXPECT_NEAR(g.weights[0][1].item<double>(), 2.0 / 3, 1e-6);
}

// Token-expert slots per expert.
std::vector<int64_t> load_of(const Routing& r, int64_t experts) {
  const torch::Tensor counts = torch::bincount(r.experts.flatten(), {}, experts);
  return std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + experts);
}

double spread(const std::vector<int64_t>& load) {  // (max - min) / mean
  const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / static_cast<double>(load.size());
  return static_cast<double>(*hi - *lo) / mean;
}

// Random router logits with a strong preference for the first experts, as an untrained or
// collapsing router has.
torch::Tensor skewed_logits(int64_t tokens, int64_t experts) {
  torch::manual_seed(3);
  return torch::randn({tokens, experts}) + torch::linspace(2.0, 0.0, experts).unsqueeze(0);
}

TEST(Routing, SinkhornBalancesExpertsWithinTenPercent) {
  const torch::Tensor logits = skewed_logits(4096, 8);
  const auto plain = load_of(route(logits, 2, LoadBalancing::kNone), 8);
  const auto balanced = load_of(route(logits, 2, LoadBalancing::kSinkhorn), 8);
  EXPECT_GT(spread(plain), 1.0) << "the test logits must be unbalanced to begin with";
  EXPECT_LE(spread(balanced), 0.10);
  EXPECT_EQ(std::accumulate(balanced.begin(), balanced.end(), int64_t{0}), 4096 * 2);
}

TEST(Routing, SinkhornOnUnskewedRandomLogits) {
  torch::manual_seed(4);
  const auto load = load_of(route(torch::randn({2048, 8}), 2, LoadBalancing::kSinkhorn), 8);
  EXPECT_LE(spread(load), 0.10);
}

TEST(Routing, SinkhornBalancesPeakedLogitsOfATrainedRouter) {
  // Logits ten times larger, as a trained router produces: an absolute stopping rule would stop
  // after one round with the experts still far apart.
  const torch::Tensor logits = skewed_logits(2048, 8) * 10;
  EXPECT_LE(spread(load_of(route(logits, 2, LoadBalancing::kSinkhorn), 8)), 0.10);
}

TEST(Routing, BalancedRespectsCapacity) {
  const torch::Tensor logits = skewed_logits(1000, 8);
  const Routing r = route(logits, 2, LoadBalancing::kBalanced);
  const auto load = load_of(r, 8);
  for (const int64_t l : load) EXPECT_LE(l, 250);  // ceil(1000 * 2 / 8)
  // Every token has two different experts.
  EXPECT_TRUE(torch::all(r.experts.select(1, 0) != r.experts.select(1, 1)).item<bool>());
  EXPECT_NEAR(r.weights.sum(1).mean().item<double>(), 1.0, 1e-6);
}

TEST(Routing, ChoiceCarriesNoGradientButWeightsDo) {
  torch::Tensor logits = skewed_logits(64, 4).requires_grad_(true);
  const Routing r = route(logits, 2, LoadBalancing::kSinkhorn);
  r.weights.select(1, 0).sum().backward();
  ASSERT_TRUE(logits.grad().defined());
  EXPECT_GT(logits.grad().abs().sum().item<double>(), 0);
}


// Megatron-Core's get_capacity(tokens x k, experts, factor): ceil(tokens x k / experts x factor).
TEST(Capacity, IsMegatronsGetCapacity) {
  EXPECT_EQ(expert_capacity(2048, 2, 8, 1.0), 512);
  EXPECT_EQ(expert_capacity(2048, 2, 8, 1.25), 640);
  EXPECT_EQ(expert_capacity(10, 2, 8, 1.0), 3);  // 2.5 rounds up
  EXPECT_EQ(expert_capacity(7, 1, 3, 1.5), 4);   // 3.5 rounds up
}

// Six tokens all routed to expert 0 (top-1 of two experts) with falling probability: at factor
// 1 expert 0 keeps ceil(6 / 2) = 3 of them, the three most probable (probs) or the first three
// (position).
Routing six_tokens_on_expert_zero() {
  Routing r;
  r.experts = torch::zeros({6, 1}, torch::kLong);
  r.weights = torch::tensor({0.6f, 0.9f, 0.7f, 0.95f, 0.55f, 0.8f}).view({6, 1});
  return r;
}

TEST(Capacity, ProbsPolicyKeepsTheMostProbableSlots) {
  const torch::Tensor kept = kept_slots(six_tokens_on_expert_zero(), 2, 1.0, TokenDropPolicy::kProbs);
  EXPECT_TRUE(torch::equal(kept.flatten(), torch::tensor({false, true, false, true, false, true})));
}

TEST(Capacity, PositionPolicyKeepsTheFirstSlots) {
  const torch::Tensor kept = kept_slots(six_tokens_on_expert_zero(), 2, 1.0, TokenDropPolicy::kPosition);
  EXPECT_TRUE(torch::equal(kept.flatten(), torch::tensor({true, true, true, false, false, false})));
}

TEST(Capacity, DroplessAndRoomyFactorsKeepEverySlot) {
  EXPECT_TRUE(kept_slots(six_tokens_on_expert_zero(), 2, 0, TokenDropPolicy::kProbs).all().item<bool>());
  EXPECT_TRUE(kept_slots(six_tokens_on_expert_zero(), 2, 2.0, TokenDropPolicy::kProbs).all().item<bool>());
}

// DeepSeek-V3's router by hand, one token at a time in plain arithmetic (transformers'
// DeepseekV3MoE.route_tokens_to_experts): sigmoid scores, plus the bias for the choice; each
// group scored by its two best; the best groups kept, the others' choice scores 0; the top-k of
// what is left, weighted by their scores without the bias, renormalised and scaled.
struct HandRouted {
  std::vector<int64_t> experts;  // in falling order of choice score
  std::vector<double> weights;
};
HandRouted route_by_hand(const std::vector<double>& logits, const std::vector<double>& bias, int64_t k, int64_t groups,
                         int64_t group_topk, double scaling) {
  const size_t n = logits.size(), per = n / static_cast<size_t>(groups);
  std::vector<double> score(n), choice(n);
  for (size_t e = 0; e < n; ++e) {
    score[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    choice[e] = score[e] + bias[e];
  }
  std::vector<std::pair<double, size_t>> group_score;
  for (size_t g = 0; g < static_cast<size_t>(groups); ++g) {
    std::vector<double> members(choice.begin() + static_cast<std::ptrdiff_t>(g * per),
                                choice.begin() + static_cast<std::ptrdiff_t>((g + 1) * per));
    std::sort(members.rbegin(), members.rend());
    group_score.push_back({members[0] + (per > 1 ? members[1] : 0.0), g});
  }
  std::sort(group_score.rbegin(), group_score.rend());
  std::vector<bool> kept(static_cast<size_t>(groups), false);
  for (int64_t i = 0; i < group_topk; ++i) kept[group_score[static_cast<size_t>(i)].second] = true;
  std::vector<std::pair<double, size_t>> ranked;
  for (size_t e = 0; e < n; ++e) ranked.push_back({kept[e / per] ? choice[e] : 0.0, e});
  std::sort(ranked.rbegin(), ranked.rend());
  HandRouted r;
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    r.experts.push_back(static_cast<int64_t>(ranked[static_cast<size_t>(i)].second));
    sum += score[ranked[static_cast<size_t>(i)].second];
  }
  for (const int64_t e : r.experts) r.weights.push_back(score[static_cast<size_t>(e)] / sum * scaling);
  return r;
}

TEST(Routing, SigmoidRouterChoosesWithinTheBestGroupsByScorePlusBias) {
  torch::manual_seed(11);
  const int64_t tokens = 64, experts = 16, k = 4, groups = 4, group_topk = 2;
  const torch::Tensor logits = torch::randn({tokens, experts}) * 2;
  const torch::Tensor bias = torch::randn({experts}) * 0.3;
  const RouterShape router{k, RouterScoring::kSigmoid, groups, group_topk, 2.5};
  const Routing r = route(logits, router, LoadBalancing::kAuxLoss, bias);
  ASSERT_EQ(r.experts.sizes(), (std::vector<int64_t>{tokens, k}));
  const std::vector<double> b(bias.data_ptr<float>(), bias.data_ptr<float>() + experts);
  int64_t outside_the_plain_top_k = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const torch::Tensor row = logits[t].contiguous();
    const HandRouted hand = route_by_hand(std::vector<double>(row.data_ptr<float>(), row.data_ptr<float>() + experts),
                                          b, k, groups, group_topk, 2.5);
    // The same set of experts, each with its weight (topk may order equal scores either way).
    std::map<int64_t, double> mine, theirs;
    for (int64_t j = 0; j < k; ++j) {
      mine[r.experts[t][j].item<int64_t>()] = r.weights[t][j].item<double>();
      theirs[hand.experts[static_cast<size_t>(j)]] = hand.weights[static_cast<size_t>(j)];
    }
    ASSERT_EQ(mine.size(), theirs.size()) << "token " << t;
    for (const auto& [e, w] : theirs) {
      ASSERT_EQ(mine.count(e), 1u) << "token " << t << " expert " << e;
      EXPECT_NEAR(mine[e], w, 1e-5) << "token " << t << " expert " << e;
    }
    const torch::Tensor plain = std::get<1>(torch::sigmoid(logits[t]).topk(k));
    for (int64_t j = 0; j < k; ++j) outside_the_plain_top_k += (plain == r.experts[t][j]).any().item<bool>() ? 0 : 1;
  }
  // The bias and the groups did change choices: the test would not see them otherwise.
  EXPECT_GT(outside_the_plain_top_k, 0);
  // The weights sum to the scaling; the choice carries no gradient, the weights do.
  EXPECT_TRUE(torch::allclose(r.weights.sum(-1), torch::full({tokens}, 2.5), 1e-5, 1e-5));
  const torch::Tensor leaf = logits.clone().requires_grad_(true);
  route(leaf, router, LoadBalancing::kAuxLoss, bias).weights.sum().backward();
  EXPECT_TRUE(leaf.grad().defined());
  // A replay of the same choice weighs it the same.
  EXPECT_TRUE(torch::allclose(route_to(logits, r.experts, router).weights, r.weights, 1e-6, 1e-6));
}

// The auxiliary-loss-free update: up by the rate below the layer's mean, down above it, still at
// the mean; each layer by its own counts.
TEST(Routing, ExpertBiasMovesTowardsTheExpertsBelowTheMean) {
  torch::Tensor bias = torch::zeros({2, 4});
  const torch::Tensor counts = torch::tensor({{1, 3, 2, 2}, {8, 0, 0, 0}}, torch::kLong);
  update_expert_bias(bias, counts, 0.01);
  const torch::Tensor expected = torch::tensor({{0.01, -0.01, 0.0, 0.0}, {-0.01, 0.01, 0.01, 0.01}}, torch::kFloat);
  EXPECT_TRUE(torch::allclose(bias, expected, 0, 1e-7)) << bias;
  update_expert_bias(bias, counts, 0.01);
  EXPECT_TRUE(torch::allclose(bias, expected * 2, 0, 1e-7)) << bias;
}

// Under sigmoid scoring the load-balancing loss averages each token's scores normalised to sum 1.
TEST(RouterLoss, SigmoidScoresNormalisedPerToken) {
  const double l3 = std::log(3.0);
  const torch::Tensor logits = torch::tensor({l3, 0.0, l3, -l3}, torch::kFloat).view({2, 2});
  // Token 1: scores (.75, .5) -> (.6, .4); token 2: (.75, .25) -> (.75, .25). P = (.675, .325)
  // (a softmax's would be (.825, .175)).
  const torch::Tensor p = balancing_probs(logits, RouterScoring::kSigmoid);
  EXPECT_NEAR(p[0][0].item<double>(), 0.6, 1e-6);
  EXPECT_NEAR(p[1][1].item<double>(), 0.25, 1e-6);
  // Top-1: expert 0 for both, f = (1, 0); aux = 2 * (1 * .675) = 1.35.
  EXPECT_NEAR(load_balancing_loss({logits}, 1, {}, RouterScoring::kSigmoid).item<double>(), 1.35, 1e-6);
  const auto [aux, z] = router_losses_of_sums(router_loss_sums({logits}, 1, 2, RouterScoring::kSigmoid), 1, 2);
  EXPECT_NEAR(aux, 1.35, 1e-6);
}

// On a skewed router every expert ends within its capacity, the slots kept are exactly those the
// slot list carries, and each token's weights are its routed ones (not renormalised).
TEST(Capacity, SlotListDropsToCapacityAndPads) {
  const torch::Tensor logits = skewed_logits(400, 8);
  const Routing r = route(logits, 2, LoadBalancing::kNone);
  MoeConfig moe;
  moe.capacity_factor = 1.0;
  const int64_t capacity = expert_capacity(400, 2, 8, 1.0);
  const SlotList s = slot_list(r, 8, moe);
  ASSERT_TRUE(s.kept.defined());
  EXPECT_EQ(s.dropped, 800 - s.token.size(0));
  EXPECT_EQ(s.dropped, 800 - s.kept.sum().item<int64_t>());
  EXPECT_GT(s.dropped, 0) << "the skewed router should overfill an expert";
  const torch::Tensor load = torch::bincount(s.expert, {}, 8);
  EXPECT_LE(load.max().item<int64_t>(), capacity);
  EXPECT_TRUE(torch::equal(s.weight, r.weights.flatten().masked_select(s.kept.flatten())));
  moe.pad_to_capacity = true;
  const SlotList padded = slot_list(r, 8, moe);
  EXPECT_TRUE(torch::equal(torch::bincount(padded.expert, {}, 8), torch::full({8}, capacity, torch::kLong)));
  EXPECT_NEAR(padded.weight.sum().item<double>(), s.weight.sum().item<double>(), 1e-4);  // padding weighs 0
  moe.capacity_factor = 0;
  const SlotList all = slot_list(r, 8, moe);
  EXPECT_FALSE(all.kept.defined());
  EXPECT_EQ(all.token.size(0), 800);
  EXPECT_EQ(all.dropped, 0);
}

}  // namespace
}  // namespace moeplan::executor
