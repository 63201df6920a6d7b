#pragma once
// Token-to-expert routing and the router's auxiliary losses, with SMP's load-balancing methods.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan::executor {

// The sum of a tensor over the ranks that route parts of one micro-batch (the context-parallel
// ranks of a sequence), differentiable with the gradient passed through as it is (every rank
// goes on to compute the same loss of the sum: all_reduce_autograd). Empty: this rank alone.
using RankSum = std::function<torch::Tensor(const torch::Tensor&)>;

struct Routing {
  torch::Tensor weights;  // [tokens, k] fp32, renormalised to sum 1 per token (Mixtral), times the scaling
  torch::Tensor experts;  // [tokens, k] int64
};

// The router as the model defines it: top-k, its scores, group-limited choice and the scale of
// the chosen weights (model_spec.h).
struct RouterShape {
  int64_t k = 2;
  RouterScoring scoring = RouterScoring::kSoftmax;
  int64_t groups = 1, group_topk = 1;
  double scaling = 1.0;
  bool renormalise = true;  // the model's norm_topk_prob
  static RouterShape of(const ModelSpec& m);
};

// Chooses k experts per token from router logits [tokens, experts]:
// - aux_loss, none: the k largest softmax probabilities (Hugging Face Mixtral);
// - sinkhorn: the k largest entries of the Sinkhorn-balanced score matrix (Megatron's S-BASE);
// - balanced: a capacity-limited greedy assignment, at most ceil(tokens * k / experts) per
//   expert (BASE layers' balanced assignment, solved greedily).
// The weights are the softmax probabilities of the chosen experts, renormalised (unless the
// router says otherwise, below); the choice itself carries no gradient.
Routing route(const torch::Tensor& router_logits, int64_t k, LoadBalancing method);
// The same for any router. Under sigmoid scoring (DeepSeek-V3, as transformers'
// DeepseekV3MoE routes): each expert's score is sigmoid(logit); the choice ranks score + bias
// (`bias` [experts] fp32, the auxiliary-loss-free balancing bias; none when undefined), first
// keeping the best group_topk of `groups` equal groups of experts by the sum of each group's two
// best (the others' choice scores set to 0), then the top-k; the weights are the chosen
// experts' scores without the bias, renormalised. Softmax scoring with groups is not routed
// here (DeepSeek-V2's group-limited greedy; the rules refuse it). Sigmoid scoring routes by its
// scores whatever `method` says (sinkhorn and balanced routing are softmax's; the rules refuse
// them with it). Without `renormalise` (DeepSeekMoE, DeepSeek-V2, Qwen2-MoE: norm_topk_prob
// false) each chosen expert keeps its own probability or score. Every weight is then multiplied
// by `scaling`.
// With `over` (RankSum below) the tokens are this rank's part of those the ranks route together,
// and sinkhorn balances all of them as one rank would (its column sums summed over the ranks).
Routing route(const torch::Tensor& router_logits, const RouterShape& router, LoadBalancing method,
              const torch::Tensor& bias = {}, const RankSum& over = {});

// The experts' probabilities the load-balancing loss averages, fp32 [tokens, experts]: the
// softmax of the logits, or under sigmoid scoring each expert's sigmoid divided by the token's
// sum of them (Megatron-Core's scores for the auxiliary loss with a sigmoid router).
torch::Tensor balancing_probs(const torch::Tensor& router_logits, RouterScoring scoring);

// Auxiliary-loss-free balancing (DeepSeek-V3; Wang et al. 2024, arXiv:2408.15664): after each
// step, each expert's bias in `bias` [layers, experts] fp32 moves by `rate` up when it got fewer
// than the mean of its layer's slots in `counts` [layers, experts] (the step's, over every rank
// and micro-batch) and down when it got more: bias += rate x sign(mean - count).
void update_expert_bias(torch::Tensor& bias, const torch::Tensor& counts, double rate);

// A layer's routing decided elsewhere (a rehearsal's reference replays its layout's, see
// routing_record.h): given the layer and this run's router logits, the experts [tokens, k] each
// token goes to and the top-k [tokens, k] the load-balancing loss counts (the k largest
// probabilities, which are not the experts under sinkhorn and balanced routing), both int64.
struct ChosenExperts {
  torch::Tensor experts;
  torch::Tensor top_k;
  torch::Tensor kept;  // [tokens, k] bool: the slots the layout's capacity kept; undefined when dropless
};
using RouteOverride = std::function<ChosenExperts(int64_t layer, const torch::Tensor& router_logits)>;

