#include "moeplan/executor/training/run_measurement.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>

#include "moeplan/core/fit.h"
#include "moeplan/executor/ranks/runtime.h"

namespace moeplan::executor {

void PhaseClock::start_step() {
  events_.clear();
  memory_.clear();
  marked_.clear();
  origin_ = Clock::now();
  sample_memory(origin_);
}

void PhaseClock::sample_memory(Clock::time_point at) {
  int64_t live = 0;
  if (device_.is_cuda()) {
    live = device_allocated_bytes(device_);
  } else {
    const TensorBytes bytes = tensor_bytes();
    if (bytes.peak == 0) return;  // tensors are not counted in this process
    live = bytes.live;
  }
  MemorySample m;
  m.rank = rank_;
  m.time_ns = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(at - origin_).count());
  m.bytes = static_cast<double>(live);
  memory_.push_back(m);
}

void PhaseClock::add_marked(std::string_view phase, DeviceMarks& marks, size_t begin, size_t end) {
  if (marks.deferred())
    marked_.push_back({phase, begin, end});
  else
    add(std::string(phase), "compute", TraceStream::kCompute, marks.time_of(begin), marks.time_of(end));
}

void PhaseClock::add_marked_spans(DeviceMarks& marks) {
  for (const MarkedSpan& s : marked_)
    add(std::string(s.phase), "compute", TraceStream::kCompute, marks.time_of(s.begin), marks.time_of(s.end));
  marked_.clear();
}

void PhaseClock::add(std::string name, std::string category, TraceStream stream, Clock::time_point start,
                     Clock::time_point end, double bytes, int64_t group) {
  TraceEvent e;
  e.name = std::move(name);
  e.category = std::move(category);
  e.start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - origin_).count();
  e.duration_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  e.rank = rank_;
  e.stream = stream;
  e.bytes = bytes;
  e.group = group;
  events_.push_back(std::move(e));
  sample_memory(end);
}

namespace {

int64_t status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = field;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;  // reported in kB
  return 0;
}

std::string mib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.0f MiB", bytes / (1 << 20));
  return s;
}

std::string percent(double measured, double predicted) {
  if (predicted <= 0) return "-";
  char s[32];
  std::snprintf(s, sizeof s, "%+.0f%%", 100.0 * relative_error(measured, predicted));
  return s;
}

}  // namespace

int64_t current_rss_bytes() { return status_bytes("VmRSS:"); }
int64_t peak_rss_bytes() { return status_bytes("VmHWM:"); }

std::optional<ProcessorTimes> processor_times(const std::string& stat_path) {
  // "cpu  user nice system idle iowait irq softirq steal guest guest_nice": the first line sums
  // every processor; guest time is already inside user and nice (proc(5)).
  std::ifstream in(stat_path);
  std::string label;
  if (!(in >> label) || label != "cpu") return std::nullopt;
  ProcessorTimes t;
  for (int field = 0; field < 8; ++field) {
    int64_t ticks = 0;
    if (!(in >> ticks) || ticks < 0) return std::nullopt;
    t.total += ticks;
    if (field == 7) t.steal = ticks;
  }
  return t;
}

std::optional<double> steal_share(const std::optional<ProcessorTimes>& before,
                                  const std::optional<ProcessorTimes>& after) {
  if (!before || !after || after->total <= before->total || after->steal < before->steal) return std::nullopt;
  const double share = static_cast<double>(after->steal - before->steal) / static_cast<double>(after->total - before->total);
  return std::min(share, 1.0);
}

Json to_json(const RankMeasurement& m) {
  Json j;
  j["rank"] = m.rank;
  j["peak_rss_bytes"] = m.peak_rss_bytes;
  j["baseline_rss_bytes"] = m.baseline_rss_bytes;
  j["peak_tensor_bytes"] = m.peak_tensor_bytes;
  j["peak_step_tensor_bytes"] = m.peak_step_tensor_bytes;
  j["busiest_expert_rows"] = m.busiest_expert_rows;
  j["peak_device_allocated_bytes"] = m.peak_device_allocated_bytes;
  j["peak_device_reserved_bytes"] = m.peak_device_reserved_bytes;
  j["baseline_device_bytes"] = m.baseline_device_bytes;
  j["device_workspace_bytes"] = m.device_workspace_bytes;
  Trace trace;
  trace.source = "measured";
  trace.ranks = m.rank + 1;
  trace.events = m.events;
  trace.memory = m.memory;
  j["trace"] = moeplan::to_json(trace);
  return j;
}

