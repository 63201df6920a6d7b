// The order each pipeline rank runs its forwards and backwards (core/pipeline_schedule.h):
// 1F1B and Megatron-LM's interleaved schedule, golden orders worked by hand, then properties
// over many shapes.
#include "moeplan/core/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace moeplan {
namespace {

// "F0 F1 B0 ..." (1F1B) or "F0c0 F1c0 B0c1 ..." (with chunks): compact and readable on failure.
std::string spell(const std::vector<PipelineAction>& order, bool with_chunks) {
  std::string s;
  for (const PipelineAction& a : order) {
    if (!s.empty()) s += ' ';
    s += (a.forward ? "F" : "B") + std::to_string(a.micro_batch);
    if (with_chunks) s += "c" + std::to_string(a.chunk);
  }
  return s;
}

// 1F1B, P = 2, m = 4. Stage 0 warms up with min(P - 1 - 0, m) = 1 forward (F0), then
// alternates forward i + 1 with backward i for the m - 1 = 3 remaining forwards, then runs the
// one backward left (B3). Stage 1, the last, warms up with none: F0 B0 F1 B1 ...
TEST(PipelineSchedule, OneForwardOneBackwardTwoStagesByHand) {
  EXPECT_EQ(spell(pipeline_schedule(2, 0, 4, 1), false), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(spell(pipeline_schedule(2, 1, 4, 1), false), "F0 B0 F1 B1 F2 B2 F3 B3");
}

// 1F1B, P = 4, m = 8, the middle stages. Stage 1 warms up with 4 - 1 - 1 = 2 forwards (F0 F1),
// pairs F2..F7 with B0..B5, then drains B6 B7. Stage 2 warms up with one (F0), pairs F1..F7
// with B0..B6, then drains B7.
TEST(PipelineSchedule, OneForwardOneBackwardMiddleStagesByHand) {
  EXPECT_EQ(spell(pipeline_schedule(4, 1, 8, 1), false),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(spell(pipeline_schedule(4, 2, 8, 1), false),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  // Fewer micro-batches than the warm-up: all forwards, then all backwards.
  EXPECT_EQ(spell(pipeline_schedule(4, 0, 2, 1), false), "F0 F1 B0 B1");
  // One stage is no pipeline: forward and backward of each micro-batch in turn.
  EXPECT_EQ(spell(pipeline_schedule(1, 0, 3, 1), false), "F0 B0 F1 B1 F2 B2");
}

// Interleaved, P = 2, v = 2, m = 4: each rank runs m v = 8 forwards and 8 backwards. As in
// Megatron-LM's forward_backward_pipelining_with_interleaving, the k-th forward is model chunk
// (k / P) % v of micro-batch (k / (P v)) P + k % P, and the k-th backward chunk
// v - 1 - (k / P) % v of the same micro-batch:
//   k         0    1    2    3    4    5    6    7
//   forward   F0c0 F1c0 F0c1 F1c1 F2c0 F3c0 F2c1 F3c1
//   backward  B0c1 B1c1 B0c0 B1c0 B2c1 B3c1 B2c0 B3c0
// Warm-up (P - r - 1) * 2 + (v - 1) * P: 4 forwards on rank 0, 2 on rank 1; then forward
// warm-up + i alternates with backward i; then the backwards left.
TEST(PipelineSchedule, InterleavedTwoRanksTwoChunksByHand) {
  EXPECT_EQ(spell(pipeline_schedule(2, 0, 4, 2), true),
            "F0c0 F1c0 F0c1 F1c1 "                 // warm-up
            "F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 "  // steady: F4..F7 with B0..B3
            "B2c1 B3c1 B2c0 B3c0");                // cool-down: B4..B7
  EXPECT_EQ(spell(pipeline_schedule(2, 1, 4, 2), true),
            "F0c0 F1c0 "                                                  // warm-up
            "F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 "  // F2..F7 with B0..B5
            "B2c0 B3c0");                                                 // B6, B7
}

// Each rank's order holds every (micro-batch, chunk) once as a forward and once as a backward,
// the backward after the forward.
TEST(PipelineSchedule, EveryMicroBatchAndChunkRunsOnceEachWayForwardFirst) {
  for (int64_t p = 1; p <= 5; ++p)
    for (int64_t v = 1; v <= 3; ++v)
      for (int64_t m = 1; m <= 12; ++m) {
        if (v > 1 && m % p != 0) continue;
        for (int64_t r = 0; r < p; ++r) {
          const auto order = pipeline_schedule(p, r, m, v);
          const std::string where = "P " + std::to_string(p) + " v " + std::to_string(v) + " m " +
                                    std::to_string(m) + " rank " + std::to_string(r);
          ASSERT_EQ(order.size(), static_cast<size_t>(2 * m * v)) << where;
          std::map<std::pair<int64_t, int64_t>, size_t> forward_at, backward_at;
          for (size_t i = 0; i < order.size(); ++i) {
            const PipelineAction& a = order[i];
            ASSERT_TRUE(a.micro_batch >= 0 && a.micro_batch < m && a.chunk >= 0 && a.chunk < v) << where;
            auto& seen = a.forward ? forward_at : backward_at;
            EXPECT_TRUE(seen.emplace(std::make_pair(a.micro_batch, a.chunk), i).second)
                << where << ": " << (a.forward ? "F" : "B") << a.micro_batch << "c" << a.chunk << " twice";
          }
          ASSERT_EQ(forward_at.size(), static_cast<size_t>(m * v)) << where;
          ASSERT_EQ(backward_at.size(), static_cast<size_t>(m * v)) << where;
          for (const auto& [key, at] : backward_at)
            EXPECT_LT(forward_at.at(key), at) << where << ": B" << key.first << "c" << key.second;
        }
      }
}

// All ranks' orders together never wait on each other: run them, each rank taking its next
// action once its input exists (the forward of the previous virtual stage, the backward of the
// next one; virtual stage s is chunk s / P of rank s % P), and every action runs. This is what
// an executor with blocking transfers needs.
TEST(PipelineSchedule, AllRanksTogetherRunToTheEnd) {
  for (int64_t p = 1; p <= 5; ++p)
    for (int64_t v = 1; v <= 3; ++v)
      for (int64_t m = 1; m <= 12; ++m) {
        if (v > 1 && m % p != 0) continue;
        std::vector<std::vector<PipelineAction>> orders;
        for (int64_t r = 0; r < p; ++r) orders.push_back(pipeline_schedule(p, r, m, v));
        const int64_t stages = p * v;
        const std::vector<bool> none(static_cast<size_t>(m), false);
        std::vector<std::vector<bool>> forward_done(static_cast<size_t>(stages), none), backward_done = forward_done;
        std::vector<size_t> next(static_cast<size_t>(p), 0);
        bool progress = true;
        while (progress) {
          progress = false;
          for (int64_t r = 0; r < p; ++r) {
            const auto& order = orders[static_cast<size_t>(r)];
            auto& at = next[static_cast<size_t>(r)];
            if (at == order.size()) continue;
            const PipelineAction& a = order[at];
            const auto s = static_cast<size_t>(a.chunk * p + r);
            const auto i = static_cast<size_t>(a.micro_batch);
            if (a.forward && s > 0 && !forward_done[s - 1][i]) continue;
            if (!a.forward && s + 1 < static_cast<size_t>(stages) && !backward_done[s + 1][i]) continue;
            (a.forward ? forward_done : backward_done)[s][i] = true;
            ++at;
            progress = true;
          }
        }
        for (int64_t r = 0; r < p; ++r)
          EXPECT_EQ(next[static_cast<size_t>(r)], orders[static_cast<size_t>(r)].size())
              << "P " << p << " v " << v << " m " << m << ": rank " << r << " stuck";
      }
}

TEST(PipelineSchedule, RefusesWhatNoScheduleFits) {
  // Megatron-LM's rule: interleaving needs whole rounds of P micro-batches.
  EXPECT_THROW(pipeline_schedule(2, 0, 3, 2), std::invalid_argument);
  EXPECT_NO_THROW(pipeline_schedule(2, 0, 3, 1));
  EXPECT_THROW(pipeline_schedule(2, 2, 4, 1), std::invalid_argument);
  EXPECT_THROW(pipeline_schedule(2, -1, 4, 1), std::invalid_argument);
  EXPECT_THROW(pipeline_schedule(0, 0, 4, 1), std::invalid_argument);
  EXPECT_THROW(pipeline_schedule(2, 0, 0, 1), std::invalid_argument);
  EXPECT_THROW(pipeline_schedule(2, 0, 4, 0), std::invalid_argument);
}

}  // namespace
}  // namespace moeplan
