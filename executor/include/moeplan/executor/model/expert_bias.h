#pragma once
// The balancing biases of a sigmoid router (DeepSeek-V3's auxiliary-loss-free balancing): one
// [experts] fp32 row per block with experts, a buffer rather than a parameter. Every rank keeps
// all of them; the trainer moves them after each step from the step's slots counted over the
// whole world (routing.h: update_expert_bias), so they stay equal on every rank, and
// checkpoints them whole beside the parameters as "buffer/<name>".

#include "moeplan/executor/libtorch.h"

#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/executor/io/checkpoint.h"

namespace moeplan::executor {

// Zeros [moe blocks, experts] fp32 under sigmoid scoring; undefined otherwise (no buffer).
torch::Tensor initial_expert_bias(const ModelSpec& spec, const torch::Device& device = torch::kCPU);

// Each row's name, by moe layer: "model.layers.<l>.block_sparse_moe.gate.e_score_correction_bias"
// of the block l that holds it (transformers' DeepseekV3 name, under moeplan's block names).
std::vector<std::string> expert_bias_names(const ModelSpec& spec);

// Appends every row as "buffer/<name>" (a copy on the host); nothing when `bias` is undefined.
void add_expert_bias(NamedTensors& tensors, const ModelSpec& spec, const torch::Tensor& bias);

// Copies every row from a checkpoint of any layout into `bias` (nothing when it is undefined).
// A row missing from `state` is reported into d when `required`, else left as it is (a Hugging
// Face folder may have none); a row of the wrong size or type is always reported.
void read_expert_bias(const SlicedState& state, const ModelSpec& spec, torch::Tensor& bias, bool required,
                      Diagnostics& d);

}  // namespace moeplan::executor
