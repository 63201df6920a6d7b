#include "moeplan/core/model_spec.h"

#include <algorithm>
#include <array>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/rules.h"

namespace moeplan {

namespace {
// Bounds that keep every derived count well inside int64 (checked again by the model rules).
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

}  // namespace

int64_t ModelSpec::moe_layers_in(int64_t begin, int64_t end) const {
  begin = std::max<int64_t>(begin, 0);
  if (end <= begin) return 0;
  if (dense()) return end - begin;
  const int64_t from = std::max(begin, first_dense_layers);
  if (end <= from) return 0;
  // Multiples of the step among [from + offset, end + offset).
  const int64_t step = std::max<int64_t>(1, moe_layer_step);
  auto multiples_below = [&](int64_t x) { return (x + step - 1) / step; };  // in [0, x), x >= 0
  return multiples_below(end + moe_layer_offset) - multiples_below(from + moe_layer_offset);
}

double ModelSpec::attention_context(int64_t seq_len) const {
  const double full = static_cast<double>(seq_len) / 2.0;
  if (!sliding_window || *sliding_window >= seq_len) return full;
  const double window = static_cast<double>(*sliding_window);
  if (full_attention_step <= 0) return window;
  // One block in full_attention_step attends over the whole sequence: the pattern's share, the
  // same for a pipeline stage's blocks as for the model's (exact where the step divides them).
  const double share = 1.0 / static_cast<double>(full_attention_step);
  return share * full + (1.0 - share) * window;
}

ModelSpec dense_block_model(const ModelSpec& m) {
  ModelSpec d = m;
  d.num_experts = 1;
  d.experts_per_token = 1;
  d.intermediate_size = m.dense_intermediate_size;
  d.shared_expert_intermediate_size = 0;
  d.shared_expert_gate = false;
  d.first_dense_layers = 0;
  d.moe_layer_step = 1;
  d.moe_layer_offset = 0;
  d.dense_intermediate_size = 0;
  return d;
}

ParamCounts count_parameters(const ModelSpec& m) {
  ParamCounts p;
  const int64_t q_width = m.num_attention_heads * m.head_dim;
  const int64_t kv_width = m.num_key_value_heads * m.head_dim;
  p.embedding = m.vocab_size * m.hidden_size;
  p.lm_head = m.tie_word_embeddings ? 0 : m.vocab_size * m.hidden_size;
  p.final_norm = m.hidden_size;
  // q: hidden -> heads*head_dim, k and v: hidden -> kv_heads*head_dim, o: heads*head_dim -> hidden.
  p.attention_per_layer = 2 * m.hidden_size * q_width + 2 * m.hidden_size * kv_width;
  p.biases_per_layer = (m.qkv_bias ? q_width + 2 * kv_width : 0) + (m.output_bias ? m.hidden_size : 0) +
                       (m.attention_sinks ? m.num_attention_heads : 0);
  p.norms_per_layer = 2 * m.hidden_size + (m.qk_norm ? 2 * m.head_dim : 0);
  if (m.mla()) {
    // q: hidden -> q_lora -> heads*head_dim (or hidden -> heads*head_dim); kv: hidden ->
    // kv_lora + rope, kv_lora -> heads*(head_dim - rope + v_head_dim); o: heads*v_head_dim ->
    // hidden; an RMSNorm on each latent.
    const int64_t q = m.q_lora_rank > 0 ? m.hidden_size * m.q_lora_rank + m.q_lora_rank * q_width
                                        : m.hidden_size * q_width;
    const int64_t kv = m.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim) +
                       m.kv_lora_rank * m.num_attention_heads * (m.head_dim - m.qk_rope_head_dim + m.v_head_dim);
    p.attention_per_layer = q + kv + m.num_attention_heads * m.v_head_dim * m.hidden_size;
    p.norms_per_layer = 2 * m.hidden_size + m.q_lora_rank + m.kv_lora_rank;
    p.tensor_replicated_per_layer = m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) +
                                    m.q_lora_rank + m.kv_lora_rank;
  }
  p.router_per_layer = (m.hidden_size + (m.expert_bias ? 1 : 0)) * m.router_width();
  p.shared_expert_per_layer =
      m.mlp_matrices() * m.hidden_size * m.shared_expert_intermediate_size + (m.shared_expert_gate ? m.hidden_size : 0);
  p.expert = m.mlp_matrices() * m.hidden_size * m.intermediate_size +
             (m.expert_bias ? (m.mlp_matrices() - 1) * m.intermediate_size + m.hidden_size : 0);
  p.dense_mlp_per_layer = m.mlp_matrices() * m.hidden_size * m.dense_intermediate_size;
  // Each multi-token prediction module: the 2h -> h projection, the norms of its two inputs
  // and its final norm.
  p.mtp_projection = m.mtp_layers * (2 * m.hidden_size * m.hidden_size + 3 * m.hidden_size);
  p.num_layers = m.blocks();
  p.moe_layers = m.moe_blocks();
  p.num_experts = m.num_experts;
  p.experts_per_token = m.experts_per_token;
  return p;
}

const char* gpt_oss_variant_field(const ModelSpec& m) {
  if (m.full_attention_step > 0) return "model.full_attention_step";
  if (m.attention_sinks) return "model.attention_sinks";
  if (m.output_bias) return "model.output_bias";
  if (m.expert_bias) return "model.expert_bias";
  if (m.glu_limit > 0) return "model.glu_limit";
  return nullptr;
}

