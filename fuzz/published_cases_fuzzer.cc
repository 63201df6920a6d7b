// The published runs `moeplan compare-published` predicts (validation/published.h,
// docs/validation/published/cases.json).
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/validation/published.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("cases.json", data, size);
  try {
    (void)validation::read_published_cases(path);
  } catch (const InputError&) {
  }
  return 0;
}
