#include "moeplan/simulator/graph.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>

namespace moeplan::sim {

namespace {

constexpr std::array<std::string_view, static_cast<size_t>(OpKind::kCount)> kKindNames = {
    "attn_fwd",     "experts_fwd",     "head_fwd_bwd",    "attn_bwd",         "experts_bwd",
    "attn_recompute", "experts_recompute", "optimizer",   "dispatch",         "combine",
    "dispatch_bwd", "combine_bwd",     "dispatch_recompute", "combine_recompute", "gather_fwd",
    "gather_bwd",   "reduce_scatter",  "grad_all_reduce", "offload",          "reload",
    "dispatch_counts", "stage_fwd",       "stage_bwd",       "send_activations", "send_gradients",
    "tp_fwd",       "tp_bwd",          "tp_recompute",    "cp_fwd",           "cp_bwd"};

enum EventKind : uint32_t { kOpDone, kCollectiveFlowsStart, kCollectiveDone, kNicCheck };

}  // namespace

std::string_view op_kind_name(OpKind kind) { return kKindNames[static_cast<size_t>(kind)]; }

std::string_view op_category(OpKind kind) {
  switch (kind) {
    case OpKind::kDispatch:
    case OpKind::kCombine:
    case OpKind::kDispatchBackward:
    case OpKind::kCombineBackward:
    case OpKind::kDispatchRecompute:
    case OpKind::kCombineRecompute: return "all_to_all";
    case OpKind::kGatherForward:
    case OpKind::kGatherBackward:
    case OpKind::kDispatchCounts: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kGradAllReduce:
    case OpKind::kTensorForward:
    case OpKind::kTensorBackward:
    case OpKind::kTensorRecompute: return "all_reduce";
    case OpKind::kOffload:
    case OpKind::kReload: return "copy";
    case OpKind::kSendActivations:
    case OpKind::kSendGradients:
    case OpKind::kContextForward:
    case OpKind::kContextBackward: return "send_recv";
    default: return "compute";
  }
}

StepGraph::StepGraph(int32_t ranks, int32_t nodes) : ranks_(ranks), nodes_(nodes) {}

OpId StepGraph::add_op(const Op& op) {
  assert(op.rank >= 0 && op.rank < ranks_ && "op on a rank that is not simulated");
  ops_.push_back(op);
  return static_cast<OpId>(ops_.size() - 1);
}

int32_t StepGraph::add_collective(SimTime latency, SimTime intra, double nic_bytes_per_node,
                                  const std::vector<int32_t>& nodes, int32_t parts, bool timed_in_place) {
  Collective c;
  c.timed_in_place = timed_in_place;
  c.latency = latency;
  c.intra = intra;
  c.nic_bytes_per_node = nic_bytes_per_node;
  c.first_node = static_cast<int32_t>(collective_nodes_.size());
  if (nic_bytes_per_node > 0) {
    collective_nodes_.insert(collective_nodes_.end(), nodes.begin(), nodes.end());
    c.node_count = static_cast<int32_t>(nodes.size());
  }
  c.parts = parts;
  collectives_.push_back(c);
  return static_cast<int32_t>(collectives_.size() - 1);
}

void StepGraph::depend(OpId later, OpId earlier) {
  if (later == kNoOp || earlier == kNoOp) return;
  assert(earlier < later && "dependencies point backwards in issue order");
  edges_.emplace_back(earlier, later);
}

namespace {

// The state of one run; lives only inside run_graph.
class Runner {
 public:
  Runner(const StepGraph& g, double nic_bandwidth) : g_(g), nic_bandwidth_(nic_bandwidth) {
    const size_t n = g.ops().size();
    times_.start.assign(n, SimTime(0));
    times_.end.assign(n, SimTime(0));
    pending_deps_.assign(n, 0);
    // Successors in compressed rows.
    succ_begin_.assign(n + 1, 0);
    for (const auto& [earlier, later] : g.edges()) {
      ++succ_begin_[static_cast<size_t>(earlier) + 1];
      ++pending_deps_[static_cast<size_t>(later)];
    }
    for (size_t i = 0; i < n; ++i) succ_begin_[i + 1] += succ_begin_[i];
    succ_.resize(g.edges().size());
    std::vector<int32_t> fill(succ_begin_.begin(), succ_begin_.end() - 1);
    for (const auto& [earlier, later] : g.edges()) succ_[static_cast<size_t>(fill[static_cast<size_t>(earlier)]++)] = later;
    // Stream FIFOs in issue order.
    const size_t streams = static_cast<size_t>(g.ranks()) * kTraceStreamCount;
    stream_begin_.assign(streams + 1, 0);
    for (const Op& op : g.ops()) ++stream_begin_[stream_of(op) + 1];
    for (size_t i = 0; i < streams; ++i) stream_begin_[i + 1] += stream_begin_[i];
    stream_ops_.resize(n);
    std::vector<int32_t> at(stream_begin_.begin(), stream_begin_.end() - 1);
    for (size_t i = 0; i < n; ++i) stream_ops_[static_cast<size_t>(at[stream_of(g.ops()[i])]++)] = static_cast<OpId>(i);
    stream_head_.assign(stream_begin_.begin(), stream_begin_.end() - 1);
    stream_busy_.assign(streams, false);
    times_.stream_busy.assign(streams, SimTime(0));
    arrived_.assign(g.collectives().size(), 0);
    flows_left_.assign(g.collectives().size(), 0);
    fixed_end_.assign(g.collectives().size(), SimTime(0));
    times_.collective_start.assign(g.collectives().size(), SimTime(0));
    times_.collective_wait.assign(g.collectives().size(), SimTime(0));
    unsynced_.assign(static_cast<size_t>(g.ranks()), SimTime(0));
    parts_.assign(g.collectives().size(), {});
    nics_.resize(static_cast<size_t>(g.nodes()));
    times_.nic_busy.assign(static_cast<size_t>(g.nodes()), SimTime(0));
    queue_.reserve(n);
  }

