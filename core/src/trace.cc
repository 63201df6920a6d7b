#include "moeplan/core/trace.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "moeplan/core/phases.h"

namespace moeplan {

namespace {
constexpr std::array<std::string_view, kTraceStreamCount> kStreamNames = {
    "compute", "expert_comm", "shard_gather", "grad_comm", "copy"};
// Chrome traces count in microseconds; nanoseconds survive as fractions.
double to_us(int64_t ns) { return static_cast<double>(ns) / 1000.0; }
}  // namespace

std::string_view stream_name(TraceStream s) { return kStreamNames[static_cast<size_t>(s)]; }

Json to_json(const Trace& trace) {
  Json events = Json::array();
  for (int64_t rank = 0; rank < trace.ranks; ++rank) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
    for (int s = 0; s < kTraceStreamCount; ++s)
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", s},
                        {"args", {{"name", std::string(kStreamNames[static_cast<size_t>(s)])}}}});
  }
  for (const TraceEvent& e : trace.events) {
    Json j;
    j["name"] = e.name;
    j["cat"] = e.category;
    j["ph"] = "X";
    j["ts"] = to_us(e.start_ns);
    j["dur"] = to_us(e.duration_ns);
    j["pid"] = e.rank;
    j["tid"] = static_cast<int>(e.stream);
    Json args;
    args["start_ns"] = e.start_ns;
    args["duration_ns"] = e.duration_ns;
    if (e.flops > 0) args["flops"] = e.flops;
    if (e.bytes > 0) args["bytes"] = e.bytes;
    if (e.group >= 0) args["group"] = e.group;
    j["args"] = args;
    events.push_back(std::move(j));
  }
  for (const MemorySample& m : trace.memory) {
    Json j;
    j["name"] = "memory";
    j["ph"] = "C";
    j["ts"] = to_us(m.time_ns);
    j["pid"] = m.rank;
    j["args"] = {{"bytes", m.bytes}, {"time_ns", m.time_ns}};
    events.push_back(std::move(j));
  }
  Json out;
  out["traceEvents"] = std::move(events);
  out["displayTimeUnit"] = "ns";
  out["otherData"] = {{"moeplan_trace_version", 1}, {"source", trace.source}, {"ranks", trace.ranks}};
  if (!trace.plan.empty()) out["otherData"]["plan"] = trace.plan;
  if (trace.world_size > 0) out["otherData"]["world_size"] = trace.world_size;
  return out;
}

