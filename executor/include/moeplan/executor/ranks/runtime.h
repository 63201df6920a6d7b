#pragma once
// Process-wide settings of a CPU rank: how many threads its math uses and how freed memory is
// kept. Called once at the start of a rank, before any tensor work.

#include <cstdint>

namespace moeplan::executor {

// Sets LibTorch's intra-op threads (its OpenMP pool, which MKL's matrix multiplies and oneDNN's
// use too).
void set_compute_threads(int threads);

// Keeps freed memory in the heap for reuse instead of returning it to the kernel, like the CUDA
// caching allocator does on a GPU. Without it every block above glibc's mmap threshold is a
// fresh mapping of small pages that the kernel faults in and zero-fills again, step after step.
// Blocks of 2 MiB and more bypass the heap (install_tensor_allocator).
void keep_freed_memory();

// Installs the rank's CPU tensor allocator (LibTorch's, wrapped): blocks of 2 MiB and more are
// mapped on their own with huge pages, and a freed mapping is kept for the next block of its
// length within the peak of the live ones (as CUDA's caching allocator does), smaller ones come from the heap
// kept by keep_freed_memory; and the bytes of live tensors are counted, apart from what the heap
// keeps around them and the runtime's own memory. Installed once; tensors allocated before are
// neither counted nor mapped.
void install_tensor_allocator();
struct TensorBytes {
  int64_t live = 0;
  int64_t peak = 0;  // since install_tensor_allocator() or the last reset
  int64_t mapped = 0;       // mappings of blocks of 2 MiB and more, those kept for reuse included
  int64_t mapped_live = 0;  // those of live blocks
  int64_t mapped_peak_live = 0;  // the most mapped_live ever was: kept mappings stay within it
};
TensorBytes tensor_bytes();
void reset_peak_tensor_bytes();

// Peaks of live tensor bytes inside the training steps alone (building the model, loading and
// saving checkpoints left out), and over everything since install_tensor_allocator().
class StepPeaks {
 public:
  void begin_step();
  void end_step();
  int64_t steps() const { return steps_; }
  int64_t whole_run() const;

 private:
  int64_t steps_ = 0, before_ = 0;
};

// Writing to a peer that died raises SIGPIPE, whose default action kills this rank silently.
// Ignored, the write fails instead and the collective reports which operation and group it was.
void ignore_broken_pipes();

}  // namespace moeplan::executor
