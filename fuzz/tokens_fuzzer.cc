// Prepared data folders (executor/io/tokens.h): manifest.json, index.bin and tokens.bin, the
// input's three parts, opened as training opens one, then its first and last blocks read.
//
// Options byte: bit 0 puts the files' true sizes and CRC-32s into the manifest first.
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/io/tokens.h"

using namespace moeplan;
using namespace moeplan::executor;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Files in = fuzz::split_files(data, size, 3);
  fuzz::Scratch& scratch = fuzz::Scratch::get();
  scratch.clear();
  const std::map<std::string, std::string_view> files = {{"index.bin", in.parts[1]}, {"tokens.bin", in.parts[2]}};
  for (const auto& [name, bytes] : files) scratch.write(name, bytes);
  scratch.write("manifest.json", (in.options & 1) != 0 ? fuzz::with_true_checksums(in.parts[0], files)
                                                       : std::string(in.parts[0]));
  try {
    const TokenDataset ds = TokenDataset::open(scratch.dir());
    const torch::Tensor blocks = ds.blocks({0, ds.num_blocks() - 1});
    if (blocks.size(0) != 2 || blocks.size(1) != ds.block_size()) fuzz::fail("blocks() gave the wrong shape");
  } catch (const InputError&) {
  }
  return 0;
}
