#include <array>
#include <cassert>

#include "moeplan/frameworks/framework.h"

namespace moeplan {

namespace frameworks {
// Each defined in its own folder, src/<name>/framework.cc.
extern const Framework kMegatron;
extern const Framework kTorchtitan;
extern const Framework kSmp;
extern const Framework kMoeplan;
}  // namespace frameworks

namespace {

// THE list of frameworks: adding one is its folder and a line here (and its declaration
// above). A log line is offered to their readers in this order, and the error on a log that
// holds none of their lines names them in it.
constexpr std::array<const Framework*, 4> kFrameworks = {
    &frameworks::kMegatron,
    &frameworks::kTorchtitan,
    &frameworks::kSmp,
    &frameworks::kMoeplan,
};

// `--target any`: every layout moeplan models, under no framework's limits.
const Framework kAny{
    .name = "any",
    .title = "every layout moeplan models",
    .target = Target::kAny,
    .defaults = {.precision = Precision::kBf16, .fp32_gradients = true, .load_balancing = LoadBalancing::kSinkhorn},
    .capabilities = {},
};

}  // namespace

std::span<const Framework* const> all_frameworks() { return kFrameworks; }

const Framework& framework(Target target) {
  for (const Framework* f : kFrameworks)
    if (f->target == target) return *f;
  assert(target == Target::kAny && "every target but any has a framework in the list");
  return kAny;
}

const Framework* find_framework(std::string_view name) {
  for (const Framework* f : kFrameworks)
    if (f->name == name) return f;
  return name == kAny.name ? &kAny : nullptr;
}

void apply_defaults(const Framework& framework, TrainingConfig& training, MoeConfig& moe) {
  training.precision = framework.defaults.precision;
  training.fp32_gradients = framework.defaults.fp32_gradients;
  moe.load_balancing = framework.defaults.load_balancing;
}

}  // namespace moeplan
