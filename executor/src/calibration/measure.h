#pragma once
// What one pass of calibration measures (calibrate.h): the workload every rank measures alike,
// the timers, and each measurement's figures under their names. Every rank makes the same
// calls in the same order, so that the collectives among them line up.

#include "moeplan/executor/libtorch.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/core/fit.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/calibration/calibrate.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/offload.h"
#include "moeplan/executor/model/sharded_model.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/training/trainer.h"

namespace moeplan::executor::calibration {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start);

// Short operations are repeated more, so that each measurement spans about 0.1 s.
int repeats_for(int reps, double one_call_s);

// Times of the calls after one warm-up call; the median. Every timer waits for the work queued
// on `device` before it reads the clock (a GPU runs its work after the call that queued it has
// returned). Collectives pass `adapt` false: every rank must make the same number of calls.
template <class F>
double time_median(const torch::Device& device, int reps, F&& f, bool adapt = true) {
  wait_for(device);
  const auto warm = Clock::now();
  f();
  wait_for(device);
  if (adapt) reps = repeats_for(reps, seconds_since(warm));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    f();
    wait_for(device);
    t.push_back(seconds_since(start));
  }
  return median(t);
}

// The mean time of `calls` calls after one warm-up call, every rank making as many. For
// collectives: their times have a long tail here (a tenth of the calls take 3 to 6 ms where
// the median takes 0.2), and what a step pays for many of them is their mean.
template <class F>
double time_mean(const torch::Device& device, int calls, F&& f) {
  f();
  wait_for(device);
  const auto start = Clock::now();
  for (int i = 0; i < calls; ++i) f();
  wait_for(device);
  return seconds_since(start) / calls;
}

// Seconds of a forward and of its backward.
struct ForwardBackward {
  double forward = 0, backward = 0;
};

// A forward and its backward, timed apart; medians over `reps` after a warm-up.
template <class Forward>
ForwardBackward time_forward_backward(const torch::Device& device, int reps, Forward&& forward) {
  std::vector<double> fwd, bwd;
  for (int i = 0; i <= reps; ++i) {
    wait_for(device);
    auto start = Clock::now();
    const torch::Tensor y = forward();
    wait_for(device);
    const double f = seconds_since(start);
    start = Clock::now();
    y.backward(torch::ones_like(y));
    wait_for(device);
    const double b = seconds_since(start);
    if (i == 0) {  // warm-up
      reps = repeats_for(reps, f + b);
      continue;
    }
    fwd.push_back(f);
    bwd.push_back(b);
  }
  return {median(fwd), median(bwd)};
}

// The median of a tensor's values, as core's median() takes it (the mean of the two middle
// values of an even count; torch's median takes the lower one).
double median_of(const torch::Tensor& t);

// Progress lines on rank 0.
class Progress {
 public:
  Progress(std::ostream* out, bool leader) : out_(leader ? out : nullptr), start_(Clock::now()) {}
  void say(const std::string& what);

 private:
  std::ostream* out_;
  Clock::time_point start_;
};

// On a GPU, the largest device memory beyond the tensors seen at the sample points: the device
// memory in use (as the driver counts it, every process on the device) beyond what the caching
// allocator reserved (the CUDA context, the libraries' handles and kernels). On CPU ranks it
// samples nothing: their overhead is a training step's (measure_step_overhead).
class OverheadProbe {
 public:
  explicit OverheadProbe(torch::Device device) : device_(device) {}
  void sample();
  void stop() { stopped_ = true; }
  int64_t most() const { return most_; }

 private:
  torch::Device device_;
  int64_t most_ = 0;
  bool stopped_ = false;
};

struct Gemm {
  int64_t rows, inner, cols;
};

// Compute of some length followed by a collective, as many calls in lockstep on every rank.
struct Stretch {
  std::function<void()> work;
  int calls;
};

// The executor's model on a mesh of one tensor split of the ranks (R = n / T replicas, sequence
// parallel), and the time its tensor group has spent inside collectives (its observer adds).
struct SplitModel {
  Plan plan;
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<ShardedModel> model;
  double inside_s = 0;
};