  GraphTimes run() {
    for (size_t s = 0; s + 1 < stream_begin_.size(); ++s) try_start(s);
    while (!queue_.empty()) {
      const Event e = queue_.pop();
      now_ = e.time;
      ++times_.events;
      switch (e.kind) {
        case kOpDone: finish(static_cast<OpId>(e.target)); break;
        case kCollectiveFlowsStart: start_flows(static_cast<int32_t>(e.target)); break;
        case kCollectiveDone: finish_collective(static_cast<int32_t>(e.target)); break;
        case kNicCheck: nic_check(e.target, e.tag); break;
      }
    }
    times_.makespan = now_;
    return std::move(times_);
  }

 private:
  struct Flow {
    int32_t collective;
    double remaining_bytes;
  };
  struct Nic {
    std::vector<Flow> flows;  // in arrival order
    SimTime last_update{0};
    uint64_t generation = 0;
  };

  size_t stream_of(const Op& op) const {
    const TraceStream stream = g_.serial_streams() ? TraceStream::kCompute : op.stream;
    return static_cast<size_t>(op.rank) * kTraceStreamCount + static_cast<size_t>(stream);
  }

  void try_start(size_t s) {
    if (stream_busy_[s] || stream_head_[s] == stream_begin_[s + 1]) return;
    const OpId id = stream_ops_[static_cast<size_t>(stream_head_[s])];
    if (pending_deps_[static_cast<size_t>(id)] > 0) return;
    ++stream_head_[s];
    stream_busy_[s] = true;
    times_.start[static_cast<size_t>(id)] = now_;
    const Op& op = g_.ops()[static_cast<size_t>(id)];
    if (op.collective < 0) {
      queue_.schedule(now_ + op.duration, kOpDone, static_cast<uint32_t>(id));
      return;
    }
    const auto c = static_cast<size_t>(op.collective);
    parts_[c].push_back(id);
    if (++arrived_[c] < g_.collectives()[c].parts) return;
    // The last participant has arrived: the transfer starts now, after what following compute
    // costs (when the graph says so).
    const Collective& col = g_.collectives()[c];
    SimTime wait{0};
    if (!g_.after_compute().empty()) {
      SimTime most{0};
      for (OpId part : parts_[c]) {
        SimTime& unsynced = unsynced_[static_cast<size_t>(g_.ops()[static_cast<size_t>(part)].rank)];
        most = std::max(most, unsynced);
        unsynced = SimTime(0);
      }
      const CurvePoints* curve = g_.after_compute().of(op_category(g_.ops()[static_cast<size_t>(id)].kind));
      if (curve != nullptr && !col.timed_in_place) wait = to_sim_time(after_compute_seconds(*curve, to_seconds(most)));
    }
    times_.collective_wait[c] = wait;
    fixed_end_[c] = now_ + wait + col.latency + col.intra;
    times_.collective_start[c] = now_;
    if (col.node_count == 0) {
      queue_.schedule(fixed_end_[c], kCollectiveDone, static_cast<uint32_t>(c));
    } else {
      queue_.schedule(now_ + wait + col.latency, kCollectiveFlowsStart, static_cast<uint32_t>(c));
    }
  }

  void finish(OpId id) {
    const Op& op = g_.ops()[static_cast<size_t>(id)];
    const size_t s = stream_of(op);
    times_.end[static_cast<size_t>(id)] = now_;
    ++times_.finished;
    if (op.collective < 0 && op.stream == TraceStream::kCompute)
      unsynced_[static_cast<size_t>(op.rank)] += now_ - times_.start[static_cast<size_t>(id)];
    times_.stream_busy[s] += now_ - times_.start[static_cast<size_t>(id)];
    stream_busy_[s] = false;
    for (int32_t i = succ_begin_[static_cast<size_t>(id)]; i < succ_begin_[static_cast<size_t>(id) + 1]; ++i) {
      const OpId next = succ_[static_cast<size_t>(i)];
      if (--pending_deps_[static_cast<size_t>(next)] == 0) try_start(stream_of(g_.ops()[static_cast<size_t>(next)]));
    }
    try_start(s);
  }

