#include "log_lines.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "moeplan/core/errors.h"

namespace moeplan::frameworks {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<double> number_at(std::string_view s) {
  std::string digits;
  for (char c : trim(s)) {
    if (c == ',') continue;
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E')
      digits += c;
    else
      break;
  }
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<double> after(std::string_view s, std::string_view key) {
  const size_t at = s.find(key);
  if (at == std::string_view::npos) return std::nullopt;
  return number_at(s.substr(at + key.size()));
}

void refuse(const LogLine& line, const std::string& what) {
  throw InputError(std::string(line.origin), {{"line " + std::to_string(line.number), what}});
}

void claim(TrainingLog& log, const LogSource& source, const LogLine& line) {
  if (!log.format)
    log.format = &source;
  else if (log.format != &source)
    refuse(line, "is a " + std::string(source.name) + " line in a " + std::string(log.format->name) +
                     " log (one run's log at a time)");
}

}  // namespace moeplan::frameworks
