#pragma once
// `moeplan validate`: plans, runs and compares a matrix of configurations on this machine
// (validation_matrix in matrix.h), writes the table and figures to the output folder, and says
// how far the predictions were from what was measured.

#include <cstdint>
#include <string>

#include "moeplan/core/parallel_config.h"

namespace moeplan::validation {

struct ValidateOptions {
  std::string profile;  // a hardware profile file, usually written by `moeplan calibrate`
  std::string model = "mixtral-tiny";
  std::string profiles;
  std::string data;
  std::string out = "validation";
  int64_t ranks = 0;  // 0: the profile's gpus_per_node
  int64_t steps = 8;
  int64_t rounds = 0;  // 0: 3, or 1 with quick
  int64_t seq_len = 256;
  int64_t global_batch_tokens = 4096;
  Precision precision = Precision::kFp32;
  bool quick = false;
  bool check = false;
  double max_median_error = 0.10, max_worst_error = 0.20, max_memory_error = 0.15, min_kendall = 0.8;
};

// Prints the table; returns an exit code (moeplan/core/exit_codes.h): with check, kExitNoPlan when
// a bound is broken.
int run_validation(const ValidateOptions& options);

}  // namespace moeplan::validation
