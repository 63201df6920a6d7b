// Checkpoints (executor/io/checkpoint.h): a step folder of manifest.json and two rank shards, the
// input's three parts. Opened as `moeplan run --resume` opens one, then every parameter and
// AdamW moment of the model put back together from the shards' slices.
//
// Options byte: bit 0 puts the shards' true sizes and CRC-32s into the manifest first.
#include "moeplan/executor/libtorch.h"

#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/model/mixtral.h"

using namespace moeplan;
using namespace moeplan::executor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Files in = fuzz::start_folder(data, size, 3);
  std::map<std::string, std::string_view> shards;
  if (!in.parts[1].empty()) shards["rank-00000.safetensors"] = in.parts[1];
  if (!in.parts[2].empty()) shards["rank-00001.safetensors"] = in.parts[2];
  fuzz::write_with_manifest(in.parts[0], shards, (in.options & 1) != 0);
  try {
    const LoadedCheckpoint checkpoint = open_checkpoint(fuzz::Scratch::get().dir());
    SlicedState state;
    for (const CheckpointFile& f : checkpoint.files) state.add(read_checkpoint_shard(checkpoint, f.name).tensors);
    Diagnostics d;
    for (const ParamInfo& info : mixtral_parameters(fuzz::tiny_model()))
      for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"}) (void)state.whole(prefix + info.name, info.shape, d);
  } catch (const InputError&) {
  }
  return 0;
}
