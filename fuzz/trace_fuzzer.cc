// Traces (core/trace.h, Chrome trace events): the streaming reader `moeplan view` uses and the
// document reader, then what the viewer does with two traces (phases side by side, one aligned
// on the other). A trace read is never written again (moeplan writes the traces it makes), so
// there is no round trip here.
#include <cstddef>
#include <cstdint>
#include <optional>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/trace.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("trace.json", data, size);
  std::optional<Trace> streamed, whole;
  try {
    streamed = read_trace_file(path);
  } catch (const InputError&) {
  }
  try {
    whole = trace_from_json(parse_json_text(std::string_view(reinterpret_cast<const char*>(data), size), path), path);
  } catch (const InputError&) {
  }
  for (const std::optional<Trace>& trace : {streamed, whole}) {
    if (!trace) continue;
    (void)step_phases(*trace, 0);
    (void)compare_phases(*trace, *trace);
    (void)align_phases(*trace, *trace);
    (void)plan_difference(*trace, *trace);
  }
  return 0;
}
