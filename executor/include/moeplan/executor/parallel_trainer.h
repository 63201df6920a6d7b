#pragma once
// Training on many ranks: the sharded model, gradient reduction over the mesh, sharded AdamW,
// clipping that counts every parameter once, checkpoints that re-shard, and the measured step
// (phase timers as a trace, peak memory, tokens per expert).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/core/trace.h"
#include "moeplan/executor/mesh.h"
#include "moeplan/executor/optimizer.h"
#include "moeplan/executor/run_report.h"
#include "moeplan/executor/sharded_model.h"
#include "moeplan/executor/tensor_file.h"
#include "moeplan/executor/trainer.h"

namespace moeplan::executor {

class ShardedTrainer {
 public:
  ShardedTrainer(const Plan& plan, DeviceMesh& mesh, ActivationStore* offload);

  // One optimizer step over this rank's micro-batches [micro_batch_size, seq_len]. Loss, norm
  // and counts in the record are of the whole world.
  StepRecord step(const std::vector<torch::Tensor>& micro_batches);
  int64_t step_count() const { return step_; }

  // This rank's part of the model and optimizer state: slices of parameters by global name,
  // "param/<name>@<first element>" (and exp_avg/, exp_avg_sq/), for the units this rank owns.
  NamedTensors state() const;
  // The parameters of which this rank keeps a part (its shard of the dense units and of its
  // experts' units): what it must read to start from a full checkpoint.
  std::set<std::string> held_parameters() const;
  // Takes this rank's shards out of any layout's slices (see SlicedState).
  void load_state(const class SlicedState& state, int64_t step, Diagnostics& d);

  const PhaseClock& clock() const { return clock_; }
  ShardedModel& model() { return model_; }

 private:
  // The forward and backward passes of a step's micro-batches on a pipeline stage; adds the
  // stage's counts and (on the last stage) the losses and tokens into counts and sums.
  void run_pipeline(const std::vector<torch::Tensor>& micro_batches, torch::Tensor& counts, torch::Tensor& sums);

  const Plan& plan_;
  DeviceMesh& mesh_;
  ShardedModel model_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;
  PhaseClock clock_;
};

// Checkpoint tensors of any layout, by parameter: a whole tensor "param/<name>", slices
// "param/<name>@<first element>" of its flattened values, or, for a matrix split by columns
// over tensor-parallel ranks, slices "param/<name>#cols<c0>:<c1>of<C>@<first element>" of its
// flattened columns [c0, c1) of C. Column blocks are put together when the tensor is first read.
class SlicedState {
 public:
  void add(const NamedTensors& tensors);
  // Elements [begin, end) of the flattened tensor `key` ("param/<name>", ...), in the stored
  // type; reports into d (and returns an undefined tensor) when the slices do not cover the
  // range exactly once or their types differ.
  torch::Tensor range(const std::string& key, int64_t begin, int64_t end, Diagnostics& d) const;
  // The whole tensor, shaped.
  torch::Tensor whole(const std::string& key, const std::vector<int64_t>& shape, Diagnostics& d) const;
  bool contains(const std::string& key) const { return slices_.count(key) != 0 || columns_.count(key) != 0; }

 private:
  using Slices = std::map<int64_t, torch::Tensor>;  // first element -> values
  // The slices of `key`, its column blocks put together first; nullptr (reported into d) when
  // there are none or the blocks do not fit together.
  const Slices* slices_of(const std::string& key, Diagnostics& d) const;

  struct ColumnBlock {
    int64_t end = 0, total = 0;  // columns [c0, end) of total
    Slices slices;
  };
  mutable std::map<std::string, Slices> slices_;
  std::map<std::string, std::map<int64_t, ColumnBlock>> columns_;  // key -> c0 -> block
};

// Where a rank of a multi-rank run comes from.
struct RankEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;
  bool store_hosted_elsewhere = false;  // the moeplan launcher hosts the store; else rank 0 does
  std::string launcher;                 // "moeplan", "torchrun", "slurm", "mpirun"
  std::string bind_address = "127.0.0.1";  // where this rank's gloo connections listen
};

// One rank of a multi-rank run: joins the others, trains, writes its part of checkpoints, the
// trace and the report. Throws InputError for bad input, CollectiveError when a peer is lost.
RunResult run_rank(const Plan& plan, const RunOptions& options, const RankEnv& env);

}  // namespace moeplan::executor
