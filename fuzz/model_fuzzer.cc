// Model profiles (core/model_spec.h, profiles/models/*.json) and Hugging Face config.json files,
// as `--model FILE` reads either: read, counted, and read back from what they write.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/model_spec.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("model.json", data, size);
  ModelSpec model;
  try {
    model = read_model_file(path);
  } catch (const InputError&) {
    return 0;
  }
  (void)count_parameters(model);
  (void)forward_flops_per_token(model, model.max_position_embeddings);
  try {
    if (model_from_json(Json(to_json(model)), "again") != model)
      fuzz::fail("an accepted model reads back different after to_json");
  } catch (const InputError& e) {
    fuzz::fail("an accepted model is refused after to_json: " + e.lines().front());
  }
  return 0;
}
