#include "moeplan/executor/model/hf_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <map>

#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/model/expert_bias.h"
#include "moeplan/executor/model/mixtral.h"

namespace moeplan::executor {

namespace fs = std::filesystem;

namespace {

// The step folder a path names: itself (it has a manifest), or the newest step of it or of
// its checkpoints/ folder.
std::string step_folder(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / "manifest.json", ec)) return path;
  for (const fs::path& dir : {fs::path(path) / "checkpoints", fs::path(path)}) {
    if (!fs::is_directory(dir, ec)) continue;
    const std::string latest = latest_checkpoint(dir.string());
    if (!latest.empty()) return latest;
  }
  throw InputError(path, {{"", "no checkpoint here (a step folder with manifest.json, a checkpoints folder or a "
                               "run folder)"}});
}

std::string torch_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    default: return c10::toString(t);
  }
}

std::string shard_name(size_t k, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return name;
}

}  // namespace

std::string hf_parameter_name(const ModelSpec& model, const std::string& name) {
  if (!model.qk_norm && !model.mla()) return name;  // Mixtral's own
  static constexpr std::string_view kSparse = "block_sparse_moe.";
  const size_t at = name.find(kSparse);
  std::string out = at == std::string::npos ? name : name.substr(0, at) + "mlp." + name.substr(at + kSparse.size());
  if (out.find(".mlp.") == std::string::npos) return out;  // attention, norms, the head
  for (const auto& [ours, theirs] : {std::pair<std::string_view, std::string_view>{".w1.weight", ".gate_proj.weight"},
                                     {".w3.weight", ".up_proj.weight"},
                                     {".w2.weight", ".down_proj.weight"}})
    if (out.size() > ours.size() && out.compare(out.size() - ours.size(), ours.size(), ours) == 0)
      return out.substr(0, out.size() - ours.size()) + std::string(theirs);
  return out;
}

HfExport export_hf_checkpoint(const std::string& checkpoint, const std::string& out_dir, int64_t max_shard_bytes) {
  if (max_shard_bytes < 1) throw InputError("--max-shard-bytes", {{"", "must be at least 1"}});
  HfExport out;
  out.checkpoint = step_folder(checkpoint);
  const LoadedCheckpoint ck = open_checkpoint(out.checkpoint);
  out.step = ck.step;
  if (!ck.state.contains("model"))
    throw InputError(out.checkpoint + "/manifest.json", {{"state.model", "missing: the checkpoint does not say its model"}});
  const ModelSpec spec = model_from_json(Json::parse(ck.state["model"].dump()), out.checkpoint + "/manifest.json");

  // Refuse to mix with another checkpoint: nothing already there is overwritten.
  std::error_code ec;
  if (fs::exists(fs::path(out_dir) / "config.json", ec) || fs::exists(fs::path(out_dir) / "model.safetensors.index.json", ec))
    throw InputError(out_dir, {{"", "already holds a Hugging Face checkpoint; choose an empty folder"}});
  fs::create_directories(out_dir, ec);
  if (ec) throw InputError(out_dir, {{"", "cannot create: " + ec.message()}});

  SlicedState state;
  for (const CheckpointFile& f : ck.files) {
    TensorFile shard = read_checkpoint_shard(ck, f.name);
    NamedTensors params;
    for (auto& [name, tensor] : shard.tensors)
      if (name.rfind("param/", 0) == 0 || name.rfind("buffer/", 0) == 0)
        params.emplace_back(std::move(name), std::move(tensor));
    state.add(params);
  }
  Diagnostics d;
  NamedTensors tensors;
  for (const ParamInfo& info : mixtral_parameters(spec)) {
    torch::Tensor t = state.whole("param/" + info.name, info.shape, d);
    if (t.defined()) tensors.emplace_back(hf_parameter_name(spec, info.name), t.contiguous());
  }
  // A sigmoid router's balancing biases, fp32 as DeepSeek-V3's checkpoint keeps them.
  if (spec.router_scoring == RouterScoring::kSigmoid)
    for (const std::string& name : expert_bias_names(spec)) {
      torch::Tensor t = state.whole("buffer/" + name, {spec.num_experts}, d);
      if (t.defined()) tensors.emplace_back(hf_parameter_name(spec, name), t.contiguous());
    }
  d.throw_if_any(out.checkpoint);

  // The config first: a model no config class can say is refused before any file is written.
  const torch::ScalarType dtype = tensors.empty() ? torch::kFloat : tensors.front().second.scalar_type();
  const Json config = to_hf_config(spec, torch_dtype_name(dtype));

  // Shards of whole tensors in the model's order.
  std::vector<NamedTensors> shards(1);
  int64_t in_shard = 0;
  for (auto& named : tensors) {
    const int64_t bytes = static_cast<int64_t>(named.second.numel() * named.second.element_size());
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    in_shard += bytes;
    out.bytes += bytes;
    shards.back().push_back(std::move(named));
  }
  Json weight_map = Json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = shard_name(k, shards.size());
    const fs::path path = fs::path(out_dir) / name;
    const std::string tmp = path.string() + ".tmp";
    write_tensor_file(tmp, shards[k], {{"format", "pt"}});
    fs::rename(tmp, path, ec);
    if (ec) throw InputError(path.string(), {{"", "cannot rename into place: " + ec.message()}});
    for (const auto& [tensor_name, t] : shards[k]) weight_map[tensor_name] = name;
    out.tensors += static_cast<int64_t>(shards[k].size());
    out.files.push_back(name);
  }
  Json index;
  index["metadata"] = {{"total_size", out.bytes}};
  index["weight_map"] = weight_map;
  write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  out.files.push_back("model.safetensors.index.json");
  write_file_atomic((fs::path(out_dir) / "config.json").string(), config.dump(2) + "\n");
  out.files.push_back("config.json");
  return out;
}

