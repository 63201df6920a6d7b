#include "moeplan/executor/model/routing.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>

namespace moeplan::executor {

torch::Tensor sinkhorn(const torch::Tensor& logits, double tol, int max_iterations, const RankSum& over) {
  // exp(logits) as in Megatron, with each row's maximum taken out first: a row scale is absorbed
  // by the row factors d0, so the balanced matrix is the same, and peaked logits cannot overflow.
  const torch::Tensor cost = torch::exp(logits - std::get<0>(logits.max(1, /*keepdim=*/true)));
  // Each column's sum runs over every rank's tokens, and each row is scaled to 1 / (all the rows).
  auto total = [&over](const torch::Tensor& t) { return over ? over(t) : t; };
  const double rows = total(torch::full({1}, static_cast<double>(cost.size(0)), torch::kDouble)).item<double>();
  torch::Tensor d0 = torch::ones({cost.size(0)}, cost.options());
  torch::Tensor d1 = torch::ones({cost.size(1)}, cost.options());
  constexpr double kEps = 1e-8;
  torch::Tensor d1_old = d1;
  // Reading the change back waits for the device: on a GPU it is read every fourth iteration
  // (the iterations between run queued), so a converged matrix may get up to three more.
  const int check_every = logits.device().is_cpu() ? 1 : 4;
  for (int i = 0; i < max_iterations; ++i) {
    d0 = (1.0 / rows) / (torch::sum(d1 * cost, 1) + kEps);
    d1 = (1.0 / static_cast<double>(d1.size(0))) / (total(torch::sum(d0.unsqueeze(1) * cost, 0)) + kEps);
    // Megatron stops on the mean absolute change of d1; d1's scale follows the logits', so the
    // change is measured relative to d1 here, which stops at the same balance for any scale.
    if ((i + 1) % check_every == 0 &&
        (torch::mean(torch::abs(d1_old - d1)) / torch::mean(torch::abs(d1))).item<double>() <= tol)
      break;
    d1_old = d1;
  }
  return d1 * cost * d0.unsqueeze(1);
}

torch::Tensor balanced_assignment(const torch::Tensor& scores_in, int64_t k) {
  // A sequential greedy pass: on the host, whatever device the scores are on.
  const torch::Tensor scores = scores_in.to(torch::kCPU, torch::kFloat).contiguous();
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  const int64_t capacity = (tokens * k + experts - 1) / experts;
  const float* s = scores.data_ptr<float>();
  // All (token, expert) pairs by falling score; ties by token, then expert, so the result is
  // deterministic.
  std::vector<int64_t> order(static_cast<size_t>(tokens * experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [s](int64_t a, int64_t b) { return s[a] > s[b]; });
  torch::Tensor chosen = torch::full({tokens, k}, -1, torch::kLong);
  int64_t* c = chosen.data_ptr<int64_t>();
  std::vector<int64_t> filled(static_cast<size_t>(tokens), 0), load(static_cast<size_t>(experts), 0);
  auto has = [&](int64_t t, int64_t e) {
    for (int64_t j = 0; j < filled[t]; ++j)
      if (c[t * k + j] == e) return true;
    return false;
  };
  for (const int64_t pair : order) {
    const int64_t t = pair / experts, e = pair % experts;
    if (filled[t] < k && load[e] < capacity) {
      c[t * k + filled[t]++] = e;
      ++load[e];
    }
  }
  // A token can be left short when the only experts with room are ones it already has. Then
  // some token u on a full expert e (one t lacks) moves to an expert f with room that u lacks,
  // and t takes e. Only if no such move exists does t go over capacity.
  auto slot_of = [&](int64_t t, int64_t e) {
    for (int64_t j = 0; j < filled[t]; ++j)
      if (c[t * k + j] == e) return j;
    return int64_t{-1};
  };
  for (int64_t t = 0; t < tokens; ++t) {
    while (filled[t] < k) {
      bool placed = false;
      for (int64_t e = 0; e < experts && !placed; ++e) {
        if (has(t, e)) continue;
        for (int64_t u = 0; u < tokens && !placed; ++u) {
          const int64_t j = slot_of(u, e);
          if (u == t || j < 0) continue;
          for (int64_t f = 0; f < experts; ++f) {
            if (load[f] >= capacity || has(u, f)) continue;
            c[u * k + j] = f;  // u moves from e to f
            ++load[f];
            c[t * k + filled[t]++] = e;  // t takes u's place on e
            placed = true;
            break;
          }
        }
      }
      if (placed) continue;
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!has(t, e) && (best < 0 || s[t * experts + e] > s[t * experts + best])) best = e;
      assert(best >= 0 && "k must not exceed the number of experts");
      c[t * k + filled[t]++] = best;
      ++load[best];
    }
  }
  return chosen.to(scores_in.device());
}

RouterShape RouterShape::of(const ModelSpec& m) {
  return {m.experts_per_token, m.router_scoring, m.router_groups, m.router_group_topk, m.routed_scaling_factor,
          m.norm_topk_prob};
}

namespace {

// DeepSeek-V3's choice: top-k of sigmoid scores plus the bias, within the best groups.
Routing route_by_sigmoid(const torch::Tensor& router_logits, const RouterShape& router, const torch::Tensor& bias) {
  const torch::Tensor scores = torch::sigmoid(router_logits.to(torch::kFloat));
  Routing r;
  {
    torch::NoGradGuard no_grad;
    torch::Tensor choice = bias.defined() ? scores.detach() + bias : scores.detach();
    if (router.groups > 1) {
      const int64_t tokens = choice.size(0), per_group = choice.size(1) / router.groups;
      const torch::Tensor group_scores =
          std::get<0>(choice.view({tokens, router.groups, per_group}).topk(std::min<int64_t>(2, per_group), -1)).sum(-1);
      const torch::Tensor best_groups = std::get<1>(group_scores.topk(router.group_topk, -1));
      const torch::Tensor kept = torch::zeros_like(group_scores, torch::kBool).scatter_(1, best_groups, true);
      choice = choice.masked_fill(kept.unsqueeze(-1).expand({tokens, router.groups, per_group}).reshape({tokens, -1})
                                      .logical_not(),
                                  0.0);
    }
    r.experts = std::get<1>(choice.topk(router.k, -1));
  }
  r.weights = torch::gather(scores, 1, r.experts);
  if (router.renormalise) r.weights = r.weights / (r.weights.sum(-1, /*keepdim=*/true) + 1e-20);
  return r;
}

}  // namespace

Routing route(const torch::Tensor& router_logits, int64_t k, LoadBalancing method) {
  return route(router_logits, RouterShape{k}, method);
}

Routing route(const torch::Tensor& router_logits, const RouterShape& router, LoadBalancing method,
              const torch::Tensor& bias, const RankSum& over) {
  if (router.scoring == RouterScoring::kSigmoid) {
    Routing r = route_by_sigmoid(router_logits, router, bias);
    if (router.scaling != 1.0) r.weights = r.weights * router.scaling;
    return r;
  }
  const int64_t k = router.k;
  const torch::Tensor probs = torch::softmax(router_logits, /*dim=*/1, torch::kFloat);
  Routing r;
  switch (method) {
    case LoadBalancing::kAuxLoss:
    case LoadBalancing::kNone: {
      auto [w, e] = torch::topk(probs, k, /*dim=*/-1);
      r.weights = w;
      r.experts = e;
      break;
    }
    case LoadBalancing::kSinkhorn: {
      torch::NoGradGuard no_grad;
      r.experts = std::get<1>(torch::topk(sinkhorn(router_logits.detach().to(torch::kFloat), 1e-4, 1000, over), k, 1));
      break;
    }
    case LoadBalancing::kBalanced: {
      torch::NoGradGuard no_grad;
      r.experts = balanced_assignment(probs.detach(), k);
      break;
    }
  }
  if (!r.weights.defined()) r.weights = torch::gather(probs, 1, r.experts);
  if (router.renormalise) r.weights = r.weights / r.weights.sum(-1, /*keepdim=*/true);
  if (router.scaling != 1.0) r.weights = r.weights * router.scaling;
  return r;
}

Routing route_to(const torch::Tensor& router_logits, const torch::Tensor& experts, const RouterShape& router) {
  const bool sigmoid = router.scoring == RouterScoring::kSigmoid;
  const torch::Tensor probs = sigmoid ? torch::sigmoid(router_logits.to(torch::kFloat))
                                      : torch::softmax(router_logits, /*dim=*/1, torch::kFloat);
  Routing r;
  r.experts = experts;
  r.weights = torch::gather(probs, 1, experts);
  if (router.renormalise)
    r.weights = r.weights / (sigmoid ? r.weights.sum(-1, /*keepdim=*/true) + 1e-20 : r.weights.sum(-1, /*keepdim=*/true));
  if (router.scaling != 1.0) r.weights = r.weights * router.scaling;
  return r;
}

torch::Tensor balancing_probs(const torch::Tensor& router_logits, RouterScoring scoring) {
  if (scoring == RouterScoring::kSoftmax) return torch::softmax(router_logits, -1, torch::kFloat);
  const torch::Tensor scores = torch::sigmoid(router_logits.to(torch::kFloat));
  return scores / (scores.sum(-1, /*keepdim=*/true) + 1e-20);
}

void update_expert_bias(torch::Tensor& bias, const torch::Tensor& counts, double rate) {
  torch::NoGradGuard no_grad;
  const torch::Tensor load = counts.to(bias.device(), torch::kDouble);
  bias.add_(torch::sign(load.mean(-1, /*keepdim=*/true) - load).to(torch::kFloat), rate);
}

int64_t expert_capacity(int64_t tokens, int64_t k, int64_t experts, double capacity_factor) {
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * k) / static_cast<double>(experts) * capacity_factor));
}

