#pragma once
// A step timeline in Chrome's trace event format (also read by Perfetto): complete events
// ("ph": "X") with pid = rank and tid = stream. The simulator writes it; the executor writes
// measured ones in the same schema; the viewer reads both.

#include <cstdint>
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
  bool operator==(const TraceEvent&) const = default;
};

struct Trace {
  std::string source;  // "simulated" or "measured"
  int64_t ranks = 0;
  std::vector<TraceEvent> events;
  bool operator==(const Trace&) const = default;
};

OrderedJson to_json(const Trace& trace);
Trace trace_from_json(const Json& json, const std::string& origin);

}  // namespace moeplan
