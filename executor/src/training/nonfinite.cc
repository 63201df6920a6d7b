#include "moeplan/executor/training/nonfinite.h"

namespace moeplan::executor {

namespace {

enum Row : int64_t { kOutputs, kParams, kGrads };

bool any_nonfinite(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 && torch::isfinite(t).logical_not().any().item<bool>();
}

std::string block_name(int64_t block, int64_t blocks) {
  if (block == 0) return "the embedding";
  if (block == blocks - 1) return "the final norm and lm head";
  return "layer " + std::to_string(block - 1);
}

}  // namespace

torch::Tensor nonfinite_blocks(int64_t layers) { return torch::zeros({3, layers + 2}, torch::kLong); }

void note_nonfinite_outputs(torch::Tensor& blocks, const torch::Tensor& nonfinite_layers) {
  if (!nonfinite_layers.defined()) return;
  blocks[kOutputs].narrow(0, 1, nonfinite_layers.size(0)) += nonfinite_layers.cpu();
}

void note_nonfinite_tensors(torch::Tensor& blocks, int64_t block, const torch::Tensor& param,
                            const torch::Tensor& grad) {
  torch::NoGradGuard no_grad;
  if (any_nonfinite(param)) blocks[kParams][block] += 1;
  if (any_nonfinite(grad)) blocks[kGrads][block] += 1;
}

std::string describe_nonfinite(const torch::Tensor& blocks) {
  const torch::Tensor counts = blocks.cpu();
  const int64_t n = counts.size(1);
  for (int64_t b = 0; b < n; ++b)
    if (counts[kParams][b].item<int64_t>() > 0) return "the parameters of " + block_name(b, n);
  for (int64_t b = 0; b < n; ++b)
    if (counts[kOutputs][b].item<int64_t>() > 0) return "the output of " + block_name(b, n) + " (forward)";
  for (int64_t b = n - 1; b >= 0; --b)
    if (counts[kGrads][b].item<int64_t>() > 0)
      return "the gradients of " + block_name(b, n) + " (the first block backward reached)";
  return "the loss";
}

}  // namespace moeplan::executor
