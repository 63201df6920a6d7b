#pragma once
// Training on many ranks: the sharded model, gradient reduction over the mesh, sharded AdamW,
// clipping that counts every parameter once, checkpoints that re-shard, and the measured step
// (phase timers as a trace, peak memory, tokens per expert).

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/trace.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/model/routing_record.h"
#include "moeplan/executor/model/sharded_model.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/mesh.h"
#include "moeplan/executor/training/optimizer.h"
#include "moeplan/executor/training/run.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor {

class ShardedTrainer final : public StepTrainer {
 public:
  ShardedTrainer(const Plan& plan, DeviceMesh& mesh, ActivationStore* offload);

  // One optimizer step over this rank's micro-batches [micro_batch_size, seq_len]. Loss, norm
  // and counts in the record are of the whole world.
  StepRecord step(const std::vector<torch::Tensor>& micro_batches) override;
  int64_t step_count() const override { return step_; }

  // This rank's part of the model and optimizer state: slices of parameters by global name,
  // "param/<name>@<first element>" (and exp_avg/, exp_avg_sq/), for the units this rank owns.
  NamedTensors state() const override;
  // The parameters of which this rank keeps a part (its shard of the dense units and of its
  // experts' units): what it must read to start from a full checkpoint.
  std::set<std::string> held_parameters() const override;
  // Takes this rank's shards out of any layout's slices (see SlicedState).
  void load_state(const SlicedState& state, int64_t step, int64_t optimizer_step, Diagnostics& d) override;
  // Each rank reads the tensors of its own shard and experts only.
  void load_hugging_face(const std::string& dir) override;
  int64_t take_busiest_expert_rows() override { return model_.take_busiest_expert_rows(); }

  const PhaseClock& clock() const override { return clock_; }
  ShardedModel& model() { return model_; }

  // A rehearsal's layout: records its routing into `record_dir` (routing_record.h) and plants
  // `fault` (rehearsal_fault.h, a test hook).
  void rehearse(const std::string& record_dir, RehearsalFault fault);

 private:
  // The forward and backward passes of a step's micro-batches on a pipeline stage; adds the
  // stage's counts into counts[micro-batch] and (on the last stage) the losses and tokens into
  // sums.
  void run_pipeline(const std::vector<torch::Tensor>& micro_batches, torch::Tensor& counts, torch::Tensor& sums);
  // Sums `counts` [expert group][micro-batch][layer][expert] over the world into the record,
  // with each rank's time inside the expert exchanges.
  void record_routing(StepRecord& r, torch::Tensor& counts);
  // Copies this rank's slices of the parameters and AdamW moments from a checkpoint of any
  // layout (or a Hugging Face folder's parameters); reports what is missing into d.
  void load_held_slices(const SlicedState& state, Diagnostics& d);

  const Plan& plan_;
  DeviceMesh& mesh_;
  ShardedModel model_;
  DeviceMarks marks_;
  ActivationStore* offload_ = nullptr;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  PhaseClock clock_;
  std::unique_ptr<RoutingRecorder> recorder_;
  RehearsalFault fault_ = RehearsalFault::kNone;
  torch::Tensor nonfinite_layers_;  // this step's, over its micro-batches (mixtral.h)
  torch::Tensor dropped_slots_;     // [layers]: this step's slots dropped at capacity, this rank's
};

}  // namespace moeplan::executor