std::string plan_difference(const Trace& a, const Trace& b) {
  const bool same_size = a.world_size <= 0 || b.world_size <= 0 || a.world_size == b.world_size;
  if (a.plan.empty() || b.plan.empty() || (a.plan == b.plan && same_size)) return "";
  auto of = [](const Trace& t) {
    if (t.world_size <= 0) return t.plan;
    return t.plan + " on " + std::to_string(t.world_size) + (t.world_size == 1 ? " rank" : " ranks");
  };
  const std::string first = a.source.empty() ? "the first" : "the " + a.source;
  const std::string second = b.source.empty() ? "the second" : "the " + b.source;
  return first + " trace is of " + of(a) + ", " + second + " one of " + of(b);
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
      trace.plan = other->string("plan", "");
      trace.world_size = other->integer("world_size", 0, int64_t{1} << 24, 0);
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
        const auto name = (*events)[i].find("name");
        if (ph == "C" && name != (*events)[i].end() && name->is_string() && *name == "memory") {
          MemorySample m;
          e.string("name");
          m.rank = e.integer("pid", 0, int64_t{1} << 24);
          m.time_ns = std::llround(e.number("ts", 0.0, 1e15) * 1000.0);
          if (auto args = e.object("args")) {
            m.bytes = args->number("bytes", 0.0, 1e30);
            m.time_ns = args->integer("time_ns", 0, int64_t{1} << 60, m.time_ns);
            args->finish();
          }
          e.finish();
          if (m.rank >= trace.ranks) trace.ranks = m.rank + 1;
          trace.memory.push_back(m);
          continue;
        }
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
          ev.group = args->integer("group", -1, int64_t{1} << 24, -1);
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

// -- Streaming reader -------------------------------------------------------------------------

namespace {

using SaxJson = nlohmann::json;

// One JSON scalar as the SAX parser hands it over.
struct Scalar {
  enum class Kind : uint8_t { kNull, kBool, kInteger, kFloat, kString } kind = Kind::kNull;
  double number = 0;
  int64_t integer = 0;
  std::string text;
  bool boolean = false;

  std::string describe() const {
    switch (kind) {
      case Kind::kNull: return "null";
      case Kind::kBool: return boolean ? "true" : "false";
      case Kind::kInteger: return "number " + std::to_string(integer);
      case Kind::kFloat: {
        std::ostringstream out;
        out << "number " << number;
        return out.str();
      }
      case Kind::kString: return "string \"" + (text.size() > 40 ? text.substr(0, 40) + "..." : text) + "\"";
    }
    return "a value";
  }
};

// The fields of one trace event as read, checked once the event is complete.
struct RawEvent {
  std::optional<std::string> name, cat, ph;
  std::optional<double> ts, dur;
  std::optional<int64_t> pid, tid;
  std::optional<int64_t> start_ns, duration_ns, time_ns;
  std::optional<double> flops, bytes;
  std::optional<int64_t> group;
  bool has_args = false;
  std::vector<std::pair<std::string, std::string>> problems;  // field, message
  void clear() { *this = RawEvent{}; }
};

class TraceSax final : public nlohmann::json_sax<SaxJson> {
 public:
  TraceSax(Trace& trace, Diagnostics& d, const std::function<void(const TraceReadProgress&)>& progress,
           int64_t file_bytes)
      : trace_(trace), d_(d), progress_(progress), file_bytes_(file_bytes) {}

  bool null() override { return scalar(Scalar{}); }
  bool boolean(bool v) override {
    Scalar s;
    s.kind = Scalar::Kind::kBool;
    s.boolean = v;
    return scalar(s);
  }
  bool number_integer(number_integer_t v) override {
    Scalar s;
    s.kind = Scalar::Kind::kInteger;
    s.integer = v;
    s.number = static_cast<double>(v);
    return scalar(s);
  }
  bool number_unsigned(number_unsigned_t v) override {
    Scalar s;
    s.kind = v > static_cast<uint64_t>(INT64_MAX) ? Scalar::Kind::kFloat : Scalar::Kind::kInteger;
    s.integer = static_cast<int64_t>(std::min<uint64_t>(v, INT64_MAX));
    s.number = static_cast<double>(v);
    return scalar(s);
  }
  bool number_float(number_float_t v, const string_t&) override {
    Scalar s;
    s.kind = Scalar::Kind::kFloat;
    s.number = v;
    return scalar(s);
  }
  bool string(string_t& v) override {
    Scalar s;
    s.kind = Scalar::Kind::kString;
    s.text = std::move(v);
    return scalar(s);
  }
  bool binary(binary_t&) override { return scalar(Scalar{}); }

  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }

  bool start_object(std::size_t) override {
    if (stack_.empty()) {
      stack_.push_back(Ctx::kTop);
      return true;
    }
    switch (stack_.back()) {
      case Ctx::kTop:
        if (key_ == "otherData") {
          stack_.push_back(Ctx::kOther);
          return true;
        }
        top_value_is_container();
        break;
      case Ctx::kEvents:
        event_.clear();
        stack_.push_back(Ctx::kEvent);
        return true;
      case Ctx::kEvent:
        if (key_ == "args") {
          event_.has_args = true;
          stack_.push_back(Ctx::kArgs);
          return true;
        }
        event_problem(key_, "expected a scalar, got an object");
        break;
      case Ctx::kArgs: event_problem("args." + key_, "expected a scalar, got an object"); break;
      case Ctx::kOther: error("otherData." + key_, "expected a scalar, got an object"); break;
      case Ctx::kSkip: break;
    }
    stack_.push_back(Ctx::kSkip);
    return keep_going();
  }

  bool start_array(std::size_t) override {
    if (stack_.empty()) {
      error("", "expected an object, got an array");
      return false;
    }
    switch (stack_.back()) {
      case Ctx::kTop:
        if (key_ == "traceEvents") {
          seen_events_ = true;
          stack_.push_back(Ctx::kEvents);
          return true;
        }
        top_value_is_container();
        break;
      case Ctx::kEvents: error(event_path(), "expected an object, got an array"); break;
      case Ctx::kEvent: event_problem(key_, "expected a scalar, got an array"); break;
      case Ctx::kArgs: event_problem("args." + key_, "expected a scalar, got an array"); break;
      case Ctx::kOther: error("otherData." + key_, "expected a scalar, got an array"); break;
      case Ctx::kSkip: break;
    }
    stack_.push_back(Ctx::kSkip);
    return keep_going();
  }

  bool end_object() override {
    const Ctx done = stack_.back();
    stack_.pop_back();
    if (done == Ctx::kEvent) {
      finish_event();
      ++index_;
      if (progress_ && (index_ & 0xFFFF) == 0) progress_({index_, file_bytes_});
    }
    if (done == Ctx::kTop && !seen_events_) error("traceEvents", "missing");
    return keep_going();
  }
  bool end_array() override {
    stack_.pop_back();
    return keep_going();
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    d_.error("", "not valid JSON at byte " + std::to_string(position) + " (" + what + ")");
    return false;
  }

 private:
  enum class Ctx : uint8_t { kTop, kOther, kEvents, kEvent, kArgs, kSkip };

  bool keep_going() const { return d_.items().size() < 20; }
  void error(const std::string& path, const std::string& message) { d_.error(path, message); }
  std::string event_path() const { return "traceEvents[" + std::to_string(index_) + "]"; }
  void event_problem(const std::string& field, const std::string& message) {
    event_.problems.emplace_back(field, message);
  }
  void top_value_is_container() {
    if (key_ == "displayTimeUnit") error(key_, "expected a string");
    else if (key_ == "traceEvents") error(key_, "expected an array");
    else if (key_ == "otherData") error(key_, "expected an object");
    else error(key_, "unknown field");
  }

  bool scalar(Scalar s) {
    if (stack_.empty()) {
      error("", "expected an object, got " + s.describe());
      return false;
    }
    switch (stack_.back()) {
      case Ctx::kTop: top_scalar(s); break;
      case Ctx::kOther: other_scalar(s); break;
      case Ctx::kEvents: error(event_path(), "expected an object, got " + s.describe()); break;
      case Ctx::kEvent: event_scalar(s); break;
      case Ctx::kArgs: args_scalar(s); break;
      case Ctx::kSkip: break;
    }
    return keep_going();
  }

  void top_scalar(const Scalar& s) {
    if (key_ == "displayTimeUnit") {
      if (s.kind != Scalar::Kind::kString) error(key_, "expected a string, got " + s.describe());
    } else if (key_ == "traceEvents") {
      error(key_, "expected an array, got " + s.describe());
    } else if (key_ == "otherData") {
      error(key_, "expected an object, got " + s.describe());
    } else {
      error(key_, "unknown field");
    }
  }

  void other_scalar(const Scalar& s) {
    const std::string path = "otherData." + key_;
    if (key_ == "source") {
      if (s.kind == Scalar::Kind::kString) trace_.source = s.text;
      else error(path, "expected a string, got " + s.describe());
    } else if (key_ == "ranks") {
      if (auto v = integer(s, path, 0, int64_t{1} << 24)) trace_.ranks = std::max(trace_.ranks, *v);
    } else if (key_ == "plan") {
      if (s.kind == Scalar::Kind::kString) trace_.plan = s.text;
      else error(path, "expected a string, got " + s.describe());
    } else if (key_ == "world_size") {
      if (auto v = integer(s, path, 0, int64_t{1} << 24)) trace_.world_size = *v;
    } else if (key_ == "moeplan_trace_version") {
      integer(s, path, 1, 1);
    } else {
      error(path, "unknown field");
    }
  }

  std::optional<int64_t> integer(const Scalar& s, const std::string& path, int64_t min, int64_t max) {
    int64_t v = s.integer;
    if (s.kind == Scalar::Kind::kFloat && std::floor(s.number) == s.number && std::abs(s.number) < 9e18) {
      v = static_cast<int64_t>(s.number);
    } else if (s.kind != Scalar::Kind::kInteger) {
      error(path, "expected an integer, got " + s.describe());
      return std::nullopt;
    }
    if (v < min || v > max) {
      error(path, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + std::to_string(v));
      return std::nullopt;
    }
    return v;
  }

  static std::optional<double> as_number(const Scalar& s) {
    if (s.kind == Scalar::Kind::kInteger || s.kind == Scalar::Kind::kFloat) return s.number;
    return std::nullopt;
  }
  static std::optional<int64_t> as_integer(const Scalar& s) {
    if (s.kind == Scalar::Kind::kInteger) return s.integer;
    if (s.kind == Scalar::Kind::kFloat && std::floor(s.number) == s.number && std::abs(s.number) < 9e18)
      return static_cast<int64_t>(s.number);
    return std::nullopt;
  }

  template <class T>
  void take(std::optional<T>& field, std::optional<T> value, const std::string& name, const char* expected,
            const Scalar& s) {
    if (value) field = value;
    else event_problem(name, std::string("expected ") + expected + ", got " + s.describe());
  }

  void event_scalar(Scalar& s) {
    const bool text = s.kind == Scalar::Kind::kString;
    if (key_ == "name" || key_ == "cat" || key_ == "ph") {
      std::optional<std::string>& field = key_ == "name" ? event_.name : key_ == "cat" ? event_.cat : event_.ph;
      if (text) field = std::move(s.text);
      else event_problem(key_, "expected a string, got " + s.describe());
    } else if (key_ == "ts") {
      take(event_.ts, as_number(s), key_, "a number", s);
    } else if (key_ == "dur") {
      take(event_.dur, as_number(s), key_, "a number", s);
    } else if (key_ == "pid") {
      take(event_.pid, as_integer(s), key_, "an integer", s);
    } else if (key_ == "tid") {
      take(event_.tid, as_integer(s), key_, "an integer", s);
    } else {
      event_problem(key_, "unknown field");
    }
  }

  void args_scalar(const Scalar& s) {
    const std::string path = "args." + key_;
    if (key_ == "start_ns") take(event_.start_ns, as_integer(s), path, "an integer", s);
    else if (key_ == "duration_ns") take(event_.duration_ns, as_integer(s), path, "an integer", s);
    else if (key_ == "time_ns") take(event_.time_ns, as_integer(s), path, "an integer", s);
    else if (key_ == "flops") take(event_.flops, as_number(s), path, "a number", s);
    else if (key_ == "bytes") take(event_.bytes, as_number(s), path, "a number", s);
    else if (key_ == "group") take(event_.group, as_integer(s), path, "an integer", s);
    else event_problem(path, "unknown field");
  }

  // Checks a value against its range; reports it under the event's path.
  template <class T>
  bool in_range(const std::optional<T>& v, const char* field, T min, T max, bool required) {
    const std::string path = event_path() + "." + field;
    if (!v) {
      if (required) error(path, "missing");
      return false;
    }
    if (*v < min || *v > max) {
      std::ostringstream range;
      range << "must be in [" << min << ", " << max << "], got " << *v;
      error(path, range.str());
      return false;
    }
    return true;
  }

  void finish_event() {
    RawEvent& e = event_;
    if (!e.ph) {
      error(event_path() + ".ph", "missing");
      return;
    }
    const bool complete = *e.ph == "X";
    const bool memory = *e.ph == "C" && e.name && *e.name == "memory";
    if (!complete && !memory) return;  // metadata and other phases carry nothing the timeline needs
    for (const auto& [field, message] : e.problems) error(event_path() + "." + field, message);
    if (!e.problems.empty()) return;
    constexpr int64_t kMaxRank = int64_t{1} << 24;
    constexpr int64_t kMaxNs = int64_t{1} << 60;
    if (memory) {
      bool ok = in_range(e.pid, "pid", int64_t{0}, kMaxRank, true);
      ok = in_range(e.ts, "ts", 0.0, 1e15, true) && ok;
      if (!e.has_args) error(event_path() + ".args", "missing");
      ok = in_range(e.bytes, "args.bytes", 0.0, 1e30, e.has_args) && ok;
      if (e.time_ns) ok = in_range(e.time_ns, "args.time_ns", int64_t{0}, kMaxNs, false) && ok;
      if (e.dur || e.cat || e.tid || e.flops || e.start_ns || e.duration_ns || e.group)
        error(event_path(), "a memory counter has only name, ph, ts, pid and args.bytes");
      if (!ok || !e.has_args) return;
      MemorySample m;
      m.rank = *e.pid;
      m.time_ns = e.time_ns ? *e.time_ns : std::llround(*e.ts * 1000.0);
      m.bytes = *e.bytes;
      trace_.ranks = std::max(trace_.ranks, m.rank + 1);
      trace_.memory.push_back(m);
      return;
    }
    bool ok = e.name.has_value();
    if (!e.name) error(event_path() + ".name", "missing");
    ok = in_range(e.ts, "ts", 0.0, 1e15, true) && ok;
    ok = in_range(e.dur, "dur", 0.0, 1e15, true) && ok;
    ok = in_range(e.pid, "pid", int64_t{0}, kMaxRank, true) && ok;
    if (e.tid) ok = in_range(e.tid, "tid", int64_t{0}, int64_t{kTraceStreamCount - 1}, false) && ok;
    if (e.start_ns) ok = in_range(e.start_ns, "args.start_ns", int64_t{0}, kMaxNs, false) && ok;
    if (e.duration_ns) ok = in_range(e.duration_ns, "args.duration_ns", int64_t{0}, kMaxNs, false) && ok;
    if (e.flops) ok = in_range(e.flops, "args.flops", 0.0, 1e30, false) && ok;
    if (e.bytes) ok = in_range(e.bytes, "args.bytes", 0.0, 1e30, false) && ok;
    if (e.group) ok = in_range(e.group, "args.group", int64_t{0}, kMaxRank, false) && ok;
    if (e.time_ns) {
      error(event_path() + ".args.time_ns", "unknown field");
      ok = false;
    }
    if (!ok) return;
    TraceEvent ev;
    ev.name = std::move(*e.name);
    ev.category = e.cat ? std::move(*e.cat) : std::string();
    ev.rank = *e.pid;
    ev.stream = static_cast<TraceStream>(e.tid.value_or(0));
    ev.start_ns = e.start_ns ? *e.start_ns : std::llround(*e.ts * 1000.0);
    ev.duration_ns = e.duration_ns ? *e.duration_ns : std::llround(*e.dur * 1000.0);
    ev.flops = e.flops.value_or(0.0);
    ev.bytes = e.bytes.value_or(0.0);
    ev.group = e.group.value_or(-1);
    trace_.ranks = std::max(trace_.ranks, ev.rank + 1);
    trace_.events.push_back(std::move(ev));
  }

  Trace& trace_;
  Diagnostics& d_;
  const std::function<void(const TraceReadProgress&)>& progress_;
  int64_t file_bytes_ = 0;
  std::vector<Ctx> stack_;
  std::string key_;
  RawEvent event_;
  int64_t index_ = 0;
  bool seen_events_ = false;
};

}  // namespace

