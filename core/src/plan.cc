#include "moeplan/core/plan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "moeplan/core/rules.h"

namespace moeplan {

namespace {

constexpr int64_t kMaxBytes = int64_t{1} << 60;
constexpr double kMaxSeconds = 1e12;
constexpr double kMaxRate = 1e30;

std::vector<MemoryItem> read_items(const Json* json, const std::string& path, Diagnostics& d) {
  std::vector<MemoryItem> items;
  if (json == nullptr) return items;
  if (!json->is_object()) {
    d.error(path, "expected an object of name: bytes, got " + describe_json(*json));
    return items;
  }
  ObjectReader r(*json, path, d);
  for (auto it = json->begin(); it != json->end(); ++it)
    items.push_back({it.key(), r.integer(it.key(), 0, kMaxBytes)});
  return items;
}

Json items_json(const std::vector<MemoryItem>& items) {
  Json j = Json::object();
  for (const auto& item : items) j[item.name] = item.bytes;
  return j;
}

// The sum of the items, or -1 when it does not fit in int64 (no total can then match it).
int64_t sum(const std::vector<MemoryItem>& items) {
  int64_t total = 0;
  for (const auto& item : items)
    if (__builtin_add_overflow(total, item.bytes, &total)) return -1;
  return total;
}

std::string sum_text(const std::vector<MemoryItem>& items) {
  const int64_t total = sum(items);
  return total < 0 ? std::string("more than 2^63") : std::to_string(total);
}

static void read_prediction_fields(ObjectReader& r, Prediction& p) {
  Diagnostics& d = r.diagnostics();
  p.estimator = r.string("estimator");
  p.step_time_s = r.number("step_time_s", 0.0, kMaxSeconds);
  p.tokens_per_s = r.number("tokens_per_s", 0.0, kMaxRate);
  p.tflops_per_gpu = r.number("tflops_per_gpu", 0.0, kMaxRate);
  p.mfu = r.number("mfu", 0.0, 1.0);
  if (auto mem = r.object("memory")) {
    p.memory.device = read_items(mem->child("device"), mem->path_of("device"), d);
    p.memory.device_total_bytes = mem->integer("device_total_bytes", 0, kMaxBytes);
    p.memory.device_limit_bytes = mem->integer("device_limit_bytes", 0, kMaxBytes);
    p.memory.host = read_items(mem->child("host"), mem->path_of("host"), d);
    p.memory.host_total_bytes = mem->integer("host_total_bytes", 0, kMaxBytes);
    p.memory.host_limit_bytes = mem->integer("host_limit_bytes", 0, kMaxBytes);
    mem->finish();
    if (d.empty()) {
      if (sum(p.memory.device) != p.memory.device_total_bytes)
        d.error(mem->path_of("device_total_bytes"),
                "= " + std::to_string(p.memory.device_total_bytes) +
                    " does not equal the sum of the device items = " + sum_text(p.memory.device));
      if (sum(p.memory.host) != p.memory.host_total_bytes)
        d.error(mem->path_of("host_total_bytes"),
                "= " + std::to_string(p.memory.host_total_bytes) +
                    " does not equal the sum of the host items = " + sum_text(p.memory.host));
    }
  }
  if (const Json* time = r.child("time")) {
    const std::string at = r.path_of("time");
    if (!time->is_object()) {
      d.error(at, "expected an object of name: seconds, got " + describe_json(*time));
    } else {
      ObjectReader t(*time, at, d);
      for (auto it = time->begin(); it != time->end(); ++it)
        p.time.push_back({it.key(), t.number(it.key(), 0.0, kMaxSeconds)});
    }
  }
}

Prediction read_prediction(const Json& json, const std::string& path, Diagnostics& d) {
  return read_object<Prediction>(json, path, d, read_prediction_fields);
}

Json to_json(const Prediction& p) {
  Json j;
  j["estimator"] = p.estimator;
  j["step_time_s"] = p.step_time_s;
  j["tokens_per_s"] = p.tokens_per_s;
  j["tflops_per_gpu"] = p.tflops_per_gpu;
  j["mfu"] = p.mfu;
  Json mem;
  mem["device"] = items_json(p.memory.device);
  mem["device_total_bytes"] = p.memory.device_total_bytes;
  mem["device_limit_bytes"] = p.memory.device_limit_bytes;
  mem["host"] = items_json(p.memory.host);
  mem["host_total_bytes"] = p.memory.host_total_bytes;
  mem["host_limit_bytes"] = p.memory.host_limit_bytes;
  j["memory"] = mem;
  Json time = Json::object();
  for (const auto& item : p.time) time[item.name] = item.seconds;
  j["time"] = time;
  return j;
}

}  // namespace

Plan plan_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  Plan plan;
  ObjectReader r(json, "", d);
  if (r.ok()) {
    plan.schema_version = r.integer("schema_version", kPlanSchemaVersion, kPlanSchemaVersion);
    if (auto model = r.object("model")) {
      plan.model = read_model(*model);
      model->finish();
    }
    if (const Json* cluster = r.child("cluster")) plan.cluster = read_cluster(*cluster, "cluster", d);
    if (const Json* parallel = r.child("parallel")) plan.parallel = read_parallel(*parallel, "parallel", d);
    if (const Json* moe = r.child("moe")) plan.moe = read_moe(*moe, "moe", d);
    if (const Json* training = r.child("training")) plan.training = read_training(*training, "training", d);
    if (const Json* prediction = r.child("prediction"))
      plan.prediction = read_prediction(*prediction, "prediction", d);
    if (const Json* alternatives = r.child("alternatives", true)) {
      if (!alternatives->is_array() || alternatives->size() > 1000) {
        d.error("alternatives", "expected an array of at most 1000 entries");
      } else {
        for (size_t i = 0; i < alternatives->size(); ++i) {
          const std::string at = "alternatives[" + std::to_string(i) + "]";
          ObjectReader a((*alternatives)[i], at, d);
          if (!a.ok()) continue;
          Alternative alt;
          if (const Json* parallel = a.child("parallel")) alt.parallel = read_parallel(*parallel, a.path_of("parallel"), d);
          alt.step_time_s = a.number("step_time_s", 0.0, kMaxSeconds);
          alt.tokens_per_s = a.number("tokens_per_s", 0.0, kMaxRate);
          alt.mfu = a.number("mfu", 0.0, 1.0);
          alt.device_peak_bytes = a.integer("device_peak_bytes", 0, kMaxBytes);
          a.finish();
          plan.alternatives.push_back(alt);
        }
      }
    }
    if (auto prov = r.object("provenance", true)) {
      plan.provenance.moeplan_version = prov->string("moeplan_version", "");
      plan.provenance.command = prov->string("command", "");
      prov->finish();
    }
    r.finish();
  }
  // Consistency rules only make sense once every field has been read.
  if (d.empty()) {
    check_cluster(plan.cluster, d, "cluster");
    RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
    for (const Violation& v : validate(config))
      d.error(v.field, v.message + " [" + std::string(v.name) + "]");
    // An alternative is the same run with another parallel configuration: the same rules,
    // reported when the alternative breaks one that the plan itself does not.
    const RuleMask plan_broken = violated_rules(config);
    for (size_t i = 0; i < plan.alternatives.size(); ++i) {
      const RunConfig alt{plan.model, plan.cluster, plan.alternatives[i].parallel, plan.moe, plan.training};
      const std::string at = "alternatives[" + std::to_string(i) + "].";
      for (const Violation& v : validate(alt)) {
        if (plan_broken & rule_bit(v.rule)) continue;
        if (v.field.rfind("parallel.", 0) == 0)
          d.error(at + v.field, v.message + " [" + std::string(v.name) + "]");
        else
          d.error(at + "parallel", "with " + v.field + " " + v.message + " [" + std::string(v.name) + "]");
      }
    }
  }
  d.throw_if_any(origin);
  return plan;
}

