#include "moeplan/core/trace.h"

#include <array>
#include <cmath>

namespace moeplan {

namespace {
constexpr std::array<std::string_view, kTraceStreamCount> kStreamNames = {
    "compute", "expert_comm", "shard_gather", "grad_comm", "copy"};
// Chrome traces count in microseconds; nanoseconds survive as fractions.
double to_us(int64_t ns) { return static_cast<double>(ns) / 1000.0; }
}  // namespace

std::string_view stream_name(TraceStream s) { return kStreamNames[static_cast<size_t>(s)]; }

OrderedJson to_json(const Trace& trace) {
  OrderedJson events = OrderedJson::array();
  for (int64_t rank = 0; rank < trace.ranks; ++rank) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    for (int s = 0; s < kTraceStreamCount; ++s)
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", s},
                        {"args", {{"name", std::string(kStreamNames[static_cast<size_t>(s)])}}}});
  }
  for (const TraceEvent& e : trace.events) {
    OrderedJson j;
    j["name"] = e.name;
    j["cat"] = e.category;
    j["ph"] = "X";
    j["ts"] = to_us(e.start_ns);
    j["dur"] = to_us(e.duration_ns);
    j["pid"] = e.rank;
    j["tid"] = static_cast<int>(e.stream);
    OrderedJson args;
    args["start_ns"] = e.start_ns;
    args["duration_ns"] = e.duration_ns;
    if (e.flops > 0) args["flops"] = e.flops;
    if (e.bytes > 0) args["bytes"] = e.bytes;
    j["args"] = args;
    events.push_back(std::move(j));
  }
  OrderedJson out;
  out["traceEvents"] = std::move(events);
  out["displayTimeUnit"] = "ns";
  out["otherData"] = {{"moeplan_trace_version", 1}, {"source", trace.source}, {"ranks", trace.ranks}};
  return out;
}

Trace trace_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  Trace trace;
  ObjectReader r(json, "", d);
  if (r.ok()) {
    r.string("displayTimeUnit", "ns");
    if (auto other = r.object("otherData", true)) {
      other->integer("moeplan_trace_version", 1, 1, 1);
      trace.source = other->string("source", "");
      trace.ranks = other->integer("ranks", 0, int64_t{1} << 24, 0);
      other->finish();
    }
    const Json* events = r.child("traceEvents");
    if (events != nullptr && !events->is_array()) d.error("traceEvents", "expected an array");
    if (events != nullptr && events->is_array()) {
      for (size_t i = 0; i < events->size() && d.items().size() < 20; ++i) {
        const std::string at = "traceEvents[" + std::to_string(i) + "]";
        ObjectReader e((*events)[i], at, d);
        if (!e.ok()) continue;
        const std::string ph = e.string("ph");
        if (ph != "X") {  // metadata and other phases carry nothing the timeline needs
          for (auto it = (*events)[i].begin(); it != (*events)[i].end(); ++it) e.ignore(it.key());
          continue;
        }
        TraceEvent ev;
        ev.name = e.string("name");
        ev.category = e.string("cat", "");
        const double ts = e.number("ts", 0.0, 1e15);
        const double dur = e.number("dur", 0.0, 1e15);
        ev.rank = e.integer("pid", 0, int64_t{1} << 24);
        ev.stream = static_cast<TraceStream>(e.integer("tid", 0, kTraceStreamCount - 1));
        ev.start_ns = std::llround(ts * 1000.0);
        ev.duration_ns = std::llround(dur * 1000.0);
        if (auto args = e.object("args", true)) {
          ev.start_ns = args->integer("start_ns", 0, int64_t{1} << 60, ev.start_ns);
          ev.duration_ns = args->integer("duration_ns", 0, int64_t{1} << 60, ev.duration_ns);
          ev.flops = args->number("flops", 0.0, 1e30, 0.0);
          ev.bytes = args->number("bytes", 0.0, 1e30, 0.0);
          args->finish();
        }
        e.finish();
        if (ev.rank >= trace.ranks) trace.ranks = ev.rank + 1;
        trace.events.push_back(std::move(ev));
      }
    }
    r.finish();
  }
  d.throw_if_any(origin);
  return trace;
}

}  // namespace moeplan
