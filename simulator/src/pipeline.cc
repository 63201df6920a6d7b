#include "moeplan/simulator/pipeline.h"

#include <algorithm>
#include <stdexcept>

#include "moeplan/core/pipeline_schedule.h"

namespace moeplan::sim {

PipelineSimulation simulate_pipeline(const std::vector<PipelineStage>& stages, int64_t micro_batches, double p2p_s,
                                     int64_t chunks) {
  if (stages.empty() || micro_batches < 1) throw std::invalid_argument("a pipeline needs a stage and a micro-batch");
  const auto p = static_cast<int64_t>(stages.size());
  const auto m = micro_batches;
  // Each rank's compute stream, in order (this also checks the chunks against the micro-batches).
  std::vector<std::vector<PipelineAction>> order;
  for (int64_t r = 0; r < p; ++r) order.push_back(pipeline_schedule(p, r, m, chunks));
  const int64_t v = chunks;
  const int64_t virtual_stages = p * v;
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
  // Virtual stage s (of P x v) is chunk s / P of rank s % P. Ops are added in the order each
  // rank's compute stream runs them; a dependency may only point back in that order, so a
  // micro-batch's ops are added stage by stage as the schedule reaches them.
  const auto vs = static_cast<size_t>(virtual_stages);
  std::vector<std::vector<OpId>> forward(vs, std::vector<OpId>(static_cast<size_t>(m), kNoOp));
  std::vector<std::vector<OpId>> backward = forward;
  std::vector<std::vector<OpId>> arrived = forward;  // activations (forward) at each stage
  std::vector<std::vector<OpId>> returned = forward;  // gradients at each stage
  // Add ops in an order that respects every dependency: repeatedly walk the ranks and add
  // each one's next op once what it waits for exists.
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  size_t added = 0;
  const size_t total = static_cast<size_t>(2 * virtual_stages * m);
  const double vd = static_cast<double>(v);
  while (added < total) {
    bool progress = false;
    for (int64_t r = 0; r < p; ++r) {
      auto& at = next[static_cast<size_t>(r)];
      while (at < order[static_cast<size_t>(r)].size()) {
        const PipelineAction step = order[static_cast<size_t>(r)][at];
        const int64_t mb = step.micro_batch;
        const auto i = static_cast<size_t>(mb);
        const int64_t s = step.chunk * p + r;
        const auto st = static_cast<size_t>(s);
        const PipelineStage& stage = stages[static_cast<size_t>(r)];
        if (step.forward) {
          if (s > 0 && forward[st - 1][i] == kNoOp) break;
          if (s > 0) {
            arrived[st][i] = g.add_op(op(r, OpKind::kSendActivations, TraceStream::kCopy, mb, p2p_s));
            g.depend(arrived[st][i], forward[st - 1][i]);
          }
          forward[st][i] = g.add_op(op(r, OpKind::kStageForward, TraceStream::kCompute, mb, stage.forward_s / vd));
          g.depend(forward[st][i], arrived[st][i]);
        } else {
          if (s + 1 < virtual_stages && backward[st + 1][i] == kNoOp) break;
          if (s + 1 < virtual_stages) {
            returned[st][i] = g.add_op(op(r, OpKind::kSendGradients, TraceStream::kGradComm, mb, p2p_s));
            g.depend(returned[st][i], backward[st + 1][i]);
          }
          backward[st][i] = g.add_op(op(r, OpKind::kStageBackward, TraceStream::kCompute, mb, stage.backward_s / vd));
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

double pipeline_step_seconds(const std::vector<PipelineStage>& stages, int64_t micro_batches, double p2p_s,
                             int64_t chunks) {
  const auto p = static_cast<int64_t>(stages.size());
  const int64_t base = 4 * p;
  if (p == 0 || micro_batches <= base + p) return simulate_pipeline(stages, micro_batches, p2p_s, chunks).step_s;
  const double shorter = simulate_pipeline(stages, base, p2p_s, chunks).step_s;
  const double longer = simulate_pipeline(stages, base + p, p2p_s, chunks).step_s;
  return longer + (longer - shorter) / static_cast<double>(p) * static_cast<double>(micro_batches - base - p);
}

}  // namespace moeplan::sim
