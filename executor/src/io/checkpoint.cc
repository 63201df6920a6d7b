#include "moeplan/executor/io/checkpoint.h"

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

std::string shard_name(int64_t rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

CheckpointFile write_checkpoint_shard(const std::string& step_dir, int64_t rank, const NamedTensors& tensors) {
  const std::string name = shard_name(rank), path = step_dir + "/" + name, tmp = path + ".tmp";
  try {
    const uint32_t crc = write_tensor_file(tmp, tensors);
    const auto bytes = static_cast<int64_t>(fs::file_size(tmp));
    fs::rename(tmp, path);
    fsync_directory(step_dir);
    return {name, bytes, crc};
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
}

void remove_checkpoint_shard(const std::string& step_dir, int64_t rank) {
  const std::string path = step_dir + "/" + shard_name(rank);
  std::error_code ec;
  fs::remove(path + ".tmp", ec);
  fs::remove(path, ec);
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

// ---------------------------------------------------------------------------------------------
// Slices of any layout (SlicedState).

namespace {

int64_t parse_count(const std::string& text, const std::string& name) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used == text.size() && v >= 0) return v;
  } catch (const std::exception&) {
  }
  throw InputError(name, {{"", "is not <name>@<first element> or <name>#cols<c0>:<c1>of<columns>@<first element>"}});
}

// The values of slices that cover [0, n) exactly once, joined; undefined when they do not.
torch::Tensor joined(const std::map<int64_t, torch::Tensor>& parts) {
  std::vector<torch::Tensor> pieces;
  int64_t at = 0;
  for (const auto& [first, values] : parts) {
    if (first != at || (!pieces.empty() && values.scalar_type() != pieces.front().scalar_type())) return {};
    pieces.push_back(values);
    at += values.numel();
  }
  return pieces.empty() ? torch::Tensor() : torch::cat(pieces);
}

}  // namespace

void SlicedState::add(const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) {
    const auto at = name.rfind('@');
    int64_t begin = 0;
    std::string key = name;
    if (at != std::string::npos) {
      key = name.substr(0, at);
      begin = parse_count(name.substr(at + 1), name);
    }
    if (const auto cols = key.find("#cols"); cols != std::string::npos) {
      const std::string range = key.substr(cols + 5);
      const auto colon = range.find(':'), of = range.find("of");
      if (colon == std::string::npos || of == std::string::npos || of < colon) parse_count("", name);  // throws
      const int64_t c0 = parse_count(range.substr(0, colon), name);
      const int64_t c1 = parse_count(range.substr(colon + 1, of - colon - 1), name);
      const int64_t total = parse_count(range.substr(of + 2), name);
      if (c1 <= c0 || c1 > total) parse_count("", name);
      const std::string whole = key.substr(0, cols);
      auto& blocks = columns_[whole];
      if (!blocks.empty() && blocks.begin()->second.total != total)
        throw InputError(name, {{"", "says " + std::to_string(total) + " columns, another block of " + whole +
                                         " says " + std::to_string(blocks.begin()->second.total)}});
      ColumnBlock& block = blocks[c0];
      block.end = c1;
      block.total = total;
      block.slices[begin] = t.flatten();
      continue;
    }
    slices_[key][begin] = t.flatten();
  }
}

const SlicedState::Slices* SlicedState::slices_of(const std::string& key, Diagnostics& d) const {
  if (const auto it = slices_.find(key); it != slices_.end()) return &it->second;
  const auto blocks = columns_.find(key);
  if (blocks == columns_.end()) {
    d.error(key, "missing from the checkpoint");
    return nullptr;
  }
  // Column blocks [c0, c1) side by side from column 0, each a whole [rows, c1 - c0] matrix.
  std::vector<torch::Tensor> matrices;
  int64_t column = 0, rows = -1;
  for (const auto& [c0, block] : blocks->second) {
    const int64_t width = block.end - c0;
    const torch::Tensor values = joined(block.slices);
    if (c0 != column || !values.defined() || values.numel() % width != 0 ||
        (rows >= 0 && values.numel() / width != rows) ||
        (!matrices.empty() && values.scalar_type() != matrices.front().scalar_type())) {
      d.error(key, "columns " + std::to_string(c0) + ".." + std::to_string(block.end) +
                       " do not fit the other column blocks of the checkpoint");
      return nullptr;
    }
    rows = values.numel() / width;
    matrices.push_back(values.view({rows, width}));
    column = block.end;
  }
  if (column != blocks->second.begin()->second.total) {
    d.error(key, "columns " + std::to_string(column) + ".." + std::to_string(blocks->second.begin()->second.total) +
                     " are in no column block of the checkpoint");
    return nullptr;
  }
  Slices& whole = slices_[key];
  whole[0] = torch::cat(matrices, 1).flatten();
  return &whole;
}

torch::Tensor SlicedState::range(const std::string& key, int64_t begin, int64_t end, Diagnostics& d) const {
  const Slices* found = slices_of(key, d);
  if (found == nullptr) return {};
  const auto& parts = *found;
  std::vector<torch::Tensor> pieces;
  int64_t at = begin;
  auto p = parts.upper_bound(begin);
  if (p != parts.begin()) --p;
  for (; p != parts.end() && at < end; ++p) {
    const int64_t first = p->first, last = first + p->second.numel();
    if (last <= at) continue;
    if (first > at) break;  // a gap
    if (!pieces.empty() && p->second.scalar_type() != pieces.front().scalar_type()) {
      d.error(key, "has slices of different types");
      return {};
    }
    const int64_t take_end = std::min(end, last);
    pieces.push_back(p->second.narrow(0, at - first, take_end - at));
    at = take_end;
  }
  if (at != end) {
    d.error(key, "elements " + std::to_string(at) + ".." + std::to_string(end) + " are in no slice of the checkpoint");
    return {};
  }
  return pieces.size() == 1 ? pieces.front() : torch::cat(pieces);
}

torch::Tensor SlicedState::whole(const std::string& key, const std::vector<int64_t>& shape, Diagnostics& d) const {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  Diagnostics missing;
  const Slices* found = slices_of(key, missing);
  if (found != nullptr && !found->empty()) {
    const auto& last = *found->rbegin();
    if (last.first + last.second.numel() != n) {
      d.error(key, "has " + std::to_string(last.first + last.second.numel()) + " elements, expected " +
                       std::to_string(n) + " " + c10::str(c10::IntArrayRef(shape)));
      return {};
    }
  }
  const torch::Tensor flat = range(key, 0, n, d);
  return flat.defined() ? flat.view(shape) : flat;
}

}  // namespace moeplan::executor
