#include "moeplan/simulator/cost_model.h"

#include <gtest/gtest.h>

#include "moeplan/simulator/op_costs.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

// A round-number cluster: 8 GPUs per node, 100 GB/s per GPU inside a node, 10 GB/s per node
// across, 1 us and 10 us latency.
ClusterSpec toy(int64_t nodes) {
  ClusterSpec c;
  c.name = "toy";
  c.gpus_per_node = 8;
  c.num_nodes = nodes;
  c.peak_bf16_flops = 100e12;
  c.peak_fp32_flops = 10e12;
  c.hbm_bandwidth_bytes_per_s = 1e12;
  c.matmul_efficiency = {{1e9, 0.5}, {1e11, 0.8}};
  c.intra_node_bandwidth_bytes_per_s = 100e9;
  c.intra_node_latency_s = 1e-6;
  c.inter_node_bandwidth_bytes_per_s = 10e9;
  c.inter_node_latency_s = 10e-6;
  c.pcie_bandwidth_bytes_per_s = 20e9;
  return c;
}

ParallelConfig mesh(int64_t w, int64_t e, int64_t s, const char* placement) {
  ParallelConfig p;
  p.world_size = w;
  p.expert_parallel_degree = e;
  p.hybrid_shard_degree = s;
  p.placement = *Placement::parse(placement);
  return p;
}

TEST(GroupShape, InnermostDimensionStaysInANode) {
  const ClusterSpec c = toy(2);
  // RSE, E = 8, S = 2: experts are ranks 0..7 (one node), shard peers 0 and 8 (two nodes).
  const ParallelConfig p = mesh(16, 8, 2, "RSE");
  const GroupShape e = group_shape(c, p, MeshDim::kExpert);
  EXPECT_EQ(e.per_node, 8);
  EXPECT_EQ(e.nodes, 1);
  const GroupShape s = group_shape(c, p, MeshDim::kShard);
  EXPECT_EQ(s.per_node, 1);
  EXPECT_EQ(s.nodes, 2);
  EXPECT_EQ(s.groups_per_node, 8);  // all 8 ranks of a node cross the NIC at once
}

TEST(GroupShape, OuterExpertDimensionSpansNodes) {
  // ESR with E = 8, S = 2, R = 1: E has stride 2, so ranks 0,2,..,14: 4 per node, 2 nodes.
  const GroupShape e = group_shape(toy(2), mesh(16, 8, 2, "ESR"), MeshDim::kExpert);
  EXPECT_EQ(e.per_node, 4);
  EXPECT_EQ(e.nodes, 2);
  EXPECT_EQ(e.groups_per_node, 2);
}

TEST(CostModel, MatmulUsesTheEfficiencyCurve) {
  const ClusterSpec c = toy(1);
  const CostModel cost(c);
  // 1e12 FLOPs at 100 TFLOP/s x 0.5 (GEMM of 1e9, first point) = 20 ms.
  EXPECT_DOUBLE_EQ(cost.matmul_seconds(1e12, 1e9, false), 0.02);
  // Halfway in log10 between 1e9 and 1e11: efficiency 0.65.
  EXPECT_DOUBLE_EQ(c.efficiency_at(1e10), 0.65);
  // fp32 uses the fp32 peak, and a GEMM beyond the last point its efficiency:
  // 1e12 / (10e12 x 0.8) = 125 ms.
  EXPECT_DOUBLE_EQ(cost.matmul_seconds(1e12, 1e12, true), 0.125);
}

TEST(CostModel, AllGatherInsideANode) {
  const ClusterSpec c = toy(1);
  const CostModel cost(c);
  GroupShape g{8, 8, 1, 1};
  // 7 steps x 1 us + 7/8 x 8 GB / 100 GB/s = 7 us + 70 ms.
  EXPECT_NEAR(cost.all_gather_seconds(8e9, g), 7e-6 + 0.07, 1e-12);
  EXPECT_NEAR(cost.all_reduce_seconds(8e9, g), 2 * (7e-6 + 0.07), 1e-12);
}

