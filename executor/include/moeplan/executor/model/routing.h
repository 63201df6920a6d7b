#pragma once
// Token-to-expert routing and the router's auxiliary losses, with SMP's load-balancing methods.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "moeplan/core/parallel_config.h"

namespace moeplan::executor {

struct Routing {
  torch::Tensor weights;  // [tokens, k] fp32, renormalised to sum 1 per token (Mixtral)
  torch::Tensor experts;  // [tokens, k] int64
};

// Chooses k experts per token from router logits [tokens, experts]:
// - aux_loss, none: the k largest softmax probabilities (Hugging Face Mixtral);
// - sinkhorn: the k largest entries of the Sinkhorn-balanced score matrix (Megatron's S-BASE);
// - balanced: a capacity-limited greedy assignment, at most ceil(tokens * k / experts) per
//   expert (BASE layers' balanced assignment, solved greedily).
// The weights are always the softmax probabilities of the chosen experts, renormalised; the
// choice itself carries no gradient.
Routing route(const torch::Tensor& router_logits, int64_t k, LoadBalancing method);

// A layer's routing decided elsewhere (a rehearsal's reference replays its layout's, see
// routing_record.h): given the layer and this run's router logits, the experts [tokens, k] each
// token goes to and the top-k [tokens, k] the load-balancing loss counts (the k largest
// probabilities, which are not the experts under sinkhorn and balanced routing), both int64.
struct ChosenExperts {
  torch::Tensor experts;
  torch::Tensor top_k;
};
using RouteOverride = std::function<ChosenExperts(int64_t layer, const torch::Tensor& router_logits)>;

// The routing to `experts` [tokens, k] chosen elsewhere, weighted as route() weights its own
// choice: the softmax probabilities of those experts, renormalised (the same values, bit for
// bit, when the choice is route()'s).
Routing route_to(const torch::Tensor& router_logits, const torch::Tensor& experts);

// Megatron's sinkhorn(): exp(logits), then alternate row and column normalisation until the
// column scalings move by less than tol of their mean (at most max_iterations rounds).
torch::Tensor sinkhorn(const torch::Tensor& logits, double tol = 1e-4, int max_iterations = 1000);

// Expert of each (token, slot): [tokens, k], every expert taking at most capacity slots.
torch::Tensor balanced_assignment(const torch::Tensor& scores, int64_t k);

// Hugging Face load_balancing_loss_func over all layers' router logits:
// num_experts * sum_e f_e * P_e, f_e the share of top-k slots, P_e the mean probability.
// `top_k`, when given (one [tokens, k] per layer), are the slots counted in place of the
// logits' own top-k (a replayed routing's).
torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& router_logits, int64_t k,
                                  const std::vector<torch::Tensor>& top_k = {});

// ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2, all layers together.
torch::Tensor router_z_loss(const std::vector<torch::Tensor>& router_logits);

// Both losses are means over every layer's rows, so a pipeline stage can sum its layers' part
// and pass it on: [k x E top-k one-hot counts, E probabilities, sum of logsumexp^2, rows], fp64,
// without gradient. Sums of several stages add.
torch::Tensor router_loss_sums(const std::vector<torch::Tensor>& router_logits, int64_t k, int64_t experts);
// The load-balancing loss and the z-loss of such sums: those of all the layers summed.
std::pair<double, double> router_losses_of_sums(const torch::Tensor& sums, int64_t k, int64_t experts);

}  // namespace moeplan::executor