double forward_flops_per_token(const ModelSpec& m, int64_t seq_len) {
  const ParamCounts p = count_parameters(m);
  const double h = static_cast<double>(m.hidden_size);
  const double layers = static_cast<double>(m.blocks());
  // Matrix multiplies: 2 FLOPs per weight a token touches (embedding lookup is not a GEMM);
  // each multi-token prediction module adds its projection and a pass through the lm head.
  const double weights =
      static_cast<double>(p.attention_per_layer) * layers +
      static_cast<double>(p.router_per_layer + p.shared_expert_per_layer + m.experts_per_token * p.expert) *
          static_cast<double>(p.moe_layers) +
      static_cast<double>(p.dense_mlp_per_layer) * static_cast<double>(p.dense_layers()) +
      static_cast<double>(m.vocab_size) * h * static_cast<double>(1 + m.mtp_layers) +
      static_cast<double>(m.mtp_layers) * 2.0 * h * h;
  // Scores and weighted sum: 2 GEMMs of (seq x head_dim x context) per head; causal masking
  // halves the average context. A sliding window caps it.
  const double context = m.attention_context(seq_len);
  const double attention = 2.0 *
                           static_cast<double>(m.num_attention_heads * m.head_dim +
                                               m.num_attention_heads * m.value_head_dim()) *
                           context * layers;
  return 2.0 * weights + attention;
}

// head_dim when the file does not give it: hidden_size / heads, as Hugging Face computes it.
static int64_t derived_head_dim(const ModelSpec& m, ObjectReader& r, const char* heads_field) {
  const int64_t head_dim = m.num_attention_heads > 0 ? m.hidden_size / m.num_attention_heads : 0;
  if (head_dim < 1 && r.diagnostics().empty())
    r.diagnostics().error(r.path_of(heads_field), "= " + std::to_string(m.num_attention_heads) +
                                                      " exceeds hidden_size = " + std::to_string(m.hidden_size) +
                                                      ", so head_dim = hidden_size / heads would be 0; give head_dim");
  return std::max<int64_t>(head_dim, 1);
}

// Shared experts sit beside routed ones, and a gate needs something to scale. `width` and
// `gate` are the file's names for the two fields.
static void check_shared_experts(const ModelSpec& m, ObjectReader& r, const char* width, const char* gate) {
  if (!r.diagnostics().empty()) return;
  if (m.shared_experts() && m.dense())
    r.diagnostics().error(r.path_of(width), "= " + std::to_string(m.shared_expert_intermediate_size) +
                                                " in a dense model (one expert): give its width as intermediate_size");
  if (m.shared_expert_gate && !m.shared_experts())
    r.diagnostics().error(r.path_of(gate), "= true without shared experts (" + std::string(width) + " = 0)");
}

ModelSpec read_model(ObjectReader& r) {
  ModelSpec m;
  m.name = r.string("name");
  m.source = r.string("source", "");
  m.vocab_size = r.integer("vocab_size", 1, kMaxDim);
  m.hidden_size = r.integer("hidden_size", 1, kMaxDim);
  m.intermediate_size = r.integer("intermediate_size", 1, kMaxDim);
  m.num_layers = r.integer("num_layers", 1, kMaxLayers);
  m.num_attention_heads = r.integer("num_attention_heads", 1, kMaxDim);
  m.num_key_value_heads = r.integer("num_key_value_heads", 1, kMaxDim);
  if (r.has("head_dim")) {
    m.head_dim = r.integer("head_dim", 1, kMaxDim);
  } else {
    m.head_dim = derived_head_dim(m, r, "num_attention_heads");
  }
  m.num_experts = r.integer("num_experts", 1, kMaxExperts);
  m.experts_per_token = r.integer("experts_per_token", 1, kMaxExperts);
  m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions);
  m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e6);
  m.sliding_window = r.nullable_integer("sliding_window", 1, kMaxPositions);
  m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-5);
  m.initializer_range = r.number("initializer_range", 0.0, 10.0, 0.02);
  m.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  m.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.0, 1e3, 0.001);
  m.mlp = r.choice<Mlp>("mlp", kMlpNames, Mlp::kSwiGlu);
  m.norm = r.choice<Norm>("norm", kNormNames, Norm::kRmsNorm);
  m.dropout = r.number("dropout", 0.0, 0.99, 0.0);
  m.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", 0, kMaxDim, 0);
  m.shared_expert_gate = r.boolean("shared_expert_gate", false);
  m.qk_norm = r.boolean("qk_norm", false);
  m.qkv_bias = r.boolean("qkv_bias", false);
  m.first_dense_layers = r.integer("first_dense_layers", 0, kMaxLayers, 0);
  m.moe_layer_step = r.integer("moe_layer_step", 1, kMaxLayers, 1);
  m.moe_layer_offset = r.integer("moe_layer_offset", 0, kMaxLayers, 0);
  m.dense_intermediate_size = r.integer("dense_intermediate_size", 0, kMaxDim, 0);
  m.router_scoring = r.choice<RouterScoring>("router_scoring", kRouterScoringNames, RouterScoring::kSoftmax);
  m.router_groups = r.integer("router_groups", 1, kMaxExperts, 1);
  m.router_group_topk = r.integer("router_group_topk", 1, kMaxExperts, 1);
  m.norm_topk_prob = r.boolean("norm_topk_prob", true);
  m.routed_scaling_factor = r.number("routed_scaling_factor", 1e-6, 1e6, 1.0);
  m.router_bias_update_rate = r.number("router_bias_update_rate", 0.0, 1.0, 0.001);
  m.kv_lora_rank = r.integer("kv_lora_rank", 0, kMaxDim, 0);
  m.q_lora_rank = r.integer("q_lora_rank", 0, kMaxDim, 0);
  m.qk_rope_head_dim = r.integer("qk_rope_head_dim", 0, kMaxDim, 0);
  m.v_head_dim = r.integer("v_head_dim", 0, kMaxDim, 0);
  m.mtp_layers = r.integer("mtp_layers", 0, kMaxLayers, 0);
  m.mtp_loss_weight = r.number("mtp_loss_weight", 0.0, 1e3, 0.1);
  m.full_attention_step = r.integer("full_attention_step", 0, kMaxLayers, 0);
  m.attention_sinks = r.boolean("attention_sinks", false);
  m.output_bias = r.boolean("output_bias", false);
  m.expert_bias = r.boolean("expert_bias", false);
  m.glu_limit = r.number("glu_limit", 0.0, 1e6, 0.0);
  check_shared_experts(m, r, "shared_expert_intermediate_size", "shared_expert_gate");
  return m;
}