TEST(CostModel, SequenceParallelRegionIsTheMeasuredPairWhereBothWereMeasured) {
  ClusterSpec c = toy(1);
  GroupShape g{2, 2, 1, 1};
  {
    const CostModel ring(c);
    // The ring model: the pair is the all-reduce, with or without sequence parallelism.
    EXPECT_DOUBLE_EQ(ring.tensor_region_seconds(1e6, g, true), ring.all_reduce_seconds(1e6, g));
    EXPECT_DOUBLE_EQ(ring.tensor_region_seconds(1e6, g, false), ring.all_reduce_seconds(1e6, g));
  }
  c.all_gather_fit = {6e-4, 8e8, {}};
  c.reduce_scatter_fit = {2e-4, 7.5e8, {}};
  c.all_reduce_fit = {6e-4, 1.3e9, {}};
  const CostModel measured(c);
  // One step each: latency + bytes / 2 over the fit's bandwidth.
  const double gather = 6e-4 + 0.5e6 / 8e8, scatter = 2e-4 + 0.5e6 / 7.5e8;
  EXPECT_NEAR(measured.tensor_region_seconds(1e6, g, true), gather + scatter, 1e-12);
  EXPECT_NEAR(measured.tensor_region_seconds(1e6, g, false), measured.all_reduce_seconds(1e6, g), 1e-12);
  EXPECT_NEAR(measured.all_reduce_seconds(1e6, g), 2 * 6e-4 + 1e6 / 1.3e9, 1e-12);
}

TEST(CostModel, AllGatherAcrossNodesSharesTheNic) {
  const ClusterSpec c = toy(2);
  const CostModel cost(c);
  // 2 members, one per node, 8 such groups per node: each node's NIC takes 8 x 1 GB x 1/2
  // = 4 GB at 10 GB/s = 0.4 s; the intra term (1/2 x 1 GB / 100 GB/s = 5 ms) is smaller.
  GroupShape g{2, 1, 2, 8};
  EXPECT_NEAR(cost.all_gather_seconds(1e9, g), 10e-6 + 0.4, 1e-12);
}

TEST(CostModel, AllToAllAcrossTwoNodes) {
  const ClusterSpec c = toy(2);
  const CostModel cost(c);
  // 16 members, 8 per node; each sends 1.6 GB, 8/16 of it off the node. All 8 ranks of a node
  // do so at once: 8 x 0.8 GB = 6.4 GB through a 10 GB/s NIC = 0.64 s, plus one network hop
  // of 10 us (NCCL sends to every peer at once, not one after another as a ring's steps).
  GroupShape g{16, 8, 2, 1};
  EXPECT_NEAR(cost.all_to_all_seconds(1.6e9, g), 10e-6 + 0.64, 1e-12);
  // Inside one node only the 7/8 that leave the rank travel: 1.4 GB / 100 GB/s = 14 ms, plus
  // one hop of 1 us.
  GroupShape local{8, 8, 1, 1};
  EXPECT_NEAR(cost.all_to_all_seconds(1.6e9, local), 1e-6 + 0.014, 1e-12);
  // A 128-member group's latency is still one hop.
  EXPECT_NEAR(cost.all_to_all_seconds(8.0, GroupShape{128, 2, 64, 4}) - 10e-6, 0, 1e-6);
}

