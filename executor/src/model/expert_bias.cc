#include "moeplan/executor/model/expert_bias.h"

namespace moeplan::executor {

namespace {
constexpr const char* kBuffer = "buffer/";
}  // namespace

torch::Tensor initial_expert_bias(const ModelSpec& spec, const torch::Device& device) {
  if (spec.router_scoring != RouterScoring::kSigmoid) return {};
  return torch::zeros({spec.moe_blocks(), spec.num_experts}, torch::dtype(torch::kFloat).device(device));
}

std::vector<std::string> expert_bias_names(const ModelSpec& spec) {
  std::vector<std::string> names;
  for (int64_t l = 0; l < spec.blocks(); ++l)
    if (spec.moe_layer(l))
      names.push_back("model.layers." + std::to_string(l) + ".block_sparse_moe.gate.e_score_correction_bias");
  return names;
}

void add_expert_bias(NamedTensors& tensors, const ModelSpec& spec, const torch::Tensor& bias) {
  if (!bias.defined()) return;
  const std::vector<std::string> names = expert_bias_names(spec);
  const torch::Tensor host = bias.detach().cpu();
  for (size_t m = 0; m < names.size(); ++m) tensors.emplace_back(kBuffer + names[m], host[static_cast<int64_t>(m)].clone());
}

void read_expert_bias(const SlicedState& state, const ModelSpec& spec, torch::Tensor& bias, bool required,
                      Diagnostics& d) {
  if (!bias.defined()) return;
  const std::vector<std::string> names = expert_bias_names(spec);
  torch::NoGradGuard no_grad;
  for (size_t m = 0; m < names.size(); ++m) {
    const std::string key = kBuffer + names[m];
    if (!state.contains(key)) {
      if (required) d.error(key, "missing from the checkpoint (the balancing bias of a sigmoid router)");
      continue;
    }
    const torch::Tensor row = state.whole(key, {spec.num_experts}, d);
    if (!row.defined()) continue;
    if (row.scalar_type() != torch::kFloat) {
      d.error(key, std::string("is ") + c10::toString(row.scalar_type()) + ", expected Float");
      continue;
    }
    bias[static_cast<int64_t>(m)].copy_(row);
  }
}

}  // namespace moeplan::executor