Plan read_plan_file(const std::string& path) { return plan_from_json(read_json_file(path), path); }

Json to_json(const Plan& plan) {
  Json j;
  j["schema_version"] = plan.schema_version;
  j["model"] = to_json(plan.model);
  j["cluster"] = to_json(plan.cluster);
  j["parallel"] = to_json(plan.parallel);
  j["moe"] = to_json(plan.moe);
  j["training"] = to_json(plan.training);
  j["prediction"] = to_json(plan.prediction);
  Json alternatives = Json::array();
  for (const auto& a : plan.alternatives) {
    Json alt;
    alt["parallel"] = to_json(a.parallel);
    alt["step_time_s"] = a.step_time_s;
    alt["tokens_per_s"] = a.tokens_per_s;
    alt["mfu"] = a.mfu;
    alt["device_peak_bytes"] = a.device_peak_bytes;
    alternatives.push_back(alt);
  }
  j["alternatives"] = alternatives;
  Json prov;
  prov["moeplan_version"] = plan.provenance.moeplan_version;
  prov["command"] = plan.provenance.command;
  j["provenance"] = prov;
  return j;
}

std::string plan_to_text(const Plan& plan) { return to_json(plan).dump(2) + "\n"; }

// Writes all of text to fd; false on an error (errno set).
static bool write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  // A device or a pipe (/dev/stdout, /dev/null) is written in place: renaming a file over it
  // would replace it.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    const bool ok = fd >= 0 && write_all(fd, text);
    const std::string reason = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    if (!ok) throw InputError(path, {{"", "write failed: " + reason}});
    return;
  }
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&](const char* what) {
    const std::string reason = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw InputError(path, {{"", std::string(what) + " failed: " + reason}});
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create");
  if (!write_all(fd, text)) {
    ::close(fd);
    fail("write");
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync");
  }
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename");
  const auto slash = path.rfind('/');
  fsync_directory(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw InputError(dir, {{"", std::string("cannot open the folder: ") + std::strerror(errno)}});
  const int rc = ::fsync(fd);
  const std::string reason = std::strerror(errno);
  ::close(fd);
  if (rc != 0) throw InputError(dir, {{"", "fsync of the folder failed: " + reason}});
}

}  // namespace moeplan
