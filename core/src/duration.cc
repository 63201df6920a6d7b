#include "moeplan/core/duration.h"

#include <cctype>
#include <vector>

#include "moeplan/core/errors.h"

namespace moeplan {

namespace {

// The digits at text[at..], advancing `at`; -1 when there are none or too many.
int64_t digits(const std::string& text, size_t& at) {
  const size_t begin = at;
  int64_t value = 0;
  while (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at])) && at - begin < 9)
    value = value * 10 + (text[at++] - '0');
  if (at == begin || (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at])))) return -1;
  return value;
}

int64_t slurm_form(const std::string& text) {
  // [D-]HH:MM:SS or MM:SS, as sbatch --time takes them.
  size_t at = 0;
  int64_t days = 0;
  if (const size_t dash = text.find('-'); dash != std::string::npos) {
    days = digits(text, at);
    if (days < 0 || at != dash) return -1;
    ++at;
  }
  std::vector<int64_t> parts;
  while (true) {
    const int64_t v = digits(text, at);
    if (v < 0) return -1;
    parts.push_back(v);
    if (at == text.size()) break;
    if (text[at++] != ':') return -1;
  }
  if (parts.size() < 2 || parts.size() > 3) return -1;
  if (parts.size() == 2) parts.insert(parts.begin(), 0);
  if (parts[1] > 59 || parts[2] > 59) return -1;
  return ((days * 24 + parts[0]) * 60 + parts[1]) * 60 + parts[2];
}

int64_t unit_form(const std::string& text) {
  // Numbers each followed by a unit, largest first: "1h30m"; a bare number is seconds.
  size_t at = 0;
  int64_t total = 0;
  int last_rank = 4;
  while (at < text.size()) {
    const int64_t v = digits(text, at);
    if (v < 0) return -1;
    if (at == text.size()) return total == 0 && last_rank == 4 ? v : -1;
    static const std::string kUnits = "smhd";
    static constexpr int64_t kSeconds[] = {1, 60, 3600, 86400};
    const size_t rank = kUnits.find(text[at++]);
    if (rank == std::string::npos || static_cast<int>(rank) >= last_rank) return -1;
    last_rank = static_cast<int>(rank);
    total += v * kSeconds[rank];
  }
  return total;
}

}  // namespace

int64_t parse_duration_seconds(const std::string& text, const std::string& field) {
  const int64_t seconds = text.find(':') != std::string::npos ? slurm_form(text) : unit_form(text);
  if (seconds <= 0)
    throw InputError(field, {{"", "\"" + text + "\" is not a positive duration (3600, 90s, 45m, 4h, 1h30m, 2d, "
                                  "HH:MM:SS or D-HH:MM:SS)"}});
  return seconds;
}

}  // namespace moeplan
