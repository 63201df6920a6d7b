// plan.json (core/plan.h): read, then what `moeplan check` and `moeplan export-launch` do with
// an accepted plan (the memory model, the closed-form step estimate, the launch files), and its
// own round trip through the text `moeplan search` writes.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/frameworks/framework.h"
#include "moeplan/frameworks/launch.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/simulator/analytic.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("plan.json", data, size);
  Plan plan;
  try {
    plan = read_plan_file(path);
  } catch (const InputError&) {
    return 0;
  }
  // An accepted plan is valid by every rule, so the estimators give sane numbers for it.
  const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  const planner::MemoryEstimate memory = planner::estimate_memory(config);
  if (memory.device_total < 0) fuzz::fail("estimate_memory gave a negative device_total");
  (void)planner::host_limit_bytes(plan.cluster, plan.parallel.world_size);
  const sim::StepEstimate step = sim::estimate_step(config, sim::layout_shapes(plan.cluster, plan.parallel));
  if (!std::isfinite(step.step_time_s) || step.step_time_s <= 0 || !std::isfinite(step.tokens_per_s))
    fuzz::fail("estimate_step gave a step time that is not a positive finite number");
  for (const Framework* f : all_frameworks()) {
    if (!f->export_launch) continue;
    try {
      (void)launch::export_launch(plan, f->target, path);
    } catch (const InputError&) {
      // A plan this framework does not run as laid out.
    }
  }
  // What it writes reads back as the same plan.
  try {
    if (plan_from_json(parse_json_text(plan_to_text(plan), "again"), "again") != plan)
      fuzz::fail("an accepted plan reads back different after plan_to_text");
  } catch (const InputError& e) {
    fuzz::fail("an accepted plan is refused after plan_to_text: " + e.lines().front());
  }
  return 0;
}
