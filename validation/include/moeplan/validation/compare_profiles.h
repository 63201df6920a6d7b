#pragma once
// `moeplan compare-profiles`: how far apart two hardware profiles are, figure by figure and in
// what they predict for the validation matrix.

#include <cstdint>
#include <string>

#include "moeplan/core/parallel_config.h"

namespace moeplan::validation {

struct CompareProfilesOptions {
  std::string first, second;  // hardware profile files
  std::string model = "mixtral-tiny";
  std::string profiles;
  int64_t ranks = 0;  // 0: the first profile's gpus_per_node
  int64_t seq_len = 256;
  int64_t global_batch_tokens = 4096;
  Precision precision = Precision::kFp32;
  bool quick = false;
  int64_t top = 10;
  std::string out;  // where the plans go; empty: a temporary folder, removed
  bool check = false;
  double max_difference = 0.10;
};

// Prints both comparisons; returns an exit code (moeplan/core/exit_codes.h): with check,
// kExitNoPlan when a prediction differs by more than max_difference.
int compare_profiles(const CompareProfilesOptions& options);

}  // namespace moeplan::validation