static void check_model_rules(const ModelSpec& m, Diagnostics& d, const std::string& prefix) {
  for (const Violation& v : validate_model(m))
    d.error(prefix.empty() ? v.field : prefix + "." + v.field, v.message);
}

ModelSpec model_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  ObjectReader r(json, "", d);
  ModelSpec m;
  if (r.ok()) {
    r.integer("schema_version", 1, 1, 1);
    m = read_model(r);
    r.finish();
  }
  if (d.empty()) check_model_rules(m, d, "");
  d.throw_if_any(origin);
  return m;
}

namespace {

// The Hugging Face architectures moeplan reads, by model_type.
// Kimi K2's config says kimi_k2 for DeepSeek-V3's architecture (its auto_map: DeepseekV3Config).
enum class HfType : uint8_t { kMixtral, kLlama, kQwen2Moe, kQwen3Moe, kDeepseek, kDeepseekV2, kDeepseekV3, kGptOss };
constexpr std::array<std::pair<std::string_view, HfType>, 9> kHfTypes{{{"mixtral", HfType::kMixtral},
                                                                        {"llama", HfType::kLlama},
                                                                        {"qwen2_moe", HfType::kQwen2Moe},
                                                                        {"qwen3_moe", HfType::kQwen3Moe},
                                                                        {"deepseek", HfType::kDeepseek},
                                                                        {"deepseek_v2", HfType::kDeepseekV2},
                                                                        {"deepseek_v3", HfType::kDeepseekV3},
                                                                        {"gpt_oss", HfType::kGptOss},
                                                                        {"kimi_k2", HfType::kDeepseekV3}}};

// Fields of PretrainedConfig and of the architectures above that change neither a step's time
// nor its memory (token ids, caching, output switches, inference-only rope scaling, dtypes,
// routing details that cost the same). Anything else a reader does not ask for is reported: a
// misspelt field would otherwise silently take its default, and a field moeplan does not model
// would be planned without.
constexpr std::array kHfAccepted = {
    "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
    "output_router_logits", "router_jitter_noise", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tokenizer_class", "rope_scaling",
    "_attn_implementation", "_commit_hash", "quantization_config", "auto_map"};

// The config's own name of the field moeplan calls `ours`, for messages.
std::string_view hf_field(HfType type, std::string_view ours) {
  const bool qwen = type == HfType::kQwen2Moe || type == HfType::kQwen3Moe;
  const bool deepseek = type == HfType::kDeepseek || type == HfType::kDeepseekV2 || type == HfType::kDeepseekV3;
  if (ours == "experts_per_token") return "num_experts_per_tok";
  if (ours == "router_groups" && deepseek) return "n_group";
  if (ours == "router_group_topk" && deepseek) return "topk_group";
  if (ours == "head_dim" && (type == HfType::kDeepseekV2 || type == HfType::kDeepseekV3)) return "qk_nope_head_dim";
  if (ours == "num_layers") return "num_hidden_layers";
  if (ours == "num_experts") return qwen ? "num_experts" : deepseek ? "n_routed_experts" : "num_local_experts";
  if (ours == "intermediate_size" && (qwen || deepseek)) return "moe_intermediate_size";
  if (ours == "dense_intermediate_size" && (qwen || deepseek)) return "intermediate_size";
  if ((ours == "moe_layer_step" || ours == "moe_layer_offset") && qwen) return "decoder_sparse_step";
  if ((ours == "moe_layer_step" || ours == "moe_layer_offset") && deepseek) return "moe_layer_freq";
  if (ours == "first_dense_layers" && deepseek) return "first_k_dense_replace";
  if (ours == "mtp_layers" && deepseek) return "num_nextn_predict_layers";
  if (ours == "full_attention_step") return "layer_types";
  if (ours == "glu_limit") return "swiglu_limit";
  return ours;
}

// What Qwen2-MoE and Qwen3-MoE configs say beyond the common fields: fine-grained routed
// experts (moe_intermediate_size; intermediate_size is the width of the dense blocks that
// decoder_sparse_step places), Qwen2-MoE's gated shared expert and q/k/v biases, Qwen3's q/k
// norms.
void read_qwen_moe(ModelSpec& m, ObjectReader& r, bool qwen3) {
  Diagnostics& d = r.diagnostics();
  m.num_experts = r.integer("num_experts", 1, kMaxExperts, qwen3 ? 128 : 60);
  m.experts_per_token = r.integer("num_experts_per_tok", 1, kMaxExperts, qwen3 ? 8 : 4);
  m.intermediate_size = r.integer("moe_intermediate_size", 1, kMaxDim, qwen3 ? 768 : 1408);
  const int64_t dense_width = r.integer("intermediate_size", 1, kMaxDim, qwen3 ? 6144 : 5632);
  m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 32768);
  m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e4);
  m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
  m.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.0, 1e3, 0.001);
  // Both config classes weight each chosen expert by its own probability unless told otherwise.
  m.norm_topk_prob = r.boolean("norm_topk_prob", false);
  // Block i has experts when (i + 1) % decoder_sparse_step == 0; the others are dense blocks
  // of intermediate_size.
  m.moe_layer_step = r.integer("decoder_sparse_step", 1, kMaxLayers, 1);
  m.moe_layer_offset = 1 % m.moe_layer_step;
  if (m.has_dense_layers()) m.dense_intermediate_size = dense_width;
  if (const Json* dense = r.child("mlp_only_layers", true); dense && !dense->is_null() &&
                                                            !(dense->is_array() && dense->empty()))
    d.error("mlp_only_layers", "= " + (dense->is_array() ? dense->dump() : describe_json(*dense)) +
                                   ": dense layers among MoE layers are not modelled yet");
  // The window applies only where use_sliding_window says so, to the layers from
  // max_window_layers on.
  if (r.boolean("use_sliding_window", false))
    d.error("use_sliding_window", "= true: a sliding window on some layers is not modelled yet");
  r.ignore("sliding_window");
  r.ignore("max_window_layers");
  if (qwen3) {
    m.qk_norm = true;
    if (r.boolean("attention_bias", false))
      d.error("attention_bias", "= true: biases on Qwen3's attention projections are not modelled");
  } else {
    m.qkv_bias = r.boolean("qkv_bias", true);
    m.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", 0, kMaxDim, 5632);
    m.shared_expert_gate = m.shared_experts();
    check_shared_experts(m, r, "shared_expert_intermediate_size", "shared_expert_intermediate_size");
  }
}

