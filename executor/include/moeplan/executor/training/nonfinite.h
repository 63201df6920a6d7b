#pragma once
// Where the NaN or Inf of a step that went wrong began, for the message of the skipped step.
// Counted per block (0: embedding; 1..L: decoder layer l-1; L+1: final norm and lm head, as
// ParamInfo::block numbers them) over this rank's part of the model, then summed over the ranks.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <string>

namespace moeplan::executor {

// [3, layers + 2] int64 on the CPU, zero: rows are the blocks whose forward output, parameters
// and gradients held a NaN or an Inf.
torch::Tensor nonfinite_blocks(int64_t layers);

// Adds ForwardResult::nonfinite_layers (decoder layers 0..L-1) to the output row.
void note_nonfinite_outputs(torch::Tensor& blocks, const torch::Tensor& nonfinite_layers);

// Adds a parameter (or this rank's slice of it) and its gradient to the rows of `block`.
void note_nonfinite_tensors(torch::Tensor& blocks, int64_t block, const torch::Tensor& param,
                            const torch::Tensor& grad);

// The first place the counts point at: a parameter holding one (forward order: a bad weight
// loaded or left by an earlier step), else the first layer whose output did (forward order),
// else the gradients of the block backward reached first; "the loss" when none of them did.
std::string describe_nonfinite(const torch::Tensor& blocks);

}  // namespace moeplan::executor
