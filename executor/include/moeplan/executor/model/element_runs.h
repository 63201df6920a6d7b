#pragma once
// Runs of a flat tensor's elements: where a flat parameter unit's shard holds matrices that take
// weight decay, or parameters every tensor-parallel rank holds alike. A shard holds each
// parameter's elements in one run, so a few runs say what a mask of one byte per element would.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <vector>

namespace moeplan::executor {

struct ElementRun {
  int64_t begin = 0, length = 0;
};
using ElementRuns = std::vector<ElementRun>;

// Adds [begin, begin + length), joined to the last run where they touch.
inline void add_run(ElementRuns& runs, int64_t begin, int64_t length) {
  if (length <= 0) return;
  if (!runs.empty() && runs.back().begin + runs.back().length == begin)
    runs.back().length += length;
  else
    runs.push_back({begin, length});
}

// The runs where a one-dimensional bool mask is true.
inline ElementRuns runs_of(const torch::Tensor& mask) {
  ElementRuns runs;
  const torch::Tensor m = mask.to(torch::kCPU, torch::kBool).contiguous();
  const bool* p = m.data_ptr<bool>();
  for (int64_t i = 0; i < m.numel(); ++i)
    if (p[i]) add_run(runs, i, 1);
  return runs;
}

}  // namespace moeplan::executor