Trace read_trace_file(const std::string& path, const std::function<void(const TraceReadProgress&)>& progress) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw InputError(path, {{"", "cannot open file"}});
  const std::streamoff size = in.tellg();
  if (size < 0) throw InputError(path, {{"", "cannot read file"}});
  // The file is read whole, and the events take about as much again.
  if (size > kMaxTraceFileBytes)
    throw InputError(path, {{"", "too large (" + std::to_string(size >> 20) + " MiB; traces are read up to " +
                                     std::to_string(kMaxTraceFileBytes >> 20) + " MiB)"}});
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(text.data(), size)) throw InputError(path, {{"", "cannot read file"}});
  in.close();

  Trace trace;
  Diagnostics d;
  TraceSax sax(trace, d, progress, static_cast<int64_t>(size));
  const bool ok = SaxJson::sax_parse(text.data(), text.data() + text.size(), &sax);
  if (!ok && d.empty()) d.error("", "not valid JSON");
  d.throw_if_any(path);
  if (progress) progress({static_cast<int64_t>(trace.events.size()), static_cast<int64_t>(size)});
  return trace;
}

// -- Phases ---------------------------------------------------------------------------------------

namespace {

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// "mb<k>." at the start of a simulated op's name: k, and the rest of the name.
std::optional<std::pair<int64_t, std::string_view>> micro_batch_of(std::string_view name) {
  if (name.size() < 4 || name.substr(0, 2) != "mb") return std::nullopt;
  size_t i = 2;
  int64_t k = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 12) k = k * 10 + (name[i++] - '0');
  if (i == 2 || i >= name.size() || name[i] != '.') return std::nullopt;
  return std::make_pair(k, name.substr(i + 1));
}

