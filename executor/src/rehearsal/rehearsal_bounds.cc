// The bounds a rehearsal holds its layout to (rehearsal_bounds.h), and their derivations.
//
// The rounding model. Each fp32 operation returns its exact result times (1 + d), |d| <= u =
// 2^-24. For sums and products of many terms, the worst case (every d at its extreme, all of one
// sign) is far from what happens, and bounds built on it (n u per sum of n) would pass any
// layout. The probabilistic model of Higham and Mary (A new approach to probabilistic rounding
// error analysis, SIAM J. Sci. Comput. 41(5), 2019) takes the d as independent with mean zero.
// The error of a value is then, to first order, a sum of independent terms d_i w_i, w_i the
// magnitude of the i-th rounded partial result (as it reaches the value), and Hoeffding's
// inequality bounds it: |error| <= lambda u sqrt(sum w_i^2) except with probability
// 2 exp(-lambda^2 / 2). Relative to the value's magnitude, sum w_i^2 is the budget K.
// The layout and the reference round independently, so their difference has budget 2 K.
//
// Budgets. A reduction of n terms rounds n - 1 partial sums. With terms of either sign (a
// matrix product with random weights, a gradient summed over tokens) the partial sum after j
// terms is about sqrt(j / n) of the result; with terms of one sign (a norm, a mean of losses)
// about j / n. Their squares sum to n / 2 and n / 3 of the result's: a reduction adds n / 2 to
// the budget (one rule, the larger). An elementwise operation rounds once (adds 1) and is left
// out beside the reductions, which are 16 to 512 long here. Along the pass, a block passes the
// relative error of its input to its output with a gain of at most one: each block starts with
// an RMSNorm (which divides out the scale of its input) and adds its output to the residual
// stream. So the budgets of the operations on the way to a value add.
//
// What is not rounding is excluded by construction, not by tolerance: the reference replays the
// layout's routing (a near tie decided the other way would move a token to another expert, which
// no rounding bound covers), and starts each step from the layout's state before it (so the
// parameters, which Adam moves by about the learning rate whatever the gradient's size, do not
// carry one run's rounding into the next step's gradient).
#include "moeplan/executor/rehearsal/rehearsal_bounds.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace moeplan::executor {

namespace {

// Higham's gamma_n: n roundings in a row move a value by at most gamma_n of it (worst case,
// used below for AdamW's few elementwise operations, where the worst case is tight).
double gamma(int n) { return n * kUnitRoundoff / (1 - n * kUnitRoundoff); }

// max over elements of |value - expected| / tolerance; 0 where both are 0.
double worst_ratio(const torch::Tensor& value, const torch::Tensor& expected, const torch::Tensor& tolerance) {
  const torch::Tensor diff = (value.to(torch::kDouble) - expected).abs();
  const torch::Tensor ratio =
      torch::where(diff == 0, torch::zeros_like(diff), diff / tolerance.clamp_min(std::numeric_limits<double>::min()));
  if (ratio.numel() == 0) return 0;
  const double worst = ratio.max().item<double>();
  return std::isnan(worst) || ratio.isnan().any().item<bool>() ? std::nan("") : worst;
}

}  // namespace