// DeepSeekMoE (model_type "deepseek", DeepseekForCausalLM; Dai et al. 2024) and DeepSeek-V2 and
// V3 (deepseek_v2, deepseek_v3): fine-grained routed experts (moe_intermediate_size),
// n_shared_experts shared experts of the same width beside them, the first
// first_k_dense_replace blocks dense (intermediate_size), then every moe_layer_freq-th block
// counted from block 0 with experts. DeepSeekMoE has multi-head attention; V2 and V3 latent
// attention, group-limited routing, and V3 sigmoid scores with a balancing bias and
// multi-token prediction (num_nextn_predict_layers).
void read_deepseek(ModelSpec& m, ObjectReader& r, HfType type) {
  Diagnostics& d = r.diagnostics();
  const bool v1 = type == HfType::kDeepseek, v3 = type == HfType::kDeepseekV3;
  m.num_experts = r.integer("n_routed_experts", 1, kMaxExperts, v1 ? 64 : v3 ? 256 : 160);
  m.experts_per_token = r.integer("num_experts_per_tok", 1, kMaxExperts, v1 ? 6 : 8);
  m.intermediate_size = r.integer("moe_intermediate_size", 1, kMaxDim, v1 ? 1408 : v3 ? 2048 : 1536);
  const int64_t dense_width = r.integer("intermediate_size", 1, kMaxDim, v1 ? 10944 : v3 ? 18432 : 12288);
  m.shared_expert_intermediate_size = r.integer("n_shared_experts", 0, kMaxExperts, v3 ? 1 : 2) *
                                      m.intermediate_size;
  m.first_dense_layers = r.integer("first_k_dense_replace", 0, kMaxLayers, v1 ? 1 : v3 ? 3 : 0);
  m.moe_layer_step = r.integer("moe_layer_freq", 1, kMaxLayers, 1);
  if (m.has_dense_layers()) m.dense_intermediate_size = dense_width;
  m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, v1 || v3 ? 4096 : 2048);
  m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e4);
  m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
  m.router_aux_loss_coef = r.number("aux_loss_alpha", 0.0, 1e3, 0.001);
  // The balance loss over each sequence or the batch, the inference-time expert split: the
  // same cost either way.
  r.ignore("seq_aux");
  r.ignore("pretraining_tp");
  m.routed_scaling_factor = r.number("routed_scaling_factor", 1e-6, 1e6, v3 ? 2.5 : 1.0);
  m.norm_topk_prob = r.boolean("norm_topk_prob", v3);
  r.ignore("ep_size");
  if (r.boolean("attention_bias", false))
    d.error("attention_bias", "= true: biases on DeepSeek's attention projections are not modelled");
  const std::string scoring = r.string("scoring_func", v3 ? "sigmoid" : "softmax");
  if (v1) {
    if (scoring != "softmax") d.error("scoring_func", "= \"" + scoring + "\": only softmax routing is modelled for DeepSeekMoE");
    return;
  }
  if (scoring == "sigmoid") m.router_scoring = RouterScoring::kSigmoid;
  else if (scoring != "softmax")
    d.error("scoring_func", "expected \"softmax\" or \"sigmoid\", got \"" + scoring + "\"");
  // greedy: one group; group_limited_greedy (V2) and noaux_tc (V3): the top groups first.
  const std::string topk = r.string("topk_method", v3 ? "noaux_tc" : "greedy");
  // An absent field takes the config class's default; null (V2's) is none.
  const int64_t groups = r.has("n_group") ? r.nullable_integer("n_group", 1, kMaxExperts).value_or(1) : v3 ? 8 : 1;
  const int64_t group_topk =
      r.has("topk_group") ? r.nullable_integer("topk_group", 1, kMaxExperts).value_or(1) : v3 ? 4 : 1;
  if (topk == "group_limited_greedy" || topk == "noaux_tc") {
    m.router_groups = groups;
    m.router_group_topk = group_topk;
  } else if (topk != "greedy") {
    d.error("topk_method", "expected \"greedy\", \"group_limited_greedy\" or \"noaux_tc\", got \"" + topk + "\"");
  }
  // Latent attention: a query and key head is its non-rotary and rotary parts (a head_dim the
  // config may write is the rotary part's, transformers' convention).
  r.ignore("head_dim");
  m.kv_lora_rank = r.integer("kv_lora_rank", 1, kMaxDim, 512);
  m.q_lora_rank = r.has("q_lora_rank") ? r.nullable_integer("q_lora_rank", 1, kMaxDim).value_or(0) : 1536;
  m.qk_rope_head_dim = r.integer("qk_rope_head_dim", 1, kMaxDim, 64);
  m.head_dim = r.integer("qk_nope_head_dim", 1, kMaxDim, 128) + m.qk_rope_head_dim;
  m.v_head_dim = r.integer("v_head_dim", 1, kMaxDim, 128);
  // DeepSeek's checkpoints hold each head's rotary pairs interleaved (transformers'
  // rope_interleave, true by default), as moeplan's executor trains them.
  if (!r.boolean("rope_interleave", true))
    d.error("rope_interleave", "= false: moeplan trains DeepSeek's interleaved rotary pairs only");
  m.mtp_layers = r.integer("num_nextn_predict_layers", 0, kMaxLayers, v3 ? 1 : 0);
}

