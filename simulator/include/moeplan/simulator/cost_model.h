#pragma once
// Time of each operation of a training step, from the hardware profile: compute from FLOPs
// and an achieved-rate curve, collectives by alpha-beta per topology level, host copies over
// PCIe. The discrete-event engine and the analytic estimate both take their times from here.

#include <cstdint>
#include <span>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan::sim {

// Where the members of one communication group sit. Every rank runs the same collective at
// the same time (SPMD), so `groups_per_node` groups share each node's network card.
struct GroupShape {
  int64_t size = 1;             // ranks in the group
  int64_t per_node = 1;         // members of the group on one node
  int64_t nodes = 1;            // nodes the group spans
  int64_t groups_per_node = 1;  // groups that have members on one node (share its NIC)

  bool crosses_nodes() const { return nodes > 1; }
};

// The group along mesh dimension `dim` (the group of rank 0; the rule groups_share_one_shape
// keeps to layouts whose groups of a dimension all have its shape).
GroupShape group_shape(const ClusterSpec& cluster, const ParallelConfig& parallel, MeshDim dim);
// A group of `size` ranks with neighbours `stride` ranks apart.
GroupShape group_shape(const ClusterSpec& cluster, int64_t world_size, int64_t size, int64_t stride);
// The group of rank 0 over several mesh dimensions: the ranks whose coordinates differ from
// rank 0's only along `dims`.
GroupShape group_shape(const ClusterSpec& cluster, const ParallelConfig& parallel, std::span<const MeshDim> dims);

// A collective split into the parts the simulator schedules separately: ring latency, the
// transfer over the intra-node fabric, and the bytes one group pushes through the network card
// of each node it spans. The card is shared with whatever else crosses it at the time.
struct CollectiveCost {
  double latency_s = 0;
  double intra_s = 0;
  double nic_bytes_per_node = 0;
};

class CostModel {
 public:
  explicit CostModel(const ClusterSpec& cluster) : cluster_(&cluster) {}
  // The model keeps a pointer to the cluster: it must outlive the model.
  explicit CostModel(const ClusterSpec&& cluster) = delete;

  // One GEMM (or a batch of same-shape GEMMs) of `flops`, at the rate the profile gives for
  // GEMMs of `gemm_flops` each.
  double matmul_seconds(double flops, double gemm_flops, bool fp32) const;
  // Elementwise work bound by device memory bandwidth.
  double memory_bound_seconds(double bytes) const;

  // Ring all-gather producing `output_bytes` on every member (each contributes 1/size).
  double all_gather_seconds(double output_bytes, const GroupShape& g) const;
  // Ring reduce-scatter of `input_bytes` per member (each keeps 1/size of the sum).
  double reduce_scatter_seconds(double input_bytes, const GroupShape& g) const;
  // Ring all-reduce of `bytes` per member (reduce-scatter then all-gather).
  double all_reduce_seconds(double bytes, const GroupShape& g) const;
  // Pairwise all-to-all: each member sends `send_bytes` in total, 1/size to each member
  // (its own share stays local).
  double all_to_all_seconds(double send_bytes, const GroupShape& g) const;
  // The same collectives as parts, for one group alone (groups_per_node is not applied).
  CollectiveCost all_gather_cost(double output_bytes, const GroupShape& g) const;
  CollectiveCost reduce_scatter_cost(double input_bytes, const GroupShape& g) const;
  CollectiveCost all_reduce_cost(double bytes, const GroupShape& g) const;
  CollectiveCost all_to_all_cost(double send_bytes, const GroupShape& g) const;
  // DeepEP's fused dispatch (or combine) of the `send_bytes` a rank's slots take: inside a node
  // over NVLink; across nodes each token crosses the network once per node it goes to
  // (`network_bytes` a rank) and is forwarded over NVLink there. Both at the links' rates:
  // DeepEP's normal kernels reach 153 to 158 GB/s of H800's ~160 GB/s NVLink, and 43 to 58 GB/s
  // of a 400 Gbit/s (~50 GB/s) CX7 card (deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels
  // with NVLink and RDMA forwarding", EP 8 to 64).
  CollectiveCost fused_dispatch_cost(double send_bytes, double network_bytes, const GroupShape& g) const;
  // What ends a tensor-parallel region: the all-reduce, or with sequence parallelism the
  // region's reduce-scatter and the next region's all-gather. The ring model counts that pair
  // as the all-reduce (the same bytes over the same links); a profile that measured both (a
  // calibrated one: over gloo the reduce-scatter runs as an all-to-all) costs each by its fit.
  CollectiveCost tensor_region_cost(double bytes, const GroupShape& g, bool sequence_parallel) const;
  double tensor_region_seconds(double bytes, const GroupShape& g, bool sequence_parallel) const;

  // A send of `bytes` from each rank to its neighbour along a pipeline group (every rank sends
  // at once, so the ranks of a node share its card when the neighbour is on another node).
  double send_seconds(double bytes, const GroupShape& g) const;

  // Host <-> device copy over PCIe of one GPU.
  double pcie_seconds(double bytes) const;

  const ClusterSpec& cluster() const { return *cluster_; }

  // A collective's time when `groups_per_node` groups cross each NIC at once.
  double seconds(const CollectiveCost& c, const GroupShape& g) const;

 private:
  const ClusterSpec* cluster_;
};

}  // namespace moeplan::sim
