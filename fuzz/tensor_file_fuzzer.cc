// Tensor files in the safetensors layout (executor/io/tensor_file.h): checkpoint shards and
// Hugging Face shards. The whole file, then one tensor of it alone, as read_hf_parameters asks.
#include "moeplan/executor/libtorch.h"

#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/io/tensor_file.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("shard.safetensors", data, size);
  try {
    const executor::TensorFile file = executor::read_tensor_file(path);
    if (!file.tensors.empty()) {
      const std::set<std::string> only = {file.tensors.back().first};
      if (executor::read_tensor_file(path, &only).tensors.size() != 1)
        fuzz::fail("reading one tensor by name did not give that one tensor");
    }
  } catch (const InputError&) {
  }
  return 0;
}