// GPT-OSS (model_type "gpt_oss", GptOssForCausalLM; OpenAI 2025): num_local_experts routed
// experts of intermediate_size, top num_experts_per_tok, blocks alternating a 128-token window
// and full attention (layer_types), attention sinks, biases on the attention projections
// (attention_bias) and always on the experts and router (transformers' GptOssExperts and
// GptOssTopKRouter), and the gate clamped at swiglu_limit.
void read_gpt_oss(ModelSpec& m, ObjectReader& r) {
  Diagnostics& d = r.diagnostics();
  m.num_experts = r.integer("num_local_experts", 1, kMaxExperts, 128);
  m.experts_per_token = r.integer("num_experts_per_tok", 1, kMaxExperts, 4);
  // The released configs repeat the top-k under the name of OpenAI's own code.
  if (r.has("experts_per_token"))
    if (const int64_t k = r.integer("experts_per_token", 1, kMaxExperts); d.empty() && k != m.experts_per_token)
      d.error("experts_per_token", "= " + std::to_string(k) + " differs from num_experts_per_tok = " +
                                       std::to_string(m.experts_per_token));
  m.intermediate_size = r.integer("intermediate_size", 1, kMaxDim, 2880);
  m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 131072);
  m.rope_theta = r.number("rope_theta", 1.0, 1e12, 150000.0);
  m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-5);
  m.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.0, 1e3, 0.9);
  m.sliding_window = r.has("sliding_window") ? r.nullable_integer("sliding_window", 1, kMaxPositions) : 128;
  m.qkv_bias = m.output_bias = r.boolean("attention_bias", true);
  m.expert_bias = true;
  m.attention_sinks = true;
  m.glu_limit = r.number("swiglu_limit", 0.0, 1e6, 7.0);
  r.ignore("initial_context_length");  // the rope scaling's original length
  // layer_types: full attention on blocks K-1, 2K-1, ... and the window on the others (the
  // config class's default alternates, K = 2); another pattern is not modelled.
  m.full_attention_step = 2;
  if (const Json* types = r.child("layer_types", true); types != nullptr && !types->is_null()) {
    std::vector<int64_t> full;
    bool known = types->is_array() && static_cast<int64_t>(types->size()) == m.num_layers;
    for (size_t i = 0; known && i < types->size(); ++i) {
      const Json& t = (*types)[i];
      known = t.is_string() && (t.get<std::string>() == "full_attention" || t.get<std::string>() == "sliding_attention");
      if (known && t.get<std::string>() == "full_attention") full.push_back(static_cast<int64_t>(i));
    }
    const int64_t step = full.empty() ? 0 : full.front() + 1;
    for (size_t j = 0; known && j < full.size(); ++j) known = full[j] == static_cast<int64_t>(j + 1) * step - 1;
    if (known && step > 0) known = static_cast<int64_t>(full.size()) == m.num_layers / step;
    if (!known)
      d.error("layer_types", "expected " + std::to_string(m.num_layers) +
                                 " of \"sliding_attention\" and \"full_attention\", full attention on every K-th block "
                                 "(blocks K-1, 2K-1, ...) or none: another pattern is not modelled");
    m.full_attention_step = step;
  }
}

}  // namespace

