#include "moeplan/core/routing_profile.h"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numbers>

#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/plan.h"

namespace moeplan {

namespace {

constexpr int64_t kRoutingSchemaVersion = 1;
constexpr int64_t kRoutingMaxExperts = 65536;
constexpr int64_t kRoutingMaxLayers = 4096;
constexpr int64_t kRoutingMaxSlots = int64_t{1} << 50;
constexpr size_t kRoutingMaxSpread = 1 << 20;

constexpr std::pair<std::string_view, RoutingKind> kRoutingKindNames[] = {
    {"balanced", RoutingKind::kBalanced}, {"skew", RoutingKind::kSkew}, {"measured", RoutingKind::kMeasured}};

std::string_view routing_kind_name(RoutingKind kind) {
  for (const auto& [name, k] : kRoutingKindNames)
    if (k == kind) return name;
  return "balanced";
}

std::string skew_text(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

// A skew read from a flag or a file: at least 1 and finite.
bool valid_skew(double x) { return std::isfinite(x) && x >= 1.0; }

// The measured slots: [layer][micro-batch][expert] of non-negative integers, every micro-batch
// of num_experts entries adding up to more than 0, every layer as many micro-batches.
std::vector<std::vector<std::vector<int64_t>>> read_slots(const Json* raw, const std::string& path, int64_t experts,
                                                          Diagnostics& d) {
  std::vector<std::vector<std::vector<int64_t>>> out;
  if (raw == nullptr) return out;
  if (!raw->is_array() || raw->empty() || static_cast<int64_t>(raw->size()) > kRoutingMaxLayers) {
    d.error(path, "expected a list of 1 to " + std::to_string(kRoutingMaxLayers) + " layers, got " + describe_json(*raw));
    return out;
  }
  for (size_t l = 0; l < raw->size(); ++l) {
    const Json& layer = (*raw)[l];
    const std::string at = path + "[" + std::to_string(l) + "]";
    if (!layer.is_array() || layer.empty()) {
      d.error(at, "expected a list of micro-batches, got " + describe_json(layer));
      return {};
    }
    if (l > 0 && layer.size() != out.front().size()) {
      d.error(at, "has " + std::to_string(layer.size()) + " micro-batches, layer 0 has " +
                      std::to_string(out.front().size()) + ": every layer records the same micro-batches");
      return {};
    }
    std::vector<std::vector<int64_t>>& batches = out.emplace_back();
    for (size_t m = 0; m < layer.size(); ++m) {
      const Json& row = layer[m];
      const std::string row_at = at + "[" + std::to_string(m) + "]";
      std::vector<int64_t> counts;
      int64_t total = 0;
      for (size_t e = 0; row.is_array() && e < row.size(); ++e) {
        if (!row[e].is_number_integer() || row[e].get<int64_t>() < 0 || row[e].get<int64_t>() > kRoutingMaxSlots) break;
        counts.push_back(row[e].get<int64_t>());
        total = std::min(total + counts.back(), kRoutingMaxSlots);  // > 0 is all that is asked of it
      }
      if (!row.is_array() || counts.size() != row.size() || static_cast<int64_t>(counts.size()) != experts) {
        d.error(row_at, "expected " + std::to_string(experts) + " slot counts (num_experts), each an integer from 0 to " +
                            std::to_string(kRoutingMaxSlots) + ", got " + describe_json(row));
        return {};
      }
      if (total == 0) {
        d.error(row_at, "routes no slot: a recorded micro-batch sends its tokens somewhere");
        return {};
      }
      batches.push_back(std::move(counts));
    }
  }
  return out;
}

// The step spread: 1 to kRoutingMaxSpread ratios, each above 0 and at most 100, in ascending
// order (as `moeplan routing --out` writes them).
std::vector<double> read_spread(const Json& raw, const std::string& path, Diagnostics& d) {
  if (!raw.is_array() || raw.empty() || raw.size() > kRoutingMaxSpread) {
    d.error(path, "expected a list of 1 to " + std::to_string(kRoutingMaxSpread) +
                      " ratios (measured step over predicted, over their median), got " + describe_json(raw));
    return {};
  }
  std::vector<double> out;
  for (size_t i = 0; i < raw.size(); ++i) {
    const Json& x = raw[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!x.is_number() || !(x.get<double>() > 0) || !(x.get<double>() <= 100)) {
      d.error(at, "expected a ratio above 0 and at most 100, got " + describe_json(x));
      return {};
    }
    if (!out.empty() && x.get<double>() < out.back()) {
      d.error(at, "= " + x.dump() + " is below the ratio before it: the spread is sorted, lowest first");
      return {};
    }
    out.push_back(x.get<double>());
  }
  return out;
}

// One binomial draw: inversion where the spread is small, the normal approximation (rounded and
// kept within [0, n]) where it is wide enough for it (variance over 25).
int64_t binomial(int64_t n, double p, RoutingRng& rng) {
  if (n <= 0 || p <= 0) return 0;
  if (p >= 1) return n;
  if (p > 0.5) return n - binomial(n, 1.0 - p, rng);
  const double nd = static_cast<double>(n);
  const double variance = nd * p * (1.0 - p);
  if (variance > 25.0) {
    const double x = std::round(nd * p + std::sqrt(variance) * rng.normal());
    return static_cast<int64_t>(std::clamp(x, 0.0, nd));
  }
  // P(0) = (1-p)^n, then P(k+1) = P(k) (n-k)/(k+1) p/(1-p); with n p <= 50 P(0) stays normal.
  double u = rng.uniform();
  double pk = std::exp(nd * std::log1p(-p));
  const double ratio = p / (1.0 - p);
  int64_t k = 0;
  while (k < n && u > pk) {
    u -= pk;
    pk *= static_cast<double>(n - k) / static_cast<double>(k + 1) * ratio;
    ++k;
  }
  return k;
}

// Each expert's share of `slots` slots drawn from `p` (adding up to 1): a multinomial draw by
// conditional binomials.
std::vector<double> multinomial_shares(const std::vector<double>& p, int64_t slots, RoutingRng& rng) {
  std::vector<double> out(p.size());
  int64_t left = slots;
  double mass = 1.0;
  for (size_t i = 0; i + 1 < p.size() && left > 0; ++i) {
    const int64_t c = binomial(left, mass > 0 ? p[i] / mass : 1.0, rng);
    out[i] = static_cast<double>(c);
    left -= c;
    mass -= p[i];
  }
  out.back() += static_cast<double>(left);
  for (double& x : out) x /= static_cast<double>(slots);
  return out;
}

// The Zipf shares of n experts, busiest first.
std::vector<double> zipf_shares(double exponent, int64_t n) {
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[static_cast<size_t>(i)] = std::pow(static_cast<double>(i + 1), -exponent);
  for (double& x : p) x /= sum;
  return p;
}

}  // namespace

uint64_t RoutingRng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// 2^52 values, each with its half step: (k + 0.5) / 2^52 is exact in a double and below 1.
double RoutingRng::uniform() { return (static_cast<double>(next() >> 12) + 0.5) * 0x1.0p-52; }

size_t RoutingRng::index(size_t n) {
  return std::min(static_cast<size_t>(uniform() * static_cast<double>(n)), n - 1);
}

double RoutingRng::normal() {
  const double u = uniform(), v = uniform();
  return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * std::numbers::pi * v);
}

double zipf_exponent_for_skew(double skew, int64_t n) {
  if (skew <= 1.0 || n <= 1) return 0;
  const double target = std::min(skew, static_cast<double>(n) * (1.0 - 1e-9));
  const auto busiest = [&](double s) { return static_cast<double>(n) * zipf_shares(s, n).front(); };
  double lo = 0, hi = 1;
  while (busiest(hi) < target && hi < 1e4) hi *= 2;
  for (int i = 0; i < 60; ++i) {
    const double mid = 0.5 * (lo + hi);
    (busiest(mid) < target ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

std::vector<double> slot_shares(const std::vector<int64_t>& counts) {
  double total = 0;
  for (int64_t c : counts) total += static_cast<double>(c);
  std::vector<double> shares;
  for (int64_t c : counts) shares.push_back(total > 0 ? static_cast<double>(c) / total : 0.0);
  return shares;
}

RoutingProfile routing_profile_from_spec(const std::string& spec, const std::string& flag) {
  RoutingProfile r;
  if (spec == "balanced") {
    r.source = "balanced routing: every expert the same share of every micro-batch";
    return r;
  }
  if (spec.rfind("skew:", 0) == 0) {
    const std::string text = spec.substr(5);
    double x = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
    if (ec != std::errc() || end != text.data() + text.size() || text.empty() || !valid_skew(x))
      throw InputError(flag, {{"", "= \"" + spec + "\": skew:X takes a number X >= 1 (the busiest expert's share "
                                                  "over the mean), e.g. skew:2"}});
    r.kind = RoutingKind::kSkew;
    r.skew = x;
    r.source = "Zipf expert shares, the busiest " + skew_text(x) + " times the mean (" + flag + ")";
    return r;
  }
  std::error_code error;
  if (!std::filesystem::is_regular_file(spec, error))
    throw InputError(flag, {{"", "= \"" + spec + "\": expected balanced, skew:X or a routing profile file, "
                                                 "and there is no such file"}});
  return read_routing_profile(spec);
}

std::string describe_routing(const RoutingProfile& r) {
  std::string out = "balanced";
  if (r.kind == RoutingKind::kSkew) out = "skew:" + skew_text(r.skew);
  if (r.kind == RoutingKind::kMeasured)
    out = "measured (" + std::to_string(r.layers()) + " layers x " + std::to_string(r.micro_batches()) +
          " micro-batches)";
  if (!r.step_spread.empty()) {
    char spread[64];
    std::snprintf(spread, sizeof spread, " with steps spread to %.2f x at the p95", quantile(r.step_spread, 0.95));
    out += spread;
  }
  return out;
}

RoutingProfile routing_profile_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  RoutingProfile r;
  ObjectReader top(json, "", d);
  if (!top.ok()) {
    d.error("", "expected a routing profile object, got " + describe_json(json));
    d.throw_if_any(origin);
  }
  const int64_t version = top.integer("schema_version", 1, 1000);
  if (version != kRoutingSchemaVersion && d.empty())
    d.error("schema_version", "= " + std::to_string(version) + ": this moeplan reads version " +
                                  std::to_string(kRoutingSchemaVersion));
  r.kind = top.choice<RoutingKind>("kind", kRoutingKindNames);
  r.source = top.string("source", std::string());
  if (r.kind == RoutingKind::kSkew) {
    r.skew = top.number("skew", 1.0, 1e9);
  } else if (r.kind == RoutingKind::kMeasured) {
    r.num_experts = top.integer("num_experts", 1, kRoutingMaxExperts);
    r.experts_per_token = top.integer("experts_per_token", 1, kRoutingMaxExperts);
    if (d.empty() && r.experts_per_token > r.num_experts)
      d.error("experts_per_token", "= " + std::to_string(r.experts_per_token) + " is more than num_experts = " +
                                       std::to_string(r.num_experts));
    const Json* slots = top.child("slots");
    if (d.empty()) r.slots = read_slots(slots, "slots", r.num_experts, d);
  }
  if (const Json* spread = top.child("step_spread", true); spread != nullptr && d.empty())
    r.step_spread = read_spread(*spread, "step_spread", d);
  top.finish();
  d.throw_if_any(origin);
  return r;
}

RoutingProfile read_routing_profile(const std::string& path) {
  return routing_profile_from_json(read_json_file(path), path);
}

Json routing_profile_json(const RoutingProfile& r) {
  Json j;
  j["schema_version"] = kRoutingSchemaVersion;
  j["kind"] = routing_kind_name(r.kind);
  j["source"] = r.source;
  if (r.kind == RoutingKind::kSkew) j["skew"] = r.skew;
  if (r.kind == RoutingKind::kMeasured) {
    j["num_experts"] = r.num_experts;
    j["experts_per_token"] = r.experts_per_token;
    j["slots"] = r.slots;
  }
  if (!r.step_spread.empty()) j["step_spread"] = r.step_spread;
  return j;
}

void write_routing_profile(const RoutingProfile& r, const std::string& path) {
  write_file_atomic(path, routing_profile_json(r).dump() + "\n");
}

std::vector<Diagnostic> routing_mismatches(const RoutingProfile& r, int64_t num_experts, int64_t experts_per_token,
                                           int64_t moe_layers, const std::string& path) {
  std::vector<Diagnostic> out;
  const auto mismatch = [&](const std::string& what, int64_t profile, int64_t model) {
    out.push_back({path, "is measured with " + what + " = " + std::to_string(profile) + ", the model has " +
                             std::to_string(model)});
  };
  if (r.kind == RoutingKind::kSkew && num_experts > 0 && r.skew >= static_cast<double>(num_experts))
    out.push_back({path, "= skew:" + skew_text(r.skew) + ": the busiest of " + std::to_string(num_experts) +
                             " experts takes less than " + std::to_string(num_experts) + " times the mean share"});
  if (r.kind != RoutingKind::kMeasured) return out;
  if (r.num_experts != num_experts) mismatch("num_experts", r.num_experts, num_experts);
  if (r.experts_per_token != experts_per_token) mismatch("experts_per_token", r.experts_per_token, experts_per_token);
  (void)moe_layers;  // any depth: the measured layers are stretched over the model's (draw_step_routing)
  return out;
}

StepRouting draw_step_routing(const RoutingProfile& r, int64_t num_experts, int64_t moe_layers, int64_t micro_batches,
                              double slots, RoutingRng& rng) {
  const auto n = static_cast<size_t>(num_experts);
  StepRouting out(static_cast<size_t>(moe_layers),
                  std::vector<std::vector<double>>(static_cast<size_t>(micro_batches),
                                                   std::vector<double>(n, 1.0 / static_cast<double>(n))));
  if (r.kind == RoutingKind::kBalanced || moe_layers == 0 || micro_batches == 0) return out;
  if (r.kind == RoutingKind::kMeasured) {
    assert(routing_mismatches(r, num_experts, r.experts_per_token, moe_layers, "").empty() &&
           "a measured profile is drawn for the experts it was measured with");
    // Micro-batch j of the step is a recorded micro-batch, the same one in every layer. A model
    // of another depth takes the measured layers stretched over its own: its layer l is the
    // measured layer floor(l x measured / moe_layers), early layers from early ones.
    const auto measured_layers = static_cast<size_t>(r.layers());
    for (size_t m = 0; m < out.front().size(); ++m) {
      const size_t pick = rng.index(static_cast<size_t>(r.micro_batches()));
      for (size_t l = 0; l < out.size(); ++l)
        out[l][m] = slot_shares(r.slots[l * measured_layers / out.size()][pick]);
    }
    return out;
  }
  const std::vector<double> ranked = zipf_shares(zipf_exponent_for_skew(r.skew, num_experts), num_experts);
  const auto whole_slots = static_cast<int64_t>(std::llround(slots));
  for (auto& layer : out) {
    // This step's popularity: the ranked shares dealt to the experts in a random order.
    std::vector<double> p = ranked;
    for (size_t i = n - 1; i > 0; --i)
      std::swap(p[i], p[rng.index(i + 1)]);
    for (auto& shares : layer) shares = whole_slots > 0 ? multinomial_shares(p, whole_slots, rng) : p;
  }
  return out;
}


}  // namespace moeplan