namespace {

// The budgets of one block: its forward pass up to its router's logits (a dense block: up to its
// feed-forward layer), the rest of its forward pass, and its backward pass. A matrix product
// [out, in] reduces over `in` forward and over `out` backward (its weight's gradient reduces
// over the tokens, counted once for the step).
struct BlockBudget {
  double to_router = 0, after_router = 0, backward = 0;
};

BlockBudget block_budget(const ModelSpec& m, int64_t seq_len, bool experts) {
  const double h = static_cast<double>(m.hidden_size), hd = static_cast<double>(m.head_dim);
  const double heads = static_cast<double>(m.num_attention_heads), t = static_cast<double>(seq_len);
  const double e = static_cast<double>(m.num_experts), k = static_cast<double>(m.experts_per_token);
  double forward = 0, backward = 0;
  auto matrix = [&](double in, double out) {
    forward += in;
    backward += out;
  };
  auto norm = [&](double width) {  // an RMSNorm's mean of squares, forward and backward
    forward += width;
    backward += width;
  };
  // Attention: the input norm, the projections, scores (head_dim) and the softmax and weighted
  // values over at most T positions forward (their backward: scores, softmax and three products
  // over positions), the output projection, the residual sum (2 each way).
  norm(h);
  if (m.mla()) {
    const double rope = static_cast<double>(m.qk_rope_head_dim), nope = hd - rope;
    const double vd = static_cast<double>(m.v_head_dim), kv_lora = static_cast<double>(m.kv_lora_rank);
    if (m.q_lora_rank > 0) {
      const double q_lora = static_cast<double>(m.q_lora_rank);
      matrix(h, q_lora);
      norm(q_lora);
      matrix(q_lora, heads * hd);
    } else {
      matrix(h, heads * hd);
    }
    matrix(h, kv_lora + rope);
    norm(kv_lora);
    matrix(kv_lora, heads * (nope + vd));
    matrix(heads * vd, h);
  } else {
    const double kv = static_cast<double>(m.num_key_value_heads) * hd;
    matrix(h, heads * hd);
    matrix(h, kv);
    matrix(h, kv);
    matrix(heads * hd, h);
    if (m.qk_norm) {
      norm(hd);
      norm(hd);
    }
  }
  forward += hd + 2 * t + 2;
  backward += hd + 4 * t + 2;
  norm(h);  // the post-attention norm
  BlockBudget b;
  if (!experts) {
    // A dense block's feed-forward layer and its residual sum.
    const double ffn = static_cast<double>(m.dense_intermediate_size > 0 ? m.dense_intermediate_size : m.intermediate_size);
    matrix(h, ffn);
    matrix(h, ffn);
    matrix(ffn, h);
    b.to_router = (forward + 2) / 2;
    b.backward = (backward + 2) / 2;
    return b;
  }
  matrix(h, e);  // the router
  b.to_router = forward / 2;
  // Then the routing weights (softmax or sigmoid scores over E, renormalised over k; backward:
  // their gradient over H and the scores' over E), each chosen expert's w1, w3 and w2, the sum over
  // the k experts, the shared experts beside them, and the residual sum (2).
  const double ffn = static_cast<double>(m.intermediate_size);
  double after = e + k + 2 * h + ffn + k + 2;
  backward += h + e + 2 * ffn + h;
  if (m.shared_experts()) {
    const double shared = static_cast<double>(m.shared_expert_intermediate_size);
    after += 2 * h + shared + 1;
    backward += 2 * shared + h;
  }
  b.after_router = after / 2;
  b.backward = (backward + 2) / 2;
  return b;
}

}  // namespace

RoundingBudget rounding_budget(const ModelSpec& m, int64_t seq_len, int64_t tokens_per_step, int64_t parameters) {
  const double h = static_cast<double>(m.hidden_size), v = static_cast<double>(m.vocab_size);
  RoundingBudget b;
  // Along the decoder, then each multi-token prediction block (which joins the output of the
  // block before with an embedding: two RMSNorms and a projection of 2 H), the budgets of the
  // blocks before a router add.
  double before = 0, backward = 0;
  for (int64_t l = 0; l < m.blocks(); ++l) {
    const bool joins = l >= m.num_layers;
    if (joins) before += (h + h + 2 * h) / 2;
    const BlockBudget block = block_budget(m, seq_len, m.moe_layer(l));
    b.router.push_back(m.moe_layer(l) ? before + block.to_router : 0.0);
    before += block.to_router + block.after_router;
    backward += block.backward + (joins ? (h + h + 4 * h) / 2 : 0.0);
  }
  // The lm head (and each prediction block's): the final RMSNorm (H), the logits (H), and the
  // log-sum-exp over the vocabulary; of the heads, the deepest's.
  b.logits = before + (h + h + v) / 2;
  // Back from the loss: the logits' gradient through the lm head (the vocabulary), the final
  // RMSNorm (H), then every block.
  b.backward = (v + h) / 2 + backward;
  const double n = static_cast<double>(tokens_per_step);
  const double routed = static_cast<double>(m.moe_blocks());
  b.tokens = n / 2;
  b.loss_mean = n / 2;
  b.router_rows = n * routed / 2;  // the load-balancing and z-losses average every routed block's rows
  b.parameters = static_cast<double>(parameters) / 2;
  return b;
}