ModelSpec model_from_hf_config(const Json& json, const std::string& origin) {
  Diagnostics d;
  ObjectReader r(json, "", d);
  ModelSpec m;
  HfType type = HfType::kMixtral;
  if (r.ok()) {
    const std::string name = r.string("model_type");
    bool known = false;
    for (const auto& [type_name, t] : kHfTypes)
      if (type_name == name) {
        type = t;
        known = true;
      }
    if (!name.empty() && !known)
      d.error("model_type",
              "expected \"mixtral\", \"qwen2_moe\", \"qwen3_moe\", \"deepseek\", \"deepseek_v2\", "
              "\"deepseek_v3\", \"kimi_k2\", \"gpt_oss\" or \"llama\", got \"" + name + "\"");
    // Each architecture's own defaults (transformers' config classes).
    const bool llama = type == HfType::kLlama, qwen = type == HfType::kQwen2Moe || type == HfType::kQwen3Moe;
    const bool deepseek = type == HfType::kDeepseek || type == HfType::kDeepseekV2 || type == HfType::kDeepseekV3;
    const std::string fallback_name = "hf-" + std::string(name_of(kHfTypes, type));
    m.name = r.string("_name_or_path", fallback_name);
    if (m.name.empty()) m.name = fallback_name;
    m.source = "Hugging Face config.json (" + origin + ")";
    // DeepSeek's: DeepseekConfig (DeepSeekMoE 16B), DeepseekV2Config (V2), DeepseekV3Config (V3).
    const bool v2 = type == HfType::kDeepseekV2, v3 = type == HfType::kDeepseekV3, oss = type == HfType::kGptOss;
    m.vocab_size =
        r.integer("vocab_size", 1, kMaxDim, oss ? 201088 : qwen ? 151936 : v3 ? 129280 : deepseek ? 102400 : 32000);
    m.hidden_size =
        r.integer("hidden_size", 1, kMaxDim, oss ? 2880 : v3 ? 7168 : v2 ? 5120 : qwen || deepseek ? 2048 : 4096);
    m.num_layers =
        r.integer("num_hidden_layers", 1, kMaxLayers, oss ? 36 : qwen ? 24 : v3 ? 61 : v2 ? 60 : deepseek ? 28 : 32);
    m.num_attention_heads = r.integer("num_attention_heads", 1, kMaxDim,
                                      v2 || v3                                  ? 128
                                      : oss                                     ? 64
                                      : type == HfType::kQwen2Moe || deepseek ? 16
                                                                                : 32);
    // LlamaConfig: no num_key_value_heads (or null) means one per query head.
    const auto kv_heads = r.nullable_integer("num_key_value_heads", 1, kMaxDim);
    m.num_key_value_heads = kv_heads                         ? *kv_heads
                            : llama || deepseek              ? m.num_attention_heads
                            : type == HfType::kQwen2Moe      ? 16
                            : type == HfType::kQwen3Moe      ? 4
                                                             : 8;
    // Newer transformers versions write head_dim explicitly (sometimes as null).
    auto head_dim = r.nullable_integer("head_dim", 1, kMaxDim);
    if (!head_dim && oss && !r.has("head_dim")) head_dim = 64;
    m.head_dim = head_dim ? *head_dim : derived_head_dim(m, r, "num_attention_heads");
    if (llama) {
      m.num_experts = 1;
      m.experts_per_token = 1;
      m.intermediate_size = r.integer("intermediate_size", 1, kMaxDim, 11008);
      m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 2048);
      m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e4);
      m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
      r.ignore("pretraining_tp");
      r.ignore("mlp_bias");
      r.ignore("attention_bias");
    } else if (qwen) {
      read_qwen_moe(m, r, type == HfType::kQwen3Moe);
    } else if (deepseek) {
      read_deepseek(m, r, type);
    } else if (oss) {
      read_gpt_oss(m, r);
    } else {
      m.num_experts = r.integer("num_local_experts", 1, kMaxExperts, 8);
      m.experts_per_token = r.integer("num_experts_per_tok", 1, kMaxExperts, 2);
      m.intermediate_size = r.integer("intermediate_size", 1, kMaxDim, 14336);
      m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 4096 * 32);
      m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e6);
      m.sliding_window = r.nullable_integer("sliding_window", 1, kMaxPositions);
      m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-5);
      m.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.0, 1e3, 0.001);
      r.ignore("attention_bias");
    }
    m.initializer_range = r.number("initializer_range", 0.0, 10.0, 0.02);
    m.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
    const std::string act = r.string("hidden_act", "silu");
    if (act != "silu") d.error("hidden_act", "only \"silu\" (SwiGLU feed-forward) is supported, got \"" + act + "\"");
    for (const char* key : kHfAccepted) r.ignore(key);
    // Mixtral's and GPT-OSS's routers renormalise the chosen experts' weights, whatever a config says.
    if (!qwen && !deepseek) r.ignore("norm_topk_prob");
    r.finish();
  }
  if (d.empty()) {
    // Rules speak of moeplan's names; report the config's own.
    for (const Violation& v : validate_model(m)) d.error(std::string(hf_field(type, v.field)), v.message);
  }
  d.throw_if_any(origin);
  return m;
}

