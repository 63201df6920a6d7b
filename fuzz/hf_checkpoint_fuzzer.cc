// Hugging Face model folders (executor/model/hf_checkpoint.h), as `moeplan run --init-from` reads
// one: config.json, model.safetensors.index.json and one shard, the input's three parts. With
// no index the shard is model.safetensors, else model-00001-of-00001.safetensors.
#include "moeplan/executor/libtorch.h"

#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/mixtral.h"

using namespace moeplan;
using namespace moeplan::executor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::Files in = fuzz::start_folder(data, size, 3);
  fuzz::Scratch& scratch = fuzz::Scratch::get();
  scratch.write("config.json", in.parts[0]);
  if (in.parts[1].empty()) {
    scratch.write("model.safetensors", in.parts[2]);
  } else {
    scratch.write("model.safetensors.index.json", in.parts[1]);
    scratch.write("model-00001-of-00001.safetensors", in.parts[2]);
  }
  try {
    const SlicedState state = read_hf_parameters(scratch.dir(), fuzz::tiny_model(), torch::kFloat);
    // What the trainers do next (load_hugging_face): every parameter whole.
    Diagnostics d;
    for (const ParamInfo& info : mixtral_parameters(fuzz::tiny_model()))
      (void)state.whole("param/" + info.name, info.shape, d);
    d.throw_if_any(scratch.dir());
  } catch (const InputError&) {
  }
  return 0;
}