struct Span {
  int64_t start = INT64_MAX;
  int64_t end = INT64_MIN;
  void add(int64_t a, int64_t b) {
    start = std::min(start, a);
    end = std::max(end, b);
  }
};

std::string forward_phase(int64_t k) { return "mb" + std::to_string(k) + " forward"; }
std::string backward_phase(int64_t k) { return "mb" + std::to_string(k) + " backward"; }

// Phases of every rank with compute events at once: rank -> name -> span. Keyed, not indexed,
// by rank: a trace of a few bytes may say it has 2^24 ranks.
using RankPhases = std::map<int64_t, std::map<std::string, Span>>;

RankPhases all_phases(const Trace& trace) {
  RankPhases out;
  std::map<int64_t, int64_t> forwards, backwards;
  for (const TraceEvent& e : trace.events) {
    if (e.stream != TraceStream::kCompute || e.rank < 0 || e.rank >= trace.ranks) continue;
    auto& phases = out[e.rank];
    const int64_t end = e.start_ns + e.duration_ns;
    if (e.name == phase::kForward) {
      phases[forward_phase(forwards[e.rank]++)].add(e.start_ns, end);
    } else if (e.name == phase::kBackward) {
      phases[backward_phase(backwards[e.rank]++)].add(e.start_ns, end);
    } else if (e.name == phase::kOptimizer) {
      phases[std::string(phase::kOptimizer)].add(e.start_ns, end);
    } else if (auto mb = micro_batch_of(e.name)) {
      const auto [k, op] = *mb;
      if (op == "head_fwd_bwd") {
        const int64_t loss = e.start_ns + e.duration_ns / 3;
        phases[forward_phase(k)].add(e.start_ns, loss);
        phases[backward_phase(k)].add(loss, end);
      } else if (ends_with(op, "_fwd")) {
        phases[forward_phase(k)].add(e.start_ns, end);
      } else if (ends_with(op, "_bwd") || ends_with(op, "_recompute")) {
        phases[backward_phase(k)].add(e.start_ns, end);
      }
    }
  }
  return out;
}

