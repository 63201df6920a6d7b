// Routing profiles (core/routing_profile.h), as `--routing FILE` reads them: read, drawn from as
// the simulator draws a step, and read back from what they write.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/routing_profile.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("routing.json", data, size);
  RoutingProfile profile;
  try {
    profile = read_routing_profile(path);
  } catch (const InputError&) {
    return 0;
  }
  try {
    if (!(routing_profile_from_json(routing_profile_json(profile), "again") == profile))
      fuzz::fail("a routing profile reads back different from what it writes");
  } catch (const InputError& e) {
    fuzz::fail("an accepted routing profile is refused after writing: " + e.lines().front());
  }
  // The shape it is drawn for: its own where measured, 64 experts over 4 layers otherwise.
  const bool measured = profile.kind == RoutingKind::kMeasured;
  const int64_t experts = measured ? profile.num_experts : 64;
  const int64_t layers = measured ? profile.layers() : 4;
  if (!routing_mismatches(profile, experts, measured ? profile.experts_per_token : 2, layers, "--routing").empty())
    return 0;
  RoutingRng rng(1);
  for (const auto& layer : draw_step_routing(profile, experts, layers, 3, 100, rng))
    for (const auto& shares : layer) {
      const double total = std::accumulate(shares.begin(), shares.end(), 0.0);
      if (!(std::abs(total - 1.0) < 1e-9)) fuzz::fail("a micro-batch's shares add up to " + std::to_string(total));
      for (double x : shares)
        if (!(x >= 0)) fuzz::fail("a negative share");
    }
  return 0;
}
