#include "moeplan/core/run_report.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "moeplan/core/fit.h"
#include "moeplan/core/step_record.h"

namespace moeplan {

namespace {

constexpr int64_t kSchemaVersion = 2;
constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();

// A list at `key` whose every element `accept` takes; problems reported into the reader's
// diagnostics, naming the list (`list_of`) or the element and what it should be (`element`).
template <class T, class Accept>
std::vector<T> list_at(ObjectReader& r, std::string_view key, const char* list_of, const char* element, Accept accept) {
  std::vector<T> out;
  const Json* value = r.child(key);
  if (value == nullptr) return out;
  if (!value->is_array()) {
    r.diagnostics().error(r.path_of(key),
                          std::string("expected a list of ") + list_of + ", got " + describe_json(*value));
    return out;
  }
  for (size_t i = 0; i < value->size(); ++i) {
    const Json& v = (*value)[i];
    if (!accept(v)) {
      r.diagnostics().error(r.path_of(key) + "[" + std::to_string(i) + "]",
                            std::string("expected ") + element + ", got " + describe_json(v));
      continue;
    }
    out.push_back(v.get<T>());
  }
  return out;
}

std::vector<int64_t> integers(ObjectReader& r, std::string_view key) {
  return list_at<int64_t>(r, key, "integers", "a non-negative integer",
                          [](const Json& v) { return v.is_number_integer() && v.get<int64_t>() >= 0; });
}

// Durations in seconds.
std::vector<double> durations(ObjectReader& r, std::string_view key) {
  return list_at<double>(r, key, "seconds", "seconds (a number from 0 to 1e12)", [](const Json& v) {
    return v.is_number() && v.get<double>() >= 0 && v.get<double>() <= 1e12;
  });
}

}  // namespace

std::string phase_of_measured_span(std::string_view name) {
  const size_t dot = name.find('.');
  std::string kind(dot == std::string_view::npos ? name : name.substr(dot + 1));
  if (kind == "offload" || kind == "reload") return std::string(phase::kCopy);
  return kind;
}

double relative_error(double measured, double predicted) {
  return predicted > 0 ? (measured - predicted) / predicted : 0.0;
}

std::vector<std::pair<std::string, double>> RunReport::phases() const {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [name, seconds] : phase_seconds) {
    const std::string key = phase_of_measured_span(name);
    const auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == key; });
    if (it == out.end())
      out.emplace_back(key, seconds);
    else
      it->second += seconds;
  }
  return out;
}

void RunReport::set_step_seconds(std::vector<double> seconds) {
  step_seconds = std::move(seconds);
  steps = static_cast<int64_t>(step_seconds.size());
  const std::vector<double> warm(step_seconds.begin() + (steps > 1 ? 1 : 0), step_seconds.end());
  step_time_s = median(warm);
  undisturbed_step_time_s = lower_quartile(warm);
}

double RunReport::mean_steal() const {
  const size_t from = step_steal.size() > 1 ? 1 : 0;
  if (step_steal.size() <= from) return 0;
  double sum = 0;
  for (size_t i = from; i < step_steal.size(); ++i) sum += step_steal[i];
  return sum / static_cast<double>(step_steal.size() - from);
}

int64_t RunReport::stolen_steps() const {
  int64_t n = 0;
  for (size_t i = step_steal.size() > 1 ? 1 : 0; i < step_steal.size(); ++i) n += step_steal[i] >= kUndisturbedSteal;
  return n;
}

int64_t RunReport::peak_step_tensor_bytes() const {
  return peak_step_tensor_bytes_per_rank.empty()
             ? 0
             : *std::max_element(peak_step_tensor_bytes_per_rank.begin(), peak_step_tensor_bytes_per_rank.end());
}

int64_t RunReport::busiest_expert_rows() const {
  return busiest_expert_rows_per_rank.empty()
             ? 0
             : *std::max_element(busiest_expert_rows_per_rank.begin(), busiest_expert_rows_per_rank.end());
}

