#include "moeplan/executor/model/mixtral.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cassert>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string_view>

#include "moeplan/executor/model/kernels.h"
#include "moeplan/executor/model/routing.h"

namespace moeplan::executor {

int64_t ParamInfo::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::vector<ParamInfo> mixtral_parameters(const ModelSpec& spec) {
  const int64_t h = spec.hidden_size, heads = spec.num_attention_heads, kv = spec.num_key_value_heads;
  const int64_t hd = spec.head_dim, ffn = spec.intermediate_size, layers = spec.num_layers;
  const double std = spec.initializer_range;
  std::vector<ParamInfo> p;
  auto matrix = [&](std::string name, std::vector<int64_t> shape, int64_t block, int64_t expert = -1) {
    p.push_back({std::move(name), std::move(shape), block, expert, InitKind::kNormal, std, true});
  };
  auto norm = [&](std::string name, int64_t block, int64_t width) {
    p.push_back({std::move(name), {width}, block, -1, InitKind::kOnes, 0, false});
  };
  matrix("model.embed_tokens.weight", {spec.vocab_size, h}, 0);
  // The decoder's blocks, then the multi-token prediction modules' (DeepSeek-V3's layer 61).
  for (int64_t l = 0; l < spec.blocks(); ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    const int64_t block = l + 1;
    if (l >= layers) {
      norm(prefix + "enorm.weight", block, h);
      norm(prefix + "hnorm.weight", block, h);
      matrix(prefix + "eh_proj.weight", {h, 2 * h}, block);
    }
    norm(prefix + "input_layernorm.weight", block, h);
    if (spec.mla()) {
      // DeepSeek-V2/V3's latent attention, as transformers names it.
      const int64_t rope = spec.qk_rope_head_dim, nope = hd - rope, vd = spec.v_head_dim;
      if (spec.q_lora_rank > 0) {
        matrix(prefix + "self_attn.q_a_proj.weight", {spec.q_lora_rank, h}, block);
        norm(prefix + "self_attn.q_a_layernorm.weight", block, spec.q_lora_rank);
        matrix(prefix + "self_attn.q_b_proj.weight", {heads * hd, spec.q_lora_rank}, block);
      } else {
        matrix(prefix + "self_attn.q_proj.weight", {heads * hd, h}, block);
      }
      matrix(prefix + "self_attn.kv_a_proj_with_mqa.weight", {spec.kv_lora_rank + rope, h}, block);
      norm(prefix + "self_attn.kv_a_layernorm.weight", block, spec.kv_lora_rank);
      matrix(prefix + "self_attn.kv_b_proj.weight", {heads * (nope + vd), spec.kv_lora_rank}, block);
      matrix(prefix + "self_attn.o_proj.weight", {h, heads * vd}, block);
    } else {
      matrix(prefix + "self_attn.q_proj.weight", {heads * hd, h}, block);
      matrix(prefix + "self_attn.k_proj.weight", {kv * hd, h}, block);
      matrix(prefix + "self_attn.v_proj.weight", {kv * hd, h}, block);
      matrix(prefix + "self_attn.o_proj.weight", {h, heads * hd}, block);
    }
    if (spec.qk_norm) {
      norm(prefix + "self_attn.q_norm.weight", block, hd);
      norm(prefix + "self_attn.k_norm.weight", block, hd);
    }
    norm(prefix + "post_attention_layernorm.weight", block, h);
    if (!spec.moe_layer(l)) {  // a dense block
      const int64_t width = spec.dense_intermediate_size;
      matrix(prefix + "mlp.w1.weight", {width, h}, block);
      matrix(prefix + "mlp.w2.weight", {h, width}, block);
      matrix(prefix + "mlp.w3.weight", {width, h}, block);
      continue;
    }
    matrix(prefix + "block_sparse_moe.gate.weight", {spec.num_experts, h}, block);
    for (int64_t e = 0; e < spec.num_experts; ++e) {
      const std::string expert = prefix + "block_sparse_moe.experts." + std::to_string(e) + ".";
      matrix(expert + "w1.weight", {ffn, h}, block, e);
      matrix(expert + "w2.weight", {h, ffn}, block, e);
      matrix(expert + "w3.weight", {ffn, h}, block, e);
    }
    if (spec.shared_experts()) {
      const int64_t width = spec.shared_expert_intermediate_size;
      const std::string shared = prefix + "block_sparse_moe.shared_experts.";
      matrix(shared + "w1.weight", {width, h}, block);
      matrix(shared + "w2.weight", {h, width}, block);
      matrix(shared + "w3.weight", {width, h}, block);
      if (spec.shared_expert_gate) matrix(prefix + "block_sparse_moe.shared_expert_gate.weight", {1, h}, block);
    }
    if (l >= layers) norm(prefix + "shared_head.norm.weight", block, h);
  }
  norm("model.norm.weight", spec.blocks() + 1, h);
  matrix("lm_head.weight", {spec.vocab_size, h}, spec.blocks() + 1);
  return p;
}

namespace {

// splitmix64: a full-avalanche mix, so nearby seeds and names give unrelated streams.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

TensorSplit tensor_split(const ParamInfo& info) {
  auto ends_with = [&](std::string_view suffix) {
    return info.name.size() >= suffix.size() && info.name.compare(info.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // Latent attention's up projections split by heads like q_proj; its down projections
  // (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole (Megatron-Core duplicates them).
  if (ends_with("q_proj.weight") || ends_with("k_proj.weight") || ends_with("v_proj.weight") ||
      ends_with("q_b_proj.weight") || ends_with("kv_b_proj.weight") || ends_with("w1.weight") ||
      ends_with("w3.weight") || ends_with("embed_tokens.weight") || info.name == "lm_head.weight")
    return TensorSplit::kRows;
  if (ends_with("o_proj.weight") || ends_with("w2.weight")) return TensorSplit::kColumns;
  return TensorSplit::kWhole;
}

torch::Tensor tensor_part(const torch::Tensor& whole, TensorSplit split, int64_t index, int64_t ranks) {
  if (split == TensorSplit::kWhole || ranks == 1) return whole;
  const int64_t dim = split == TensorSplit::kRows ? 0 : 1;
  const int64_t n = whole.size(dim) / ranks;
  return whole.narrow(dim, index * n, n);
}

ParamInfo tensor_part_info(const ParamInfo& info, int64_t ranks) {
  ParamInfo part = info;
  const TensorSplit split = tensor_split(info);
  if (split != TensorSplit::kWhole) part.shape[split == TensorSplit::kRows ? 0 : 1] /= ranks;
  return part;
}

uint64_t parameter_seed(uint64_t run_seed, const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ULL;  // FNV-1a over the name
  for (const unsigned char ch : name) h = (h ^ ch) * 0x100000001B3ULL;
  return mix(mix(run_seed) ^ h);
}

void initialize_parameter(torch::Tensor& t, const ParamInfo& info, uint64_t run_seed) {
  torch::NoGradGuard no_grad;
  switch (info.init) {
    case InitKind::kOnes:
      t.fill_(1.0);
      return;
    case InitKind::kNormal: {
      // Drawn in fp32 whatever the storage type, so fp32 and bf16 runs start from the same values
      // (rounded).
      auto generator = at::make_generator<at::CPUGeneratorImpl>(parameter_seed(run_seed, info.name));
      torch::Tensor values = torch::empty(info.shape, torch::kFloat);
      values.normal_(0.0, info.init_std, generator);
      t.copy_(values);
      return;
    }
  }
}

ParameterSet ParameterSet::on_meta(std::vector<ParamInfo> infos) {
  ParameterSet set;
  set.infos_ = std::move(infos);
  for (const ParamInfo& info : set.infos_)
    set.tensors_.push_back(torch::empty(info.shape, torch::TensorOptions().device(torch::kMeta)));
  return set;
}

void ParameterSet::materialize(uint64_t run_seed, torch::ScalarType dtype) {
  for (size_t i = 0; i < infos_.size(); ++i) {
    torch::Tensor t = torch::empty(infos_[i].shape, torch::TensorOptions().dtype(dtype));
    initialize_parameter(t, infos_[i], run_seed);
    tensors_[i] = t;
  }
}

void ParameterSet::move_to(const torch::Device& device) {
  for (torch::Tensor& t : tensors_) t = t.to(device);
}

void ParameterSet::check_materialized() const {
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (!tensors_[i].defined() || tensors_[i].is_meta())
      throw std::logic_error("parameter " + infos_[i].name + " is still on the meta device");
}

int64_t ParameterSet::numel() const {
  int64_t n = 0;
  for (const ParamInfo& info : infos_) n += info.numel();
  return n;
}

int64_t ParameterSet::find(const std::string& name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

void LayerWeights::bind(std::string_view role, const torch::Tensor& t, int64_t first_expert) {
  static constexpr std::string_view kExperts = "block_sparse_moe.experts.";
  if (role.substr(0, kExperts.size()) == kExperts) {
    const std::string_view rest = role.substr(kExperts.size());  // "3.w1.weight"
    const size_t dot = rest.find('.');
    const int64_t e = std::stoll(std::string(rest.substr(0, dot))) - first_expert;
    const std::string_view matrix = rest.substr(dot + 1);
    std::vector<torch::Tensor>& list = matrix == "w1.weight" ? w1 : matrix == "w2.weight" ? w2 : w3;
    if (matrix != "w1.weight" && matrix != "w2.weight" && matrix != "w3.weight")
      throw std::logic_error("no role for expert parameter " + std::string(role));
    if (e < 0) throw std::logic_error("expert parameter " + std::string(role) + " before the layer's first expert");
    if (static_cast<int64_t>(list.size()) <= e) list.resize(static_cast<size_t>(e + 1));
    list[static_cast<size_t>(e)] = t;
    return;
  }
  const std::pair<std::string_view, torch::Tensor LayerWeights::*> roles[] = {
      {"input_layernorm.weight", &LayerWeights::input_norm},
      {"self_attn.q_proj.weight", &LayerWeights::q_proj},
      {"self_attn.k_proj.weight", &LayerWeights::k_proj},
      {"self_attn.v_proj.weight", &LayerWeights::v_proj},
      {"self_attn.o_proj.weight", &LayerWeights::o_proj},
      {"self_attn.q_norm.weight", &LayerWeights::q_norm},
      {"self_attn.k_norm.weight", &LayerWeights::k_norm},
      {"self_attn.q_a_proj.weight", &LayerWeights::q_a_proj},
      {"self_attn.q_a_layernorm.weight", &LayerWeights::q_a_norm},
      {"self_attn.q_b_proj.weight", &LayerWeights::q_b_proj},
      {"self_attn.kv_a_proj_with_mqa.weight", &LayerWeights::kv_a_proj},
      {"self_attn.kv_a_layernorm.weight", &LayerWeights::kv_a_norm},
      {"self_attn.kv_b_proj.weight", &LayerWeights::kv_b_proj},
      {"post_attention_layernorm.weight", &LayerWeights::post_attention_norm},
      {"block_sparse_moe.gate.weight", &LayerWeights::router},
      {"block_sparse_moe.shared_experts.w1.weight", &LayerWeights::shared_w1},
      {"block_sparse_moe.shared_experts.w2.weight", &LayerWeights::shared_w2},
      {"block_sparse_moe.shared_experts.w3.weight", &LayerWeights::shared_w3},
      {"block_sparse_moe.shared_expert_gate.weight", &LayerWeights::shared_gate},
      {"enorm.weight", &LayerWeights::mtp_enorm},
      {"hnorm.weight", &LayerWeights::mtp_hnorm},
      {"eh_proj.weight", &LayerWeights::mtp_eh_proj},
      {"shared_head.norm.weight", &LayerWeights::mtp_head_norm},
      {"mlp.w1.weight", &LayerWeights::dense_w1},
      {"mlp.w2.weight", &LayerWeights::dense_w2},
      {"mlp.w3.weight", &LayerWeights::dense_w3}};
  for (const auto& [name, member] : roles)
    if (role == name) {
      this->*member = t;
      return;
    }
  throw std::logic_error("no role for layer parameter " + std::string(role));
}

MixtralWeights MixtralWeights::bind(const ModelSpec& spec, const std::vector<torch::Tensor>& t,
                                    const torch::Tensor& expert_bias) {
  const std::vector<ParamInfo> infos = mixtral_parameters(spec);
  assert(t.size() == infos.size() && "one tensor per parameter");
  MixtralWeights w;
  w.layers.resize(static_cast<size_t>(spec.blocks()));
  for (size_t i = 0; i < infos.size(); ++i) {
    const ParamInfo& info = infos[i];
    if (info.name == "model.embed_tokens.weight") {
      w.embed_tokens = t[i];
    } else if (info.name == "model.norm.weight") {
      w.norm = t[i];
    } else if (info.name == "lm_head.weight") {
      w.lm_head = t[i];
    } else {
      const std::string prefix = "model.layers." + std::to_string(info.block - 1) + ".";
      w.layers[static_cast<size_t>(info.block - 1)].bind(std::string_view(info.name).substr(prefix.size()), t[i]);
    }
  }
  if (expert_bias.defined())
    for (int64_t l = 0; l < spec.blocks(); ++l)
      if (spec.moe_layer(l)) w.layers[static_cast<size_t>(l)].expert_bias = expert_bias[spec.moe_row(l)];
  return w;
}

using torch::indexing::Slice;

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return fused_rms_norm(x, weight, eps);
}

Rope rope_tables(const ModelSpec& spec, int64_t seq_len, torch::ScalarType dtype, const torch::Device& device) {
  const int64_t d = spec.mla() ? spec.qk_rope_head_dim : spec.head_dim;
  const torch::Tensor exponents = torch::arange(0, d, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(d);
  const torch::Tensor inv_freq = 1.0 / torch::pow(spec.rope_theta, exponents);
  const torch::Tensor positions = torch::arange(seq_len, torch::kLong).to(torch::kFloat);
  const torch::Tensor freqs = torch::outer(positions, inv_freq);
  const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(device, dtype), emb.sin().to(device, dtype)};
}

namespace {

// DeepSeek's rotary layout (transformers' apply_rotary_pos_emb_interleave): a head's rotary
// part holds its pairs interleaved, (x0, x1), (x2, x3), ...; they are first put in halves, x0 x2
// ... then x1 x3 ..., and rotated as every other model's. [B, T, heads, d].
torch::Tensor deinterleaved(const torch::Tensor& x) {
  const int64_t d = x.size(-1);
  return x.unflatten(-1, {d / 2, 2}).transpose(-1, -2).reshape(x.sizes());
}

// Multi-head latent attention (DeepSeek-V2/V3, as transformers' DeepseekV3Attention): queries
// from a normed latent of q_lora_rank (or straight from x), keys' and values' per-head parts up
// from one normed latent of kv_lora_rank per token, beside one rotary key of qk_rope_head_dim
// that every head shares. A query and key head is its non-rotary part then its rotary part
// (head_dim wide, scaled by 1/sqrt(head_dim)); a value head is v_head_dim wide, padded with zeros
// to head_dim for the flash kernel (which takes one width) and cut back after it.
torch::Tensor latent_attention(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const Rope& rope,
                               const AttentionCore& core) {
  const int64_t b = x.size(0), t = x.size(1), heads = spec.num_attention_heads, hd = spec.head_dim;
  const int64_t rope_dim = spec.qk_rope_head_dim, nope = hd - rope_dim, vd = spec.v_head_dim;
  const torch::Tensor q = (w.q_a_proj.defined()
                               ? torch::matmul(rms_norm(torch::matmul(x, w.q_a_proj.t()), w.q_a_norm, spec.rms_norm_eps),
                                               w.q_b_proj.t())
                               : torch::matmul(x, w.q_proj.t()))
                              .view({b, t, heads, hd});
  const torch::Tensor latent = torch::matmul(x, w.kv_a_proj.t());  // [B, T, kv_lora_rank + rope]
  const torch::Tensor kv =
      torch::matmul(rms_norm(latent.narrow(-1, 0, spec.kv_lora_rank), w.kv_a_norm, spec.rms_norm_eps), w.kv_b_proj.t())
          .view({b, t, heads, nope + vd});
  const torch::Tensor q_rot = fused_rotary(deinterleaved(q.narrow(-1, nope, rope_dim)), rope.cos, rope.sin);
  const torch::Tensor k_rot = fused_rotary(
      deinterleaved(latent.narrow(-1, spec.kv_lora_rank, rope_dim).unsqueeze(2)), rope.cos, rope.sin);
  const torch::Tensor query = torch::cat({q.narrow(-1, 0, nope), q_rot}, -1).transpose(1, 2);
  const torch::Tensor key = torch::cat({kv.narrow(-1, 0, nope), k_rot.expand({b, t, heads, rope_dim})}, -1).transpose(1, 2);
  torch::Tensor value = kv.narrow(-1, nope, vd);
  if (vd < hd) value = torch::constant_pad_nd(value, {0, hd - vd});
  torch::Tensor out = core(query, key, value.transpose(1, 2));  // [B, heads, T, hd]
  if (vd < hd) out = out.narrow(-1, 0, vd);
  return torch::matmul(out.transpose(1, 2).reshape({b, t, heads * vd}), w.o_proj.t());
}

}  // namespace

torch::Tensor attention(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const Rope& rope,
                        const torch::Tensor& mask_bias) {
  return attention(spec, w, x, rope, [&mask_bias](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return flash_attention(q, k, v, mask_bias);
  });
}

torch::Tensor attention(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const Rope& rope,
                        const AttentionCore& core) {
  if (spec.mla()) return latent_attention(spec, w, x, rope, core);
  const int64_t b = x.size(0), t = x.size(1);
  const int64_t heads = spec.num_attention_heads, kv = spec.num_key_value_heads, hd = spec.head_dim;
  // Qwen3's q/k norms act on each head before the rotation.
  auto normed = [&](torch::Tensor heads_of, const torch::Tensor& weight) {
    return weight.defined() ? rms_norm(heads_of, weight, spec.rms_norm_eps) : heads_of;
  };
  const torch::Tensor q =
      fused_rotary(normed(torch::matmul(x, w.q_proj.t()).view({b, t, heads, hd}), w.q_norm), rope.cos, rope.sin)
          .transpose(1, 2);
  const torch::Tensor k =
      fused_rotary(normed(torch::matmul(x, w.k_proj.t()).view({b, t, kv, hd}), w.k_norm), rope.cos, rope.sin)
          .transpose(1, 2);
  const torch::Tensor v = torch::matmul(x, w.v_proj.t()).view({b, t, kv, hd}).transpose(1, 2);
  // Grouped-query attention: each key/value head serves heads / kv query heads, unrepeated.
  const torch::Tensor out = core(q, k, v);
  return torch::matmul(out.transpose(1, 2).reshape({b, t, heads * hd}), w.o_proj.t());
}

torch::Tensor attention_mask_bias(const ModelSpec& spec, int64_t t, torch::ScalarType dtype,
                                  const torch::Device& device) {
  if (!spec.sliding_window) return {};
  const torch::Tensor i = torch::arange(t, torch::kLong).unsqueeze(1);
  const torch::Tensor j = torch::arange(t, torch::kLong).unsqueeze(0);
  const torch::Tensor masked = (j > i) | (i - j >= *spec.sliding_window);
  return torch::zeros({t, t}, dtype).masked_fill(masked, -std::numeric_limits<float>::infinity()).to(device);
}

torch::Tensor expert_ffn(const torch::Tensor& in, const torch::Tensor& w1, const torch::Tensor& w2,
                         const torch::Tensor& w3) {
  return torch::matmul(torch::silu(torch::matmul(in, w1.t())) * torch::matmul(in, w3.t()), w2.t());
}

torch::Tensor shared_experts(const LayerWeights& w, const torch::Tensor& x) {
  const torch::Tensor out = expert_ffn(x, w.shared_w1, w.shared_w2, w.shared_w3);
  return w.shared_gate.defined() ? out * torch::sigmoid(torch::matmul(x, w.shared_gate.t())) : out;
}

int64_t expert_row_multiple(const torch::Tensor& rows) {
  // oneDNN, LibTorch's 16-bit matrix multiply on the CPU, builds and caches a kernel per shape:
  // with the rows per expert changing every step, most of its multiplies would build one (a
  // third of the speed). Rows in multiples of 64 keep to a few shapes. MKL's fp32 multiply and
  // the GPU's need none.
  return rows.device().is_cpu() && rows.element_size() < 4 ? 64 : 1;
}

torch::Tensor grouped_experts(const torch::Tensor& rows, c10::IntArrayRef rows_per_expert, const ExpertWeightsFn& weights) {
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  const int64_t multiple = expert_row_multiple(rows);
  std::vector<int64_t> padded(rows_per_expert.begin(), rows_per_expert.end());
  for (int64_t& n : padded) n = (n + multiple - 1) / multiple * multiple;
  // Padding rows (copies of row 0) are computed and dropped; the gradient of the rows kept is
  // exactly what it would be without them.
  torch::Tensor input = rows, kept;
  if (multiple > 1) {
    std::vector<int64_t> source, position;
    int64_t begin = 0, padded_begin = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = rows_per_expert[static_cast<size_t>(e)];
      for (int64_t i = 0; i < padded[static_cast<size_t>(e)]; ++i) source.push_back(i < n ? begin + i : 0);
      for (int64_t i = 0; i < n; ++i) position.push_back(padded_begin + i);
      begin += n;
      padded_begin += padded[static_cast<size_t>(e)];
    }
    input = rows.index_select(0, torch::tensor(source, torch::dtype(torch::kLong).device(rows.device())));
    kept = torch::tensor(position, torch::dtype(torch::kLong).device(rows.device()));
  }
  // Split, not sliced: the backward of a split concatenates the experts' input gradients once,
  // where each slice's would be a zero-filled copy of the whole, summed into the rest.
  const std::vector<torch::Tensor> parts = torch::split_with_sizes(input, padded);
  std::vector<torch::Tensor> outputs;
  for (int64_t e = 0; e < experts; ++e) {
    if (rows_per_expert[static_cast<size_t>(e)] == 0) continue;
    const ExpertWeights w = weights(e);
    outputs.push_back(expert_ffn(parts[static_cast<size_t>(e)], w.w1, w.w2, w.w3));
  }
  if (outputs.empty()) return rows * 0;  // still tied to the input, for collectives in backward
  const torch::Tensor out = torch::cat(outputs, 0);
  return kept.defined() ? out.index_select(0, kept) : out;
}

namespace {

// Slots of each of n bins of `index` [S] int64, on its device: bincount's counts without its
// read of the largest index back to the host (a GPU's bincount waits for it).
torch::Tensor counts_of(const torch::Tensor& index, int64_t n) {
  return torch::zeros({n}, index.options()).scatter_add_(0, index, torch::ones_like(index));
}

// A tensor the grouped kernel takes: its data on a 16-byte boundary (a view into another's
// storage may not be).
torch::Tensor aligned16(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// x [N, k] times each group's w [groups, n, k] transposed, the groups ending at offs [groups]
// int32: [N, n]. Its own backward, so the CPU's grouped kernel (whose derivative LibTorch
// does not give for this layout) and a GPU's run the same two grouped products: the input's
// gradient dy w, and the weights' dy^T x over each group's rows.
class GroupedMatmul : public torch::autograd::Function<GroupedMatmul> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& offs) {
    ctx->save_for_backward({x, w, offs});
    return at::_grouped_mm(aligned16(x), w.transpose(1, 2), offs);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1], &offs = saved[2];
    const torch::Tensor dy = aligned16(grads[0]);
    return {at::_grouped_mm(dy, w, offs), at::_grouped_mm(dy.t(), aligned16(x), offs), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor stacked_experts(const torch::Tensor& rows, const torch::Tensor& row_expert, const torch::Tensor& w13,
                              const torch::Tensor& w2) {
  const int64_t experts = w13.size(0), ffn = w2.size(2), slots = rows.size(0);
  const int64_t align = std::max<int64_t>(1, 16 / static_cast<int64_t>(rows.element_size()));
  const torch::Tensor load = counts_of(row_expert, experts);
  // As torchtitan pads them for this kernel: each group to a multiple of 16 bytes of rows, and at
  // least that many (an expert without tokens gets zero rows, not an empty group).
  const torch::Tensor padded = (torch::div(load + (align - 1), align, "floor") * align).clamp_min(align);
  const torch::Tensor ends = torch::cumsum(padded, 0);
  const torch::Tensor starts = torch::cumsum(load, 0) - load;
  // Each row's place in the padded buffer: its group's padded start plus its rank in the group.
  const torch::Tensor place = (ends - padded).index_select(0, row_expert) +
                              torch::arange(slots, row_expert.options()) - starts.index_select(0, row_expert);
  // A size the host knows without reading the loads: every group's padding at its widest (a
  // group of n rows takes at most n + align). The last group takes the rest (zero rows), so the
  // groups cover the buffer.
  const int64_t total = (slots + experts * align + align - 1) / align * align;
  const torch::Tensor offs =
      ends.index_fill(0, torch::full({1}, experts - 1, row_expert.options()), total).to(torch::kInt);
  const torch::Tensor x = torch::zeros({total, rows.size(1)}, rows.options()).index_copy(0, place, rows);
  const std::vector<torch::Tensor> h13 = GroupedMatmul::apply(x, w13, offs).split(ffn, 1);
  const torch::Tensor y = GroupedMatmul::apply(torch::silu(h13[0]) * h13[1], w2, offs);
  return y.index_select(0, place);
}

ExpertKernel resolve_expert_kernel(ExpertKernel asked, const ModelSpec& spec, const torch::Device& device,
                                   torch::ScalarType master, torch::ScalarType compute) {
  if (asked != ExpertKernel::kAuto) return asked;
  const int64_t align = 16 / static_cast<int64_t>(c10::elementSize(compute));
  const bool aligned = spec.hidden_size % align == 0 && spec.intermediate_size % align == 0;
  // bf16 (the kernel's fast path on an H100; fp16 would take its loop over the groups).
  const bool copies = master != compute && compute == torch::kBFloat16;
  return device.is_cuda() && copies && aligned ? ExpertKernel::kGrouped : ExpertKernel::kPerExpert;
}

ExpertStacks::ExpertStacks(const ModelSpec& spec, const std::vector<torch::Tensor>& tensors, torch::ScalarType type) {
  const std::vector<ParamInfo> infos = mixtral_parameters(spec);
  stacked_.assign(infos.size(), false);
  std::map<int64_t, Stack> by_block;
  for (size_t i = 0; i < infos.size(); ++i) {
    const ParamInfo& info = infos[i];
    if (info.expert < 0) continue;
    Stack& s = by_block[info.block];
    s.block = info.block;
    const std::string_view name(info.name);
    std::vector<size_t>& of = name.ends_with(".w1.weight") ? s.w1_of : name.ends_with(".w2.weight") ? s.w2_of : s.w3_of;
    if (static_cast<int64_t>(of.size()) <= info.expert) of.resize(static_cast<size_t>(info.expert + 1));
    of[static_cast<size_t>(info.expert)] = i;
    stacked_[i] = true;
  }
  torch::NoGradGuard no_grad;
  for (auto& [block, s] : by_block) {
    const torch::Tensor& w1 = tensors[s.w1_of.front()];
    const int64_t experts = static_cast<int64_t>(s.w1_of.size()), ffn = w1.size(0), hidden = w1.size(1);
    const torch::TensorOptions options = w1.options().dtype(type);
    s.w13 = torch::empty({experts, 2 * ffn, hidden}, options);
    s.w2 = torch::empty({experts, hidden, ffn}, options);
    for (int64_t e = 0; e < experts; ++e) {
      const auto j = static_cast<size_t>(e);
      s.w13[e].narrow(0, 0, ffn).copy_(tensors[s.w1_of[j]]);
      s.w13[e].narrow(0, ffn, ffn).copy_(tensors[s.w3_of[j]]);
      s.w2[e].copy_(tensors[s.w2_of[j]]);
    }
    s.w13.requires_grad_(true);
    s.w2.requires_grad_(true);
    stacks_.push_back(std::move(s));
  }
}

void ExpertStacks::bind(MixtralWeights& weights) const {
  for (const Stack& s : stacks_) {
    LayerWeights& layer = weights.layers[static_cast<size_t>(s.block - 1)];
    layer.experts_w13 = s.w13;
    layer.experts_w2 = s.w2;
  }
}

void ExpertStacks::add_gradients(std::vector<torch::Tensor>& grads) {
  torch::NoGradGuard no_grad;
  auto add = [&grads](size_t i, const torch::Tensor& g) {
    if (grads[i].defined())
      grads[i].add_(g);  // widened inside the addition where grads[i] is wider
    else
      grads[i] = g;  // a view of the stack's gradient, which it keeps
  };
  for (Stack& s : stacks_) {
    torch::Tensor& g13 = s.w13.mutable_grad();
    torch::Tensor& g2 = s.w2.mutable_grad();
    if (!g13.defined() || !g2.defined()) continue;
    const int64_t ffn = g2.size(2);
    for (size_t e = 0; e < s.w1_of.size(); ++e) {
      const auto j = static_cast<int64_t>(e);
      add(s.w1_of[e], g13[j].narrow(0, 0, ffn));
      add(s.w3_of[e], g13[j].narrow(0, ffn, ffn));
      add(s.w2_of[e], g2[j]);
    }
    g13 = torch::Tensor();
    g2 = torch::Tensor();
  }
}

namespace {

torch::Tensor sparse_moe(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const MoeConfig& moe,
                         torch::Tensor& router_logits, torch::Tensor counts, torch::Tensor dropped,
                         const std::function<ChosenExperts(const torch::Tensor&)>& replay) {
  const int64_t h = x.size(-1);
  const torch::Tensor tokens = x.reshape({-1, h});
  router_logits = torch::matmul(tokens, w.router.t());
  const ChosenExperts chosen = replay ? replay(router_logits.detach()) : ChosenExperts{};
  const RouterShape router = RouterShape::of(spec);
  const Routing r = replay ? route_to(router_logits, chosen.experts, router)
                           : route(router_logits, router, moe.load_balancing, w.expert_bias);
  counts.copy_(counts_of(r.experts.flatten(), spec.num_experts));  // what the router asked for
  const SlotList slots = slot_list(r, spec.num_experts, moe, chosen.kept);
  dropped.fill_(slots.dropped);
  const torch::Tensor weights = slots.weight.to(x.scalar_type());
  // Group the token-expert slots by expert once (a stable sort keeps tokens in order), so each
  // expert reads a contiguous slice: one gather and one scatter per layer instead of one each
  // per expert.
  const torch::Tensor order = std::get<1>(torch::sort(slots.expert, /*stable=*/c10::optional<bool>(true), /*dim=*/0));
  const torch::Tensor token_of = slots.token.index_select(0, order);
  const torch::Tensor gathered = tokens.index_select(0, token_of);
  const torch::Tensor slot_weights = weights.index_select(0, order).unsqueeze(-1);
  torch::Tensor expert_out;
  if (w.experts_w13.defined()) {
    expert_out = stacked_experts(gathered, slots.expert.index_select(0, order), w.experts_w13, w.experts_w2);
  } else {
    // The experts' row counts on the host, where the loop over experts needs them: on a GPU the
    // host waits here, with the sort and gathers above already queued.
    const torch::Tensor host_load = counts_of(slots.expert, spec.num_experts).cpu();
    expert_out = grouped_experts(
        gathered, c10::IntArrayRef(host_load.data_ptr<int64_t>(), static_cast<size_t>(spec.num_experts)),
        [&w](int64_t e) { return ExpertWeights{w.w1[e], w.w2[e], w.w3[e]}; });
  }
  const torch::Tensor out = torch::zeros_like(tokens).index_add(0, token_of, expert_out * slot_weights);
  return out.view(x.sizes());
}

}  // namespace

void note_nonfinite(ForwardResult& out, int64_t layer, const torch::Tensor& output) {
  torch::NoGradGuard no_grad;
  out.nonfinite_layers[layer] += torch::isfinite(output).logical_not().any();
}

ForwardResult mixtral_forward(const ModelSpec& spec, const MixtralWeights& w, const torch::Tensor& input_ids,
                              LoadBalancing balancing, const RouteOverride& replay) {
  MoeConfig moe;
  moe.load_balancing = balancing;
  return mixtral_forward(spec, w, input_ids, moe, replay);
}

ForwardResult mixtral_forward(const ModelSpec& spec, const MixtralWeights& w, const torch::Tensor& input_ids,
                              const MoeConfig& moe, const RouteOverride& replay) {
  const int64_t t = input_ids.size(1);
  const torch::ScalarType dtype = w.embed_tokens.scalar_type();
  const Rope rope = rope_tables(spec, t, dtype, input_ids.device());
  const torch::Tensor mask = attention_mask_bias(spec, t, dtype, input_ids.device());
  ForwardResult out;
  const torch::TensorOptions counts = torch::dtype(torch::kLong).device(input_ids.device());
  out.tokens_per_expert = torch::zeros({spec.moe_blocks(), spec.num_experts}, counts);
  out.dropped_slots = torch::zeros({spec.moe_blocks()}, counts);
  out.nonfinite_layers = torch::zeros({spec.blocks()}, counts);
  auto run_block = [&](int64_t l, torch::Tensor x) {
    const LayerWeights& layer = w.layers[static_cast<size_t>(l)];
    x = x + attention(spec, layer, rms_norm(x, layer.input_norm, spec.rms_norm_eps), rope,
                      spec.windowed(l) ? mask : torch::Tensor());
    torch::Tensor router_logits;
    std::function<ChosenExperts(const torch::Tensor&)> replay_layer;
    if (replay)
      replay_layer = [&replay, &out, l](const torch::Tensor& logits) {
        ChosenExperts chosen = replay(l, logits);
        out.top_k.push_back(chosen.top_k);
        return chosen;
      };
    const torch::Tensor normed = rms_norm(x, layer.post_attention_norm, spec.rms_norm_eps);
    if (!layer.has_experts()) {
      x = x + expert_ffn(normed, layer.dense_w1, layer.dense_w2, layer.dense_w3);
      note_nonfinite(out, l, x);
      return x;
    }
    const int64_t m = spec.moe_row(l);
    torch::Tensor y = sparse_moe(spec, layer, normed, moe, router_logits, out.tokens_per_expert[m],
                                 out.dropped_slots[m], replay_layer);
    if (layer.shared_w1.defined()) y = y + shared_experts(layer, normed);
    x = x + y;
    out.router_logits.push_back(router_logits);
    note_nonfinite(out, l, x);
    return x;
  };
  torch::Tensor x = torch::embedding(w.embed_tokens, input_ids);
  for (int64_t l = 0; l < spec.num_layers; ++l) x = run_block(l, x);
  out.logits = torch::matmul(rms_norm(x, w.norm, spec.rms_norm_eps), w.lm_head.t()).to(torch::kFloat);
  // Multi-token prediction: depth k joins the normed output of depth k - 1 (the decoder's
  // before its final norm) with the normed embedding of the token k ahead, runs its block, and
  // predicts the token k + 1 ahead through its own norm and the shared head.
  for (int64_t k = 1; k <= spec.mtp_layers; ++k) {
    const int64_t l = spec.num_layers + k - 1;
    const LayerWeights& layer = w.layers[static_cast<size_t>(l)];
    const torch::Tensor ahead = torch::embedding(w.embed_tokens, mtp_input_ids(input_ids, k));
    x = torch::matmul(torch::cat({rms_norm(ahead, layer.mtp_enorm, spec.rms_norm_eps),
                                  rms_norm(x, layer.mtp_hnorm, spec.rms_norm_eps)},
                                 -1),
                      layer.mtp_eh_proj.t());
    x = run_block(l, x);
    out.mtp_logits.push_back(
        torch::matmul(rms_norm(x, layer.mtp_head_norm, spec.rms_norm_eps), w.lm_head.t()).to(torch::kFloat));
  }
  return out;
}

torch::Tensor mtp_input_ids(const torch::Tensor& input_ids, int64_t k) {
  torch::Tensor ids = torch::zeros_like(input_ids);
  const int64_t t = input_ids.size(1);
  if (k < t) ids.narrow(1, 0, t - k).copy_(input_ids.narrow(1, k, t - k));
  return ids;
}

torch::Tensor mtp_labels(const torch::Tensor& input_ids, int64_t k) {
  torch::Tensor labels = torch::full_like(input_ids, kIgnoreLabel);
  const int64_t t = input_ids.size(1);
  if (k + 1 < t) labels.narrow(1, 0, t - k - 1).copy_(input_ids.narrow(1, k + 1, t - k - 1));
  return labels;
}

torch::Tensor next_token_labels(const torch::Tensor& input_ids) {
  torch::Tensor labels = torch::full_like(input_ids, kIgnoreLabel);
  labels.index_put_({Slice(), Slice(0, -1)}, input_ids.index({Slice(), Slice(1, torch::indexing::None)}));
  return labels;
}

LossTerms mixtral_loss(const ModelSpec& spec, const MoeConfig& moe, const ForwardResult& out,
                       const torch::Tensor& input_ids) {
  // Each position predicts the next token; the last position has none and is ignored. The
  // logits are read in place (a slice of them would be copied by the reshape).
  auto cross_entropy = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}), /*weight=*/{},
                                     at::Reduction::Mean, kIgnoreLabel, /*label_smoothing=*/0.0);
  };
  std::vector<torch::Tensor> mtp;
  for (size_t k = 0; k < out.mtp_logits.size(); ++k)
    mtp.push_back(cross_entropy(out.mtp_logits[k], mtp_labels(input_ids, static_cast<int64_t>(k) + 1)));
  return mixtral_loss_from_lm(spec, moe, out, cross_entropy(out.logits, next_token_labels(input_ids)), mtp);
}

LossTerms mixtral_loss_from_lm(const ModelSpec& spec, const MoeConfig& moe, const ForwardResult& out, torch::Tensor lm,
                               const std::vector<torch::Tensor>& mtp, const RankSum& over) {
  LossTerms loss;
  loss.lm = std::move(lm);
  loss.prediction = loss.lm;
  if (!mtp.empty()) {
    loss.mtp = torch::stack(mtp).mean();
    loss.prediction = loss.lm + spec.mtp_loss_weight * loss.mtp;
  }
  loss.aux = load_balancing_loss(out.router_logits, spec.experts_per_token, out.top_k, spec.router_scoring, over);
  loss.z = router_z_loss(out.router_logits, over);
  loss.total = loss.prediction;
  if (moe.load_balancing == LoadBalancing::kAuxLoss && moe.aux_loss_coef != 0)
    loss.total = loss.total + moe.aux_loss_coef * loss.aux;
  if (moe.z_loss_coef != 0) loss.total = loss.total + moe.z_loss_coef * loss.z;
  return loss;
}

std::vector<std::vector<int64_t>> slot_table(const torch::Tensor& counts) {
  const torch::Tensor host = counts.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(host.size(0)));
  for (size_t l = 0; l < rows.size(); ++l)
    rows[l].assign(data + static_cast<int64_t>(l) * host.size(1), data + static_cast<int64_t>(l + 1) * host.size(1));
  return rows;
}

}  // namespace moeplan::executor
