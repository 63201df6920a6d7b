#include "moeplan/simulator/cost_model.h"

#include <algorithm>

namespace moeplan::sim {

GroupShape group_shape(const ClusterSpec& cluster, int64_t world_size, int64_t size, int64_t stride) {
  GroupShape g;
  g.size = std::max<int64_t>(1, size);
  const int64_t node_ranks = std::max<int64_t>(1, std::min(world_size, cluster.gpus_per_node));
  // Members i * stride, i < size, that fall on the first node.
  int64_t on_first = 0;
  for (int64_t i = 0; i < g.size && i * stride < node_ranks; ++i) ++on_first;
  g.per_node = std::max<int64_t>(1, on_first);
  g.nodes = (g.size + g.per_node - 1) / g.per_node;
  g.groups_per_node = std::max<int64_t>(1, node_ranks / g.per_node);
  return g;
}

GroupShape group_shape(const ClusterSpec& cluster, const ParallelConfig& parallel, MeshDim dim) {
  return group_shape(cluster, parallel.world_size, parallel.degree(dim), parallel.stride(dim));
}

GroupShape group_shape(const ClusterSpec& cluster, const ParallelConfig& parallel, std::span<const MeshDim> dims) {
  GroupShape g;
  for (MeshDim d : dims) g.size *= std::max<int64_t>(1, parallel.degree(d));
  const int64_t node_ranks = std::max<int64_t>(1, std::min(parallel.world_size, cluster.gpus_per_node));
  // Members on the first node: ranks whose coordinates are 0 along every other dimension.
  int64_t on_first = 0;
  for (int64_t rank = 0; rank < node_ranks; ++rank) {
    bool member = true;
    for (MeshDim d : kAllMeshDims) {
      if (std::find(dims.begin(), dims.end(), d) != dims.end()) continue;
      const int64_t degree = std::max<int64_t>(1, parallel.degree(d));
      if ((rank / std::max<int64_t>(1, parallel.stride(d))) % degree != 0) member = false;
    }
    if (member) ++on_first;
  }
  g.per_node = std::clamp<int64_t>(on_first, 1, g.size);
  g.nodes = (g.size + g.per_node - 1) / g.per_node;
  g.groups_per_node = std::max<int64_t>(1, node_ranks / g.per_node);
  return g;
}

double CostModel::matmul_seconds(double flops, double gemm_flops, bool fp32) const {
  if (flops <= 0) return 0;
  const double peak = fp32 ? cluster_->peak_fp32_flops : cluster_->peak_bf16_flops;
  return flops / (peak * cluster_->efficiency_at(gemm_flops));
}

double CostModel::memory_bound_seconds(double bytes) const {
  return bytes / cluster_->hbm_bandwidth_bytes_per_s;
}

double CostModel::seconds(const CollectiveCost& c, const GroupShape& g) const {
  const double nic = static_cast<double>(g.groups_per_node) * c.nic_bytes_per_node /
                     cluster_->inter_node_bandwidth_bytes_per_s;
  return c.latency_s + std::max(c.intra_s, nic);
}

namespace {

// A calibrated collective inside one node: measured at this size, or its own line.
// (The points were measured with a whole node in the group.)
bool calibrated(const CollectiveFit& fit, const GroupShape& g, int64_t node_ranks, double bytes, double steps,
                double share, CollectiveCost& c) {
  if (!fit.given() || g.crosses_nodes()) return false;
  if (const double measured = g.size == node_ranks ? fit.measured_at(bytes) : -1.0; measured >= 0) {
    c.intra_s = measured;
    return true;
  }
  c.latency_s = steps * fit.latency_s;
  c.intra_s = share * bytes / fit.bandwidth_bytes_per_s;
  return true;
}

}  // namespace

CollectiveCost CostModel::all_gather_cost(double output_bytes, const GroupShape& g) const {
  CollectiveCost c;
  if (g.size <= 1 || output_bytes <= 0) return c;
  const double n = static_cast<double>(g.size);
  if (calibrated(cluster_->all_gather_fit, g, cluster_->gpus_per_node, output_bytes, n - 1, (n - 1) / n, c)) return c;
  // NCCL's ring: a base latency, then one hop per step (tuning.cc).
  c.latency_s = cluster_->collective_base_latency_s +
                (n - 1) * (g.crosses_nodes() ? cluster_->inter_node_latency_s : cluster_->intra_node_latency_s);
  c.intra_s = (n - 1) / n * output_bytes / cluster_->intra_node_bandwidth_bytes_per_s;
  if (g.crosses_nodes()) {
    // One ring per group enters each node once; the link into a node carries every chunk
    // that started on another node.
    const double k = static_cast<double>(g.nodes);
    c.nic_bytes_per_node = output_bytes * (k - 1) / k;
  }
  return c;
}

CollectiveCost CostModel::reduce_scatter_cost(double input_bytes, const GroupShape& g) const {
  // The mirror image of the all-gather: the same chunks travel the same links.
  CollectiveCost c;
  const double n = static_cast<double>(g.size);
  if (g.size > 1 && input_bytes > 0 &&
      calibrated(cluster_->reduce_scatter_fit, g, cluster_->gpus_per_node, input_bytes, n - 1, (n - 1) / n, c))
    return c;
  return all_gather_cost(input_bytes, g);
}

CollectiveCost CostModel::all_reduce_cost(double bytes, const GroupShape& g) const {
  const double n = static_cast<double>(g.size);
  CollectiveCost calibrated_cost;
  if (g.size > 1 && bytes > 0 &&
      calibrated(cluster_->all_reduce_fit, g, cluster_->gpus_per_node, bytes, 2 * (n - 1), 2 * (n - 1) / n, calibrated_cost))
    return calibrated_cost;
  CollectiveCost c = all_gather_cost(bytes, g);
  if (c.latency_s > 0) c.latency_s = 2 * c.latency_s - cluster_->collective_base_latency_s;  // one base, twice the steps
  c.intra_s *= 2;
  c.nic_bytes_per_node *= 2;
  return c;
}

CollectiveCost CostModel::all_to_all_cost(double send_bytes, const GroupShape& g) const {
  CollectiveCost c;
  if (g.size <= 1 || send_bytes <= 0) return c;
  const double n = static_cast<double>(g.size);
  const double m = static_cast<double>(g.per_node);
  if (calibrated(cluster_->all_to_all_fit, g, cluster_->gpus_per_node, send_bytes, n - 1, (m - 1) / n, c)) return c;
  // NCCL's all-to-all is grouped point-to-point: one kernel sends to every peer at once, each
  // channel taking up to 8 peers a batch, and across nodes NCCL narrows the channels per peer
  // until every peer fits in one round (NVIDIA/nccl, src/graph/paths.cc,
  // ncclTopoComputeP2pChannels; NCCL_MAX_DEV_WORK_P2P_PER_BATCH). Its latency is one hop, not
  // one per peer as in a ring.
  c.latency_s = cluster_->collective_base_latency_s +
                (g.crosses_nodes() ? cluster_->inter_node_latency_s : cluster_->intra_node_latency_s);
  c.intra_s = send_bytes * (m - 1) / n / cluster_->intra_node_bandwidth_bytes_per_s;
  // Each of the group's m members on a node sends (n - m)/n of its buffer off the node.
  if (g.crosses_nodes()) c.nic_bytes_per_node = m * send_bytes * (n - m) / n;
  return c;
}

CollectiveCost CostModel::fused_dispatch_cost(double send_bytes, double network_bytes, const GroupShape& g) const {
  CollectiveCost c;
  if (g.size <= 1 || send_bytes <= 0) return c;
  const double n = static_cast<double>(g.size);
  const double m = static_cast<double>(g.per_node);
  const bool across = g.crosses_nodes();
  c.latency_s = cluster_->collective_base_latency_s + (across ? cluster_->inter_node_latency_s : cluster_->intra_node_latency_s);
  // NVLink carries the slots for the node's other members and forwards what arrives from the
  // network to them.
  c.intra_s = (send_bytes * (m - 1) / n + (across ? network_bytes : 0.0)) / cluster_->intra_node_bandwidth_bytes_per_s;
  if (across) c.nic_bytes_per_node = m * network_bytes;
  return c;
}

CollectiveCost CostModel::tensor_region_cost(double bytes, const GroupShape& g, bool sequence_parallel) const {
  if (!sequence_parallel || !cluster_->all_gather_fit.given() || !cluster_->reduce_scatter_fit.given())
    return all_reduce_cost(bytes, g);
  const CollectiveCost scatter = reduce_scatter_cost(bytes, g), gather = all_gather_cost(bytes, g);
  return {scatter.latency_s + gather.latency_s, scatter.intra_s + gather.intra_s,
          scatter.nic_bytes_per_node + gather.nic_bytes_per_node};
}

double CostModel::tensor_region_seconds(double bytes, const GroupShape& g, bool sequence_parallel) const {
  return seconds(tensor_region_cost(bytes, g, sequence_parallel), g);
}

double CostModel::all_gather_seconds(double output_bytes, const GroupShape& g) const {
  return seconds(all_gather_cost(output_bytes, g), g);
}

double CostModel::reduce_scatter_seconds(double input_bytes, const GroupShape& g) const {
  return seconds(reduce_scatter_cost(input_bytes, g), g);
}

double CostModel::all_reduce_seconds(double bytes, const GroupShape& g) const {
  return seconds(all_reduce_cost(bytes, g), g);
}

double CostModel::all_to_all_seconds(double send_bytes, const GroupShape& g) const {
  return seconds(all_to_all_cost(send_bytes, g), g);
}

double CostModel::send_seconds(double bytes, const GroupShape& g) const {
  if (g.size <= 1 || bytes <= 0) return 0;
  // The slowest hop sets the pace: one that leaves the node when the group spans nodes.
  if (!g.crosses_nodes())
    return cluster_->collective_base_latency_s + cluster_->intra_node_latency_s +
           bytes / cluster_->intra_node_bandwidth_bytes_per_s;
  const double sharing = static_cast<double>(g.groups_per_node);
  return cluster_->collective_base_latency_s + cluster_->inter_node_latency_s +
         bytes * sharing / cluster_->inter_node_bandwidth_bytes_per_s;
}

double CostModel::pcie_seconds(double bytes) const {
  return bytes / cluster_->pcie_bandwidth_bytes_per_s;
}

}  // namespace moeplan::sim
