#pragma once
// How far a rehearsal's layout may differ from its one-rank reference by rounding alone, and how
// far AdamW's own arithmetic may move a step's state (docs/reliability.md, "Rehearsal
// verdicts"). Every bound is derived in rehearsal_bounds.cc; none is a number chosen to pass.
//
// What is compared: the reference replays the layout's routing (routing_record.h) and starts
// each step from the layout's state before it, so both evaluate the same function of the same
// state in fp32, and differ only in how their sums are split and ordered (tensor-parallel parts,
// shards, replicas, micro-batches, experts' token groups).

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moeplan/core/model_spec.h"

namespace moeplan::executor {

// fp32's unit roundoff: round to nearest with a 24-bit significand.
inline constexpr double kUnitRoundoff = 0x1p-24;

// The rounding budget K of a value: the sum of the squares of the magnitudes of the partial
// results rounded on the way to it, each relative to the value's magnitude. A reduction of n
// terms contributes n / 2 (see rehearsal_bounds.cc); the budgets of a step of `model`.
struct RoundingBudget {
  std::vector<double> router;  // per layer: the forward pass up to that layer's router logits
  double logits = 0;           // the forward pass up to the lm head's logits
  double backward = 0;         // the backward pass from the loss to the first block's input
  double tokens = 0;           // a weight's gradient: the sum over the step's tokens
  double loss_mean = 0;        // the step's loss: the mean over its tokens
  double router_rows = 0;      // the router losses: means over every layer's tokens
  double parameters = 0;       // the gradient norm: the sum of squares over every parameter
};
RoundingBudget rounding_budget(const ModelSpec& model, int64_t seq_len, int64_t tokens_per_step, int64_t parameters);

// Two fp32 evaluations of a value of budget K differ by at most lambda u sqrt(2 K) of its
// magnitude, except with probability 2 exp(-lambda^2 / 2); lambda is set so that this holds
// for all `comparisons` at once except with probability `false_alarm`.
class RoundingBound {
 public:
  RoundingBound(double comparisons, double false_alarm);
  double lambda() const { return lambda_; }
  double of(double budget) const;

 private:
  double lambda_ = 0;
};

// Magnitudes of the logits a step computes, from the parameters at its start (Cauchy-Schwarz:
// |w . x| <= |w| |x|, and an RMSNorm's output with weight g has norm at most max|g| sqrt(H)).
struct LogitMagnitudes {
  std::vector<double> router_per_token;  // per layer: bound on the norm of a token's router logits
  std::vector<double> router_element;    // per layer: bound on one router logit
  double lm_head_element = 0;            // bound on one lm head logit
};
// `parameter` gives a whole parameter by its Hugging Face name.
LogitMagnitudes logit_magnitudes(const ModelSpec& model,
                                 const std::function<torch::Tensor(const std::string&)>& parameter);

// What one rank's step reported, and what the layout's may differ from it by (absolute).
struct StepMetrics {
  double loss = 0, aux_loss = 0, z_loss = 0, grad_norm = 0;
};
StepMetrics metric_bounds(const RoundingBudget& budget, const RoundingBound& bound, const LogitMagnitudes& magnitudes,
                          const StepMetrics& reference, int64_t experts);

// The relative bound on the difference of one step's gradients (every tensor, normwise), after
// clipping when either run may have clipped.
double gradient_bound(const RoundingBudget& budget, const RoundingBound& bound, bool clipped);

// AdamW's step (optimizer.h) as the checks redo it in double.
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;
  bool decay = true;  // the parameter takes weight decay
};

// The gradient a step's first moment took in, exp_avg = beta1 exp_avg_prev + (1 - beta1) g,
// and elementwise how far the fp32 update of exp_avg can have moved it (double tensors).
struct RecoveredGradient {
  torch::Tensor gradient, error;
};
RecoveredGradient recovered_gradient(const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_prev, double beta1);

// The largest |value - AdamW's| over its rounding bound, elementwise, for the second moment
// (from the recovered gradient) and for the parameter (from the moments): at most 1 when the
// step's state follows from the state before it by one fp32 AdamW step.
double second_moment_mismatch(const torch::Tensor& exp_avg_sq, const torch::Tensor& exp_avg_sq_prev,
                              const RecoveredGradient& g, const AdamWStep& adam);
double parameter_mismatch(const torch::Tensor& param, const torch::Tensor& param_prev, const torch::Tensor& exp_avg,
                          const torch::Tensor& exp_avg_sq, const AdamWStep& adam);

}  // namespace moeplan::executor