// DeepEP's fused dispatch sends a token across the network once per other node that holds one
// of its experts, and forwards it over NVLink there. Mixtral's 8 experts (top 2) over 16 ranks on
// two nodes, 4 experts on each: a token misses the other node when both its experts are on its
// own, C(4, 2) / C(8, 2) = 6/28 of the time, so it crosses 22/28 of a time, and each of its 2
// slots' bytes 11/28: less than the all-to-all's 8/16 off the node.
TEST(CostModel, DeepEpSendsATokenOncePerNode) {
  const ClusterSpec c = toy(2);
  const CostModel cost(c);
  ModelSpec mixtral;
  mixtral.num_experts = 8;
  mixtral.experts_per_token = 2;
  GroupShape g{16, 8, 2, 1};
  const double send = 1.6e9;
  const double network = fused_network_bytes(mixtral, send, g);
  EXPECT_NEAR(network, send * 11.0 / 28.0, 1e-3);
  // Its 8 ranks' share through the node's card at 10 GB/s; NVLink carries the 7/16 for the
  // node's other ranks and forwards what arrived: (0.7 + 0.629) GB at 100 GB/s, under the card.
  const CollectiveCost fused = cost.fused_dispatch_cost(send, network, g);
  EXPECT_NEAR(fused.nic_bytes_per_node, 8 * network, 1e-3);
  EXPECT_NEAR(cost.seconds(fused, g), 10e-6 + 8 * network / 10e9, 1e-9);
  EXPECT_LT(cost.seconds(fused, g), cost.all_to_all_seconds(send, g));
  // Inside one node there is nothing to save: NVLink carries the 7/8 for the other ranks.
  GroupShape local{8, 8, 1, 1};
  EXPECT_EQ(fused_network_bytes(mixtral, send, local), 0);
  EXPECT_NEAR(cost.seconds(cost.fused_dispatch_cost(send, 0, local), local), cost.all_to_all_seconds(send, local), 1e-12);

  // DeepSeek-V3's group-limited routing (8 groups of 32 experts, 4 of them a token) on 8 nodes
  // that each hold one group: another node is hit when its group is chosen, 1 - C(7,4)/C(8,4)
  // = 1/2 of the time, 3.5 of the 7 (uniform top-8 over the experts would reach 4.6).
  ModelSpec v3;
  v3.num_experts = 256;
  v3.experts_per_token = 8;
  v3.router_groups = 8;
  v3.router_group_topk = 4;
  const GroupShape eight_nodes{64, 8, 8, 1};
  EXPECT_NEAR(fused_network_bytes(v3, send, eight_nodes), send / 8 * 3.5, 1e-3);
  v3.router_groups = 1;
  EXPECT_GT(fused_network_bytes(v3, send, eight_nodes), send / 8 * 4.5);
}

// A tensor-parallel group of 16 on nodes of 8 spans two: its collectives go through each node's
// network card, so an all-reduce costs at least what half its ring traffic takes at the card's
// bandwidth, over three times the same bytes inside one node over NVLink.
TEST(CostModel, TensorGroupAcrossTwoNodesIsPricedAtTheCard) {
  const ClusterSpec cl = test::hardware("p4d.24xlarge", 16);
  ParallelConfig p;
  p.world_size = 16;
  p.expert_parallel_degree = 1;
  p.hybrid_shard_degree = 1;
  p.tensor_parallel_degree = 16;
  const GroupShape across = group_shape(cl, p, MeshDim::kTensor);
  EXPECT_TRUE(across.crosses_nodes());
  EXPECT_EQ(across.per_node, 8);
  EXPECT_EQ(across.nodes, 2);
  p.tensor_parallel_degree = 8;
  p.hybrid_shard_degree = 2;
  const GroupShape inside = group_shape(cl, p, MeshDim::kTensor);
  EXPECT_FALSE(inside.crosses_nodes());
  const CostModel cost(cl);
  const double bytes = 64e6;
  EXPECT_GE(cost.all_reduce_seconds(bytes, across), 2 * bytes / 2 / cl.inter_node_bandwidth_bytes_per_s);
  EXPECT_GT(cost.all_reduce_seconds(bytes, across), 3 * cost.all_reduce_seconds(bytes, inside));
}

TEST(CostModel, SingleMemberGroupsCostNothing) {
  const ClusterSpec cluster = toy(1);
  const CostModel cost(cluster);
  GroupShape one{};
  EXPECT_EQ(cost.all_gather_seconds(1e9, one), 0);
  EXPECT_EQ(cost.all_to_all_seconds(1e9, one), 0);
  EXPECT_EQ(cost.all_reduce_seconds(1e9, one), 0);
}

}  // namespace
}  // namespace moeplan::sim
