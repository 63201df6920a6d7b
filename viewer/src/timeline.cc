#include "moeplan/viewer/timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>

namespace moeplan::viewer {

namespace {

constexpr std::array<std::string_view, kKindCount> kKindNames = {
    "compute", "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "copy", "other"};

}  // namespace

Kind kind_of(std::string_view category) {
  for (size_t i = 0; i + 1 < kKindNames.size(); ++i)
    if (category == kKindNames[i]) return static_cast<Kind>(i);
  return Kind::kOther;
}

std::string_view kind_name(Kind kind) { return kKindNames[static_cast<size_t>(kind)]; }

std::vector<int64_t> collective_waits(const Trace& trace) {
  std::vector<int64_t> waits(trace.events.size(), 0);
  // (group, name) -> rank -> its events of that collective, in time order.
  std::map<std::pair<int64_t, std::string_view>, std::map<int64_t, std::vector<uint32_t>>> collectives;
  for (size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    const Kind kind = kind_of(e.category);
    if (e.group < 0 || kind == Kind::kCompute || kind == Kind::kCopy || kind == Kind::kOther) continue;
    collectives[{e.group, e.name}][e.rank].push_back(static_cast<uint32_t>(i));
  }
  for (auto& [key, by_rank] : collectives) {
    if (by_rank.size() < 2) continue;
    const size_t count = by_rank.begin()->second.size();
    if (!std::all_of(by_rank.begin(), by_rank.end(), [&](const auto& r) { return r.second.size() == count; })) continue;
    for (auto& [rank, ids] : by_rank)
      std::stable_sort(ids.begin(), ids.end(),
                       [&](uint32_t a, uint32_t b) { return trace.events[a].start_ns < trace.events[b].start_ns; });
    for (size_t k = 0; k < count; ++k) {
      int64_t shortest = INT64_MAX;
      for (const auto& [rank, ids] : by_rank) shortest = std::min(shortest, trace.events[ids[k]].duration_ns);
      for (const auto& [rank, ids] : by_rank) waits[ids[k]] = trace.events[ids[k]].duration_ns - shortest;
    }
  }
  return waits;
}

Timeline::Timeline(Trace first, std::optional<Trace> second) : first_(std::move(first)) {
  if (second) second_ = align_phases(*second, first_);

  // Events and memory samples per source, rank and stream.
  int64_t ranks = 0;
  for (int s = 0; s < sources(); ++s) {
    ranks = std::max(ranks, trace(s).ranks);
    for (const TraceEvent& e : trace(s).events) ranks = std::max(ranks, e.rank + 1);
    for (const MemorySample& m : trace(s).memory) ranks = std::max(ranks, m.rank + 1);
  }
  using ByStream = std::vector<std::vector<uint32_t>>;
  std::vector<std::vector<ByStream>> events(static_cast<size_t>(sources()),
                                            std::vector<ByStream>(static_cast<size_t>(ranks), ByStream(kTraceStreamCount)));
  std::vector<std::vector<std::vector<std::pair<int64_t, double>>>> memory(
      static_cast<size_t>(sources()), std::vector<std::vector<std::pair<int64_t, double>>>(static_cast<size_t>(ranks)));
  int64_t begin = INT64_MAX, end = INT64_MIN;
  for (int s = 0; s < sources(); ++s) {
    const Trace& t = trace(s);
    for (size_t i = 0; i < t.events.size(); ++i) {
      const TraceEvent& e = t.events[i];
      events[static_cast<size_t>(s)][static_cast<size_t>(e.rank)][static_cast<size_t>(e.stream)].push_back(
          static_cast<uint32_t>(i));
      begin = std::min(begin, e.start_ns);
      end = std::max(end, e.start_ns + e.duration_ns);
    }
    for (const MemorySample& m : t.memory) {
      memory[static_cast<size_t>(s)][static_cast<size_t>(m.rank)].emplace_back(m.time_ns, m.bytes);
      begin = std::min(begin, m.time_ns);
      end = std::max(end, m.time_ns);
    }
    event_count_ += static_cast<int64_t>(t.events.size());
  }
  if (begin > end) begin = end = 0;
  begin_ns_ = std::min<int64_t>(begin, 0);
  end_ns_ = std::max(end, begin_ns_ + 1);

  std::vector<std::vector<int64_t>> waits;
  for (int s = 0; s < sources(); ++s) waits.push_back(collective_waits(trace(s)));
  for (int64_t rank = 0; rank < ranks; ++rank)
    for (int s = 0; s < sources(); ++s)
      add_lanes(s, rank, events[static_cast<size_t>(s)][static_cast<size_t>(rank)],
                memory[static_cast<size_t>(s)][static_cast<size_t>(rank)], waits[static_cast<size_t>(s)]);

  for (int64_t rank = 0; rank < first_.ranks && phases_.empty(); ++rank) phases_ = step_phases(first_, rank);
  if (second_) differences_ = compare_phases(first_, *second_);
}

std::string_view Timeline::source_name(int source) const {
  const std::string& name = trace(source).source;
  if (!name.empty()) return name;
  return source == 0 ? "first" : "second";
}

void Timeline::add_lanes(int source, int64_t rank, const std::vector<std::vector<uint32_t>>& by_stream,
                         const std::vector<std::pair<int64_t, double>>& memory, const std::vector<int64_t>& waits) {
  const Trace& t = trace(source);
  const std::string who = "rank " + std::to_string(rank) + " ";
  const std::string suffix = sources() > 1 ? " (" + std::string(source_name(source)) + ")" : "";
  for (int s = 0; s < kTraceStreamCount; ++s) {
    const std::vector<uint32_t>& ids = by_stream[static_cast<size_t>(s)];
    if (ids.empty()) continue;
    Lane lane;
    lane.source = source;
    lane.rank = rank;
    lane.stream = static_cast<TraceStream>(s);
    lane.label = who + std::string(stream_name(lane.stream)) + suffix;
    lane.boxes.reserve(ids.size());
    for (uint32_t i : ids) {
      const TraceEvent& e = t.events[i];
      lane.boxes.push_back({e.start_ns, e.start_ns + e.duration_ns, i, kind_of(e.category), waits[i]});
      lane.longest_ns = std::max(lane.longest_ns, e.duration_ns);
    }
    std::stable_sort(lane.boxes.begin(), lane.boxes.end(),
                     [](const Box& a, const Box& b) { return a.start_ns < b.start_ns; });
    lanes_.push_back(std::move(lane));
  }
  if (!memory.empty()) {
    Lane lane;
    lane.type = Lane::Type::kMemory;
    lane.source = source;
    lane.rank = rank;
    lane.label = who + "memory" + suffix;
    lane.memory = memory;
    std::stable_sort(lane.memory.begin(), lane.memory.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    lane.low_bytes = lane.memory.front().second;
    for (const auto& [time, bytes] : lane.memory) {
      lane.peak_bytes = std::max(lane.peak_bytes, bytes);
      lane.low_bytes = std::min(lane.low_bytes, bytes);
    }
    largest_memory_ = std::max(largest_memory_, lane.peak_bytes);
    lanes_.push_back(std::move(lane));
  }
}

std::span<const Box> Timeline::visible(const Lane& lane, int64_t t0, int64_t t1) const {
  const auto by_start = [](const Box& b, int64_t t) { return b.start_ns < t; };
  const int64_t from = t0 > INT64_MIN + lane.longest_ns ? t0 - lane.longest_ns : INT64_MIN;
  auto first = std::lower_bound(lane.boxes.begin(), lane.boxes.end(), from, by_start);
  auto last = std::lower_bound(first, lane.boxes.end(), t1, by_start);
  // Boxes that start early but end before t0 stay in the span; drawing skips them.
  return {first, last};
}

const Box* Timeline::hit(const Lane& lane, int64_t t, int64_t slack_ns) const {
  const Box* best = nullptr;
  int64_t best_distance = slack_ns + 1;
  for (const Box& b : visible(lane, t - slack_ns, t + slack_ns + 1)) {
    const int64_t distance = t < b.start_ns ? b.start_ns - t : t > b.end_ns ? t - b.end_ns : 0;
    // Inside several: the shortest, which is drawn on top.
    if (distance < best_distance ||
        (distance == 0 && best_distance == 0 && b.end_ns - b.start_ns < best->end_ns - best->start_ns)) {
      best = &b;
      best_distance = distance;
    }
  }
  return best;
}

std::string format_duration(int64_t ns) {
  char s[48];
  const double v = static_cast<double>(ns);
  const double a = std::abs(v);
  if (a >= 1e9) std::snprintf(s, sizeof s, "%.3g s", v * 1e-9);
  else if (a >= 1e6) std::snprintf(s, sizeof s, "%.3g ms", v * 1e-6);
  else if (a >= 1e3) std::snprintf(s, sizeof s, "%.3g us", v * 1e-3);
  else std::snprintf(s, sizeof s, "%lld ns", static_cast<long long>(ns));
  return s;
}

std::string format_bytes(double bytes) {
  char s[48];
  if (bytes >= double(1ull << 30)) std::snprintf(s, sizeof s, "%.3g GiB", bytes / double(1ull << 30));
  else if (bytes >= double(1 << 20)) std::snprintf(s, sizeof s, "%.3g MiB", bytes / double(1 << 20));
  else if (bytes >= 1024) std::snprintf(s, sizeof s, "%.3g KiB", bytes / 1024);
  else std::snprintf(s, sizeof s, "%.0f B", bytes);
  return s;
}

std::string format_flops(double flops) {
  char s[48];
  if (flops >= 1e12) std::snprintf(s, sizeof s, "%.3g TFLOP", flops * 1e-12);
  else if (flops >= 1e9) std::snprintf(s, sizeof s, "%.3g GFLOP", flops * 1e-9);
  else if (flops >= 1e6) std::snprintf(s, sizeof s, "%.3g MFLOP", flops * 1e-6);
  else std::snprintf(s, sizeof s, "%.0f FLOP", flops);
  return s;
}

std::string describe(const Timeline& timeline, const Lane& lane, const Box& box) {
  const TraceEvent& e = timeline.event(lane, box);
  std::string out = e.name + "\n" + std::string(kind_name(box.kind)) + " on rank " + std::to_string(e.rank) + ", " +
                    std::string(stream_name(e.stream));
  if (timeline.sources() > 1) out += " (" + std::string(timeline.source_name(lane.source)) + ")";
  out += "\nstart " + format_duration(box.start_ns) + ", duration " + format_duration(e.duration_ns);
  if (box.wait_ns > 0) out += ", of it " + format_duration(box.wait_ns) + " waiting for the group's last rank";
  if (e.bytes > 0) out += "\n" + format_bytes(e.bytes);
  if (e.flops > 0) out += "\n" + format_flops(e.flops);
  if (e.flops > 0 && e.duration_ns > 0) {
    char s[64];
    std::snprintf(s, sizeof s, " (%.3g TFLOP/s)", e.flops / static_cast<double>(e.duration_ns) * 1e-3);
    out += s;
  }
  return out;
}

}  // namespace moeplan::viewer