Json to_json(const RunReport& r) {
  Json report;
  report["schema_version"] = kSchemaVersion;
  report["plan"] = {{"parallel", r.parallel}, {"profile", r.profile}};
  Json phases = Json::object();
  for (const auto& [name, seconds] : r.phase_seconds) phases[name] = seconds;
  report["measured"] = {{"where", r.where},
                        {"ranks", r.ranks},
                        {"steps", r.steps},
                        {"step_seconds", r.step_seconds},
                        {"step_time_s", r.step_time_s},
                        {"undisturbed_step_time_s", r.undisturbed_step_time_s},
                        {"tokens_per_s", r.tokens_per_s},
                        {"peak_rss_bytes_per_rank", r.peak_rss_bytes_per_rank},
                        {"baseline_rss_bytes_per_rank", r.baseline_rss_bytes_per_rank},
                        {"peak_tensor_bytes_per_rank", r.peak_tensor_bytes_per_rank},
                        {"peak_step_tensor_bytes_per_rank", r.peak_step_tensor_bytes_per_rank},
                        {"busiest_expert_rows_per_rank", r.busiest_expert_rows_per_rank},
                        {"peak_rss_bytes", r.peak_rss_bytes},
                        {"phase_seconds_rank0", phases},
                        {"tokens_per_expert", r.tokens_per_expert}};
  if (!r.step_steal.empty()) report["measured"]["step_steal"] = r.step_steal;
  if (!r.peak_device_bytes_per_rank.empty()) {
    report["measured"]["peak_device_allocated_bytes_per_rank"] = r.peak_device_allocated_bytes_per_rank;
    report["measured"]["peak_device_reserved_bytes_per_rank"] = r.peak_device_reserved_bytes_per_rank;
    report["measured"]["peak_device_bytes_per_rank"] = r.peak_device_bytes_per_rank;
    report["measured"]["device_workspace_bytes_per_rank"] = r.device_workspace_bytes_per_rank;
    report["measured"]["peak_device_bytes"] = r.peak_device_bytes;
  }
  report["predicted"] = {{"step_time_s", r.predicted_step_time_s},
                         {"tokens_per_s", r.predicted_tokens_per_s},
                         {"device_bytes_per_rank", r.predicted_bytes_per_rank}};
  report["relative_error"] = {
      {"step_time", r.step_time_error()},
      {"undisturbed_step_time", r.undisturbed_step_time_error()},
      {"tokens_per_s", r.tokens_per_s_error()}, {"peak_memory", r.memory_error()}};
  return report;
}