torch::Tensor kept_slots(const Routing& r, int64_t experts, double capacity_factor, TokenDropPolicy policy) {
  torch::NoGradGuard no_grad;
  const int64_t tokens = r.experts.size(0), k = r.experts.size(1);
  const int64_t capacity = expert_capacity(tokens, k, experts, capacity_factor);
  if (!(capacity_factor > 0) || capacity >= tokens) return torch::ones_like(r.experts, torch::kBool);
  // [tokens, experts]: the weight of each routed pair (probs) or 1 (position), 0 elsewhere.
  const torch::Tensor routed = torch::zeros({tokens, experts}, r.weights.options().dtype(torch::kFloat))
                                   .scatter_(1, r.experts, 1.0);
  torch::Tensor keep;
  if (policy == TokenDropPolicy::kProbs) {
    const torch::Tensor gates = torch::zeros_like(routed).scatter_(1, r.experts, r.weights.detach().to(torch::kFloat));
    const torch::Tensor best = std::get<1>(torch::topk(gates, capacity, /*dim=*/0));  // [capacity, experts]
    keep = torch::zeros_like(routed).scatter_(0, best, 1.0) * routed;
  } else {
    keep = routed * (routed.cumsum(0) <= static_cast<double>(capacity)).to(routed.scalar_type());
  }
  return torch::gather(keep, 1, r.experts) > 0;
}

