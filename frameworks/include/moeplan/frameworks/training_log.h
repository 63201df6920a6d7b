#pragma once
// The training logs of other frameworks, read back: each framework in all_frameworks() reads
// its own lines (frameworks/src/<name>/log.cc says which); other lines are skipped. A line
// that starts like one of theirs but does not read is an error naming its number.

#include <cstdint>
#include <string>
#include <string_view>

#include "moeplan/core/training_log.h"

namespace moeplan {

// One line of a log as a framework's reader gets it, terminal colour codes removed.
struct LogLine {
  int64_t number = 0;  // 1-based
  std::string_view text;
  std::string_view origin;  // the log's name, for errors
};

// Throws InputError naming the file (and the line) when the log cannot be read, holds lines
// of more than one framework, or holds no iteration line at all.
TrainingLog read_training_log(const std::string& path);
// The same from text; `origin` names it in errors.
TrainingLog parse_training_log(std::string_view text, const std::string& origin);

}  // namespace moeplan