std::vector<TracePhase> in_order(const std::map<std::string, Span>& phases) {
  std::vector<TracePhase> out;
  for (const auto& [name, span] : phases) out.push_back({name, span.start, span.end});
  std::sort(out.begin(), out.end(), [](const TracePhase& a, const TracePhase& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.name < b.name;
  });
  return out;
}

}  // namespace

std::vector<TracePhase> step_phases(const Trace& trace, int64_t rank) {
  const RankPhases phases = all_phases(trace);
  const auto it = phases.find(rank);
  return it == phases.end() ? std::vector<TracePhase>() : in_order(it->second);
}

std::vector<PhaseDifference> compare_phases(const Trace& first, const Trace& second) {
  const RankPhases a = all_phases(first), b = all_phases(second);
  // The ranks both traces have phases for; all of them if they share none.
  std::set<int64_t> common;
  for (const auto& [rank, phases] : a)
    if (const auto it = b.find(rank); !phases.empty() && it != b.end() && !it->second.empty()) common.insert(rank);
  auto longest = [&](const RankPhases& phases, bool only_common) {
    std::map<std::string, int64_t> out;
    for (const auto& [rank, named] : phases) {
      if (only_common && common.count(rank) == 0) continue;
      for (const auto& [name, span] : named) out[name] = std::max(out[name], span.end - span.start);
    }
    return out;
  };
  const auto la = longest(a, !common.empty()), lb = longest(b, !common.empty());
  std::vector<PhaseDifference> out;
  for (const auto& [name, ns] : la)
    if (auto it = lb.find(name); it != lb.end())
      out.push_back({name, static_cast<double>(ns) * 1e-9, static_cast<double>(it->second) * 1e-9});
  std::stable_sort(out.begin(), out.end(), [](const PhaseDifference& x, const PhaseDifference& y) {
    return std::abs(x.second_s - x.first_s) > std::abs(y.second_s - y.first_s);
  });
  return out;
}

