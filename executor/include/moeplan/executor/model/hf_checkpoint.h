#pragma once
// Hugging Face checkpoints: a moeplan checkpoint written as the folder transformers loads as
// MixtralForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM (to_hf_config: config.json,
// safetensors shards
// named model-0000k-of-0000n.safetensors with "format": "pt" metadata, and
// model.safetensors.index.json mapping every tensor to its shard). Parameter shapes are Hugging
// Face's already and names Mixtral's (mixtral.h, renamed for Qwen3-MoE by hf_parameter_name),
// so a parameter is its checkpoint slices put back together, in the dtype it was trained in.

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/executor/io/checkpoint.h"

namespace moeplan::executor {

// A parameter's name in the model's Hugging Face folder: moeplan names its parameters as
// MixtralForCausalLM does (and the q/k norms as Qwen3MoeForCausalLM, latent attention and the
// multi-token prediction blocks as DeepseekV3ForCausalLM); Qwen3-MoE and DeepSeek-V3 call the
// sparse block "mlp" and the w1, w3 and w2 of an expert, a shared expert or a dense block
// gate_proj, up_proj and down_proj. A sigmoid router's balancing biases are
// "mlp.gate.e_score_correction_bias" there, written in fp32 and read where the folder has them.
std::string hf_parameter_name(const ModelSpec& model, const std::string& name);

struct HfExport {
  std::string checkpoint;          // the step folder exported
  int64_t step = 0;
  std::vector<std::string> files;  // written, relative to the output folder
  int64_t tensors = 0;
  int64_t bytes = 0;               // tensor data
};

// `checkpoint` is a step folder (with manifest.json), a checkpoints folder or a run folder
// (their newest step). `out_dir` must not hold a checkpoint already. Shards hold whole tensors,
// in the model's order, up to `max_shard_bytes` each (one larger tensor gets a shard alone).
// Throws InputError naming the file or the field at fault.
HfExport export_hf_checkpoint(const std::string& checkpoint, const std::string& out_dir,
                              int64_t max_shard_bytes = int64_t{5} << 30);

// The start of a run from a Hugging Face Mixtral or Qwen3-MoE folder (`run --init-from DIR`):
// config.json must describe `model` (every shape field equal), and each parameter in `wanted`
// (moeplan's names; all when null) is read from the shard the index (or the single
// model.safetensors) names, and only those tensors. Each must have the parameter's shape and a
// floating dtype (F32, BF16, F16, and the one config.json's torch_dtype names); it is converted
// to `dtype`. The state holds
// "param/<name>" and zero AdamW moments "exp_avg/<name>", "exp_avg_sq/<name>" in `dtype`, for
// the trainers' load_state at step 0. Throws InputError naming the file, tensor or field.
SlicedState read_hf_parameters(const std::string& dir, const ModelSpec& model, torch::ScalarType dtype,
                               const std::set<std::string>* wanted = nullptr);

}  // namespace moeplan::executor
