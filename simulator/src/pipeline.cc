#include "moeplan/simulator/pipeline.h"

#include <algorithm>
#include <stdexcept>

namespace moeplan::sim {

PipelineSimulation simulate_pipeline(const std::vector<PipelineStage>& stages, int64_t micro_batches, double p2p_s) {
  if (stages.empty() || micro_batches < 1) throw std::invalid_argument("a pipeline needs a stage and a micro-batch");
  const auto p = static_cast<int64_t>(stages.size());
  const auto m = micro_batches;
  PipelineSimulation sim;
  sim.graph = StepGraph(static_cast<int32_t>(p), 1);
  StepGraph& g = sim.graph;
  auto op = [&](int64_t stage, OpKind kind, TraceStream stream, int64_t mb, double seconds) {
    Op o;
    o.rank = static_cast<int32_t>(stage);
    o.stream = stream;
    o.kind = kind;
    o.micro_batch = static_cast<int16_t>(mb);
    o.duration = to_sim_time(seconds);
    return o;
  };
  // Ops are added in the order each stage's compute stream runs them; a dependency may only
  // point back in that order, so a micro-batch's ops are added stage by stage as the schedule
  // reaches them: forwards from the first stage down, backwards from the last stage up.
  std::vector<std::vector<OpId>> forward(static_cast<size_t>(p), std::vector<OpId>(static_cast<size_t>(m), kNoOp));
  std::vector<std::vector<OpId>> backward = forward;
  std::vector<std::vector<OpId>> arrived = forward;  // activations (forward) at each stage
  std::vector<std::vector<OpId>> returned = forward;  // gradients at each stage
  // The schedule of each stage: (is forward, micro-batch) in order.
  std::vector<std::vector<std::pair<bool, int64_t>>> order(static_cast<size_t>(p));
  for (int64_t s = 0; s < p; ++s) {
    const int64_t warmup = std::min(p - 1 - s, m);
    auto& o = order[static_cast<size_t>(s)];
    for (int64_t i = 0; i < warmup; ++i) o.emplace_back(true, i);
    for (int64_t i = 0; i < m - warmup; ++i) {
      o.emplace_back(true, warmup + i);
      o.emplace_back(false, i);
    }
    for (int64_t i = m - warmup; i < m; ++i) o.emplace_back(false, i);
  }
  // Add ops in an order that respects every dependency: repeatedly walk the stages and add
  // each one's next op once what it waits for exists.
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  size_t added = 0;
  const size_t total = static_cast<size_t>(2 * p * m);
  while (added < total) {
    bool progress = false;
    for (int64_t s = 0; s < p; ++s) {
      auto& at = next[static_cast<size_t>(s)];
      while (at < order[static_cast<size_t>(s)].size()) {
        const auto [is_forward, mb] = order[static_cast<size_t>(s)][at];
        const auto i = static_cast<size_t>(mb);
        const auto st = static_cast<size_t>(s);
        const PipelineStage& stage = stages[st];
        if (is_forward) {
          if (s > 0 && forward[st - 1][i] == kNoOp) break;
          if (s > 0) {
            arrived[st][i] = g.add_op(op(s, OpKind::kSendActivations, TraceStream::kCopy, mb, p2p_s));
            g.depend(arrived[st][i], forward[st - 1][i]);
          }
          forward[st][i] = g.add_op(op(s, OpKind::kStageForward, TraceStream::kCompute, mb, stage.forward_s));
          g.depend(forward[st][i], arrived[st][i]);
        } else {
          if (s + 1 < p && backward[st + 1][i] == kNoOp) break;
          if (s + 1 < p) {
            returned[st][i] = g.add_op(op(s, OpKind::kSendGradients, TraceStream::kGradComm, mb, p2p_s));
            g.depend(returned[st][i], backward[st + 1][i]);
          }
          backward[st][i] = g.add_op(op(s, OpKind::kStageBackward, TraceStream::kCompute, mb, stage.backward_s));
          g.depend(backward[st][i], returned[st][i]);
          g.depend(backward[st][i], forward[st][i]);
        }
        ++at;
        ++added;
        progress = true;
      }
    }
    if (!progress) throw std::logic_error("pipeline schedule waits on itself");
  }
  sim.times = run_graph(g, 1.0);
  if (sim.times.finished != g.ops().size()) throw std::logic_error("pipeline simulation deadlocked");
  sim.step_s = to_seconds(sim.times.makespan);
  double busiest = 0;
  for (int64_t s = 0; s < p; ++s)
    busiest = std::max(busiest, to_seconds(sim.times.stream_busy[static_cast<size_t>(s) * kTraceStreamCount +
                                                                 static_cast<size_t>(TraceStream::kCompute)]));
  sim.bubble_fraction = sim.step_s > 0 ? 1.0 - busiest / sim.step_s : 0.0;
  return sim;
}

}  // namespace moeplan::sim