// What calibration measures, the same on every rank: the model's GEMM shapes, expert rows and
// optimizer shards, the collectives' sizes, and the weights and inputs of the executor's
// operations. Built once, used by every pass.
// The micro-batch sizes measured: powers of two up to the largest.
std::vector<int64_t> micro_batches(int64_t max_micro_batch);
// The calibrated model on one rank alone (E = S = 1), at the calibration's sequence and precision.
Plan alone_plan(const CalibrateOptions& o);

struct Workload {
  Workload(const CalibrateOptions& options, Communicator& communicator, const MeshMaker& mesh_of);
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  const torch::Device device;  // where every tensor measured is, and what every timer waits for
  const CalibrateOptions& o;
  Communicator& world;
  const ModelSpec& m;
  const torch::ScalarType type, master;
  const int64_t h, t, n, a;  // hidden size, sequence, ranks, bytes per element moved
  const int reps, few;       // repeats per figure; few: 2 with quick (half the calls), else 1
  std::vector<int64_t> mbs, expert_rows, units, divisors, shard_sizes, sizes;
  std::vector<int64_t> splits;  // tensor-parallel degrees the operations are measured split over
  std::vector<Gemm> gemms;
  const std::vector<std::string> kinds{"all_gather", "all_to_all", "all_reduce", "reduce_scatter"};
  std::map<std::string, std::vector<int64_t>> unit_sizes;  // per kind: the model's flat units
  MoeConfig moe;
  // The executor's operations and its own model, one rank alone on it (E = S = 1).
  Rope rope;
  torch::Tensor mask;
  LayerWeights w;
  torch::Tensor w1, w2, w3, embed, norm, lm_head;
  Plan whole_plan;
  DeviceMesh alone;
  // The executor's own model of one rank: on the CPU the sharded model (E = S = 1) that every
  // CPU layout runs; on a GPU the one-rank trainer, whose steps are timed whole.
  std::unique_ptr<ShardedModel> whole;
  std::unique_ptr<ModelTrainer> trainer;
  // The same sharded model with every block checkpointed whole (full recomputation; CPU).
  Plan recomputed_plan;
  std::unique_ptr<ShardedModel> recomputed;
  // Forward with the loss of the sharded model on token ids (CPU), or of the recomputed one.
  torch::Tensor micro_batch_loss(const torch::Tensor& ids, bool recompute = false);
  // Collectives after compute: each kind as the executor uses it, small (a one-element
  // all-reduce, the tokens-per-expert all-gather before a dispatch, a dispatch of one
  // sequence), after stretches from a router's forward to a whole micro-batch's forward and
  // backward.
  torch::Tensor token, expert_counts, dispatch, stretch_x, stretch_ids;
  std::vector<int64_t> dispatch_split;
  std::vector<std::pair<std::string, std::function<void()>>> after_collectives;
  std::vector<Stretch> stretches;
  ActivationStore store;
  // Per tensor split that divides the ranks, per expert split, and the states sharded over
  // every rank (when meshes can be formed): the whole model on it, formed by form_split_models
  // (every rank alike).
  MeshMaker mesh_of;
  std::vector<std::unique_ptr<SplitModel>> split_models;
  void form_split_models();

  // A weight of `shape` on the device, drawn with a standard deviation of 0.02, that takes a
  // gradient.
  torch::Tensor weight(std::vector<int64_t> shape) const;
  // Attention's projections for `local`'s heads (the model's, or one tensor-parallel rank's
  // part of them): q, k, v and o, or latent attention's, as the executor holds them.
  void set_attention_weights(LayerWeights& into, const ModelSpec& local) const;
};

// -- Each measurement's figures, seconds unless the name says otherwise.

