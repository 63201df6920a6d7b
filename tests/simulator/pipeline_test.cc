#include "moeplan/simulator/pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace moeplan::sim {
namespace {

// Four equal stages, 8 micro-batches, forward 1 ms and backward 2 ms, free transfers: 1F1B
// takes (m + P - 1)(f + b) = 11 x 3 ms = 33 ms, and every stage idles (P - 1)(f + b) = 9 ms
// of it: the bubble is (P - 1) / (m + P - 1) = 3 / 11.
TEST(Pipeline, EqualStagesTakeTheBubbleOfTheTextbook) {
  const PipelineSimulation sim = simulate_pipeline(std::vector<PipelineStage>(4, {1e-3, 2e-3}), 8, 0);
  EXPECT_NEAR(sim.step_s, 33e-3, 1e-9);
  EXPECT_NEAR(sim.bubble_fraction, 3.0 / 11.0, 1e-6);
  // One stage is no pipeline: m (f + b).
  EXPECT_NEAR(simulate_pipeline({{1e-3, 2e-3}}, 8, 0).step_s, 24e-3, 1e-9);
  EXPECT_NEAR(simulate_pipeline({{1e-3, 2e-3}}, 8, 0).bubble_fraction, 0, 1e-9);
}

// Two stages, 2 micro-batches, f = 1, b = 2, transfers of 0.5 (all in ms), worked by hand:
//   stage 0: F0 0-1, F1 1-2;            activations reach stage 1 at 1.5 and 2.5
//   stage 1: F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5
//   gradients reach stage 0 at 5 and 8: B0 5-7, B1 8-10.
// 10 ms = (m + P - 1)(f + b) + 2 (P - 1) x transfer = 9 + 1.
TEST(Pipeline, TransfersLengthenTheFirstRoundTrip) {
  const PipelineSimulation sim = simulate_pipeline({{1e-3, 2e-3}, {1e-3, 2e-3}}, 2, 0.5e-3);
  EXPECT_NEAR(sim.step_s, 10e-3, 1e-9);
  const StepGraph& g = sim.graph;
  int checked = 0;
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    const double start = to_seconds(sim.times.start[i]) * 1e3, end = to_seconds(sim.times.end[i]) * 1e3;
    if (op.rank == 1 && op.kind == OpKind::kStageForward && op.micro_batch == 1) {
      EXPECT_NEAR(start, 4.5, 1e-6);  // after B0: one forward, one backward
      ++checked;
    }
    if (op.rank == 0 && op.kind == OpKind::kStageBackward && op.micro_batch == 0) {
      EXPECT_NEAR(start, 5.0, 1e-6);
      EXPECT_NEAR(end, 7.0, 1e-6);
      ++checked;
    }
    if (op.kind == OpKind::kSendGradients) {
      EXPECT_EQ(op_category(op.kind), "send_recv");
    }
  }
  EXPECT_EQ(checked, 2);
}

// The slowest stage sets the pace. Two stages, 2 micro-batches, stage 1 twice as slow
// (f = 2, b = 4) as stage 0 (f = 1, b = 2), free transfers:
//   stage 1: F0 1-3, B0 3-7, F1 7-9, B1 9-13; stage 0: F0 0-1, F1 1-2, B0 7-9, B1 13-15.
// 15 ms = m (f + b) of stage 1 + f and b of stage 0.
TEST(Pipeline, TheSlowestStageSetsThePace) {
  const PipelineSimulation sim = simulate_pipeline({{1e-3, 2e-3}, {2e-3, 4e-3}}, 2, 0);
  EXPECT_NEAR(sim.step_s, 15e-3, 1e-9);
  EXPECT_NEAR(sim.bubble_fraction, 1.0 - 12.0 / 15.0, 1e-6);
}

// A stage never holds more than P - s micro-batches' activations: stage s starts the
// backward of micro-batch i before the forward of micro-batch i + P - s.
TEST(Pipeline, EachStageKeepsAtMostItsWarmupPlusOneInFlight) {
  const int64_t p = 4, m = 8;
  const PipelineSimulation sim = simulate_pipeline(std::vector<PipelineStage>(p, {1e-3, 2e-3}), m, 0.1e-3);
  for (int64_t s = 0; s < p; ++s) {
    std::vector<SimTime> fwd_start(m), bwd_start(m);
    for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
      const Op& op = sim.graph.ops()[i];
      if (op.rank != s) continue;
      if (op.kind == OpKind::kStageForward) fwd_start[static_cast<size_t>(op.micro_batch)] = sim.times.start[i];
      if (op.kind == OpKind::kStageBackward) bwd_start[static_cast<size_t>(op.micro_batch)] = sim.times.start[i];
    }
    for (int64_t i = 0; i + (p - s) < m; ++i)
      EXPECT_LT(bwd_start[static_cast<size_t>(i)], fwd_start[static_cast<size_t>(i + p - s)]) << "stage " << s << " mb " << i;
  }
}

TEST(Pipeline, EmptyInputIsRefused) {
  EXPECT_THROW(simulate_pipeline({}, 4, 0), std::invalid_argument);
  EXPECT_THROW(simulate_pipeline({{1, 1}}, 0, 0), std::invalid_argument);
}