  void finish_collective(int32_t c) {
    // Parts finish in arrival order, so equal-time successors start in a fixed order.
    for (OpId part : parts_[static_cast<size_t>(c)]) finish(part);
  }

  void start_flows(int32_t c) {
    const Collective& col = g_.collectives()[static_cast<size_t>(c)];
    flows_left_[static_cast<size_t>(c)] = col.node_count;
    for (int32_t i = 0; i < col.node_count; ++i) {
      const auto node = static_cast<size_t>(g_.collective_nodes()[static_cast<size_t>(col.first_node + i)]);
      advance(node);
      nics_[node].flows.push_back({c, col.nic_bytes_per_node});
      reschedule(node);
    }
  }

  // Brings every flow on the card up to now: the bandwidth was split evenly among them.
  void advance(size_t node) {
    Nic& nic = nics_[node];
    if (!nic.flows.empty()) {
      const SimTime elapsed = now_ - nic.last_update;
      times_.nic_busy[node] += elapsed;
      const double share = nic_bandwidth_ * to_seconds(elapsed) / static_cast<double>(nic.flows.size());
      for (Flow& f : nic.flows) f.remaining_bytes -= share;
    }
    nic.last_update = now_;
  }

  void reschedule(size_t node) {
    Nic& nic = nics_[node];
    ++nic.generation;
    if (nic.flows.empty()) return;
    double least = nic.flows.front().remaining_bytes;
    for (const Flow& f : nic.flows) least = std::min(least, f.remaining_bytes);
    // Round up so that a flow never finishes before its last byte.
    const double seconds = std::max(0.0, least) * static_cast<double>(nic.flows.size()) / nic_bandwidth_;
    const SimTime wait(static_cast<int64_t>(std::ceil(seconds * 1e9)));
    queue_.schedule(now_ + wait, kNicCheck, static_cast<uint32_t>(node), nic.generation);
  }

  void nic_check(uint32_t node_index, uint64_t generation) {
    const auto node = static_cast<size_t>(node_index);
    if (generation != nics_[node].generation) return;  // the flows changed since
    advance(node);
    // Rounding up leaves the finished flows at or a hair below zero bytes.
    constexpr double kDoneBytes = 1e-3;
    std::vector<int32_t> done;
    auto& flows = nics_[node].flows;
    for (const Flow& f : flows)
      if (f.remaining_bytes <= kDoneBytes) done.push_back(f.collective);
    flows.erase(std::remove_if(flows.begin(), flows.end(), [](const Flow& f) { return f.remaining_bytes <= kDoneBytes; }),
                flows.end());
    reschedule(node);
    for (int32_t c : done) {
      if (--flows_left_[static_cast<size_t>(c)] > 0) continue;
      const SimTime end = std::max(now_, fixed_end_[static_cast<size_t>(c)]);
      queue_.schedule(end, kCollectiveDone, static_cast<uint32_t>(c));
    }
  }

  const StepGraph& g_;
  double nic_bandwidth_;
  EventQueue queue_;
  SimTime now_{0};
  GraphTimes times_;
  std::vector<int32_t> pending_deps_;
  std::vector<int32_t> succ_begin_;
  std::vector<OpId> succ_;
  std::vector<int32_t> stream_begin_;
  std::vector<OpId> stream_ops_;
  std::vector<int32_t> stream_head_;
  std::vector<bool> stream_busy_;
  std::vector<int32_t> arrived_;
  std::vector<int32_t> flows_left_;
  std::vector<SimTime> fixed_end_;
  std::vector<std::vector<OpId>> parts_;
  std::vector<SimTime> unsynced_;  // per rank: compute since its last collective
  std::vector<Nic> nics_;
};

}  // namespace

GraphTimes run_graph(const StepGraph& graph, double nic_bandwidth_bytes_per_s) {
  return Runner(graph, nic_bandwidth_bytes_per_s).run();
}

Trace to_trace(const StepGraph& graph, const GraphTimes& times) {
  Trace trace;
  trace.source = "simulated";
  trace.ranks = graph.ranks();
  trace.events.reserve(graph.ops().size());
  for (size_t i = 0; i < graph.ops().size(); ++i) {
    const Op& op = graph.ops()[i];
    TraceEvent e;
    e.name = std::string(op_kind_name(op.kind));
    if (op.layer >= 0) e.name = "L" + std::to_string(op.layer) + "." + e.name;
    if (op.micro_batch >= 0) e.name = "mb" + std::to_string(op.micro_batch) + "." + e.name;
    e.category = std::string(op_category(op.kind));
    e.start_ns = times.start[i].count();
    e.duration_ns = (times.end[i] - times.start[i]).count();
    e.rank = op.rank;
    e.stream = op.stream;
    e.flops = op.flops;
    e.bytes = op.bytes;
    trace.events.push_back(std::move(e));
  }
  return trace;
}

}  // namespace moeplan::sim
