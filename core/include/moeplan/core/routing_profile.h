#pragma once
// How a router spreads token-expert slots over a layer's experts, micro-batch by micro-batch: a
// routing profile. Three kinds (docs/formats.md, "Routing profile"):
// - balanced: every expert gets the same share of every micro-batch (what published MoE
//   benchmarks force);
// - skew: each layer's experts ranked by a Zipf law whose busiest expert gets `skew` times the
//   mean share, the ranks dealt to the experts at random for every step, and each micro-batch's
//   slots drawn from those shares (so a small micro-batch is also uneven by chance);
// - measured: the slots each expert received in each recorded micro-batch of each MoE layer, as
//   a run counted them.
// A draw is seeded: the generator and every distribution are written here, not taken from the
// standard library, whose distributions differ between implementations (pow, exp, log and cos
// still come from the C library).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"

namespace moeplan {

enum class RoutingKind { kBalanced, kSkew, kMeasured };

struct RoutingProfile {
  RoutingKind kind = RoutingKind::kBalanced;
  std::string source;  // where the profile came from, for people
  // kSkew: the busiest expert's share over the mean share (1 = balanced), below the number of
  // experts of the model it is used with.
  double skew = 1.0;
  // kMeasured: the experts and top-k of the model that was measured, and per MoE layer, per
  // recorded micro-batch, the slots each expert received. Every layer has the same number of
  // micro-batches (micro-batch j of every layer is one batch of tokens).
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  std::vector<std::vector<std::vector<int64_t>>> slots;  // [layer][micro-batch][expert]
  // Any kind, optional: how the steps of a run varied beyond what their routing explains --
  // each measured step over the step predicted from its own expert loads, over the median of
  // those ratios (so the median is 1), sorted. A run on a shared machine, or a cluster with
  // stragglers, varies by more than its routing; a draw's step is multiplied by one of these
  // (seeded), so the drawn p95 holds that too. Empty: steps vary by their routing alone.
  std::vector<double> step_spread;

  int64_t layers() const { return static_cast<int64_t>(slots.size()); }
  int64_t micro_batches() const { return slots.empty() ? 0 : static_cast<int64_t>(slots.front().size()); }
  bool operator==(const RoutingProfile&) const = default;
};

// Each expert's share of a micro-batch's slot counts (all zero: all zero).
std::vector<double> slot_shares(const std::vector<int64_t>& counts);

// The profile a command-line value names: "balanced", "skew:X" (X >= 1) or a profile file.
// A bad value is an InputError naming `flag`.
RoutingProfile routing_profile_from_spec(const std::string& spec, const std::string& flag = "--routing");
// Short name for tables: "balanced", "skew:2.0", "measured (8 layers x 64 micro-batches)".
std::string describe_routing(const RoutingProfile& profile);

// The file format, strict: every problem reported with its field path.
RoutingProfile routing_profile_from_json(const Json& json, const std::string& origin);
RoutingProfile read_routing_profile(const std::string& path);
Json routing_profile_json(const RoutingProfile& profile);
void write_routing_profile(const RoutingProfile& profile, const std::string& path);

// Problems using `profile` for a model with `num_experts` routed experts, top-`experts_per_token`
// and `moe_layers` MoE layers (a measured profile must come from as many experts and the same
// top-k, of any depth: its layers are stretched over the model's; a skew needs fewer than
// num_experts), each at `path` ("--routing" or a field); empty when it fits.
std::vector<Diagnostic> routing_mismatches(const RoutingProfile& profile, int64_t num_experts,
                                           int64_t experts_per_token, int64_t moe_layers, const std::string& path);

// The Zipf exponent s whose shares p_i = i^-s / sum_j j^-s over n experts give the busiest
// p_1 = skew / n (skew in [1, n)); 0 for skew 1.
double zipf_exponent_for_skew(double skew, int64_t n);

// A seeded generator (SplitMix64, Steele, Lea and Flood 2014): the same numbers everywhere.
class RoutingRng {
 public:
  explicit RoutingRng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();  // in (0, 1)
  size_t index(size_t n);  // one of 0 .. n - 1, each as likely (n > 0)
  double normal();   // standard normal (Box-Muller)

 private:
  uint64_t state_;
};

// Each expert's share of one micro-batch's slots, per MoE layer and micro-batch of one step:
// [layer][micro-batch][expert], each row adding up to 1. `slots` is the token-expert slots of
// one micro-batch over the exchange group (tokens x top-k): the chance spread of a skewed draw
// depends on it; a measured profile keeps the spread it was recorded with.
using StepRouting = std::vector<std::vector<std::vector<double>>>;
StepRouting draw_step_routing(const RoutingProfile& profile, int64_t num_experts, int64_t moe_layers,
                              int64_t micro_batches, double slots, RoutingRng& rng);


}  // namespace moeplan
