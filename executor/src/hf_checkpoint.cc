#include "moeplan/executor/hf_checkpoint.h"

#include <cstdio>
#include <filesystem>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/parallel_trainer.h"

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
      if (name.rfind("param/", 0) == 0) params.emplace_back(std::move(name), std::move(tensor));
    state.add(params);
  }
  Diagnostics d;
  NamedTensors tensors;
  for (const ParamInfo& info : mixtral_parameters(spec)) {
    torch::Tensor t = state.whole("param/" + info.name, info.shape, d);
    if (t.defined()) tensors.emplace_back(info.name, t.contiguous());
  }
  d.throw_if_any(out.checkpoint);

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
  OrderedJson weight_map = OrderedJson::object();
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
  OrderedJson index;
  index["metadata"] = {{"total_size", out.bytes}};
  index["weight_map"] = weight_map;
  write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  out.files.push_back("model.safetensors.index.json");
  const torch::ScalarType dtype = shards.front().empty() ? torch::kFloat : shards.front().front().second.scalar_type();
  write_file_atomic((fs::path(out_dir) / "config.json").string(), to_hf_config(spec, torch_dtype_name(dtype)).dump(2) + "\n");
  out.files.push_back("config.json");
  return out;
}

}  // namespace moeplan::executor
