// A fuzz target without libFuzzer: runs each file named on the command line through the
// target once, as libFuzzer does with its file arguments. The ordinary and sanitizer builds
// link every target with this, so that ctest replays fuzz/regressions/ and the seed corpus in
// them (scripts/fuzz builds the coverage-guided targets with clang instead).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Defined by the targets that set something up once (libFuzzer calls it the same way).
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot read %s\n", argv[0], argv[i]);
      return 2;
    }
    const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    // An empty input is passed as libFuzzer passes it: a valid pointer and size 0.
    static const uint8_t kEmpty = 0;
    const auto* data = bytes.empty() ? &kEmpty : reinterpret_cast<const uint8_t*>(bytes.data());
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", argv[i], bytes.size());
    LLVMFuzzerTestOneInput(data, bytes.size());
    ++replayed;
  }
  std::printf("replayed %d inputs, none crashed\n", replayed);
  return 0;
}
