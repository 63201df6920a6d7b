#pragma once
// Checkpoints: one folder per saved step, CHECKPOINTS/step-00000010/, holding one tensor file per
// rank (safetensors layout, global parameter names) and manifest.json. Saving is atomic: each
// shard goes to a temporary name, is fsynced and renamed; the manifest, which lists every shard
// with its size and CRC-32, is written last the same way. A folder without a manifest, or whose
// files do not match it, never loads.

#include <cstdint>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/executor/tensor_file.h"

namespace moeplan::executor {

struct CheckpointFile {
  std::string name;  // relative to the step folder
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

// The folder of a step: CHECKPOINTS/step-00000010.
std::string step_folder(const std::string& checkpoints_dir, int64_t step);

// Creates (or reopens) the folder of a step and removes any manifest in it, so that the folder
// is not loadable while it is rewritten. Returns the folder's path.
std::string begin_checkpoint(const std::string& checkpoints_dir, int64_t step);

// Writes one rank's shard atomically.
CheckpointFile write_checkpoint_shard(const std::string& step_dir, int64_t rank, const NamedTensors& tensors);

// Writes the manifest (the commit point): `state` is the trainer's JSON, `files` every shard.
void commit_checkpoint(const std::string& step_dir, int64_t step, const Json& state,
                       const std::vector<CheckpointFile>& files);

// The newest step folder with a manifest, or "" if there is none. Does not verify the files.
std::string latest_checkpoint(const std::string& checkpoints_dir);

struct LoadedCheckpoint {
  std::string dir;
  int64_t step = 0;
  Json state;
  std::vector<CheckpointFile> files;
};

// Reads the manifest and verifies every file's size and CRC-32. Throws InputError naming the
// file at fault.
LoadedCheckpoint open_checkpoint(const std::string& step_dir);

// The tensors of one listed shard (after open_checkpoint verified it).
TensorFile read_checkpoint_shard(const LoadedCheckpoint& checkpoint, const std::string& name);

}  // namespace moeplan::executor
