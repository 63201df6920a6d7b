// report.json (core/run_report.h): read, the figures `moeplan simulate --measured` and
// `moeplan validate` take from it, and read back from what it writes.
#include <cstddef>
#include <cstdint>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/run_report.h"

using namespace moeplan;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::Scratch::get().write("report.json", data, size);
  RunReport report;
  try {
    report = read_run_report(path);
  } catch (const InputError&) {
    return 0;
  }
  (void)report.phases();
  (void)report.step_time_error();
  (void)report.tokens_per_s_error();
  (void)report.memory_error();
  try {
    (void)run_report_from_json(to_json(report), "again");
  } catch (const InputError& e) {
    fuzz::fail("an accepted report is refused after to_json: " + e.lines().front());
  }
  return 0;
}
