#pragma once
// A test hook: a fault planted into a rehearsal's layout, so that tests can show that each
// check of `moeplan run --rehearse` catches what it is for (docs/executor.md, "Rehearsal").
//
// Set MOEPLAN_REHEARSAL_FAULT in the environment of `moeplan run plan.json --rehearse`: the
// rehearsal says so in its output and rehearsal.json, and passes the fault to its layout's runs
// (RunOptions::planted_fault, which only a run that records its routing for a rehearsal takes).
// Nothing else reads the variable, so a training run never plants a fault, whatever its
// environment holds.

#include <cstdint>
#include <string>
#include <string_view>

namespace moeplan::executor {

enum class RehearsalFault : uint8_t {
  kNone,
  // Expert 0 and the first expert of the second expert rank trade places: tokens routed to
  // either are computed by the other's weights, and train them (needs E > 1).
  kExpertOnWrongRank,
  // Rank 0 writes every slice of its checkpoint shard offset by one element (rotated by one).
  kShardOffByOne,
  // The dense replica group of the first pipeline stage's first shard and tensor coordinate
  // leaves the gradient of its first block's dense unit unreduced (needs R x E > 1).
  kUnreducedGradient,
};

inline constexpr char kRehearsalFaultVariable[] = "MOEPLAN_REHEARSAL_FAULT";

// "expert-on-wrong-rank", "shard-off-by-one", "unreduced-gradient"; "" for kNone.
std::string_view name_of(RehearsalFault fault);

// The fault of that name (kNone for ""). Throws InputError naming `origin` for any other name.
RehearsalFault rehearsal_fault_named(std::string_view name, const std::string& origin);

// The fault MOEPLAN_REHEARSAL_FAULT names (kNone when it is unset or empty).
RehearsalFault rehearsal_fault_from_environment();

}  // namespace moeplan::executor
