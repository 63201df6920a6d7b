#include "moeplan/executor/training/optimizer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <map>
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

AdamW AdamW::with_decay_runs(std::vector<torch::Tensor> params, std::vector<ElementRuns> runs,
                             AdamWSettings settings) {
  assert(runs.size() == params.size() && "one list of decay runs per parameter");
  const size_t n = params.size();
  AdamW adam(std::move(params), std::vector<bool>(n, false), settings);
  adam.runs_ = std::move(runs);
  adam.by_runs_ = true;
  return adam;
}

void AdamW::step(const std::vector<torch::Tensor>& grads, double lr) {
  assert(grads.size() == params_.size() && "one gradient per parameter");
  torch::NoGradGuard no_grad;
  ++step_count_;
  // LibTorch's fused AdamW (one pass over each tensor, the update PyTorch's AdamW(fused=True)
  // makes), called once per kind of decay and dtype: it takes one weight decay and one dtype
  // per call. Per-element decay is applied first, as the fused kernel applies its own: the
  // same factor, rounded the same way, where the mask is set; exactly 1 elsewhere.
  struct Group {
    std::vector<torch::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  };
  std::map<std::pair<bool, c10::ScalarType>, Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    if (by_runs_ && settings_.weight_decay != 0) {
      // The factor as the fused kernel rounds it: fp32.
      const float factor = static_cast<float>(1 - lr * settings_.weight_decay);
      for (const ElementRun& run : runs_[i]) p.narrow(0, run.begin, run.length).mul_(factor);
    }
    Group& g = groups[{decay_[i], p.scalar_type()}];
    g.params.push_back(p);
    g.grads.push_back(grads[i].scalar_type() == p.scalar_type() ? grads[i] : grads[i].to(p.scalar_type()));
    g.exp_avg.push_back(exp_avg_[i]);
    g.exp_avg_sq.push_back(exp_avg_sq_[i]);
    g.steps.push_back(torch::full({}, static_cast<double>(step_count_), torch::dtype(torch::kFloat).device(p.device())));
  }
  for (auto& [key, g] : groups) {
    const double decay = key.first ? settings_.weight_decay : 0.0;
    at::_fused_adamw_(g.params, g.grads, g.exp_avg, g.exp_avg_sq, /*max_exp_avg_sqs=*/{}, g.steps, lr,
                      settings_.beta1, settings_.beta2, decay, settings_.eps, /*amsgrad=*/false, /*maximize=*/false);
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