ModelSpec read_model_file(const std::string& path) {
  Json json = read_json_file(path);
  if (json.is_object() && json.contains("model_type")) return model_from_hf_config(json, path);
  return model_from_json(json, path);
}

namespace {

// The sizes, in the same order in both formats, under the names of config.json's architecture
// `hf` where there is one.
void put_sizes(const ModelSpec& m, std::optional<HfType> hf, Json& j) {
  for (const auto& [field, value] : {std::pair<std::string_view, int64_t>{"vocab_size", m.vocab_size},
                                     {"hidden_size", m.hidden_size},
                                     {"intermediate_size", m.intermediate_size},
                                     {"num_layers", m.num_layers},
                                     {"num_attention_heads", m.num_attention_heads},
                                     {"num_key_value_heads", m.num_key_value_heads},
                                     {"head_dim", m.head_dim},
                                     {"num_experts", m.num_experts},
                                     {"experts_per_token", m.experts_per_token}})
    j[std::string(hf ? hf_field(*hf, field) : field)] = value;
}

// The fields both formats name alike.
void put_positions_and_norms(const ModelSpec& m, Json& j) {
  j["max_position_embeddings"] = m.max_position_embeddings;
  j["rope_theta"] = m.rope_theta;
  j["sliding_window"] = m.sliding_window ? Json(*m.sliding_window) : Json(nullptr);
  j["rms_norm_eps"] = m.rms_norm_eps;
  j["initializer_range"] = m.initializer_range;
  j["tie_word_embeddings"] = m.tie_word_embeddings;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
}

}  // namespace

namespace {

// DeepseekV3Config's own fields (transformers; DeepSeek-V3's released config.json): latent
// attention, fine-grained routed experts beside shared ones of their width, dense first blocks,
// sigmoid scores in groups, and the multi-token prediction modules.
void put_deepseek_v3(const ModelSpec& m, Json& j) {
  j["moe_intermediate_size"] = m.intermediate_size;
  // The dense blocks' width (unused without them, written as the experts' because the config
  // class wants one).
  j["intermediate_size"] = m.has_dense_layers() ? m.dense_intermediate_size : m.intermediate_size;
  j["n_shared_experts"] = m.shared_expert_intermediate_size / m.intermediate_size;
  j["first_k_dense_replace"] = m.first_dense_layers;
  j["moe_layer_freq"] = 1;
  j["n_group"] = m.router_groups;
  j["topk_group"] = m.router_group_topk;
  j["topk_method"] = "noaux_tc";
  j["scoring_func"] = "sigmoid";
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["routed_scaling_factor"] = m.routed_scaling_factor;
  j["aux_loss_alpha"] = m.router_aux_loss_coef;
  j["kv_lora_rank"] = m.kv_lora_rank;
  j["q_lora_rank"] = m.q_lora_rank > 0 ? Json(m.q_lora_rank) : Json(nullptr);
  j["qk_rope_head_dim"] = m.qk_rope_head_dim;
  j["qk_nope_head_dim"] = m.head_dim - m.qk_rope_head_dim;
  j["v_head_dim"] = m.v_head_dim;
  j["rope_interleave"] = true;
  j["num_nextn_predict_layers"] = m.mtp_layers;
  j["attention_bias"] = false;
}

}  // namespace

