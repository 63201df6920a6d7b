#pragma once
// AdamW (PyTorch's formula, decoupled weight decay), global-norm gradient clipping and the
// warmup + cosine learning-rate schedule.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <vector>

#include "moeplan/executor/model/element_runs.h"

#include "moeplan/core/parallel_config.h"

namespace moeplan::executor {

struct AdamWSettings {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// Updates the master parameters in place. Its moments have the parameters' dtype (fp32 master
// weights: fp32 moments; bf16 parameters: bf16 moments, as SMP's bf16 mode has).
class AdamW {
 public:
  AdamW(std::vector<torch::Tensor> params, std::vector<bool> decay, AdamWSettings settings);
  // Per-element decay: runs[i] are the elements of params[i] (one-dimensional) that take weight
  // decay (flat parameters mix matrices and norms).
  static AdamW with_decay_runs(std::vector<torch::Tensor> params, std::vector<ElementRuns> runs,
                               AdamWSettings settings);
  void step(const std::vector<torch::Tensor>& grads, double lr);

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t n) { step_count_ = n; }
  std::vector<torch::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<torch::Tensor>& exp_avg_sq() { return exp_avg_sq_; }

 private:
  std::vector<torch::Tensor> params_;
  std::vector<bool> decay_;
  std::vector<ElementRuns> runs_;
  bool by_runs_ = false;
  AdamWSettings settings_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_;
  int64_t step_count_ = 0;
};

// Scales the gradients so that their joint L2 norm is at most max_norm (torch's
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), never above 1). Returns the norm
// before clipping, computed in fp32 over every gradient exactly once.
double clip_grad_norm(const std::vector<torch::Tensor>& grads, double max_norm);

// Learning rate of optimizer step `step` (1-based): linear warmup from 0 over warmup_steps,
// then cosine decay to min_learning_rate at training.steps (Megatron's schedule).
double learning_rate(const TrainingConfig& training, int64_t step);

}  // namespace moeplan::executor
