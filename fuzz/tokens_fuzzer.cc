// Prepared data folders (executor/io/tokens.h): manifest.json, index.bin and tokens.bin, the
// input's three parts, opened as training opens one, then its first and last blocks read.
//
// Options byte: bit 0 puts the files' true sizes and CRC-32s into the manifest first.
#include "moeplan/executor/libtorch.h"

#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/io/tokens.h"

using namespace moeplan;
using namespace moeplan::executor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Files in = fuzz::start_folder(data, size, 3);
  fuzz::write_with_manifest(in.parts[0], {{"index.bin", in.parts[1]}, {"tokens.bin", in.parts[2]}},
                            (in.options & 1) != 0);
  try {
    const TokenDataset ds = TokenDataset::open(fuzz::Scratch::get().dir());
    const torch::Tensor blocks = ds.blocks({0, ds.num_blocks() - 1});
    if (blocks.size(0) != 2 || blocks.size(1) != ds.block_size()) fuzz::fail("blocks() gave the wrong shape");
  } catch (const InputError&) {
  }
  return 0;
}
