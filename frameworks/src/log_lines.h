#pragma once
// What the frameworks' log readers share: numbers found after a key, and the two errors of a
// line (unreadable; another program's line in this one's log).

#include <optional>
#include <string>
#include <string_view>

#include "moeplan/core/training_log.h"
#include "moeplan/frameworks/training_log.h"

namespace moeplan::frameworks {

// Counts read from a log (iterations, batch sizes) stay far from int64's range.
inline constexpr double kMaxCount = 1e15;

std::string_view trim(std::string_view s);
// A finite number at the start of `s` (thousands separators allowed); nullopt otherwise.
std::optional<double> number_at(std::string_view s);
// The number after `key` in `s`; nullopt when the key is missing or no number follows.
std::optional<double> after(std::string_view s, std::string_view key);

// Throws InputError naming the log and the line: the line `what`.
[[noreturn]] void refuse(const LogLine& line, const std::string& what);
// Records that `log` is `source`'s, or throws naming the line when it is another's.
void claim(TrainingLog& log, const LogSource& source, const LogLine& line);

}  // namespace moeplan::frameworks
