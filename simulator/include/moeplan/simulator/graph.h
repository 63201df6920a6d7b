#pragma once
// One training step as a graph of ops on per-rank streams, and its discrete-event execution.
//
// Streams behave like CUDA streams: each rank's stream runs its ops one at a time in the order
// they were added (a busy flag and a FIFO). An op also waits for the ops it depends on. A
// collective is a set of parts, one on a stream of each participating rank; it starts when the
// last part arrives and ends for all of them together. Collectives that cross nodes push bytes
// through each node's network card, which is shared fairly by all transfers crossing it at the
// same moment (processor sharing).

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/trace.h"
#include "moeplan/simulator/cost_model.h"
#include "moeplan/simulator/engine.h"

namespace moeplan::sim {

using OpId = int32_t;
inline constexpr OpId kNoOp = -1;

enum class OpKind : uint8_t {
  kAttentionForward,
  kExpertForward,
  kHeadForwardBackward,
  kAttentionBackward,
  kExpertBackward,
  kAttentionRecompute,
  kExpertRecompute,
  kOptimizer,
  kDispatch,
  kCombine,
  kDispatchBackward,
  kCombineBackward,
  kDispatchRecompute,
  kCombineRecompute,
  kGatherForward,
  kGatherBackward,
  kReduceScatter,
  kGradAllReduce,
  kOffload,
  kReload,
  kDispatchCounts,  // each rank's tokens per expert, all-gathered before a dispatch
  kStageForward,    // a pipeline stage's forward of one micro-batch
  kStageBackward,
  kSendActivations,  // to the next stage (point to point)
  kSendGradients,    // to the previous stage
  kTensorForward,    // a tensor-parallel all-reduce (or reduce-scatter + all-gather) in forward
  kTensorBackward,
  kTensorRecompute,
  kContextForward,   // context parallelism's key-value exchange in forward (and recompute)
  kContextBackward,  // and in backward, with the gradients
  kCount
};
std::string_view op_kind_name(OpKind kind);
// Trace category: compute, all_to_all, all_gather, reduce_scatter, all_reduce or copy.
std::string_view op_category(OpKind kind);

struct Op {
  int32_t rank = 0;  // index among the simulated ranks
  TraceStream stream = TraceStream::kCompute;
  OpKind kind = OpKind::kAttentionForward;
  int16_t layer = -1;        // -1: not a layer's op
  int16_t micro_batch = -1;  // -1: once per step
  int32_t collective = -1;   // >= 0: this op is one rank's part of that collective
  SimTime duration{0};       // compute and copy ops; a collective's time is the collective's
  double flops = 0;
  double bytes = 0;
};

struct Collective {
  SimTime latency{0};  // ring steps
  SimTime intra{0};    // transfer inside nodes
  double nic_bytes_per_node = 0;
  int32_t first_node = 0;  // into StepGraph::collective_nodes
  int32_t node_count = 0;  // nodes whose card it crosses (0: none)
  int32_t parts = 0;
  // Its time was measured where it runs, after the compute before it: it pays no
  // after-compute extra (set_after_compute) on top.
  bool timed_in_place = false;
};

class StepGraph {
 public:
  StepGraph(int32_t ranks, int32_t nodes);

  OpId add_op(const Op& op);
  // A collective among `parts` ranks, crossing the cards of `nodes`.
  int32_t add_collective(SimTime latency, SimTime intra, double nic_bytes_per_node,
                         const std::vector<int32_t>& nodes, int32_t parts, bool timed_in_place = false);
  // `later` starts only after `earlier` has finished; kNoOp is ignored.
  void depend(OpId later, OpId earlier);

  int32_t ranks() const { return ranks_; }
  int32_t nodes() const { return nodes_; }
  // Collectives and copies run in the compute stream's FIFO, in issue order, instead of
  // beside it (ClusterSpec::comm_overlaps_compute false). The trace still shows their stream.
  void set_serial_streams(bool serial) { serial_streams_ = serial; }
  bool serial_streams() const { return serial_streams_; }
  // Collectives that follow compute take longer (ClusterSpec::after_compute): a collective
  // starts when its last member arrives and then takes, beyond its own time, the curve of its
  // kind at the most compute any member did since that member's previous collective.
  void set_after_compute(AfterCompute after) { after_compute_ = std::move(after); }
  const AfterCompute& after_compute() const { return after_compute_; }
  const std::vector<Op>& ops() const { return ops_; }
  const std::vector<Collective>& collectives() const { return collectives_; }
  const std::vector<int32_t>& collective_nodes() const { return collective_nodes_; }
  const std::vector<std::pair<OpId, OpId>>& edges() const { return edges_; }  // (earlier, later)

 private:
  int32_t ranks_;
  int32_t nodes_;
  bool serial_streams_ = false;
  AfterCompute after_compute_;
  std::vector<Op> ops_;
  std::vector<Collective> collectives_;
  std::vector<int32_t> collective_nodes_;
  std::vector<std::pair<OpId, OpId>> edges_;
};

struct GraphTimes {
  std::vector<SimTime> start;  // per op: when it began (a collective part: when its rank arrived)
  std::vector<SimTime> end;
  SimTime makespan{0};
  uint64_t events = 0;
  size_t finished = 0;  // ops that ran; fewer than the graph's means a deadlock (a bug)
  std::vector<SimTime> stream_busy;  // [rank * kTraceStreamCount + stream]
  std::vector<SimTime> nic_busy;     // per node: time with at least one transfer
  std::vector<SimTime> collective_start;  // per collective: when its last member arrived
  std::vector<SimTime> collective_wait;   // per collective: what it took for following compute
};

// Runs the graph. `nic_bandwidth_bytes_per_s` is each node's card.
GraphTimes run_graph(const StepGraph& graph, double nic_bandwidth_bytes_per_s);

// The ops as trace events (rank = simulated rank index).
Trace to_trace(const StepGraph& graph, const GraphTimes& times);

}  // namespace moeplan::sim