RunReport run_report_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  RunReport r;
  ObjectReader top(json, "", d);
  if (!top.ok()) {
    d.error("", "expected a run report object, got " + describe_json(json));
    d.throw_if_any(origin);
  }
  const int64_t version = top.integer("schema_version", 1, kMaxCount);
  if (version != kSchemaVersion && d.empty())
    d.error("schema_version", "= " + std::to_string(version) + ": this moeplan reads version " +
                                  std::to_string(kSchemaVersion));
  if (auto plan = top.object("plan")) {
    r.parallel = plan->string("parallel");
    r.profile = plan->string("profile");
    plan->finish();
  }
  if (auto m = top.object("measured")) {
    r.where = m->string("where");
    r.ranks = m->integer("ranks", 1, kMaxCount);
    r.steps = m->integer("steps", 0, kMaxCount);
    r.step_seconds = durations(*m, "step_seconds");
    if (m->child("step_steal", true) != nullptr) {
      r.step_steal = list_at<double>(*m, "step_steal", "shares", "a share from 0 to 1", [](const Json& v) {
        return v.is_number() && v.get<double>() >= 0 && v.get<double>() <= 1;
      });
      if (r.step_steal.size() != r.step_seconds.size() && d.empty())
        d.error(m->path_of("step_steal"), "has " + std::to_string(r.step_steal.size()) + " entries for " +
                                             std::to_string(r.step_seconds.size()) + " step_seconds");
    }
    r.step_time_s = m->number("step_time_s", 0, 1e12);
    r.undisturbed_step_time_s = m->number("undisturbed_step_time_s", 0, 1e12);
    r.tokens_per_s = m->number("tokens_per_s", 0, 1e18);
    r.peak_rss_bytes_per_rank = integers(*m, "peak_rss_bytes_per_rank");
    r.baseline_rss_bytes_per_rank = integers(*m, "baseline_rss_bytes_per_rank");
    r.peak_tensor_bytes_per_rank = integers(*m, "peak_tensor_bytes_per_rank");
    r.peak_step_tensor_bytes_per_rank = integers(*m, "peak_step_tensor_bytes_per_rank");
    r.busiest_expert_rows_per_rank = integers(*m, "busiest_expert_rows_per_rank");
    r.peak_rss_bytes = m->integer("peak_rss_bytes", 0, kMaxCount);
    if (m->child("peak_device_bytes_per_rank", true) != nullptr) {
      r.peak_device_allocated_bytes_per_rank = integers(*m, "peak_device_allocated_bytes_per_rank");
      r.peak_device_reserved_bytes_per_rank = integers(*m, "peak_device_reserved_bytes_per_rank");
      r.peak_device_bytes_per_rank = integers(*m, "peak_device_bytes_per_rank");
      if (m->child("device_workspace_bytes_per_rank", true) != nullptr)  // reports before it had none
        r.device_workspace_bytes_per_rank = integers(*m, "device_workspace_bytes_per_rank");
      r.peak_device_bytes = m->integer("peak_device_bytes", 0, kMaxCount);
    }
    if (auto phases = m->object("phase_seconds_rank0")) {
      const Json* raw = m->child("phase_seconds_rank0");
      for (const auto& [name, seconds] : raw->items()) r.phase_seconds.emplace_back(name, phases->number(name, 0, 1e12));
      phases->finish();
    }
    if (const Json* layers = m->child("tokens_per_expert")) {
      for (size_t l = 0; layers->is_array() && l < layers->size(); ++l) {
        const Json& row = (*layers)[l];
        std::vector<int64_t> counts;
        for (size_t e = 0; row.is_array() && e < row.size(); ++e)
          if (row[e].is_number_integer() && row[e].get<int64_t>() >= 0) counts.push_back(row[e].get<int64_t>());
        if (!row.is_array() || counts.size() != row.size())
          d.error(m->path_of("tokens_per_expert") + "[" + std::to_string(l) + "]",
                  "expected a list of non-negative token counts, got " + describe_json(row));
        r.tokens_per_expert.push_back(std::move(counts));
      }
      if (!layers->is_array())
        d.error(m->path_of("tokens_per_expert"), "expected a list per layer, got " + describe_json(*layers));
    }
    if (static_cast<int64_t>(r.step_seconds.size()) != r.steps && d.empty())
      d.error(m->path_of("step_seconds"), "has " + std::to_string(r.step_seconds.size()) +
                                             " entries for steps = " + std::to_string(r.steps));
    if (d.empty()) {
      // The two figures are the step times': a report that contradicts itself is refused.
      RunReport derived;
      derived.set_step_seconds(r.step_seconds);
      const auto check = [&](const char* key, double stored, double from_steps) {
        if (std::abs(stored - from_steps) > 1e-9 * std::max(1.0, std::abs(from_steps)))
          d.error(m->path_of(key), "= " + std::to_string(stored) + " s, but step_seconds give " +
                                       std::to_string(from_steps) + " s");
      };
      check("step_time_s", r.step_time_s, derived.step_time_s);
      check("undisturbed_step_time_s", r.undisturbed_step_time_s, derived.undisturbed_step_time_s);
    }
    if (static_cast<int64_t>(r.peak_rss_bytes_per_rank.size()) != r.ranks && d.empty())
      d.error(m->path_of("peak_rss_bytes_per_rank"), "has " + std::to_string(r.peak_rss_bytes_per_rank.size()) +
                                                        " entries for ranks = " + std::to_string(r.ranks));
    m->finish();
  }
  if (auto p = top.object("predicted")) {
    r.predicted_step_time_s = p->number("step_time_s", 0, 1e12);
    r.predicted_tokens_per_s = p->number("tokens_per_s", 0, 1e18);
    r.predicted_bytes_per_rank = p->integer("device_bytes_per_rank", 0, kMaxCount);
    p->finish();
  }
  top.ignore("relative_error");  // derived from the fields above; written for readers of the file
  top.finish();
  d.throw_if_any(origin);
  return r;
}

RunReport read_run_report(const std::string& path) { return run_report_from_json(read_json_file(path), path); }

}  // namespace moeplan
