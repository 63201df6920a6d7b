#pragma once
// The model being trained: a Mixtral-style decoder (Hugging Face MixtralConfig semantics).

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "moeplan/core/json_reader.h"

namespace moeplan {

// The feed-forward layer of a block (of each expert): SwiGLU, w2(silu(w1 x) * w3 x) as in
// Mixtral and Llama, or a plain two-matrix MLP, fc2(gelu(fc1 x)) as in GPT-3.
enum class Mlp : uint8_t { kSwiGlu, kGelu };
inline constexpr std::array<std::pair<std::string_view, Mlp>, 2> kMlpNames{{{"swiglu", Mlp::kSwiGlu}, {"gelu", Mlp::kGelu}}};

// The normalisation before each sub-block and at the end: RMSNorm (Mixtral, Llama) or LayerNorm
// (GPT-3, MPT). Eager PyTorch runs LayerNorm as one kernel and Hugging Face's RMSNorm as several.
enum class Norm : uint8_t { kRmsNorm, kLayerNorm };
inline constexpr std::array<std::pair<std::string_view, Norm>, 2> kNormNames{
    {{"rmsnorm", Norm::kRmsNorm}, {"layernorm", Norm::kLayerNorm}}};

// How the router scores the experts before its top-k: a softmax over them (Mixtral, Qwen,
// DeepSeek-V2), or a sigmoid of each plus a bias that only steers the choice (DeepSeek-V3's
// auxiliary-loss-free balancing).
enum class RouterScoring : uint8_t { kSoftmax, kSigmoid };
inline constexpr std::array<std::pair<std::string_view, RouterScoring>, 2> kRouterScoringNames{
    {{"softmax", RouterScoring::kSoftmax}, {"sigmoid", RouterScoring::kSigmoid}}};

struct ModelSpec {
  std::string name;
  std::string source;  // where the figures come from (model card, config.json)
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per routed expert (the feed-forward width)
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_attention_heads unless the config says otherwise
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;  // top-k
  int64_t max_position_embeddings = 0;
  double rope_theta = 1e6;
  std::optional<int64_t> sliding_window;
  double rms_norm_eps = 1e-5;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  double router_aux_loss_coef = 0.001;
  Mlp mlp = Mlp::kSwiGlu;
  Norm norm = Norm::kRmsNorm;
  // Dropout probability after attention's softmax and on each sub-block's output (GPT-3 as
  // Megatron-LM trains it: 0.1); 0 runs no dropout kernels and keeps no masks.
  double dropout = 0.0;
  // Shared experts (Qwen2-MoE, DeepSeek-V2 and V3, Llama 4): a feed-forward layer beside the
  // routed experts that every token passes through, of this width (all shared experts
  // together; 0: none). It is split like a dense model's feed-forward layer (tensor
  // parallelism), not over the expert-parallel ranks. Qwen2-MoE scales its output by a sigmoid
  // gate (hidden -> 1).
  int64_t shared_expert_intermediate_size = 0;
  bool shared_expert_gate = false;
  // RMSNorm over each head's query and key before the rotary embedding (Qwen3, OLMoE), a
  // head_dim weight each.
  bool qk_norm = false;
  // Biases on the q, k and v projections (Qwen2-MoE).
  bool qkv_bias = false;
  // Dense blocks among the MoE blocks: block i (from 0) has routed experts when i >=
  // first_dense_layers and i + moe_layer_offset is a multiple of moe_layer_step; the others
  // have one dense feed-forward layer of dense_intermediate_size (no router, no shared
  // experts). DeepSeek-V2/V3's first_k_dense_replace is first_dense_layers; Qwen2-MoE's
  // decoder_sparse_step K and Llama 4's interleave_moe_layer_step are moe_layer_step = K with
  // offset 1 (blocks K-1, 2K-1, ...). Every block has experts by default.
  int64_t first_dense_layers = 0;
  int64_t moe_layer_step = 1;
  int64_t moe_layer_offset = 0;
  int64_t dense_intermediate_size = 0;
  // Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight; DeepSeek-AI 2024,
  // arXiv:2405.04434): keys and values come up from one latent of kv_lora_rank per token, beside
  // a rotary key of qk_rope_head_dim that every head shares; queries from a latent of
  // q_lora_rank (0: straight from the hidden state). head_dim is then a query's and a key's
  // width per head (qk_nope_head_dim + qk_rope_head_dim) and v_head_dim a value's; training
  // makes every head's key and value (num_key_value_heads = num_attention_heads). 0: not MLA.
  // The router: its scoring, and group-limited routing (DeepSeek-V2/V3: the experts in
  // router_groups groups, a token's top-k taken from its best router_group_topk groups; 1: one
  // group).
  RouterScoring router_scoring = RouterScoring::kSoftmax;
  int64_t router_groups = 1;
  int64_t router_group_topk = 1;
  // The chosen experts' weights, renormalised to sum 1 per token where norm_topk_prob says so
  // (Mixtral, Qwen3-30B-A3B, DeepSeek-V3; not DeepSeekMoE, DeepSeek-V2 or Qwen2-MoE, which weight
  // each expert by its own score), times this (DeepSeek-V3's routed_scaling_factor: 2.5).
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  // Under sigmoid scoring, how far each expert's bias moves after a step, towards the experts
  // that got fewer than the mean of the step's slots (the bias update speed gamma of DeepSeek-V3:
  // 0.001, arXiv:2412.19437 section 4.2; Megatron-Core's --moe-router-bias-update-rate).
  double router_bias_update_rate = 0.001;
  int64_t kv_lora_rank = 0;
  int64_t q_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // Multi-token prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers; Liu et al. 2024,
  // arXiv:2412.19437, section 2.2): mtp_layers modules after the last block, the k-th
  // predicting the token k + 1 ahead. Each norms the previous depth's output and the embedding
  // of the token k ahead, joins them and projects 2 x hidden -> hidden, runs one more block of
  // the last block's kind (an MoE block), a final norm, and the shared lm head with a loss of
  // its own. They run on the last pipeline stage, which then holds the embedding as well.
  int64_t mtp_layers = 0;
  // The weight of the modules' losses, their mean over the depths added to the next-token loss
  // (Megatron-Core's --mtp-loss-scaling-factor, 0.1 by default; DeepSeek-V3 trained with 0.3,
  // then 0.1).
  double mtp_loss_weight = 0.1;
  // Attention within a window on some blocks only (Gemma, GPT-OSS): with sliding_window set,
  // every full_attention_step-th block (blocks K-1, 2K-1, ...: Megatron-Core's
  // --window-attn-skip-freq) attends over the whole sequence, the others within the window;
  // 0: every block within it.
  int64_t full_attention_step = 0;
  // GPT-OSS: a learned logit per head in each softmax (attention sinks), a bias on o_proj,
  // biases on each expert's projections and on the router, and its gate: gate x
  // sigmoid(1.702 gate) x (up + 1), both clamped at glu_limit (0: plain SwiGLU). The gate is
  // priced as SwiGLU: the same GEMMs, its clamp inside the fused activation.
  bool attention_sinks = false;
  bool output_bias = false;
  bool expert_bias = false;
  double glu_limit = 0;