Trace align_phases(const Trace& moved, const Trace& reference) {
  const RankPhases mine = all_phases(moved), theirs = all_phases(reference);
  // Per rank: phase starts in `moved` and the shift of each, a phase absent from `reference`
  // taking the shift of the phase before it.
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> shifts;
  for (const auto& [rank, phases] : mine) {
    const auto ref = theirs.find(rank);
    if (ref == theirs.end() || ref->second.empty()) continue;
    auto& starts = shifts[rank];
    std::optional<int64_t> shift;
    for (const TracePhase& p : in_order(phases)) {
      if (auto it = ref->second.find(p.name); it != ref->second.end()) {
        // Phases before the first matched one take its shift.
        if (!shift)
          for (auto& earlier : starts) earlier.second = it->second.start - p.start_ns;
        shift = it->second.start - p.start_ns;
      }
      starts.emplace_back(p.start_ns, shift.value_or(0));
    }
    if (!shift) starts.clear();
  }
  auto shift_at = [&](int64_t rank, int64_t t) -> int64_t {
    const auto found = shifts.find(rank);
    if (found == shifts.end() || found->second.empty()) return 0;
    const auto& s = found->second;
    auto it = std::upper_bound(s.begin(), s.end(), std::make_pair(t, INT64_MAX));
    return it == s.begin() ? s.front().second : std::prev(it)->second;
  };
  Trace out = moved;
  for (TraceEvent& e : out.events) e.start_ns = std::max<int64_t>(0, e.start_ns + shift_at(e.rank, e.start_ns));
  for (MemorySample& m : out.memory) m.time_ns = std::max<int64_t>(0, m.time_ns + shift_at(m.rank, m.time_ns));
  return out;
}

}  // namespace moeplan