Json to_hf_config(const ModelSpec& m, const std::string& torch_dtype) {
  const bool qwen3 = m.qk_norm, deepseek = !qwen3 && m.mla();
  const std::string architecture = qwen3 ? "Qwen3-MoE" : deepseek ? "DeepSeek-V3" : "Mixtral";
  // None of the three config classes has these (Qwen3-MoE's q/k norms are its own).
  for (const auto& [field, has] : {std::pair<const char*, bool>{"qkv_bias", m.qkv_bias},
                                   {"full_attention_step", m.full_attention_step > 0},
                                   {"attention_sinks", m.attention_sinks},
                                   {"output_bias", m.output_bias},
                                   {"expert_bias", m.expert_bias},
                                   {"glu_limit", m.glu_limit > 0}})
    if (has) throw InputError(m.name, {{field, "a " + architecture + " config.json cannot say this"}});
  // Mixtral's and Qwen3-MoE's classes have none of DeepSeek's parts, and Mixtral's always renormalises.
  if (!deepseek)
    for (const auto& [field, has] :
         {std::pair<const char*, bool>{"shared_expert_intermediate_size", m.shared_experts()},
          {"first_dense_layers", m.has_dense_layers()},
          {"kv_lora_rank", m.mla()},
          {"router_scoring", m.router_scoring != RouterScoring::kSoftmax},
          {"router_groups", m.router_groups > 1},
          {"routed_scaling_factor", m.routed_scaling_factor != 1.0},
          {"mtp_layers", m.mtp_layers > 0},
          {"sliding_window", qwen3 && m.sliding_window.has_value()},
          {"norm_topk_prob", !qwen3 && !m.norm_topk_prob}})
      if (has) throw InputError(m.name, {{field, "a " + architecture + " config.json cannot say this"}});
  // DeepSeek-V3's class scores by sigmoid, has shared experts of the routed width, ungated, and
  // its dense blocks first.
  if (deepseek)
    for (const auto& [field, has] :
         {std::pair<const char*, bool>{"router_scoring", m.router_scoring != RouterScoring::kSigmoid},
          {"shared_expert_intermediate_size", m.shared_expert_intermediate_size % m.intermediate_size != 0},
          {"shared_expert_gate", m.shared_expert_gate},
          {"moe_layer_step", m.moe_layer_step != 1 || m.moe_layer_offset != 0},
          {"sliding_window", m.sliding_window.has_value()}})
      if (has) throw InputError(m.name, {{field, "a " + architecture + " config.json cannot say this"}});
  Json j;
  j["_name_or_path"] = m.name;
  j["architectures"] = {qwen3 ? "Qwen3MoeForCausalLM" : deepseek ? "DeepseekV3ForCausalLM" : "MixtralForCausalLM"};
  j["model_type"] = qwen3 ? "qwen3_moe" : deepseek ? "deepseek_v3" : "mixtral";
  put_sizes(m, qwen3 ? HfType::kQwen3Moe : deepseek ? HfType::kDeepseekV3 : HfType::kMixtral, j);
  put_positions_and_norms(m, j);
  if (qwen3) {
    // Every block sparse (decoder_sparse_step 1, no mlp_only_layers): the dense width is
    // unused, written as the experts' because the config class wants one.
    j["intermediate_size"] = m.intermediate_size;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = Json::array();
    j["norm_topk_prob"] = m.norm_topk_prob;
    j["use_sliding_window"] = false;
    j["max_window_layers"] = m.num_layers;
    j["attention_bias"] = false;
  }
  if (deepseek) {
    // After put_sizes, whose head_dim (written as qk_nope_head_dim) and expert width this
    // overwrites with DeepseekV3Config's own meaning.
    put_deepseek_v3(m, j);
    // DeepseekV3Config has neither; its balance loss coefficient is aux_loss_alpha.
    j.erase("sliding_window");
    j.erase("router_aux_loss_coef");
  }
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["output_router_logits"] = false;
  j["use_cache"] = true;
  j["torch_dtype"] = torch_dtype;
  return j;
}

Json to_json(const ModelSpec& m) {
  Json j;
  j["name"] = m.name;
  j["source"] = m.source;
  put_sizes(m, std::nullopt, j);
  put_positions_and_norms(m, j);
  j["mlp"] = std::string(name_of(kMlpNames, m.mlp));
  if (m.norm != Norm::kRmsNorm) j["norm"] = std::string(name_of(kNormNames, m.norm));
  if (m.dropout > 0) j["dropout"] = m.dropout;
  if (m.shared_experts()) j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
  if (m.shared_expert_gate) j["shared_expert_gate"] = true;
  if (m.qk_norm) j["qk_norm"] = true;
  if (m.qkv_bias) j["qkv_bias"] = true;
  if (m.first_dense_layers > 0) j["first_dense_layers"] = m.first_dense_layers;
  if (m.moe_layer_step > 1) j["moe_layer_step"] = m.moe_layer_step;
  if (m.moe_layer_offset > 0) j["moe_layer_offset"] = m.moe_layer_offset;
  if (m.dense_intermediate_size > 0) j["dense_intermediate_size"] = m.dense_intermediate_size;
  if (m.router_scoring != RouterScoring::kSoftmax) j["router_scoring"] = std::string(name_of(kRouterScoringNames, m.router_scoring));
  if (m.router_groups > 1) j["router_groups"] = m.router_groups;
  if (m.router_group_topk > 1) j["router_group_topk"] = m.router_group_topk;
  if (!m.norm_topk_prob) j["norm_topk_prob"] = false;
  if (m.routed_scaling_factor != 1.0) j["routed_scaling_factor"] = m.routed_scaling_factor;
  if (m.router_scoring == RouterScoring::kSigmoid) j["router_bias_update_rate"] = m.router_bias_update_rate;
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"kv_lora_rank", m.kv_lora_rank},
                                     {"q_lora_rank", m.q_lora_rank},
                                     {"qk_rope_head_dim", m.qk_rope_head_dim},
                                     {"v_head_dim", m.v_head_dim}})
    if (value > 0) j[field] = value;
  if (m.mtp_layers > 0) j["mtp_layers"] = m.mtp_layers;
  if (m.mtp_layers > 0) j["mtp_loss_weight"] = m.mtp_loss_weight;
  if (m.full_attention_step > 0) j["full_attention_step"] = m.full_attention_step;
  if (m.attention_sinks) j["attention_sinks"] = true;
  if (m.output_bias) j["output_bias"] = true;
  if (m.expert_bias) j["expert_bias"] = true;
  if (m.glu_limit > 0) j["glu_limit"] = m.glu_limit;
  return j;
}

}  // namespace moeplan