  // One expert is a dense model: its feed-forward layer takes every token and has no router.
  bool dense() const { return num_experts == 1; }
  int64_t router_width() const { return dense() ? 0 : num_experts; }
  // Weight matrices of one feed-forward layer, each hidden x intermediate.
  int64_t mlp_matrices() const { return mlp == Mlp::kGelu ? 2 : 3; }
  bool shared_experts() const { return shared_expert_intermediate_size > 0; }
  bool mla() const { return kv_lora_rank > 0; }
  // A value's width per head: head_dim but under MLA.
  int64_t value_head_dim() const { return mla() ? v_head_dim : head_dim; }
  // Whether block i has routed experts (every block of a dense model counts as one: its
  // feed-forward layer is its one expert).
  // Multi-token prediction blocks (i >= num_layers) have them.
  bool moe_layer(int64_t i) const {
    return dense() || i >= num_layers || (i >= first_dense_layers && (i + moe_layer_offset) % std::max<int64_t>(1, moe_layer_step) == 0);
  }
  // Blocks with routed experts among blocks [begin, end).
  int64_t moe_layers_in(int64_t begin, int64_t end) const;
  int64_t moe_layers() const {
    return first_dense_layers == 0 && moe_layer_step == 1 ? num_layers : moe_layers_in(0, num_layers);
  }
  bool has_dense_layers() const { return moe_layers() < num_layers; }
  // Block l's row among the blocks with experts: the decoder's in order, then the multi-token
  // prediction blocks'.
  int64_t moe_row(int64_t l) const { return l < num_layers ? moe_layers_in(0, l) : moe_layers() + (l - num_layers); }
  // The keys a query sees on average over the blocks, at sequence length seq_len (causal: half
  // the sequence; within a window shorter than the sequence, the window; one block in
  // full_attention_step the whole sequence).
  double attention_context(int64_t seq_len) const;
  // Whether block `block` attends within sliding_window: every block where a window is set but
  // the full-attention ones of full_attention_step (blocks K-1, 2K-1, ...); the multi-token
  // prediction blocks (block >= num_layers) within it.
  bool windowed(int64_t block) const {
    if (!sliding_window) return false;
    if (full_attention_step <= 0 || block >= num_layers) return true;
    return (block + 1) % full_attention_step != 0;
  }
  // Every block that runs: the decoder's and the multi-token prediction ones.
  int64_t blocks() const { return num_layers + mtp_layers; }
  int64_t moe_blocks() const { return moe_layers() + mtp_layers; }

