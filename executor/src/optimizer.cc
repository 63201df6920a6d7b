#include "moeplan/executor/optimizer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numbers>

namespace moeplan::executor {

AdamW::AdamW(std::vector<torch::Tensor> params, std::vector<bool> decay, AdamWSettings settings)
    : params_(std::move(params)), decay_(std::move(decay)), settings_(settings) {
  assert(params_.size() == decay_.size() && "one decay flag per parameter");
  for (const torch::Tensor& p : params_) {
    exp_avg_.push_back(torch::zeros_like(p));
    exp_avg_sq_.push_back(torch::zeros_like(p));
  }
}

AdamW AdamW::with_decay_masks(std::vector<torch::Tensor> params, std::vector<torch::Tensor> masks,
                              AdamWSettings settings) {
  assert(masks.size() == params.size() && "one decay mask per parameter");
  const size_t n = params.size();
  AdamW adam(std::move(params), std::vector<bool>(n, false), settings);
  adam.masks_ = std::move(masks);
  return adam;
}

void AdamW::step(const std::vector<torch::Tensor>& grads, double lr) {
  assert(grads.size() == params_.size() && "one gradient per parameter");
  torch::NoGradGuard no_grad;
  ++step_count_;
  const double n = static_cast<double>(step_count_);
  const double bias_correction1 = 1 - std::pow(settings_.beta1, n);
  const double bias_correction2_sqrt = std::sqrt(1 - std::pow(settings_.beta2, n));
  const double step_size = lr / bias_correction1;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    const torch::Tensor g = grads[i].to(p.scalar_type());
    if (decay_[i] && settings_.weight_decay != 0) p.mul_(1 - lr * settings_.weight_decay);
    // The same factor, rounded the same way, where the mask is set; exactly 1 elsewhere.
    if (!masks_.empty() && settings_.weight_decay != 0)
      p.mul_(torch::where(masks_[i], 1 - lr * settings_.weight_decay, 1.0));
    exp_avg_[i].mul_(settings_.beta1).add_(g, 1 - settings_.beta1);
    exp_avg_sq_[i].mul_(settings_.beta2).addcmul_(g, g, 1 - settings_.beta2);
    const torch::Tensor denom = (exp_avg_sq_[i].sqrt() / bias_correction2_sqrt).add_(settings_.eps);
    p.addcdiv_(exp_avg_[i], denom, -step_size);
  }
}

double clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  norms.reserve(grads.size());
  for (const torch::Tensor& g : grads) norms.push_back(g.to(torch::kFloat).norm());
  const double total = torch::stack(norms).norm().item<double>();
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (const torch::Tensor& g : grads) g.mul_(coef);
  return total;
}

double learning_rate(const TrainingConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step <= t.warmup_steps)
    return t.learning_rate * static_cast<double>(step) / static_cast<double>(t.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, t.steps - t.warmup_steps);
  const double progress = std::clamp(static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return t.min_learning_rate + 0.5 * (t.learning_rate - t.min_learning_rate) * (1 + std::cos(std::numbers::pi * progress));
}

}  // namespace moeplan::executor