// The routing to `experts` [tokens, k] chosen elsewhere, weighted as route() weights its own
// choice: the softmax probabilities (or sigmoid scores) of those experts, renormalised and
// scaled as `router` says (the same values, bit for bit, when the choice is route()'s).
Routing route_to(const torch::Tensor& router_logits, const torch::Tensor& experts, const RouterShape& router = {});

// Token dropping (Megatron-Core's --moe-expert-capacity-factor). An expert's capacity is
// get_capacity(tokens x k, experts, factor) = ceil(tokens x k / experts x factor), counted over
// the tokens one rank routes, before they are exchanged, as Megatron-Core counts it.
int64_t expert_capacity(int64_t tokens, int64_t k, int64_t experts, double capacity_factor);

// The slots [tokens, k] (bool) their experts keep when each takes at most its capacity: those of
// the largest routing weight (drop policy probs) or the first tokens (position). Every slot when
// capacity_factor is 0. A dropped slot adds nothing to its token's output; the weights of the
// slots kept are not renormalised (Megatron-Core's).
torch::Tensor kept_slots(const Routing& r, int64_t experts, double capacity_factor, TokenDropPolicy policy);

// The token-expert pairs an MoE layer computes, flat: the token, the expert and the weight of
// each. Without padding, the slots kept in token-major order; with pad_to_capacity, then each
// expert's empty places up to its capacity, filled with token 0 at weight 0 (computed and
// discarded, as Megatron-Core's padded dispatch computes them). `kept`, when given, is the
// choice of kept_slots() made elsewhere (a replayed layout's).
struct SlotList {
  torch::Tensor token, expert, weight;  // [S] int64, int64, the weights' type
  torch::Tensor kept;                   // [tokens, k] bool; undefined when dropless
  int64_t dropped = 0;                  // slots the capacity dropped
};
SlotList slot_list(const Routing& r, int64_t experts, const MoeConfig& moe, const torch::Tensor& kept = {});

// Megatron's sinkhorn(): exp(logits), then alternate row and column normalisation until the
// column scalings move by less than tol of their mean (at most max_iterations rounds).
torch::Tensor sinkhorn(const torch::Tensor& logits, double tol = 1e-4, int max_iterations = 1000,
                       const RankSum& over = {});

// Expert of each (token, slot): [tokens, k], every expert taking at most capacity slots.
torch::Tensor balanced_assignment(const torch::Tensor& scores, int64_t k);

// Hugging Face load_balancing_loss_func over all layers' router logits:
// num_experts * sum_e f_e * P_e, f_e the share of top-k slots, P_e the mean probability.
// `top_k`, when given (one [tokens, k] per layer), are the slots counted in place of the
// logits' own top-k (a replayed routing's).
// Under sigmoid scoring P_e and the top-k are those of balancing_probs().
// With `over`, the counts, probabilities and rows are summed over the ranks first: every rank gets
// the loss of all their tokens, and its tokens' part of the gradient.
torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& router_logits, int64_t k,
                                  const std::vector<torch::Tensor>& top_k = {},
                                  RouterScoring scoring = RouterScoring::kSoftmax, const RankSum& over = {});

// ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2, all layers together (with
// `over`, over the ranks' tokens as above).
torch::Tensor router_z_loss(const std::vector<torch::Tensor>& router_logits, const RankSum& over = {});

// Both losses are means over every layer's rows, so a pipeline stage can sum its layers' part
// and pass it on: [k x E top-k one-hot counts, E probabilities, sum of logsumexp^2, rows], fp64,
// without gradient. Sums of several stages add.
torch::Tensor router_loss_sums(const std::vector<torch::Tensor>& router_logits, int64_t k, int64_t experts,
                               RouterScoring scoring = RouterScoring::kSoftmax);
// The load-balancing loss and the z-loss of such sums: those of all the layers summed.
std::pair<double, double> router_losses_of_sums(const torch::Tensor& sums, int64_t k, int64_t experts);

}  // namespace moeplan::executor