// Per micro-batch size (Workload::mbs), one rank alone: the attention sub-block, the MoE
// sub-block without its experts (router), and the head with the loss (forward and backward
// together).
struct OpFigures {
  ForwardBackward attention, router;
  double head = 0;
};
// Under one tensor split (Workload::splits): per micro-batch size its attention and head, per
// expert row count (Workload::expert_rows) one expert.
struct SplitFigures {
  struct Ops {
    ForwardBackward attention;
    double head = 0;
  };
  std::vector<Ops> ops;
  std::vector<ForwardBackward> experts;
};
struct CopyFigures {
  double copy_bytes_per_s = 0;  // bytes read and written
  // On the CPU the offload file's; on a GPU pinned host memory's, from the device and back.
  double offload_write_bytes_per_s = 0, offload_read_bytes_per_s = 0;
};
// One kind of collective (Workload::kinds): at the sweep's sizes (Workload::sizes) and at the
// model's flat units (Workload::unit_sizes).
struct CollectiveFigures {
  std::vector<double> sweep, units;
};
// A whole micro-batch on a tensor split's mesh: its compute (the time inside the tensor group's
// collectives left out; medians) and its whole time (means, the collectives' tail included).
struct SplitMicroBatchFigures {
  ForwardBackward compute, whole;
};
// A collective after a stretch of compute: the stretch's own time, and what the pair took
// beyond the stretch and the collective alone.
struct AfterComputeFigures {
  double stretch = 0, extra = 0;
};
struct MemoryFigures {
  double overhead_bytes = 0, baseline_rss_bytes = 0;
};

// One pass's figures, on one rank or kept over the ranks and passes.
struct PassFigures {
  std::vector<double> gemms;             // per Workload::gemms
  std::vector<OpFigures> ops;            // per micro-batch size
  std::vector<ForwardBackward> experts;  // per expert row count
  std::vector<SplitFigures> splits;      // per Workload::splits
  std::vector<double> optimizer;         // per Workload::shard_sizes
  CopyFigures copies;
  std::vector<CollectiveFigures> collectives;  // per Workload::kinds; more than one rank
  std::vector<ForwardBackward> micro_batches;  // per micro-batch size
  std::vector<ForwardBackward> recomputed_micro_batches;  // the same, every block recomputed (CPU)
  // Per Workload::split_models, per micro-batch size.
  std::vector<std::vector<SplitMicroBatchFigures>> split_micro_batches;
  // Per Workload::after_collectives, per Workload::stretches; more than one rank.
  std::vector<std::vector<AfterComputeFigures>> after_compute;
  MemoryFigures memory;  // after the passes
};

// -- The measurements (measure_compute.cc, measure_transfers.cc).

std::vector<double> measure_gemms(Workload& x, OverheadProbe& overhead);
std::vector<OpFigures> measure_ops(Workload& x, OverheadProbe& overhead);
// One expert's SwiGLU (w1, w3: [width, h], w2: [h, width]) per row count, forward and backward.
std::vector<ForwardBackward> measure_experts(const Workload& x, const torch::Tensor& w1, const torch::Tensor& w2,
                                             const torch::Tensor& w3, OverheadProbe& overhead);
std::vector<SplitFigures> measure_splits(Workload& x, OverheadProbe& overhead);
std::vector<double> measure_optimizer(Workload& x, OverheadProbe& overhead);
// recompute: with every block checkpointed whole (CPU ranks; empty on a GPU).
std::vector<ForwardBackward> measure_micro_batches(Workload& x, bool recompute = false);
// On CPU ranks: what a run's rank holds beyond its tensors, as its report measures it (the
// peak resident set less the peak of live tensors) over three optimizer steps of the executor's
// trainer on the data-parallel layout of the ranks. Measured first, before the workload is
// made, while the process is as fresh as a run's: what later measurements leave in the heap is
// not a run's.
int64_t measure_step_overhead(const CalibrateOptions& o, Communicator& world, const MeshMaker& mesh_of);
std::vector<std::vector<SplitMicroBatchFigures>> measure_split_micro_batches(Workload& x);
CopyFigures measure_copies(Workload& x, OverheadProbe& overhead);
std::vector<CollectiveFigures> measure_collectives(Workload& x, Progress& progress, const std::string& of);
std::vector<std::vector<AfterComputeFigures>> measure_after_compute(Workload& x);

}  // namespace moeplan::executor::calibration