SlotList slot_list(const Routing& r, int64_t experts, const MoeConfig& moe, const torch::Tensor& kept_given) {
  const int64_t tokens = r.experts.size(0), k = r.experts.size(1);
  const torch::Tensor all = torch::arange(tokens * k, torch::dtype(torch::kLong).device(r.experts.device()));
  SlotList s{torch::div(all, k, "floor"), r.experts.flatten(), r.weights.flatten(), {}};
  if (!(moe.capacity_factor > 0)) return s;
  s.kept = kept_given.defined() ? kept_given : kept_slots(r, experts, moe.capacity_factor, moe.drop_policy);
  const torch::Tensor kept = torch::nonzero(s.kept.flatten()).flatten();
  s.dropped = tokens * k - kept.size(0);
  s.token = s.token.index_select(0, kept);
  s.expert = s.expert.index_select(0, kept);
  s.weight = s.weight.index_select(0, kept);
  if (!moe.pad_to_capacity) return s;
  const int64_t capacity = expert_capacity(tokens, k, experts, moe.capacity_factor);
  const torch::Tensor load = torch::bincount(s.expert, {}, experts).cpu();
  const int64_t* kept_of = load.data_ptr<int64_t>();
  std::vector<int64_t> pad_expert;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = kept_of[e]; i < capacity; ++i) pad_expert.push_back(e);
  if (pad_expert.empty()) return s;
  const auto n = static_cast<int64_t>(pad_expert.size());
  const torch::Tensor pad = torch::tensor(pad_expert, torch::kLong).to(r.experts.device());
  s.token = torch::cat({s.token, torch::zeros({n}, s.token.options())});
  s.expert = torch::cat({s.expert, pad});
  s.weight = torch::cat({s.weight, torch::zeros({n}, s.weight.options())});
  return s;
}

