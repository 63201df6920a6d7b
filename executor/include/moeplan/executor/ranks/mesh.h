#pragma once
// The device mesh [P, R, S, E, T] of a plan (docs/architecture.md section 6): which coordinates a rank has,
// which ranks form each group, and the process groups themselves.
//
// Groups, for a rank at (p, r, s, e, c, t); each keeps the coordinates not written as *:
//   shard group           ranks (p, r, *, e, c, t): model states are sharded over it (all-gather,
//                         reduce-scatter);
//   expert group          ranks (p, r, s, *, c, t); with C > 1 and E > 1 (p, r, s, *, *, t),
//                         and with the tensor ranks folded into it (ETP = 1 under T > 1,
//                         parallel folding) their t varies too: tokens travel inside it
//                         (all-to-all, all-gather); it spans the context-parallel and folded
//                         tensor ranks as Megatron-Core's does, so a rank's experts are those of
//                         its index in the group;
//   dense replica group   ranks (p, *, s, *, *, t): dense gradients are summed over it after the
//                         reduce-scatter;
//   expert replica group  ranks (p, *, s, e, c, t), and with C > 1 and E = 1 (p, *, s, e, *, t):
//                         expert gradients are summed over it;
//   context group         ranks (p, r, s, e, *, t): the parts of one sequence (context
//                         parallelism), which pass each other keys and values;
//   routing group         ranks (p, r, s, e, *, t), or (p, r, s, e, *, *) where T is folded: the
//                         ranks that route different parts of one micro-batch (unfolded tensor
//                         ranks route the same gathered tokens), over which the router's
//                         losses and sinkhorn's balance are summed;
//   tensor group          ranks (p, r, s, e, c, *): each block's matrices are split over it, and
//                         the sequence between them (Megatron's tensor and sequence parallelism);
//   pipeline group        ranks (*, r, s, e, c, t): the stages of one pipeline;
//   world                 every rank: loss, gradient norm, counts.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/ranks/collectives.h"
#include "moeplan/executor/ranks/device.h"

namespace moeplan::executor {

struct MeshCoords {
  int64_t r = 0, s = 0, e = 0, t = 0, p = 0, c = 0;
  int64_t of(MeshDim d) const;
  int64_t& of(MeshDim d);
  bool operator==(const MeshCoords&) const = default;
};

// Pure rank arithmetic of a valid ParallelConfig.
class MeshLayout {
 public:
  explicit MeshLayout(const ParallelConfig& parallel);
  int64_t world_size() const { return world_size_; }
  MeshCoords coords(int64_t rank) const;
  int64_t rank_of(const MeshCoords& c) const;
  // The ranks that share every coordinate of `rank` except those in `varying`, ascending (so a
  // rank's index in a one-dimension group is its coordinate along that dimension).
  std::vector<int64_t> group(int64_t rank, const std::vector<MeshDim>& varying) const;
  // Which of the W / (T P) data readers a rank is: the ranks of one tensor-parallel group and of
  // one pipeline read the same micro-batches. Without T and P it is the rank itself.
  int64_t reader(int64_t rank) const;
  // The dimensions an expert group, and an expert replica group, vary over.
  std::vector<MeshDim> expert_dims() const;
  std::vector<MeshDim> expert_replica_dims() const;
  std::vector<MeshDim> routing_dims() const;
  // A rank's index in its expert group: it holds experts [index n, (index + 1) n), n = experts / E.
  int64_t expert_index(int64_t rank) const;

 private:
  ParallelConfig parallel_;
  int64_t world_size_ = 1;
};

// Where a mesh's rank computes, and the backend of all its groups (the same on every rank).
struct MeshDevice {
  torch::Device device = torch::kCPU;
  GroupBackend backend = GroupBackend::kGloo;
};

class DeviceMesh {
 public:
  // Forms every group this rank belongs to over `store` (every rank of the world calls it).
  DeviceMesh(const ParallelConfig& parallel, int64_t rank, const c10::intrusive_ptr<c10d::Store>& store,
             std::chrono::milliseconds timeout, const std::string& address = "127.0.0.1", MeshDevice on = {});
  // One rank alone: every group is this rank.
  explicit DeviceMesh(const ParallelConfig& parallel, torch::Device device = torch::kCPU);

  const MeshLayout& layout() const { return layout_; }
  // Where this rank computes: the model's states, activations and collectives are there.
  const torch::Device& device() const { return device_; }
  int64_t rank() const { return rank_; }
  const MeshCoords& coords() const { return coords_; }

  Communicator world, shard, expert, dense_replicas, expert_replicas, context, routing, tensor, pipeline;
  // Every group of the mesh reports into `activity`.
  void set_activity(const std::shared_ptr<CollectiveActivity>& activity);

 private:
  MeshLayout layout_;
  int64_t rank_ = 0;
  MeshCoords coords_;
  torch::Device device_ = torch::kCPU;
};

// Forms a mesh of another layout of the same ranks (every rank calls it alike, in the same
// order), for work that tries several layouts in one process (calibration).
using MeshMaker = std::function<std::unique_ptr<DeviceMesh>(const ParallelConfig& parallel)>;

}  // namespace moeplan::executor