RankMeasurement rank_measurement_from_json(const Json& j, const std::string& origin) {
  RankMeasurement m;
  m.rank = j.at("rank").get<int64_t>();
  m.peak_rss_bytes = j.at("peak_rss_bytes").get<int64_t>();
  m.baseline_rss_bytes = j.at("baseline_rss_bytes").get<int64_t>();
  m.peak_tensor_bytes = j.at("peak_tensor_bytes").get<int64_t>();
  m.peak_step_tensor_bytes = j.at("peak_step_tensor_bytes").get<int64_t>();
  m.busiest_expert_rows = j.at("busiest_expert_rows").get<int64_t>();
  m.peak_device_allocated_bytes = j.at("peak_device_allocated_bytes").get<int64_t>();
  m.peak_device_reserved_bytes = j.at("peak_device_reserved_bytes").get<int64_t>();
  m.baseline_device_bytes = j.at("baseline_device_bytes").get<int64_t>();
  m.device_workspace_bytes = j.at("device_workspace_bytes").get<int64_t>();
  Trace trace = trace_from_json(j.at("trace"), origin);
  m.events = std::move(trace.events);
  m.memory = std::move(trace.memory);
  return m;
}

RunReport write_run_outputs(const Plan& plan, const std::string& out_dir, const std::vector<StepRecord>& steps,
                            const std::vector<RankMeasurement>& ranks, const std::string& where) {
  Trace trace;
  trace.source = "measured";
  trace.ranks = static_cast<int64_t>(ranks.size());
  trace.plan = describe(plan.parallel);
  trace.world_size = plan.parallel.world_size;
  RunReport r;
  r.parallel = describe(plan.parallel);
  r.profile = plan.cluster.name;
  r.where = where;
  r.ranks = trace.ranks;
  for (const RankMeasurement& m : ranks) {
    trace.events.insert(trace.events.end(), m.events.begin(), m.events.end());
    trace.memory.insert(trace.memory.end(), m.memory.begin(), m.memory.end());
    r.peak_rss_bytes_per_rank.push_back(m.peak_rss_bytes);
    r.baseline_rss_bytes_per_rank.push_back(m.baseline_rss_bytes);
    r.peak_tensor_bytes_per_rank.push_back(m.peak_tensor_bytes);
    r.peak_step_tensor_bytes_per_rank.push_back(m.peak_step_tensor_bytes);
    r.busiest_expert_rows_per_rank.push_back(m.busiest_expert_rows);
    r.peak_rss_bytes = std::max(r.peak_rss_bytes, m.peak_rss_bytes);
  }
  const auto on_gpu = [](const RankMeasurement& m) { return m.peak_device_reserved_bytes > 0; };
  if (std::any_of(ranks.begin(), ranks.end(), on_gpu))
    for (const RankMeasurement& m : ranks) {
      r.peak_device_allocated_bytes_per_rank.push_back(m.peak_device_allocated_bytes);
      r.peak_device_reserved_bytes_per_rank.push_back(m.peak_device_reserved_bytes);
      r.peak_device_bytes_per_rank.push_back(m.baseline_device_bytes + m.peak_device_reserved_bytes);
      r.device_workspace_bytes_per_rank.push_back(m.device_workspace_bytes);
      r.peak_device_bytes = std::max(r.peak_device_bytes, r.peak_device_bytes_per_rank.back());
    }
  write_file_atomic(out_dir + "/trace.json", moeplan::to_json(trace).dump(1) + "\n");

  std::vector<double> seconds;
  for (const StepRecord& step : steps) seconds.push_back(step.seconds);
  r.set_step_seconds(std::move(seconds));
  if (!steps.empty() && std::all_of(steps.begin(), steps.end(), [](const StepRecord& x) { return x.steal.has_value(); }))
    for (const StepRecord& step : steps) r.step_steal.push_back(*step.steal);
  const double tokens = steps.empty() ? 0 : static_cast<double>(steps.back().tokens);
  r.tokens_per_s = r.step_time_s > 0 ? tokens / r.step_time_s : 0.0;
  if (!steps.empty()) r.tokens_per_expert = steps.back().tokens_per_expert;
  r.predicted_step_time_s = plan.prediction.step_time_s;
  r.predicted_tokens_per_s = plan.prediction.tokens_per_s;
  r.predicted_bytes_per_rank = plan.prediction.memory.device_total_bytes;
  if (!ranks.empty()) {
    std::map<std::string, double> by_name;
    std::vector<std::string> order;
    for (const TraceEvent& e : ranks.front().events) {
      if (!by_name.count(e.name)) order.push_back(e.name);
      by_name[e.name] += 1e-9 * static_cast<double>(e.duration_ns);
    }
    for (const std::string& name : order) r.phase_seconds.emplace_back(name, by_name[name]);
  }
  write_file_atomic(out_dir + "/report.json", moeplan::to_json(r).dump(2) + "\n");
  return r;
}

