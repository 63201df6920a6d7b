#include "moeplan/simulator/graph.h"

#include <gtest/gtest.h>

namespace moeplan::sim {
namespace {

using std::chrono::nanoseconds;

Op compute(int32_t rank, int64_t ns, TraceStream stream = TraceStream::kCompute) {
  Op op;
  op.rank = rank;
  op.stream = stream;
  op.duration = SimTime(ns);
  return op;
}

Op part(int32_t rank, int32_t collective, TraceStream stream = TraceStream::kExpertComm) {
  Op op;
  op.rank = rank;
  op.stream = stream;
  op.kind = OpKind::kDispatch;
  op.collective = collective;
  return op;
}

// 10 GB/s per node card: 10 bytes per nanosecond.
constexpr double kNic = 10e9;

TEST(Graph, OneOp) {
  StepGraph g(1, 1);
  g.add_op(compute(0, 1'500));
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.makespan, SimTime(1'500));
  EXPECT_EQ(t.finished, 1u);
}

// Compute (1,000 ns) and a copy (600 ns) on two streams of one rank overlap; an op that needs
// both starts at 1,000 and ends at 1,300. A second op on the copy stream waits its turn
// (FIFO): 600 + 250 = 850.
TEST(Graph, TwoStreamsOverlap) {
  StepGraph g(1, 1);
  const OpId a = g.add_op(compute(0, 1'000));
  const OpId b = g.add_op(compute(0, 600, TraceStream::kCopy));
  const OpId b2 = g.add_op(compute(0, 250, TraceStream::kCopy));
  const OpId c = g.add_op(compute(0, 300));
  g.depend(c, a);
  g.depend(c, b);
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.end[a], SimTime(1'000));
  EXPECT_EQ(t.end[b], SimTime(600));
  EXPECT_EQ(t.start[b2], SimTime(600));
  EXPECT_EQ(t.end[b2], SimTime(850));
  EXPECT_EQ(t.start[c], SimTime(1'000));
  EXPECT_EQ(t.makespan, SimTime(1'300));
}

// A collective starts when its last member arrives: rank 1 computes 300 ns first; the
// 1,000 ns collective then ends at 1,300 on both ranks, and rank 0's part shows the wait.
TEST(Graph, CollectiveWaitsForTheLastMember) {
  StepGraph g(2, 1);
  const int32_t c = g.add_collective(SimTime(200), SimTime(800), 0, {}, 2);
  const OpId p0 = g.add_op(part(0, c));
  const OpId w = g.add_op(compute(1, 300));
  const OpId p1 = g.add_op(part(1, c));
  g.depend(p1, w);
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.start[p0], SimTime(0));
  EXPECT_EQ(t.start[p1], SimTime(300));
  EXPECT_EQ(t.end[p0], SimTime(1'300));
  EXPECT_EQ(t.end[p1], SimTime(1'300));
}

// A collective after compute takes longer: here an all-to-all 100 ns after 1,000 ns of compute,
// 200 ns after 4,000 (read linearly between), 5% of the compute beyond. Rank 0 computes
// 1,000 ns, rank 1 3,000 ns; the first exchange (200 + 800 ns) starts at 3,000 when rank 1
// arrives, takes 100 + 100 x 2/3 ns more for rank 1's 3,000 ns (the most), and ends at
// 4,000 + 167. The second follows no compute: 1,000 ns. After rank 0's 8,000 ns the third
// takes 400 more.
TEST(Graph, CollectiveAfterComputeTakesLonger) {
  StepGraph g(2, 1);
  AfterCompute after;
  after.all_to_all = {{1e-6, 100e-9}, {4e-6, 200e-9}};
  g.set_after_compute(after);
  const int32_t first = g.add_collective(SimTime(200), SimTime(800), 0, {}, 2);
  const int32_t second = g.add_collective(SimTime(200), SimTime(800), 0, {}, 2);
  const int32_t third = g.add_collective(SimTime(200), SimTime(800), 0, {}, 2);
  g.add_op(compute(0, 1'000));
  g.add_op(compute(1, 3'000));
  const OpId a0 = g.add_op(part(0, first, TraceStream::kCompute));
  const OpId a1 = g.add_op(part(1, first, TraceStream::kCompute));
  const OpId b0 = g.add_op(part(0, second, TraceStream::kCompute));
  g.add_op(part(1, second, TraceStream::kCompute));
  g.add_op(compute(0, 8'000));
  const OpId c0 = g.add_op(part(0, third, TraceStream::kCompute));
  g.add_op(part(1, third, TraceStream::kCompute));
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.start[a0], SimTime(1'000));
  EXPECT_EQ(t.end[a0], SimTime(4'167));
  EXPECT_EQ(t.end[a1], SimTime(4'167));
  EXPECT_EQ(t.collective_wait[static_cast<size_t>(first)], SimTime(167));
  EXPECT_EQ(t.end[b0], SimTime(5'167));
  EXPECT_EQ(t.collective_wait[static_cast<size_t>(second)], SimTime(0));
  EXPECT_EQ(t.end[c0], SimTime(5'167 + 8'000 + 400 + 1'000));
  // Only the curve of the collective's kind counts; without one, the last member alone.
  StepGraph other_kind = g;
  after.all_gather = after.all_to_all;
  after.all_to_all.clear();
  other_kind.set_after_compute(after);
  EXPECT_EQ(run_graph(other_kind, kNic).end[a0], SimTime(4'000));
}

TEST(Graph, AfterComputeCurveIsReadAsASharePastItsEnds) {
  const CurvePoints curve{{1e-3, 1e-3}, {2e-2, 2e-3}};
  EXPECT_DOUBLE_EQ(after_compute_seconds(curve, 0), 0);
  EXPECT_DOUBLE_EQ(after_compute_seconds(curve, 0.5e-3), 0.5e-3);  // the first point's share
  EXPECT_NEAR(after_compute_seconds(curve, 10.5e-3), 1.5e-3, 1e-15);  // between
  EXPECT_NEAR(after_compute_seconds(curve, 0.2), 0.02, 1e-15);  // the last point's share: 10%
  EXPECT_DOUBLE_EQ(after_compute_seconds({}, 1.0), 0);
}

// All-to-all over two nodes of two ranks each (n = 4, m = 2), 1 MB sent per rank, 100 GB/s
// inside a node, 10 GB/s card, 10 us latency a network hop (every peer at once: one hop):
//   latency 10,000 ns; intra 1e6 x 1/4 / 100e9 = 2,500 ns;
//   card bytes per node 2 x 1e6 x 2/4 = 1e6, alone on the card: 100,000 ns.
//   end = 10,000 + max(2,500, 100,000) = 110,000 ns.
// Two such groups crossing the same cards at once (E groups {0,2,4,6} and {1,3,5,7} of two
// 4-GPU nodes) share them: 2e6 bytes at 10 bytes/ns = 200,000 ns, end 210,000 ns.
TEST(Graph, AllToAllAcrossTwoNodesSharesTheCard) {
  ClusterSpec cl;
  cl.intra_node_bandwidth_bytes_per_s = 100e9;
  cl.intra_node_latency_s = 1e-6;
  cl.inter_node_bandwidth_bytes_per_s = kNic;
  cl.inter_node_latency_s = 10e-6;
  const CostModel cost(cl);
  const CollectiveCost a2a = cost.all_to_all_cost(1e6, GroupShape{4, 2, 2, 1});
  EXPECT_DOUBLE_EQ(a2a.nic_bytes_per_node, 1e6);

  StepGraph one(4, 2);
  const int32_t c = one.add_collective(to_sim_time(a2a.latency_s), to_sim_time(a2a.intra_s), a2a.nic_bytes_per_node, {0, 1}, 4);
  for (int32_t r = 0; r < 4; ++r) one.add_op(part(r, c));
  EXPECT_EQ(run_graph(one, kNic).makespan, SimTime(110'000));

  StepGraph two(8, 2);
  const int32_t even = two.add_collective(to_sim_time(a2a.latency_s), to_sim_time(a2a.intra_s), 1e6, {0, 1}, 4);
  const int32_t odd = two.add_collective(to_sim_time(a2a.latency_s), to_sim_time(a2a.intra_s), 1e6, {0, 1}, 4);
  for (int32_t r = 0; r < 8; ++r) two.add_op(part(r, r % 2 == 0 ? even : odd));
  const GraphTimes t = run_graph(two, kNic);
  EXPECT_EQ(t.makespan, SimTime(210'000));
  EXPECT_EQ(t.nic_busy[0], SimTime(200'000));
  // The analytic form says the same when told two groups share each card.
  EXPECT_NEAR(cost.all_to_all_seconds(1e6, GroupShape{4, 2, 2, 2}), 210e-6, 1e-15);
}

// Processor sharing with staggered starts on one card (10 bytes/ns), 1 MB each:
//   A alone from 0 to 50 us moves 500,000 bytes; A and B share 5 bytes/ns each, so A's last
//   500,000 bytes take 100 us: A ends at 150 us. B has moved 500,000 bytes by then and
//   finishes alone in 50 us: B ends at 200 us.
TEST(Graph, CardIsSharedFairlyBetweenStaggeredTransfers) {
  StepGraph g(2, 2);
  const int32_t a = g.add_collective(SimTime(0), SimTime(0), 1e6, {0}, 1);
  const int32_t b = g.add_collective(SimTime(0), SimTime(0), 1e6, {0}, 1);
  const OpId pa = g.add_op(part(0, a));
  const OpId delay = g.add_op(compute(1, 50'000));
  const OpId pb = g.add_op(part(1, b));
  g.depend(pb, delay);
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.end[pa], SimTime(150'000));
  EXPECT_EQ(t.end[pb], SimTime(200'000));
}

// A block's parameters gathered on their own stream while the previous block computes
// (400 us). Two ranks in one node, 100 GB/s, 1 us latency per step; gathering M bytes takes
// 1,000 + (1/2) M / 100 bytes-per-ns nanoseconds.
//   M = 2e7:   101,000 ns, hidden: the next block starts at 400,000 and ends at 800,000.
//   M = 1.2e8: 601,000 ns, exposed: the next block starts at 601,000 and ends at 1,001,000.
int64_t next_block_end(double gathered_bytes) {
  ClusterSpec cl;
  cl.intra_node_bandwidth_bytes_per_s = 100e9;
  cl.intra_node_latency_s = 1e-6;
  cl.inter_node_bandwidth_bytes_per_s = kNic;
  const CollectiveCost ag = CostModel(cl).all_gather_cost(gathered_bytes, GroupShape{2, 2, 1, 1});
  StepGraph g(2, 1);
  const int32_t c = g.add_collective(to_sim_time(ag.latency_s), to_sim_time(ag.intra_s), 0, {}, 2);
  OpId next[2];
  for (int32_t r = 0; r < 2; ++r) {
    const OpId gather = g.add_op(part(r, c, TraceStream::kShardGather));
    g.add_op(compute(r, 400'000));
    next[r] = g.add_op(compute(r, 400'000));
    g.depend(next[r], gather);
  }
  const GraphTimes t = run_graph(g, kNic);
  EXPECT_EQ(t.end[next[0]], t.end[next[1]]);
  return t.end[next[0]].count();
}

TEST(Graph, PrefetchedGatherHiddenBehindCompute) { EXPECT_EQ(next_block_end(2e7), 800'000); }
TEST(Graph, PrefetchedGatherLongerThanCompute) { EXPECT_EQ(next_block_end(1.2e8), 1'001'000); }

// Equal-time events run in the order they were scheduled, so the same graph gives the same
// times and the same event count every run.
TEST(Graph, Deterministic) {
  auto build = [] {
    StepGraph g(4, 2);
    const int32_t c = g.add_collective(SimTime(10), SimTime(20), 5e5, {0, 1}, 4);
    for (int32_t r = 0; r < 4; ++r) {
      g.add_op(compute(r, 100 * (r + 1)));
      g.add_op(part(r, c));
    }
    return g;
  };
  const GraphTimes a = run_graph(build(), kNic);
  const GraphTimes b = run_graph(build(), kNic);
  EXPECT_EQ(a.end, b.end);
  EXPECT_EQ(a.events, b.events);
}

}  // namespace
}  // namespace moeplan::sim
