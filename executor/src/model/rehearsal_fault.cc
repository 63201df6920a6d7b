#include "moeplan/executor/model/rehearsal_fault.h"

#include <array>
#include <cstdlib>
#include <utility>

#include "moeplan/core/errors.h"

namespace moeplan::executor {

namespace {

constexpr std::array<std::pair<std::string_view, RehearsalFault>, 3> kFaults{{
    {"expert-on-wrong-rank", RehearsalFault::kExpertOnWrongRank},
    {"shard-off-by-one", RehearsalFault::kShardOffByOne},
    {"unreduced-gradient", RehearsalFault::kUnreducedGradient},
}};

}  // namespace

std::string_view name_of(RehearsalFault fault) {
  for (const auto& [name, f] : kFaults)
    if (f == fault) return name;
  return "";
}

RehearsalFault rehearsal_fault_named(std::string_view name, const std::string& origin) {
  if (name.empty()) return RehearsalFault::kNone;
  for (const auto& [known, f] : kFaults)
    if (known == name) return f;
  std::string known;
  for (const auto& [each, f] : kFaults) known += (known.empty() ? "" : ", ") + std::string(each);
  throw InputError(origin, {{"", "= " + std::string(name) + " names no fault a rehearsal can plant (" + known + ")"}});
}

RehearsalFault rehearsal_fault_from_environment() {
  const char* value = std::getenv(kRehearsalFaultVariable);
  return rehearsal_fault_named(value == nullptr ? "" : value, kRehearsalFaultVariable);
}

}  // namespace moeplan::executor