// Interleaved: two ranks, two chunks each (virtual stages rank0/c0, rank1/c0, rank0/c1,
// rank1/c1), 2 micro-batches; each rank's stage takes f = 1 and b = 2 (ms), so a chunk takes
// 0.5 and 1; free transfers. Worked by hand from Megatron's order (rank 0: F0c0 F1c0 F0c1 F1c1,
// then B0c1 B1c1 B0c0 B1c0; rank 1: F0c0 F1c0, F0c1 B0c1, F1c1 B1c1, B0c0 B1c0):
//   rank 0: F0c0 0-0.5, F1c0 0.5-1, F0c1 1-1.5, F1c1 1.5-2, B0c1 3-4, B1c1 4.5-5.5,
//           B0c0 5.5-6.5, B1c0 6.5-7.5
//   rank 1: F0c0 0.5-1, F1c0 1-1.5, F0c1 1.5-2, B0c1 2-3, F1c1 3-3.5, B1c1 3.5-4.5,
//           B0c0 4.5-5.5, B1c0 5.5-6.5
// 7.5 ms = m (f + b) + (P - 1)(f + b) / v = 6 + 1.5, against 9 without interleaving.
TEST(Pipeline, InterleavedChunksShrinkTheBubbleWorkedByHand) {
  const std::vector<PipelineStage> two(2, {1e-3, 2e-3});
  const PipelineSimulation sim = simulate_pipeline(two, 2, 0, 2);
  EXPECT_NEAR(sim.step_s, 7.5e-3, 1e-9);
  EXPECT_NEAR(simulate_pipeline(two, 2, 0).step_s, 9e-3, 1e-9);
  const StepGraph& g = sim.graph;
  std::vector<std::pair<double, double>> rank0_backward, rank1_forward;
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    const double start = to_seconds(sim.times.start[i]) * 1e3, end = to_seconds(sim.times.end[i]) * 1e3;
    if (op.rank == 0 && op.kind == OpKind::kStageBackward) rank0_backward.emplace_back(start, end);
    if (op.rank == 1 && op.kind == OpKind::kStageForward) rank1_forward.emplace_back(start, end);
  }
  const std::vector<std::pair<double, double>> backward0 = {{3, 4}, {4.5, 5.5}, {5.5, 6.5}, {6.5, 7.5}};
  const std::vector<std::pair<double, double>> forward1 = {{0.5, 1}, {1, 1.5}, {1.5, 2}, {3, 3.5}};
  ASSERT_EQ(rank0_backward.size(), 4u);
  ASSERT_EQ(rank1_forward.size(), 4u);
  std::sort(rank0_backward.begin(), rank0_backward.end());
  std::sort(rank1_forward.begin(), rank1_forward.end());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(rank0_backward[i].first, backward0[i].first, 1e-6) << i;
    EXPECT_NEAR(rank0_backward[i].second, backward0[i].second, 1e-6) << i;
    EXPECT_NEAR(rank1_forward[i].first, forward1[i].first, 1e-6) << i;
    EXPECT_NEAR(rank1_forward[i].second, forward1[i].second, 1e-6) << i;
  }
  // A micro-batch count that is not whole rounds of the ranks is refused, as Megatron does.
  EXPECT_THROW(simulate_pipeline(two, 3, 0, 2), std::invalid_argument);
}

// Four ranks, 8 micro-batches, f = 1 and b = 2: the bubble falls from (P - 1)(f + b) = 9 ms to
// (P - 1)(f + b) / v = 4.5 ms with two chunks and 3 ms with three, where transfers are free.
TEST(Pipeline, InterleavedBubbleIsTheTextbooksOverTheChunks) {
  const std::vector<PipelineStage> four(4, {1e-3, 2e-3});
  EXPECT_NEAR(simulate_pipeline(four, 8, 0, 1).step_s, 33e-3, 1e-9);
  EXPECT_NEAR(simulate_pipeline(four, 8, 0, 2).step_s, 28.5e-3, 1e-9);
  EXPECT_NEAR(simulate_pipeline(four, 8, 0, 3).step_s, 27e-3, 1e-9);
  // Transfers: a micro-batch crosses P v - 1 boundaries instead of P - 1.
  EXPECT_GT(simulate_pipeline(four, 8, 0.1e-3, 2).step_s, simulate_pipeline(four, 8, 0, 2).step_s);
}

// The step of many micro-batches from two short runs equals the whole schedule: equal and
// unequal stages, with and without transfers and chunks, micro-batch counts just past and
// far past the short runs.
TEST(Pipeline, ManyMicroBatchesExtrapolateFromTwoShortRuns) {
  const std::vector<PipelineStage> equal(4, {1e-3, 2e-3});
  const std::vector<PipelineStage> uneven = {{1e-3, 2e-3}, {1.2e-3, 2.1e-3}, {0.9e-3, 2e-3}, {1.5e-3, 3e-3}};
  for (const auto* stages : {&equal, &uneven})
    for (double send : {0.0, 0.3e-3})
      for (int64_t chunks : {1, 2})
        for (int64_t m : {24, 64, 200}) {
          const double whole = simulate_pipeline(*stages, m, send, chunks).step_s;
          EXPECT_NEAR(pipeline_step_seconds(*stages, m, send, chunks), whole, 1e-9 * whole)
              << "m " << m << " chunks " << chunks << " send " << send;
        }
}

}  // namespace
}  // namespace moeplan::sim