RoundingBound::RoundingBound(double comparisons, double false_alarm) {
  // 2 m exp(-lambda^2 / 2) = p: the union bound over m comparisons.
  lambda_ = std::sqrt(2 * std::log(2 * std::max(1.0, comparisons) / false_alarm));
}

double RoundingBound::of(double budget) const { return lambda_ * kUnitRoundoff * std::sqrt(2 * budget); }

LogitMagnitudes logit_magnitudes(const ModelSpec& m, const std::function<torch::Tensor(const std::string&)>& parameter) {
  torch::NoGradGuard no_grad;
  const double root_h = std::sqrt(static_cast<double>(m.hidden_size));
  LogitMagnitudes out;
  for (int64_t l = 0; l < m.blocks(); ++l) {
    if (!m.moe_layer(l)) {  // a dense block: no router
      out.router_per_token.push_back(0);
      out.router_element.push_back(0);
      continue;
    }
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    const double normed = parameter(prefix + "post_attention_layernorm.weight").abs().max().item<double>() * root_h;
    const torch::Tensor router = parameter(prefix + "block_sparse_moe.gate.weight").to(torch::kDouble);
    out.router_per_token.push_back(normed * router.norm().item<double>());
    out.router_element.push_back(normed * router.norm(2, 1).max().item<double>());
  }
  // The lm head's logits through the final norm, or a prediction block's own.
  double norm = parameter("model.norm.weight").abs().max().item<double>();
  for (int64_t l = m.num_layers; l < m.blocks(); ++l)
    norm = std::max(norm,
                    parameter("model.layers." + std::to_string(l) + ".shared_head.norm.weight").abs().max().item<double>());
  out.lm_head_element = norm * root_h * parameter("lm_head.weight").to(torch::kDouble).norm(2, 1).max().item<double>();
  return out;
}

StepMetrics metric_bounds(const RoundingBudget& budget, const RoundingBound& bound, const LogitMagnitudes& magnitudes,
                          const StepMetrics& reference, int64_t experts) {
  StepMetrics b;
  // The loss is a mean of per-token cross entropies, log-sum-exp minus the label's logit: each
  // moves by at most its logits' largest error, so a token's by twice that, and the mean adds
  // its own rounding.
  b.loss = 2 * bound.of(budget.logits) * magnitudes.lm_head_element + bound.of(budget.loss_mean) * reference.loss;
  // The router's logits move by at most bound.of(router) of their magnitude (absolute: dz).
  double dz = 0;
  for (size_t l = 0; l < budget.router.size(); ++l)
    dz = std::max(dz, bound.of(budget.router[l]) * magnitudes.router_element[l]);
  // The load-balancing loss is E sum_e f_e P_e: the slot shares f_e are the layout's (replayed);
  // a probability p = exp(z - lse) moves by at most 2 dz relative (first order), and the softmax
  // and the means over rows add their rounding.
  const double e = static_cast<double>(experts);
  b.aux_loss = (2 * dz + bound.of(e / 2 + budget.router_rows)) * reference.aux_loss;
  // The z-loss is the mean of lse^2 over rows: lse moves by at most dz, plus its sum over the
  // experts' exponentials (relative, so absolute in the logarithm) and its own rounding; then
  // |mean(a^2) - mean(b^2)| <= 2 sqrt(mean(b^2)) d + d^2 (Cauchy-Schwarz), and the mean rounds.
  double largest_logit = 0;
  for (const double z : magnitudes.router_element) largest_logit = std::max(largest_logit, z);
  const double d_lse = dz + bound.of(e / 2) + kUnitRoundoff * (largest_logit + std::log(e));
  b.z_loss = 2 * std::sqrt(std::max(0.0, reference.z_loss)) * d_lse + d_lse * d_lse +
             bound.of(budget.router_rows) * reference.z_loss;
  // The gradient norm: every element's error (gradient_bound) and the sum of squares over the
  // parameters, whose relative error the square root halves.
  b.grad_norm = (gradient_bound(budget, bound, false) + bound.of(budget.parameters) / 2) * reference.grad_norm;
  return b;
}

