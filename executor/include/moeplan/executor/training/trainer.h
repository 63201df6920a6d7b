#pragma once
// The reference trainer of one rank: a plan's model, precision and batch settings, trained with
// AdamW, warmup + cosine schedule, global-norm clipping and gradient accumulation, every tensor
// whole. run_training drives it through the run's loop (run.h) on a prepared data folder.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/routing_record.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/training/optimizer.h"
#include "moeplan/executor/training/run.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor {

// The model, its optimizer and one optimizer step of a plan, without data or files (the
// benchmarks drive it directly).
class ModelTrainer {
 public:
  // On `device`: the parameters are drawn on the CPU (the same values on every device) and
  // moved there; each step's token ids are copied there. `kernel`: the experts' (kAuto: the
  // grouped kernel on a GPU in 16-bit compute, resolve_expert_kernel).
  explicit ModelTrainer(const Plan& plan, torch::Device device = torch::kCPU, ExpertKernel kernel = ExpertKernel::kAuto);

  // One optimizer step over gradient_accumulation_steps micro-batches of token ids
  // [micro_batch_size, seq_len]: forward, loss, backward (accumulated), clipping, AdamW.
  StepRecord step(const std::vector<torch::Tensor>& micro_batches);

  int64_t step_count() const { return step_; }
  // Parameters, AdamW moments, the balancing biases and the CPU generator, by global name
  // ("param/<name>", ..., "buffer/<name>").
  NamedTensors state() const;
  // Restores what state() returned; every missing or mismatched tensor is reported into d.
  void load_state(const NamedTensors& tensors, int64_t step, int64_t optimizer_step, Diagnostics& d);
  const ParameterSet& parameters() const { return params_; }
  // A sigmoid router's balancing biases [moe blocks, experts] (expert_bias.h; undefined under
  // softmax scoring), moved after each step that is applied.
  torch::Tensor& expert_bias() { return expert_bias_; }
  const PhaseClock& clock() const { return clock_; }
  ExpertKernel expert_kernel() const { return expert_kernel_; }
  // A rehearsal's reference: every layer sends its tokens where the layout's did
  // (routing_record.h).
  void replay_routing(RoutingReplay* replay) { replay_ = replay; }

 private:
  const Plan& plan_;
  torch::Device device_;
  torch::ScalarType master_type_, compute_type_;
  ExpertKernel expert_kernel_;
  ParameterSet params_;
  torch::Tensor expert_bias_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  PhaseClock clock_;
  DeviceMarks marks_;
  RoutingReplay* replay_ = nullptr;
};

// A one-rank run, on the GPU the plan's profile names where this machine has one (see
// choose_device). Throws InputError for a plan, data folder or checkpoint that does not fit.
RunResult run_training(const Plan& plan, const RunOptions& options);

}  // namespace moeplan::executor
