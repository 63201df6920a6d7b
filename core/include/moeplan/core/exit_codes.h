#pragma once
// The moeplan program's exit codes, shared by the commands and the validation harness.

namespace moeplan {

inline constexpr int kExitOk = 0;
inline constexpr int kExitNoPlan = 1;    // no plan found, or a plan or check has problems
inline constexpr int kExitBadInput = 2;  // an input (flag, file, profile) is malformed
// `moeplan run` stopped before its last step, on SIGTERM or SIGINT or at its --stop-after time
// limit, after saving what it had trained: `--resume` continues it.
inline constexpr int kExitStopped = 3;

}  // namespace moeplan