double gradient_bound(const RoundingBudget& budget, const RoundingBound& bound, bool clipped) {
  // A weight's gradient sums, over the step's tokens, products of a forward activation and a
  // backward gradient: the budget of the whole forward pass, of the backward pass, and of the
  // sum over tokens (the order of which differs most between layouts: micro-batches, readers,
  // an expert's tokens from every rank of its group).
  const double gradient = bound.of(budget.logits + budget.backward + budget.tokens);
  if (!clipped) return gradient;
  // Clipping scales by max_norm / |g|: the norm's relative error (the gradient's and the sum of
  // squares', halved by the square root) adds.
  return 2 * gradient + bound.of(budget.parameters) / 2;
}

RecoveredGradient recovered_gradient(const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_prev, double beta1) {
  // fp32 AdamW forms exp_avg as beta1 m + (1 - beta1) g or as m + (1 - beta1)(g - m) (lerp):
  // at most four roundings on terms of magnitude (1 + (1 - beta1)) |m| and (1 - beta1) |g|.
  const double w = 1 - beta1;
  const torch::Tensor m = exp_avg.to(torch::kDouble), prev = exp_avg_prev.to(torch::kDouble);
  RecoveredGradient r;
  r.gradient = (m - beta1 * prev) / w;
  r.error = gamma(4) * ((1 + w) * prev.abs() + w * r.gradient.abs()) / w;
  return r;
}

double second_moment_mismatch(const torch::Tensor& exp_avg_sq, const torch::Tensor& exp_avg_sq_prev,
                              const RecoveredGradient& g, const AdamWStep& a) {
  // exp_avg_sq = beta2 v + (1 - beta2) g^2: at most four roundings on either term (the two
  // constants, the products, the square, the sum); the recovered g carries its own error e,
  // which moves g^2 by at most 2 |g| e + e^2.
  const torch::Tensor prev = exp_avg_sq_prev.to(torch::kDouble);
  const torch::Tensor expected = a.beta2 * prev + (1 - a.beta2) * g.gradient.square();
  const torch::Tensor tolerance =
      gamma(4) * expected.abs() + (1 - a.beta2) * (2 * g.gradient.abs() * g.error + g.error.square());
  return worst_ratio(exp_avg_sq, expected, tolerance);
}

double parameter_mismatch(const torch::Tensor& param, const torch::Tensor& param_prev, const torch::Tensor& exp_avg,
                          const torch::Tensor& exp_avg_sq, const AdamWStep& a) {
  // p = p_prev (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps), bc = 1 - beta^t
  // (PyTorch's AdamW). The decay rounds its factor and the product (2 roundings of p_prev); the
  // update rounds lr / bc1, sqrt(v), sqrt(bc2), the quotient, eps, the sum, m / denominator and
  // the product (8); the difference rounds once.
  const double t = static_cast<double>(a.step);
  const double bc1 = 1 - std::pow(a.beta1, t), bc2 = 1 - std::pow(a.beta2, t);
  const torch::Tensor prev = param_prev.to(torch::kDouble);
  const torch::Tensor update = (a.lr / bc1) * exp_avg.to(torch::kDouble) /
                               (exp_avg_sq.to(torch::kDouble).sqrt() / std::sqrt(bc2) + a.eps);
  const double keep = a.decay ? 1 - a.lr * a.weight_decay : 1.0;
  const torch::Tensor expected = prev * keep - update;
  const torch::Tensor tolerance = gamma(2) * prev.abs() + gamma(8) * update.abs() + kUnitRoundoff * expected.abs();
  return worst_ratio(param, expected, tolerance);
}

}  // namespace moeplan::executor
