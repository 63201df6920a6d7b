#include "moeplan/core/model_spec.h"

#include <algorithm>
#include <array>

#include "moeplan/core/rules.h"

namespace moeplan {

namespace {
// Bounds that keep every derived count well inside int64 (checked again by the model rules).
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

// The fields Hugging Face's config.json names otherwise: {ours, theirs}.
constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kHfNames{
    {{"experts_per_token", "num_experts_per_tok"}, {"num_layers", "num_hidden_layers"},
     {"num_experts", "num_local_experts"}}};

// The name config.json gives the field moeplan calls `ours`.
std::string_view hf_name(std::string_view ours) {
  for (const auto& [name, theirs] : kHfNames)
    if (name == ours) return theirs;
  return ours;
}
}  // namespace

ParamCounts count_parameters(const ModelSpec& m) {
  ParamCounts p;
  const int64_t q_width = m.num_attention_heads * m.head_dim;
  const int64_t kv_width = m.num_key_value_heads * m.head_dim;
  p.embedding = m.vocab_size * m.hidden_size;
  p.lm_head = m.tie_word_embeddings ? 0 : m.vocab_size * m.hidden_size;
  p.final_norm = m.hidden_size;
  // q: hidden -> heads*head_dim, k and v: hidden -> kv_heads*head_dim, o: heads*head_dim -> hidden.
  p.attention_per_layer = 2 * m.hidden_size * q_width + 2 * m.hidden_size * kv_width;
  p.norms_per_layer = 2 * m.hidden_size;
  p.router_per_layer = m.hidden_size * m.router_width();
  p.expert = m.mlp_matrices() * m.hidden_size * m.intermediate_size;
  p.num_layers = m.num_layers;
  p.num_experts = m.num_experts;
  p.experts_per_token = m.experts_per_token;
  return p;
}

double forward_flops_per_token(const ModelSpec& m, int64_t seq_len) {
  const ParamCounts p = count_parameters(m);
  const double h = static_cast<double>(m.hidden_size);
  const double layers = static_cast<double>(m.num_layers);
  // Matrix multiplies: 2 FLOPs per weight a token touches (embedding lookup is not a GEMM).
  const double weights = static_cast<double>(p.attention_per_layer + p.router_per_layer +
                                             m.experts_per_token * p.expert) *
                             layers +
                         static_cast<double>(m.vocab_size) * h;
  // Scores and weighted sum: 2 GEMMs of (seq x head_dim x context) per head; causal masking
  // halves the average context. A sliding window caps it.
  double context = static_cast<double>(seq_len) / 2.0;
  if (m.sliding_window && *m.sliding_window < seq_len) context = static_cast<double>(*m.sliding_window);
  const double attention = 2.0 * 2.0 * static_cast<double>(m.num_attention_heads * m.head_dim) *
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

ModelSpec model_from_hf_config(const Json& json, const std::string& origin) {
  Diagnostics d;
  ObjectReader r(json, "", d);
  ModelSpec m;
  if (r.ok()) {
    const std::string type = r.string("model_type");
    if (!type.empty() && type != "mixtral" && type != "llama")
      d.error("model_type", "expected \"mixtral\" or \"llama\", got \"" + type + "\"");
    // LlamaConfig: a dense model, and its own defaults (transformers' LlamaConfig).
    const bool llama = type == "llama";
    m.name = r.string("_name_or_path", llama ? "hf-llama" : "hf-mixtral");
    if (m.name.empty()) m.name = llama ? "hf-llama" : "hf-mixtral";
    m.source = "Hugging Face config.json (" + origin + ")";
    m.vocab_size = r.integer("vocab_size", 1, kMaxDim, 32000);
    m.hidden_size = r.integer("hidden_size", 1, kMaxDim, 4096);
    m.intermediate_size = r.integer("intermediate_size", 1, kMaxDim, llama ? 11008 : 14336);
    m.num_layers = r.integer("num_hidden_layers", 1, kMaxLayers, 32);
    m.num_attention_heads = r.integer("num_attention_heads", 1, kMaxDim, 32);
    // LlamaConfig: no num_key_value_heads (or null) means one per query head.
    const auto kv_heads = r.nullable_integer("num_key_value_heads", 1, kMaxDim);
    m.num_key_value_heads = kv_heads ? *kv_heads : (llama ? m.num_attention_heads : 8);
    // Newer transformers versions write head_dim explicitly (sometimes as null).
    auto head_dim = r.nullable_integer("head_dim", 1, kMaxDim);
    m.head_dim = head_dim ? *head_dim : derived_head_dim(m, r, "num_attention_heads");
    if (llama) {
      m.num_experts = 1;
      m.experts_per_token = 1;
      m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 2048);
      m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e4);
      m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-6);
      r.ignore("pretraining_tp");
      r.ignore("mlp_bias");
    } else {
      m.num_experts = r.integer("num_local_experts", 1, kMaxExperts, 8);
      m.experts_per_token = r.integer("num_experts_per_tok", 1, kMaxExperts, 2);
      m.max_position_embeddings = r.integer("max_position_embeddings", 1, kMaxPositions, 4096 * 32);
      m.rope_theta = r.number("rope_theta", 1.0, 1e12, 1e6);
      m.sliding_window = r.nullable_integer("sliding_window", 1, kMaxPositions);
      m.rms_norm_eps = r.number("rms_norm_eps", 0.0, 1.0, 1e-5);
    }
    m.initializer_range = r.number("initializer_range", 0.0, 10.0, 0.02);
    m.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
    if (!llama) m.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.0, 1e3, 0.001);
    const std::string act = r.string("hidden_act", "silu");
    if (act != "silu") d.error("hidden_act", "only \"silu\" (SwiGLU feed-forward) is supported, got \"" + act + "\"");
    // Fields of MixtralConfig and PretrainedConfig that do not change the model's shape or
    // cost. Anything else is reported: a misspelt field would otherwise silently take its
    // default.
    static constexpr std::array kAccepted = {
        "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
        "output_router_logits", "router_jitter_noise", "torch_dtype", "dtype",
        "transformers_version", "use_cache", "return_dict", "output_hidden_states",
        "output_attentions", "torchscript", "use_bfloat16", "tokenizer_class", "rope_scaling",
        "attention_bias", "_attn_implementation", "_commit_hash", "quantization_config"};
    for (const char* key : kAccepted) r.ignore(key);
    r.finish();
  }
  if (d.empty()) {
    // Rules speak of moeplan's names; report the config's own.
    for (const Violation& v : validate_model(m)) d.error(std::string(hf_name(v.field)), v.message);
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

// The sizes, in the same order in both formats, under config.json's names where `hf_names`.
void put_sizes(const ModelSpec& m, bool hf_names, Json& j) {
  for (const auto& [field, value] : {std::pair<std::string_view, int64_t>{"vocab_size", m.vocab_size},
                                     {"hidden_size", m.hidden_size},
                                     {"intermediate_size", m.intermediate_size},
                                     {"num_layers", m.num_layers},
                                     {"num_attention_heads", m.num_attention_heads},
                                     {"num_key_value_heads", m.num_key_value_heads},
                                     {"head_dim", m.head_dim},
                                     {"num_experts", m.num_experts},
                                     {"experts_per_token", m.experts_per_token}})
    j[std::string(hf_names ? hf_name(field) : field)] = value;
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

Json to_hf_config(const ModelSpec& m, const std::string& torch_dtype) {
  Json j;
  j["_name_or_path"] = m.name;
  j["architectures"] = {"MixtralForCausalLM"};
  j["model_type"] = "mixtral";
  put_sizes(m, /*hf_names=*/true, j);
  put_positions_and_norms(m, j);
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
  put_sizes(m, /*hf_names=*/false, j);
  put_positions_and_norms(m, j);
  j["mlp"] = std::string(name_of(kMlpNames, m.mlp));
  if (m.norm != Norm::kRmsNorm) j["norm"] = std::string(name_of(kNormNames, m.norm));
  if (m.dropout > 0) j["dropout"] = m.dropout;
  return j;
}

}  // namespace moeplan
