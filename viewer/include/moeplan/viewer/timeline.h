#pragma once
// What the viewer shows, independent of how it is drawn: one trace, or a simulated and a
// measured trace of the same plan, as lanes of boxes (a lane per rank and stream) and a memory
// curve per rank, with the queries a picture of a time window needs.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/trace.h"

namespace moeplan::viewer {

// What an op is, for its colour: the trace event's category.
enum class Kind : uint8_t { kCompute, kAllToAll, kAllGather, kReduceScatter, kAllReduce, kCopy, kOther };
inline constexpr int kKindCount = 7;
Kind kind_of(std::string_view category);
std::string_view kind_name(Kind kind);

struct Box {
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  uint32_t event = 0;  // index into the lane's trace's events
  Kind kind = Kind::kOther;
  int64_t wait_ns = 0;  // of a collective: its first wait_ns spent waiting for the group's last rank
};

// Each event's wait for the last rank of its collective (0 for any other event): the k-th
// collective of a name on each rank of a group (TraceEvent::group) is one collective, which
// ends on all its ranks together, so a rank that took longer than the group's shortest took
// the difference waiting for the others to arrive. Durations alone, so the ranks' clocks need
// not agree. A group whose ranks recorded different numbers of a collective is left out.
std::vector<int64_t> collective_waits(const Trace& trace);

struct Lane {
  enum class Type : uint8_t { kOps, kMemory };
  Type type = Type::kOps;
  int source = 0;  // which trace: 0 the first, 1 the second
  int64_t rank = 0;
  TraceStream stream = TraceStream::kCompute;
  std::string label;           // "rank 3 compute", "rank 3 memory"; "sim"/"measured" in an overlay
  std::vector<Box> boxes;      // by start
  int64_t longest_ns = 0;      // the longest box: how far before a window a box may start and reach in
  std::vector<std::pair<int64_t, double>> memory;  // (time, bytes), by time
  double peak_bytes = 0;
  double low_bytes = 0;  // the least in use
};

class Timeline {
 public:
  // One trace, or two of the same plan: the second is aligned phase by phase to the first
  // (align_phases) and its lanes follow the first's, rank by rank.
  explicit Timeline(Trace first, std::optional<Trace> second = std::nullopt);

  int sources() const { return second_ ? 2 : 1; }
  const Trace& trace(int source) const { return source == 0 ? first_ : *second_; }
  std::string_view source_name(int source) const;
  const std::vector<Lane>& lanes() const { return lanes_; }
  const TraceEvent& event(const Lane& lane, const Box& box) const { return trace(lane.source).events[box.event]; }

  int64_t begin_ns() const { return begin_ns_; }
  int64_t end_ns() const { return end_ns_; }
  double largest_memory_bytes() const { return largest_memory_; }
  int64_t event_count() const { return event_count_; }

  // The boxes of a lane that reach into [t0, t1).
  std::span<const Box> visible(const Lane& lane, int64_t t0, int64_t t1) const;
  // The box of a lane under time t, or within `slack_ns` of it (the nearest); nullptr if none.
  const Box* hit(const Lane& lane, int64_t t, int64_t slack_ns) const;

  // Phase starts of the first trace's lowest rank (lines across the picture), and, with two
  // traces, the phases that differ most, largest difference first.
  const std::vector<TracePhase>& phases() const { return phases_; }
  const std::vector<PhaseDifference>& differences() const { return differences_; }

 private:
  void add_lanes(int source, int64_t rank, const std::vector<std::vector<uint32_t>>& by_stream,
                 const std::vector<std::pair<int64_t, double>>& memory, const std::vector<int64_t>& waits);

  Trace first_;
  std::optional<Trace> second_;
  std::vector<Lane> lanes_;
  int64_t begin_ns_ = 0, end_ns_ = 1;
  double largest_memory_ = 0;
  int64_t event_count_ = 0;
  std::vector<TracePhase> phases_;
  std::vector<PhaseDifference> differences_;
};

// Human-readable figures for labels and tooltips.
std::string format_duration(int64_t ns);
std::string format_bytes(double bytes);
std::string format_flops(double flops);
// The tooltip of a box: op, kind, rank and stream, start, duration, bytes, FLOPs.
std::string describe(const Timeline& timeline, const Lane& lane, const Box& box);

}  // namespace moeplan::viewer
