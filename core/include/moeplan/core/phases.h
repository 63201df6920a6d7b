#pragma once
// The phases of a step that a simulated and a measured run share, by the names their traces and
// reports use: one list for the simulator, the executor, the trace tools and the comparisons.

#include <array>
#include <string_view>

namespace moeplan::phase {

inline constexpr std::string_view kForward = "forward";
inline constexpr std::string_view kBackward = "backward";
inline constexpr std::string_view kOptimizer = "optimizer";
inline constexpr std::string_view kCopy = "copy";  // offloaded activations out and back
// Time inside collectives, by kind.
inline constexpr std::array<std::string_view, 4> kCollectives = {"all_to_all", "all_gather", "reduce_scatter",
                                                                  "all_reduce"};

}  // namespace moeplan::phase
