#include "moeplan/core/step_record.h"

#include <cmath>
#include <fstream>
#include <limits>

#include "moeplan/core/errors.h"

namespace moeplan {

namespace {

constexpr int64_t kMaxStepCount = std::numeric_limits<int64_t>::max();

// A loss or a norm: a number, or null where it was not finite.
double finite_or_null(ObjectReader& r, const char* key) {
  const Json* value = r.child(key);
  if (value == nullptr) return 0;
  if (value->is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!value->is_number()) {
    r.diagnostics().error(r.path_of(key), "expected a number or null, got " + describe_json(*value));
    return 0;
  }
  return value->get<double>();
}

// Nested lists of non-negative integers, `depth` deep ([layer][expert] is 2), each innermost
// list as long as the first one.
template <class Out>
bool read_counts(const Json& value, const std::string& path, Diagnostics& d, Out& out);

template <>
bool read_counts(const Json& value, const std::string& path, Diagnostics& d, std::vector<int64_t>& out) {
  if (!value.is_array()) {
    d.error(path, "expected a list of token counts, got " + describe_json(value));
    return false;
  }
  for (const Json& x : value) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0) {
      d.error(path, "expected non-negative integer token counts, got " + describe_json(x));
      return false;
    }
    out.push_back(x.get<int64_t>());
  }
  return true;
}

template <class Out>
bool read_counts(const Json& value, const std::string& path, Diagnostics& d, Out& out) {
  if (!value.is_array()) {
    d.error(path, "expected a list, got " + describe_json(value));
    return false;
  }
  for (size_t i = 0; i < value.size(); ++i)
    if (!read_counts(value[i], path + "[" + std::to_string(i) + "]", d, out.emplace_back())) return false;
  return true;
}

// Every [layer][expert] table of the groups' micro-batches has the shape of tokens_per_expert.
void check_exchange_shape(const StepRecord& r, Diagnostics& d) {
  for (size_t g = 0; g < r.exchange_slots.size(); ++g) {
    if (r.exchange_slots[g].size() != r.exchange_slots.front().size()) {
      d.error("exchange_slots[" + std::to_string(g) + "]", "has " + std::to_string(r.exchange_slots[g].size()) +
                                                               " micro-batches, group 0 has " +
                                                               std::to_string(r.exchange_slots.front().size()));
      return;
    }
    for (size_t m = 0; m < r.exchange_slots[g].size(); ++m) {
      const auto& table = r.exchange_slots[g][m];
      bool same = table.size() == r.tokens_per_expert.size();
      for (size_t l = 0; same && l < table.size(); ++l) same = table[l].size() == r.tokens_per_expert[l].size();
      if (!same) {
        d.error("exchange_slots[" + std::to_string(g) + "][" + std::to_string(m) + "]",
                "is not a [layer][expert] table of tokens_per_expert's shape");
        return;
      }
    }
  }
}

}  // namespace

int64_t StepRecord::total_slots() const {
  int64_t n = 0;
  for (const std::vector<int64_t>& layer : tokens_per_expert)
    for (int64_t c : layer) n += c;
  return n;
}

int64_t StepRecord::total_dropped() const {
  int64_t n = 0;
  for (int64_t d : dropped_slots) n += d;
  return n;
}

std::string to_json_line(const StepRecord& r) {
  Json j;
  j["step"] = r.step;
  j["loss"] = r.loss;
  j["aux_loss"] = r.aux_loss;
  j["z_loss"] = r.z_loss;
  j["total_loss"] = r.total_loss;
  j["lr"] = r.learning_rate;
  j["grad_norm"] = r.grad_norm;
  j["tokens"] = r.tokens;
  j["step_s"] = r.seconds;
  j["tokens_per_s"] = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0;
  j["tokens_per_expert"] = r.tokens_per_expert;
  if (!r.exchange_slots.empty()) j["exchange_slots"] = r.exchange_slots;
  if (!r.exchange_seconds.empty()) j["exchange_s"] = r.exchange_seconds;
  if (!r.dropped_slots.empty()) j["dropped_slots"] = r.dropped_slots;
  if (r.skipped) {
    j["skipped"] = true;
    j["nonfinite"] = r.nonfinite;
  }
  if (r.steal) j["steal"] = *r.steal;
  return j.dump();
}

StepRecord step_record_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  StepRecord r;
  ObjectReader top(json, "", d);
  if (!top.ok()) {
    d.error("", "expected a step's metrics object, got " + describe_json(json));
    d.throw_if_any(origin);
  }
  r.step = top.integer("step", 1, kMaxStepCount);
  r.loss = finite_or_null(top, "loss");
  r.aux_loss = finite_or_null(top, "aux_loss");
  r.z_loss = finite_or_null(top, "z_loss");
  r.total_loss = finite_or_null(top, "total_loss");
  r.learning_rate = top.number("lr", 0, 1e6);
  r.grad_norm = finite_or_null(top, "grad_norm");
  r.tokens = top.integer("tokens", 0, kMaxStepCount);
  r.seconds = top.number("step_s", 0, 1e12);
  top.ignore("tokens_per_s");  // tokens over step_s, for people
  if (const Json* counts = top.child("tokens_per_expert");
      counts != nullptr && read_counts(*counts, "tokens_per_expert", d, r.tokens_per_expert))
    for (size_t l = 1; l < r.tokens_per_expert.size(); ++l)
      if (r.tokens_per_expert[l].size() != r.tokens_per_expert.front().size()) {
        d.error("tokens_per_expert[" + std::to_string(l) + "]",
                "counts " + std::to_string(r.tokens_per_expert[l].size()) + " experts, layer 0 " +
                    std::to_string(r.tokens_per_expert.front().size()));
        break;
      }
  if (const Json* slots = top.child("exchange_slots", true);
      slots != nullptr && read_counts(*slots, "exchange_slots", d, r.exchange_slots) && d.empty())
    check_exchange_shape(r, d);
  if (const Json* seconds = top.child("exchange_s", true)) {
    for (size_t i = 0; seconds->is_array() && i < seconds->size(); ++i) {
      const Json& x = (*seconds)[i];
      if (!x.is_number() || !(x.get<double>() >= 0) || !std::isfinite(x.get<double>())) {
        d.error("exchange_s[" + std::to_string(i) + "]", "expected seconds (a finite number >= 0), got " + describe_json(x));
        break;
      }
      r.exchange_seconds.push_back(x.get<double>());
    }
    if (!seconds->is_array()) d.error("exchange_s", "expected a list of seconds per rank, got " + describe_json(*seconds));
  }
  if (const Json* dropped = top.child("dropped_slots", true);
      dropped != nullptr && read_counts(*dropped, "dropped_slots", d, r.dropped_slots) &&
      r.dropped_slots.size() != r.tokens_per_expert.size())
    d.error("dropped_slots", "counts " + std::to_string(r.dropped_slots.size()) + " layers, tokens_per_expert " +
                                 std::to_string(r.tokens_per_expert.size()));
  r.skipped = top.boolean("skipped", false);
  if (r.skipped) r.nonfinite = top.string("nonfinite");
  if (top.has("steal")) r.steal = top.number("steal", 0, 1);
  top.finish();
  d.throw_if_any(origin);
  return r;
}

std::vector<StepRecord> read_step_records(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path, {{"", "cannot be read"}});
  std::vector<StepRecord> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const std::string origin = path + ":" + std::to_string(n);
    out.push_back(step_record_from_json(parse_json_text(line, origin), origin));
  }
  return out;
}

}  // namespace moeplan
