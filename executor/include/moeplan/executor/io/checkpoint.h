#pragma once
// Checkpoints: one folder per saved step, CHECKPOINTS/step-00000010/, holding one tensor file per
// rank (safetensors layout, global parameter names) and manifest.json. Saving is atomic: each
// shard goes to a temporary name, is fsynced and renamed; the manifest, which lists every shard
// with its size and CRC-32, is written last the same way. A folder without a manifest, or whose
// files do not match it, never loads.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/executor/io/tensor_file.h"

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

// The file name of a rank's shard: rank-00003.safetensors.
std::string shard_name(int64_t rank);

// Writes one rank's shard atomically: a write that fails leaves no file behind.
CheckpointFile write_checkpoint_shard(const std::string& step_dir, int64_t rank, const NamedTensors& tensors);

// Removes one rank's shard of a save that failed, and its temporary file if any.
void remove_checkpoint_shard(const std::string& step_dir, int64_t rank);

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

// Checkpoint tensors of any layout, by parameter: a whole tensor "param/<name>", slices
// "param/<name>@<first element>" of its flattened values, or, for a matrix split by columns
// over tensor-parallel ranks, slices "param/<name>#cols<c0>:<c1>of<C>@<first element>" of its
// flattened columns [c0, c1) of C. Column blocks are put together when the tensor is first read.
class SlicedState {
 public:
  void add(const NamedTensors& tensors);
  // Elements [begin, end) of the flattened tensor `key` ("param/<name>", ...), in the stored
  // type; reports into d (and returns an undefined tensor) when the slices do not cover the
  // range exactly once or their types differ.
  torch::Tensor range(const std::string& key, int64_t begin, int64_t end, Diagnostics& d) const;
  // The whole tensor, shaped.
  torch::Tensor whole(const std::string& key, const std::vector<int64_t>& shape, Diagnostics& d) const;
  bool contains(const std::string& key) const { return slices_.count(key) != 0 || columns_.count(key) != 0; }

 private:
  using Slices = std::map<int64_t, torch::Tensor>;  // first element -> values
  // The slices of `key`, its column blocks put together first; nullptr (reported into d) when
  // there are none or the blocks do not fit together.
  const Slices* slices_of(const std::string& key, Diagnostics& d) const;

  struct ColumnBlock {
    int64_t end = 0, total = 0;  // columns [c0, end) of total
    Slices slices;
  };
  mutable std::map<std::string, Slices> slices_;
  std::map<std::string, std::map<int64_t, ColumnBlock>> columns_;  // key -> c0 -> block
};

}  // namespace moeplan::executor
