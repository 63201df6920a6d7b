// Stand-ins for the executor commands when moeplan was built without LibTorch.
#include <cstdio>

#include "command.h"
#include "executor_commands.h"

namespace moeplan::cli {

namespace {

int not_built(const char* command) {
  std::fprintf(stderr,
               "moeplan: error: %s needs the executor, which this build does not have "
               "(install libtorch-dev, libgloo-dev and libsentencepiece-dev, then rebuild)\n",
               command);
  return kExitBadInput;
}

}  // namespace

int run_run(const RunArgs&) { return not_built("run"); }
int run_calibrate(const CalibrateArgs&) { return not_built("calibrate"); }
int run_export(const ExportArgs&) { return not_built("export"); }

}  // namespace moeplan::cli