SlicedState read_hf_parameters(const std::string& dir, const ModelSpec& model, torch::ScalarType dtype,
                               const std::set<std::string>* wanted) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  std::error_code ec;
  if (!fs::exists(config_path, ec))
    throw InputError(dir, {{"", "no config.json: not a Hugging Face model folder"}});
  const Json config = read_json_file(config_path);
  const ModelSpec theirs = model_from_hf_config(config, config_path);
  Diagnostics d;
  auto same = [&](const char* field, int64_t a, int64_t b) {
    if (a != b) d.error(field, "= " + std::to_string(a) + ", the plan's model has " + std::to_string(b));
  };
  same("vocab_size", theirs.vocab_size, model.vocab_size);
  same("hidden_size", theirs.hidden_size, model.hidden_size);
  same("intermediate_size", theirs.intermediate_size, model.intermediate_size);
  same("num_hidden_layers", theirs.num_layers, model.num_layers);
  same("num_attention_heads", theirs.num_attention_heads, model.num_attention_heads);
  same("num_key_value_heads", theirs.num_key_value_heads, model.num_key_value_heads);
  same("head_dim", theirs.head_dim, model.head_dim);
  same("num_local_experts", theirs.num_experts, model.num_experts);
  same("num_experts_per_tok", theirs.experts_per_token, model.experts_per_token);
  same("tie_word_embeddings", theirs.tie_word_embeddings, model.tie_word_embeddings);
  // A Qwen folder of Mixtral's sizes still holds tensors Mixtral has not.
  same("shared_expert_intermediate_size", theirs.shared_expert_intermediate_size, model.shared_expert_intermediate_size);
  same("qk_norm", theirs.qk_norm, model.qk_norm);
  same("qkv_bias", theirs.qkv_bias, model.qkv_bias);
  same("moe_layers", theirs.moe_layers(), model.moe_layers());
  // DeepSeek's latent attention, router and multi-token prediction.
  same("kv_lora_rank", theirs.kv_lora_rank, model.kv_lora_rank);
  same("q_lora_rank", theirs.q_lora_rank, model.q_lora_rank);
  same("qk_rope_head_dim", theirs.qk_rope_head_dim, model.qk_rope_head_dim);
  same("v_head_dim", theirs.v_head_dim, model.v_head_dim);
  same("n_group", theirs.router_groups, model.router_groups);
  same("topk_group", theirs.router_group_topk, model.router_group_topk);
  same("num_nextn_predict_layers", theirs.mtp_layers, model.mtp_layers);
  // The rotary embedding and the norms as the executor computes them: no rope scaling (YaRN's
  // frequencies and attention scale, which DeepSeek-V3's released config has, are not trained
  // here), the same base and epsilon.
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null())
    d.error("rope_scaling", "is set: the executor trains the rotary embedding without scaling (remove it to train "
                            "at the model's own lengths)");
  if (theirs.rope_theta != model.rope_theta)
    d.error("rope_theta", "= " + std::to_string(theirs.rope_theta) + ", the plan's model has " +
                              std::to_string(model.rope_theta));
  if (theirs.rms_norm_eps != model.rms_norm_eps)
    d.error("rms_norm_eps", "= " + std::to_string(theirs.rms_norm_eps) + ", the plan's model has " +
                                std::to_string(model.rms_norm_eps));
  if (theirs.router_scoring != model.router_scoring)
    d.error("scoring_func", "differs from the plan's model's router_scoring");
  if (theirs.routed_scaling_factor != model.routed_scaling_factor)
    d.error("routed_scaling_factor", "= " + std::to_string(theirs.routed_scaling_factor) + ", the plan's model has " +
                                         std::to_string(model.routed_scaling_factor));
  // Whether the chosen experts' weights are renormalised: each config class's default where
  // the field is absent (Qwen's and DeepSeek-V1/V2's: no; DeepSeek-V3's and Kimi K2's: yes).
  if (theirs.norm_topk_prob != model.norm_topk_prob)
    d.error("norm_topk_prob", std::string("= ") + (theirs.norm_topk_prob ? "true" : "false") +
                                  " (or its class's default), the plan's model has " +
                                  (model.norm_topk_prob ? "true" : "false"));
  d.throw_if_any(config_path);
  // The dtype config.json declares, which every tensor must have.
  std::string declared;
  if (config.contains("torch_dtype") && config["torch_dtype"].is_string()) declared = config["torch_dtype"].get<std::string>();

  // Which file holds each tensor.
  std::map<std::string, std::string> file_of;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const std::vector<ParamInfo> params = mixtral_parameters(model);
  if (fs::exists(index_path, ec)) {
    const Json index = read_json_file(index_path.string());
    const Json* map = index.is_object() && index.contains("weight_map") ? &index["weight_map"] : nullptr;
    if (map == nullptr || !map->is_object())
      throw InputError(index_path.string(), {{"weight_map", "missing or not an object of tensor -> file"}});
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        throw InputError(index_path.string(), {{"weight_map." + name, "must name a file in the folder, got " + file.dump()}});
      file_of[name] = file.get<std::string>();
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors", ec)) {
    for (const ParamInfo& info : params) file_of[hf_parameter_name(model, info.name)] = "model.safetensors";
    for (const std::string& name : expert_bias_names(model))  // read where the file has them
      file_of[hf_parameter_name(model, name)] = "model.safetensors";
  } else {
    throw InputError(dir, {{"", "neither model.safetensors.index.json nor model.safetensors"}});
  }

  std::map<std::string, std::set<std::string>> needed;  // file -> tensors, by their names there
  std::map<std::string, const ParamInfo*> info_of;       // by the name there
  // A sigmoid router's balancing biases, where the folder has them (DeepSeek-V3's has; a
  // run starts them at zero otherwise).
  std::map<std::string, std::string> bias_of;  // by the name there -> moeplan's
  if (model.router_scoring == RouterScoring::kSigmoid)
    for (const std::string& name : expert_bias_names(model)) {
      const std::string theirs = hf_parameter_name(model, name);
      if (const auto it = file_of.find(theirs); it != file_of.end()) {
        needed[it->second].insert(theirs);
        bias_of[theirs] = name;
      }
    }
  for (const ParamInfo& info : params) {
    if (wanted != nullptr && wanted->count(info.name) == 0) continue;
    const std::string theirs = hf_parameter_name(model, info.name);
    const auto it = file_of.find(theirs);
    if (it == file_of.end()) {
      d.error(theirs, "is not in the checkpoint");
      continue;
    }
    needed[it->second].insert(theirs);
    info_of[theirs] = &info;
  }
  d.throw_if_any(index_path.string());

  SlicedState state;
  for (const auto& [file, names] : needed) {
    const std::string path = (fs::path(dir) / file).string();
    TensorFile t = read_tensor_file(path, &names);
    NamedTensors tensors;
    for (auto& [name, tensor] : t.tensors) {
      if (const auto bias = bias_of.find(name); bias != bias_of.end()) {
        if (tensor.sizes().vec() != std::vector<int64_t>{model.num_experts})
          d.error(name + ".shape", "is " + c10::str(tensor.sizes()) + ", the model needs [" +
                                       std::to_string(model.num_experts) + "]");
        else if (!tensor.is_floating_point())
          d.error(name + ".dtype", safetensors_dtype(tensor.scalar_type()) + " is not a floating-point type");
        else
          tensors.emplace_back("buffer/" + bias->second, tensor.to(torch::kFloat));
        continue;
      }
      const ParamInfo& info = *info_of.at(name);
      const torch::ScalarType type = tensor.scalar_type();
      if (type != torch::kFloat && type != torch::kBFloat16 && type != torch::kHalf) {
        d.error(name + ".dtype", safetensors_dtype(type) + " is not a floating-point type (F32, BF16, F16)");
        continue;
      }
      if (!declared.empty() && torch_dtype_name(type) != declared) {
        d.error(name + ".dtype", safetensors_dtype(type) + ", but config.json says torch_dtype \"" + declared + "\"");
        continue;
      }
      if (tensor.sizes().vec() != info.shape) {
        d.error(name + ".shape", "is " + c10::str(tensor.sizes()) + ", the model needs " + c10::str(c10::IntArrayRef(info.shape)));
        continue;
      }
      const torch::Tensor values = tensor.to(dtype);
      tensors.emplace_back("param/" + info.name, values);
      tensors.emplace_back("exp_avg/" + info.name, torch::zeros_like(values));
      tensors.emplace_back("exp_avg_sq/" + info.name, torch::zeros_like(values));
    }
    d.throw_if_any(path);
    state.add(tensors);
  }
  return state;
}

}  // namespace moeplan::executor
