#include "moeplan/executor/checkpoint.h"

#include <cstdio>
#include <filesystem>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kCheckpointSchemaVersion = 1;
constexpr char kManifest[] = "manifest.json";

}  // namespace

std::string step_folder(const std::string& checkpoints_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return checkpoints_dir + "/" + name;
}

std::string begin_checkpoint(const std::string& checkpoints_dir, int64_t step) {
  const std::string dir = step_folder(checkpoints_dir, step);
  fs::create_directories(dir);
  if (fs::remove(dir + "/" + kManifest)) fsync_directory(dir);
  fsync_directory(checkpoints_dir);
  return dir;
}

CheckpointFile write_checkpoint_shard(const std::string& step_dir, int64_t rank, const NamedTensors& tensors) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
  const std::string path = step_dir + "/" + name;
  const std::string tmp = path + ".tmp";
  const uint32_t crc = write_tensor_file(tmp, tensors);
  const auto bytes = static_cast<int64_t>(fs::file_size(tmp));
  fs::rename(tmp, path);
  fsync_directory(step_dir);
  return {name, bytes, crc};
}

void commit_checkpoint(const std::string& step_dir, int64_t step, const Json& state,
                       const std::vector<CheckpointFile>& files) {
  Json manifest;
  manifest["schema_version"] = kCheckpointSchemaVersion;
  manifest["kind"] = "moeplan-checkpoint";
  manifest["step"] = step;
  Json list = Json::array();
  for (const CheckpointFile& f : files) list.push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32", f.crc32}});
  manifest["files"] = list;
  manifest["state"] = state;
  write_file_atomic(step_dir + "/" + kManifest, manifest.dump(2) + "\n");
}

std::string latest_checkpoint(const std::string& checkpoints_dir) {
  std::error_code ec;
  std::string best;
  int64_t best_step = -1;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() > 5 + 18 || !fs::exists(entry.path() / kManifest)) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    // By number: past eight digits the names no longer sort as text.
    const int64_t step = std::stoll(digits);
    if (step > best_step) {
      best_step = step;
      best = name;
    }
  }
  return best.empty() ? "" : checkpoints_dir + "/" + best;
}

LoadedCheckpoint open_checkpoint(const std::string& step_dir) {
  const std::string manifest_path = step_dir + "/" + kManifest;
  if (!fs::exists(manifest_path))
    throw InputError(step_dir, {{"", "no manifest.json: the checkpoint is incomplete (its save did not finish)"}});
  const Json json = read_json_file(manifest_path);
  Diagnostics d;
  LoadedCheckpoint c;
  c.dir = step_dir;
  ObjectReader r(json, "", d);
  if (r.ok()) {
    if (r.integer("schema_version", 1, 1000) != kCheckpointSchemaVersion)
      d.error("schema_version", "this moeplan reads version " + std::to_string(kCheckpointSchemaVersion));
    if (r.string("kind") != "moeplan-checkpoint") d.error("kind", "expected \"moeplan-checkpoint\"");
    c.step = r.integer("step", 0, int64_t{1} << 50);
    if (const Json* files = r.child("files"); files != nullptr) {
      if (!files->is_array() || files->empty()) d.error("files", "must list at least one shard");
      else
        for (size_t i = 0; i < files->size(); ++i) {
          ObjectReader f((*files)[i], "files[" + std::to_string(i) + "]", d);
          if (!f.ok()) continue;
          CheckpointFile file;
          file.name = f.string("name");
          file.bytes = f.integer("bytes", 0, int64_t{1} << 52);
          file.crc32 = static_cast<uint32_t>(f.integer("crc32", 0, 0xFFFFFFFFll));
          if (file.name.empty() || file.name.find('/') != std::string::npos)
            d.error(f.path_of("name"), "must be a file name inside the checkpoint folder");
          f.finish();
          c.files.push_back(file);
        }
    }
    if (const Json* state = r.child("state"); state != nullptr) c.state = *state;
    r.finish();
  }
  d.throw_if_any(manifest_path);
  for (const CheckpointFile& f : c.files) {
    const std::string path = step_dir + "/" + f.name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) throw InputError(path, {{"", "listed in the manifest but missing"}});
    if (static_cast<int64_t>(size) != f.bytes)
      throw InputError(path, {{"", std::to_string(size) + " bytes, the manifest says " + std::to_string(f.bytes) +
                                       " (truncated or damaged)"}});
    if (crc32_file(path) != f.crc32)
      throw InputError(path, {{"", "checksum does not match the manifest (the file is damaged)"}});
  }
  return c;
}

TensorFile read_checkpoint_shard(const LoadedCheckpoint& checkpoint, const std::string& name) {
  return read_tensor_file(checkpoint.dir + "/" + name);
}

}  // namespace moeplan::executor
