#include "moeplan/frameworks/training_log.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "moeplan/core/errors.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan {

namespace {

// Without terminal colour codes (ESC [ ... m), which torchtitan's log lines carry.
std::string without_colours(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\x1b' && i + 1 < s.size() && s[i + 1] == '[') {
      size_t j = i + 2;
      while (j < s.size() && s[j] != 'm') ++j;
      i = j;
      continue;
    }
    out += s[i];
  }
  return out;
}

// The first framework whose reader takes the line reads it; the others never see it.
void read_line(const LogLine& line, TrainingLog& log) {
  for (const Framework* f : all_frameworks())
    if (f->read_log_line && f->read_log_line(line, log)) return;
}

std::string every_frameworks_lines() {
  std::string out;
  for (const Framework* f : all_frameworks())
    if (f->read_log_line) out += (out.empty() ? "" : ", ") + std::string(f->log_lines);
  return out;
}

}  // namespace

TrainingLog parse_training_log(std::string_view text, const std::string& origin) {
  TrainingLog log;
  int64_t number = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    ++number;
    std::string_view line = text.substr(start, end - start);
    if (line.find('\0') != std::string_view::npos)
      throw InputError(origin, {{"line " + std::to_string(number), "holds a NUL byte: not a text log"}});
    const std::string plain = without_colours(line);
    read_line({number, plain, origin}, log);
    start = end + 1;
  }
  if (log.iterations.empty())
    throw InputError(origin, {{"", "holds no iteration line of " + every_frameworks_lines()}});
  return log;
}

TrainingLog read_training_log(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, {{"", std::string("cannot open: ") + std::strerror(errno)}});
  std::ostringstream text;
  text << in.rdbuf();
  return parse_training_log(text.str(), path);
}

}  // namespace moeplan