std::string format_summary(const RunReport& r) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "run: %s, profile %s; measured: %lld %s, %lld steps\n", r.parallel.c_str(),
                r.profile.c_str(), static_cast<long long>(r.ranks), r.where.c_str(), static_cast<long long>(r.steps));
  out += line;
  std::snprintf(line, sizeof line, "  %-23s %14s %14s %8s\n", "", "predicted", "measured", "error");
  out += line;
  std::snprintf(line, sizeof line, "  %-23s %12.3f s %12.3f s %8s\n", "step time (median)", r.predicted_step_time_s,
                r.step_time_s, percent(r.step_time_s, r.predicted_step_time_s).c_str());
  out += line;
  if (r.steps > 2) {
    // The prediction is of a machine that runs nothing beside the job (calibration keeps the
    // lower quartile of its passes); on a shared machine the steps' lower quartile is its like.
    std::snprintf(line, sizeof line, "  %-23s %12.3f s %12.3f s %8s\n", "step time (undisturbed)",
                  r.predicted_step_time_s, r.undisturbed_step_time_s,
                  percent(r.undisturbed_step_time_s, r.predicted_step_time_s).c_str());
    out += line;
  }
  if (r.stolen_steps() > 0) {
    // A cloud VM's hypervisor ran other guests on the run's processors: those steps ran slower
    // for a reason outside the run and the plan.
    std::snprintf(line, sizeof line, "  %-23s %.1f%% of the processors' time; %lld of %lld steps over %.0f%%\n",
                  "hypervisor's steal", 100 * r.mean_steal(), static_cast<long long>(r.stolen_steps()),
                  static_cast<long long>(r.steps > 1 ? r.steps - 1 : r.steps), 100 * kUndisturbedSteal);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-23s %14.0f %14.0f %8s\n", "tokens/s", r.predicted_tokens_per_s, r.tokens_per_s,
                percent(r.tokens_per_s, r.predicted_tokens_per_s).c_str());
  out += line;
  std::snprintf(line, sizeof line, "  %-23s %14s %14s %8s\n",
                r.peak_device_bytes > 0 ? "peak device memory" : "peak memory per rank",
                mib(static_cast<double>(r.predicted_bytes_per_rank)).c_str(),
                mib(static_cast<double>(r.peak_memory_bytes())).c_str(),
                percent(static_cast<double>(r.peak_memory_bytes()), static_cast<double>(r.predicted_bytes_per_rank))
                    .c_str());
  out += line;
  for (size_t i = 0; i < r.peak_device_bytes_per_rank.size(); ++i) {
    if (r.peak_device_bytes_per_rank[i] != r.peak_device_bytes) continue;
    std::snprintf(line, sizeof line,
                  "  %-23s rank %zu: %s before the model (CUDA context), caching allocator at most %s reserved, "
                  "%s allocated (%s of it cuBLAS's workspaces)\n",
                  "", i,
                  mib(static_cast<double>(r.peak_device_bytes - r.peak_device_reserved_bytes_per_rank[i])).c_str(),
                  mib(static_cast<double>(r.peak_device_reserved_bytes_per_rank[i])).c_str(),
                  mib(static_cast<double>(r.peak_device_allocated_bytes_per_rank[i])).c_str(),
                  mib(static_cast<double>(r.device_workspace_bytes_per_rank[i])).c_str());
    out += line;
    break;
  }
  for (size_t i = 0; i < r.peak_rss_bytes_per_rank.size(); ++i) {
    if (r.peak_rss_bytes_per_rank[i] != r.peak_rss_bytes) continue;
    std::snprintf(line, sizeof line, "  %-23s rank %zu: %s before the model, live tensors at most %s\n", "", i,
                  mib(static_cast<double>(r.baseline_rss_bytes_per_rank[i])).c_str(),
                  mib(static_cast<double>(r.peak_tensor_bytes_per_rank[i])).c_str());
    out += line;
    break;
  }
  if (!r.phase_seconds.empty()) {
    // Phases of one name summed; the largest first, up to a line's worth.
    std::vector<std::pair<std::string, double>> phases = r.phase_seconds;
    std::stable_sort(phases.begin(), phases.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    std::string text = "  last step of rank 0:";
    for (size_t i = 0; i < phases.size() && i < 6; ++i) {
      std::snprintf(line, sizeof line, "%s %s %.3f s", i ? "," : "", phases[i].first.c_str(), phases[i].second);
      text += line;
    }
    out += text + "\n";
  }
  if (!r.tokens_per_expert.empty()) {
    // The expert load of the last step: the busiest expert against the mean, per layer.
    std::string text = "  expert load (max/mean) per layer:";
    for (const std::vector<int64_t>& layer : r.tokens_per_expert) {
      int64_t sum = 0, top = 0;
      for (const int64_t n : layer) {
        sum += n;
        top = std::max(top, n);
      }
      const double mean = layer.empty() ? 0 : static_cast<double>(sum) / static_cast<double>(layer.size());
      std::snprintf(line, sizeof line, " %.2f", mean > 0 ? static_cast<double>(top) / mean : 0.0);
      text += line;
    }
    out += text + "\n";
  }
  return out;
}

}  // namespace moeplan::executor
