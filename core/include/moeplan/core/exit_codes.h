#pragma once
// The moeplan program's exit codes, shared by the commands and the validation harness.

namespace moeplan {

inline constexpr int kExitOk = 0;
inline constexpr int kExitNoPlan = 1;    // no plan found, or a plan or check has problems
inline constexpr int kExitBadInput = 2;  // an input (flag, file, profile) is malformed

}  // namespace moeplan
