#include "moeplan/core/profile_files.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "moeplan/core/errors.h"

namespace moeplan {

namespace fs = std::filesystem;

namespace {

bool looks_like_path(const std::string& value) {
  return value.find('/') != std::string::npos || value.ends_with(".json");
}

std::string resolve(const std::string& name, const std::string& dir, const char* kind, const char* flag) {
  if (looks_like_path(name)) return name;
  const fs::path folder = fs::path(dir) / kind;
  const fs::path file = folder / (name + ".json");
  std::error_code ec;
  if (fs::exists(file, ec)) return file.string();
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder, ec))
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  std::sort(names.begin(), names.end());
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw InputError(flag, {{"", "no " + std::string(kind) + " profile named \"" + name + "\" in " +
                                   folder.string() + (known.empty() ? "" : " (known: " + known + ")")}});
}

}  // namespace

std::string profile_dir(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("MOEPLAN_PROFILES"); env != nullptr && *env != '\0') return env;
  return MOEPLAN_PROFILE_DIR;
}

ClusterSpec load_hardware(const std::string& name_or_path, const std::string& dir) {
  return read_cluster_file(resolve(name_or_path, dir, "hardware", "--instance"));
}

ModelSpec load_model(const std::string& name_or_path, const std::string& dir) {
  return read_model_file(resolve(name_or_path, dir, "models", "--model"));
}

}  // namespace moeplan