  bool operator==(const ModelSpec&) const = default;
};

// Parameter counts, by where they live in the model. Expert parameters are the only ones
// that expert parallelism partitions.
struct ParamCounts {
  int64_t embedding = 0;            // vocab x hidden
  int64_t lm_head = 0;              // vocab x hidden, 0 when tied
  int64_t final_norm = 0;           // hidden
  int64_t attention_per_layer = 0;  // q, k, v, o projections (their weights; MLA's down and up ones)
  int64_t biases_per_layer = 0;     // q, k and v biases (qkv_bias), o_proj's, the attention sinks
  int64_t norms_per_layer = 0;      // two RMSNorm weights, and q and k's (qk_norm) or MLA's latents'
  int64_t router_per_layer = 0;     // hidden x num_experts, and a bias each with expert_bias (none in a dense model)
  int64_t shared_expert_per_layer = 0;  // the shared experts' matrices and their gate
  int64_t expert = 0;               // one routed expert of one layer: w1, w2, w3 (fc1, fc2 for gelu), its biases
  int64_t dense_mlp_per_layer = 0;  // the feed-forward layer of a dense block among MoE blocks
  // Of attention's, what every tensor-parallel rank holds whole: latent attention's down
  // projections and its latents' norms (0 without latent attention).
  int64_t tensor_replicated_per_layer = 0;
  // Multi-token prediction's own weights: per module, the 2 x hidden -> hidden projection and
  // its three norms (its block is counted with the others; the embedding and head are shared).
  int64_t mtp_projection = 0;
  int64_t num_layers = 0;           // every block: the decoder's and the multi-token prediction ones
  int64_t moe_layers = 0;           // blocks with routed experts (all of them by default)
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;

  // What every block has: attention, its biases, the norms.
  int64_t common_per_layer() const { return attention_per_layer + biases_per_layer + norms_per_layer; }
  // Non-expert parameters of one MoE block, and of one dense block among them.
  int64_t dense_per_layer() const { return common_per_layer() + router_per_layer + shared_expert_per_layer; }
  int64_t dense_block() const { return common_per_layer() + dense_mlp_per_layer; }
  int64_t dense_layers() const { return num_layers - moe_layers; }
  int64_t dense() const {
    return embedding + lm_head + final_norm + mtp_projection + moe_layers * dense_per_layer() +
           dense_layers() * dense_block();
  }
  int64_t experts() const { return moe_layers * num_experts * expert; }
  // A rank's share of `params` (non-expert parameters of `layers` blocks, or of the model) under
  // a tensor split of `t`: 1/t of what the split divides, and the replicated part whole.
  double tensor_share(double params, double layers, double t) const {
    const double whole = layers * static_cast<double>(tensor_replicated_per_layer);
    return (params - whole) / t + whole;
  }
  int64_t total() const { return dense() + experts(); }
  // Parameters that one token passes through (top-k experts per MoE block).
  int64_t active() const { return dense() + moe_layers * experts_per_token * expert; }
};

// A dense block among MoE blocks as a model of its own: one expert of the dense width, no router
// and no shared experts. Its MoE sub-block is the dense block's feed-forward layer, so what
// prices or sizes an MoE sub-block prices and sizes it too.
ModelSpec dense_block_model(const ModelSpec& model);

ParamCounts count_parameters(const ModelSpec& model);

// The first of GPT-OSS's block variants the model has, as its field ("model.full_attention_step",
// "model.attention_sinks", "model.output_bias", "model.expert_bias", "model.glu_limit"), or
// nullptr: what frameworks that build other blocks refuse by name.
const char* gpt_oss_variant_field(const ModelSpec& model);

// Forward FLOPs of one token through the whole model at sequence length seq_len (matrix
// multiplies only, 2 FLOPs per multiply-add; causal attention counted at half the square).
double forward_flops_per_token(const ModelSpec& model, int64_t seq_len);

// moeplan model profile (profiles/models/*.json).
ModelSpec model_from_json(const Json& json, const std::string& origin);
// Hugging Face config.json: MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, DeepseekConfig,
// DeepseekV2Config, DeepseekV3Config, GptOssConfig, or LlamaConfig (a dense model). A field that
// changes the model's time or memory and that moeplan does not model is refused by name.
ModelSpec model_from_hf_config(const Json& json, const std::string& origin);
// Reads either format from a file: a "model_type" field marks a Hugging Face config.
ModelSpec read_model_file(const std::string& path);
Json to_json(const ModelSpec& model);
// A Hugging Face config.json of the model, which model_from_hf_config reads back as the same
// model (its name as "_name_or_path"): a Qwen3MoeConfig when the model has q/k norms, else a
// MixtralConfig; `torch_dtype` as transformers writes it ("float32", "bfloat16"). Throws
// InputError naming a field neither can say.
Json to_hf_config(const ModelSpec& model, const std::string& torch_dtype);

// Reads the fields of a model profile from r (used inside plan.json too).
ModelSpec read_model(ObjectReader& r);

}  // namespace moeplan