namespace {
// How many tokens chose each expert as their j-th choice, [k, E] of `selected` [N, k] (a
// one-hot [N, k, E] summed over the tokens, without making it: it would be the largest tensor
// of the loss).
torch::Tensor choice_counts(const torch::Tensor& selected, int64_t experts) {
  const torch::Tensor choices = selected.t().contiguous();  // [k, N]
  return torch::zeros({choices.size(0), experts}, choices.options())
      .scatter_add_(1, choices, torch::ones_like(choices));
}
}  // namespace

torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& router_logits, int64_t k,
                                  const std::vector<torch::Tensor>& top_k, RouterScoring scoring, const RankSum& over) {
  if (router_logits.empty()) return torch::zeros({}, torch::kFloat);  // blocks without experts only
  const torch::Tensor logits = torch::cat(router_logits, 0);
  const int64_t experts = logits.size(1);
  const torch::Tensor probs = balancing_probs(logits, scoring);
  const torch::Tensor selected = top_k.empty() ? std::get<1>(torch::topk(probs, k, -1)) : torch::cat(top_k, 0);
  const torch::Tensor chosen = choice_counts(selected, experts).to(torch::kFloat);  // [k, E]
  torch::Tensor tokens_per_expert, prob_per_expert;  // [k, E], [E]
  if (over) {
    const torch::TensorOptions options = torch::dtype(torch::kFloat).device(logits.device());
    const torch::Tensor rows = over(torch::full({1}, static_cast<double>(logits.size(0)), options));
    tokens_per_expert = over(chosen) / rows;
    prob_per_expert = over(probs.sum(0)) / rows;
  } else {
    tokens_per_expert = chosen / static_cast<double>(logits.size(0));
    prob_per_expert = probs.mean(0);
  }
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(experts);
}

torch::Tensor router_z_loss(const std::vector<torch::Tensor>& router_logits, const RankSum& over) {
  if (router_logits.empty()) return torch::zeros({}, torch::kFloat);
  const torch::Tensor logits = torch::cat(router_logits, 0).to(torch::kFloat);
  const torch::Tensor squares = torch::logsumexp(logits, -1).square();
  if (!over) return squares.mean();
  const torch::Tensor rows =
      over(torch::full({1}, static_cast<double>(logits.size(0)), torch::dtype(torch::kFloat).device(logits.device())));
  return (over(squares.sum().reshape({1})) / rows).squeeze(0);
}

torch::Tensor router_loss_sums(const std::vector<torch::Tensor>& router_logits, int64_t k, int64_t experts,
                               RouterScoring scoring) {
  torch::NoGradGuard no_grad;
  torch::Tensor sums = torch::zeros({k * experts + experts + 2}, torch::kDouble);
  if (router_logits.empty()) return sums;
  const torch::Tensor logits = torch::cat(router_logits, 0).to(torch::kFloat);
  const torch::Tensor probs = balancing_probs(logits, scoring);
  const torch::Tensor selected = std::get<1>(torch::topk(probs, k, -1));
  sums.narrow(0, 0, k * experts).copy_(choice_counts(selected, experts).flatten());
  sums.narrow(0, k * experts, experts).copy_(probs.sum(0));
  sums[k * experts + experts] = torch::logsumexp(logits, -1).square().sum().item<double>();
  sums[k * experts + experts + 1] = static_cast<double>(logits.size(0));
  return sums;
}

std::pair<double, double> router_losses_of_sums(const torch::Tensor& sums, int64_t k, int64_t experts) {
  const double rows = sums[k * experts + experts + 1].item<double>();
  if (rows == 0) return {0, 0};
  const torch::Tensor share = sums.narrow(0, 0, k * experts).view({k, experts}) / rows;
  const torch::Tensor mean_prob = sums.narrow(0, k * experts, experts) / rows;
  const double aux = (share * mean_prob.unsqueeze(0)).sum().item<double>() * static_cast<double>(experts);
  return {aux, sums[k * experts + experts].item<double>() / rows};
}

}  // namespace moeplan::executor
