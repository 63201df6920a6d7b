#pragma once
// The device mesh [R, S, E] of a plan (design.md section 2): which coordinates a rank has, which
// ranks form each group, and the process groups themselves.
//
// Groups, for a rank at (r, s, e):
//   shard group           ranks (r, *, e): model states are sharded over it (all-gather,
//                         reduce-scatter);
//   expert group          ranks (r, s, *): tokens travel inside it (all-to-all, all-gather);
//   dense replica group   ranks (*, s, *): dense gradients are summed over it after the
//                         reduce-scatter;
//   expert replica group  ranks (*, s, e): expert gradients are summed over it;
//   world                 every rank: loss, gradient norm, counts.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/collectives.h"

namespace moeplan::executor {

struct MeshCoords {
  int64_t r = 0, s = 0, e = 0;
  int64_t of(MeshDim d) const { return d == MeshDim::kReplica ? r : d == MeshDim::kShard ? s : e; }
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

 private:
  ParallelConfig parallel_;
  int64_t world_size_ = 1;
};

class DeviceMesh {
 public:
  // Forms every group this rank belongs to over `store` (every rank of the world calls it).
  DeviceMesh(const ParallelConfig& parallel, int64_t rank, const c10::intrusive_ptr<c10d::Store>& store,
             std::chrono::milliseconds timeout, const std::string& address = "127.0.0.1");
  // One rank alone: every group is this rank.
  explicit DeviceMesh(const ParallelConfig& parallel);

  const MeshLayout& layout() const { return layout_; }
  int64_t rank() const { return rank_; }
  const MeshCoords& coords() const { return coords_; }

  Communicator world, shard, expert, dense_replicas, expert_replicas;

 private:
  MeshLayout layout_;
  int64_t rank_ = 0;
  MeshCoords coords_;
};

}  // namespace moeplan::executor
