// What the LibTorch targets share (linked into each as an object: libFuzzer only looks for
// LLVMFuzzerInitialize, it does not pull it from a library): one intra-op thread, so that an
// input runs the same way every time and a run of many targets does not oversubscribe the CPUs.
#include "moeplan/executor/libtorch.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}
