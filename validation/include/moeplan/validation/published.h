#pragma once
// `moeplan compare-published`: moeplan's prediction for published training runs beside their
// published step times, the fit part and the held-out part of the set summarised on their own.

#include <cstdint>
#include <string>
#include <vector>

namespace moeplan::validation {

struct ComparePublishedOptions {
  std::string cases;  // JSON list of published runs (docs/validation/published/cases.json)
  std::string profiles;
  bool check = false;
  double max_median_error = 0.25, max_worst_error = 0.5, max_mean_error = 1.0;
  std::vector<std::string> fit;  // kernel-model numbers fitted on the fit part, per chip
};

// Prints the table; returns an exit code (moeplan/core/exit_codes.h): with check, kExitNoPlan
// when a bound is broken.
int compare_published(const ComparePublishedOptions& options);

}  // namespace moeplan::validation
