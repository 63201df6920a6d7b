#pragma once
// Units used across moeplan. Quantities carry their unit in their name
// (memory_bytes, step_time_seconds, flops); these constants only spell out powers.

#include <cstdint>
#include <cstdio>
#include <string>

namespace moeplan {

inline constexpr int64_t kKiB = int64_t{1} << 10;
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;
inline constexpr double kGB = 1e9;
inline constexpr double kTera = 1e12;

// Bytes in GiB, for tables.
inline double in_gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }

// Bytes as "12.3 GiB", for messages.
inline std::string gib_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / static_cast<double>(kGiB));
  return text;
}
inline std::string gib_text(int64_t bytes) { return gib_text(static_cast<double>(bytes)); }

// Bytes per element of the number formats the model and optimizer use.
inline constexpr int64_t kBytesBf16 = 2;
inline constexpr int64_t kBytesFp32 = 4;

}  // namespace moeplan
