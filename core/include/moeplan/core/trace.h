#pragma once
// A step timeline in Chrome's trace event format (also read by Perfetto): complete events
// ("ph": "X") with pid = rank and tid = stream, and a counter ("ph": "C", name "memory") with
// a rank's bytes in use. The simulator writes it; the executor writes measured ones in the
// same schema; the viewer reads both.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"

namespace moeplan {

// Streams of a rank, the trace's tid.
enum class TraceStream : uint8_t { kCompute = 0, kExpertComm = 1, kShardGather = 2, kGradComm = 3, kCopy = 4 };
inline constexpr int kTraceStreamCount = 5;
std::string_view stream_name(TraceStream s);

struct TraceEvent {
  std::string name;      // op, e.g. "layer3.expert_fwd"
  std::string category;  // "compute", "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "copy"
  int64_t start_ns = 0;
  int64_t duration_ns = 0;
  int64_t rank = 0;
  TraceStream stream = TraceStream::kCompute;
  double flops = 0;
  double bytes = 0;
  // A collective's group: the lowest rank of the ranks it spans (the k-th collective of a name
  // on each rank of a group is one collective); -1 when not a collective or not recorded.
  int64_t group = -1;
  bool operator==(const TraceEvent&) const = default;
};

// A rank's memory in use from this moment until its next sample.
struct MemorySample {
  int64_t rank = 0;
  int64_t time_ns = 0;
  double bytes = 0;
  bool operator==(const MemorySample&) const = default;
};

struct Trace {
  std::string source;  // "simulated" or "measured"
  int64_t ranks = 0;
  // The plan the step is of (its layout as `describe` writes it) and its world size; empty and
  // 0 in traces that do not say.
  std::string plan;
  int64_t world_size = 0;
  std::vector<TraceEvent> events;
  std::vector<MemorySample> memory;  // in time order per rank
  bool operator==(const Trace&) const = default;
};

Json to_json(const Trace& trace);
// Why two traces are not of one plan: "the simulated trace is of <plan> on <n> ranks, the
// measured one of <plan> on <m> ranks"; empty when they are, or when either does not say.
std::string plan_difference(const Trace& first, const Trace& second);
Trace trace_from_json(const Json& json, const std::string& origin);

// Reads a trace file as a stream, without holding its JSON document: a simulated step of
// thousands of ranks has millions of events. `progress`, if given, is called with the events
// read so far every 2^16 events. Problems are an InputError naming the file and the event.
struct TraceReadProgress {
  int64_t events = 0;
  int64_t file_bytes = 0;
};
// Files larger than kMaxTraceFileBytes are refused (a simulated step of 1,024 ranks is 91 MB).
inline constexpr int64_t kMaxTraceFileBytes = int64_t{4} << 30;
Trace read_trace_file(const std::string& path, const std::function<void(const TraceReadProgress&)>& progress = {});

// -- Phases: the parts of a step that a simulated and a measured trace of the same plan share.
// Per micro-batch k, "mb<k> forward" and "mb<k> backward", then "optimizer". A simulated trace
// names its ops "mb<k>.<op>" (forward ops end in _fwd, backward ones in _bwd or _recompute; the
// head's forward and backward op counts a third as forward); a measured one records
// "forward", "backward" and "optimizer" spans in micro-batch order. Each phase spans its
// compute events on the rank.
struct TracePhase {
  std::string name;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};
std::vector<TracePhase> step_phases(const Trace& trace, int64_t rank);

// The phases of two traces side by side: each phase's longest span over the ranks, in order of
// the absolute difference, largest first. Phases in only one trace are left out.
struct PhaseDifference {
  std::string phase;
  double first_s = 0;
  double second_s = 0;
};
std::vector<PhaseDifference> compare_phases(const Trace& first, const Trace& second);

// `moved` with every rank's events shifted phase by phase so that each phase starts where the
// same phase of the same rank starts in `reference`: the events from a phase's start to the
// next phase's start move with it. Ranks or phases absent from `reference` stay in place.
Trace align_phases(const Trace& moved, const Trace& reference);

}  // namespace moeplan
