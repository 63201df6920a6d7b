// Training logs of other frameworks (moeplan/frameworks/training_log.h: Megatron-LM,
// torchtitan, SMP's script, the Hugging Face Trainer), as `moeplan compare --log` reads them.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/frameworks/training_log.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("train.log", data, size);
  try {
    const TrainingLog log = read_training_log(path);
    if (log.iterations.empty()) fuzz::fail("an accepted log holds no iteration");
  } catch (const InputError&) {
  }
  return 0;
}
