#include <array>
#include <cassert>

#include "moeplan/frameworks/framework.h"

namespace moeplan {

// THE list of frameworks, kFrameworks, made from MOEPLAN_FRAMEWORKS in frameworks/CMakeLists.txt:
// each folder's `frameworks::<name>_framework`, in that order. A log line is offered to their
// readers in this order, and the error on a log that holds none of their lines names them in it.
#include "framework_list.inc"

namespace {

// `--target any`: every layout moeplan models, under no framework's limits.
const Framework kAny{
    .name = "any",
    .title = "every layout moeplan models",
    .target = nullptr,
    .defaults = {.precision = Precision::kBf16, .fp32_gradients = true, .load_balancing = LoadBalancing::kSinkhorn},
    .capabilities = {},
};

}  // namespace

std::span<const Framework* const> all_frameworks() { return kFrameworks; }

const Framework& framework(Target target) {
  for (const Framework* f : kFrameworks)
    if (f->target == target) return *f;
  assert(target == nullptr && "every target but any has a framework in the list");
  return kAny;
}

// Declared by the list, which frameworks/CMakeLists.txt requires to hold moeplan.
const Framework& executor_framework() { return frameworks::moeplan_framework; }

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
