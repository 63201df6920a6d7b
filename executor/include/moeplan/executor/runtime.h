#pragma once
// Process-wide settings of a CPU rank: how many threads its math uses and how freed memory is
// kept. Called once at the start of a rank, before any tensor work.

#include <cstdint>

namespace moeplan::executor {

// Sets LibTorch's intra-op threads and, when the BLAS library is OpenBLAS (Debian's LibTorch
// takes whatever libblas.so.3 is selected and does not tell it), OpenBLAS's own pool too:
// otherwise OpenBLAS runs one thread per core in every rank and they spin against each other.
void set_compute_threads(int threads);

// Keeps freed memory in the heap for reuse instead of returning it to the kernel, like the CUDA
// caching allocator does on a GPU. Without it every large activation is a fresh mmap whose
// pages the kernel zero-fills again, step after step (a quarter of the step time here).
void keep_freed_memory();

// Counts the bytes of live CPU tensors by wrapping LibTorch's CPU allocator: what a rank's
// tensors hold, apart from what the heap keeps around them (fragmentation, freed blocks kept by
// keep_freed_memory) and the runtime's own memory. Installed once; tensors allocated before are
// not counted.
void count_tensor_bytes();
struct TensorBytes {
  int64_t live = 0;
  int64_t peak = 0;  // since count_tensor_bytes() or the last reset
};
TensorBytes tensor_bytes();
void reset_peak_tensor_bytes();

// Writing to a peer that died raises SIGPIPE, whose default action kills this rank silently.
// Ignored, the write fails instead and the collective reports which operation and group it was.
void ignore_broken_pipes();

}  // namespace moeplan::executor
