#include "moeplan/executor/ranks/runtime.h"

#include <ATen/Parallel.h>
#include <malloc.h>
#include <c10/core/CPUAllocator.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

namespace moeplan::executor {

void set_compute_threads(int threads) { at::set_num_threads(threads); }

void keep_freed_memory() {
#ifdef __GLIBC__
  ::mallopt(M_MMAP_MAX, 0);                  // large blocks come from the heap too
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);      // and stay there once freed (up to 1 GiB of slack)
  ::mallopt(M_TOP_PAD, 64 << 20);            // grow the heap in 64 MiB steps
#endif
}

namespace {

// The CPU tensor allocator of a rank. Blocks of at least 2 MiB get a mapping of their own, a
// whole number of huge pages long and backed by huge pages where the kernel allows (transparent
// huge pages, madvise mode); smaller ones come from the C heap. In glibc's heap, big blocks freed
// between long-lived activations leave holes that keep the heap's extent, and so the resident
// set, up to twice the live tensor bytes; mapped, the resident set follows them (docs/memory-model.md).
//
// A freed mapping is kept for the next block of its length, as CUDA's caching allocator keeps
// device memory: a training step asks for the same sizes in the same order every step, and
// a mapping returned to the kernel would be faulted in and zero-filled again by the next one
// (a tenth of a small model's step). Kept mappings are returned only to stay within the most
// bytes of mappings ever live at once: the resident set never exceeds its peak without the
// cache, it only stops shrinking after it.
//
// Each block carries its size, and its mapping's length, in a header one alignment unit wide in
// front of the tensor data, so the data pointer is its own context: LibTorch's raw_allocate (used
// by some kernels) requires that.
class TensorAllocator final : public c10::Allocator {
 public:
  explicit TensorAllocator(c10::Allocator* base) : base_(base) {
    base_free_ = base->raw_deleter();
    TORCH_CHECK(base_free_ != nullptr, "the CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t n) override { return allocate_block(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TensorAllocator::free; }

  TensorBytes bytes() const {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    return {live_.load(), peak_.load(), static_cast<int64_t>(mapped_), static_cast<int64_t>(mapped_ - kept_bytes_),
            static_cast<int64_t>(mapped_peak_live_)};
  }
  void reset_peak() const { peak_.store(live_.load()); }

 private:
  static constexpr size_t kHeader = c10::gAlignment;  // keeps the data as aligned as the block

  static constexpr size_t kHugePage = size_t{2} << 20;
  static constexpr size_t kLarge = kHugePage;
  static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

  // A block of n bytes behind its header (the class comment).
  c10::DataPtr allocate_block(size_t n) const {
    void* block = nullptr;
    int64_t mapped = 0;
    c10::Device device(c10::kCPU);
    if (n >= kLarge) {
      mapped = static_cast<int64_t>(round_up(n + kHeader, kHugePage));
      block = take_mapping(static_cast<size_t>(mapped));
    } else {
      c10::DataPtr inner = base_->allocate(n + kHeader);
      device = inner.device();
      block = inner.get();
      if (block == nullptr) return {nullptr, nullptr, &TensorAllocator::free, device};
      TORCH_CHECK(inner.get_context() == block && inner.release_context() == block,
                  "the CPU allocator's blocks are not their own context");
    }
    auto* header = static_cast<int64_t*>(block);
    header[0] = static_cast<int64_t>(n);
    header[1] = mapped;
    void* data = static_cast<char*>(block) + kHeader;
    const int64_t live = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
    return {data, data, &TensorAllocator::free, device};
  }

  // A mapping of `bytes` (a whole number of huge pages) for a large block: one kept from a freed
  // block of that length, else a new one, after returning kept ones while the mappings would
  // otherwise exceed their live peak (the class comment).
  static void* take_mapping(size_t bytes) {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto kept = kept_.find(bytes); kept != kept_.end()) {
      void* block = kept->second;
      kept_.erase(kept);
      kept_bytes_ -= bytes;
      note_live_mapping_locked();
      return block;
    }
    const size_t live_mapped = mapped_ - kept_bytes_;
    while (!kept_.empty() && mapped_ + bytes > std::max(mapped_peak_live_, live_mapped + bytes)) {
      auto largest = std::prev(kept_.end());
      ::munmap(largest->second, largest->first);
      mapped_ -= largest->first;
      kept_bytes_ -= largest->first;
      kept_.erase(largest);
    }
    void* block = map(bytes);
    mapped_ += bytes;
    note_live_mapping_locked();
    return block;
  }

  static void note_live_mapping_locked() { mapped_peak_live_ = std::max(mapped_peak_live_, mapped_ - kept_bytes_); }

  // A new mapping, starting at a huge-page boundary so that the kernel can back it with huge pages.
  static void* map(size_t bytes) {
    const size_t reserve = bytes + kHugePage;
    void* raw = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "out of memory: could not map ", bytes, " bytes for a tensor");
    const auto begin = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = round_up(begin, kHugePage);
    if (aligned > begin) ::munmap(raw, aligned - begin);
    const uintptr_t end = begin + reserve, used_end = aligned + bytes;
    if (end > used_end) ::munmap(reinterpret_cast<void*>(used_end), end - used_end);
    ::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // a hint: may be refused
    return reinterpret_cast<void*>(aligned);
  }

  static void free(void* data) {
    if (data == nullptr) return;
    void* block = static_cast<char*>(data) - kHeader;
    const auto* header = static_cast<const int64_t*>(block);
    live_.fetch_sub(header[0]);
    if (header[1] > 0) {
      const std::lock_guard<std::mutex> lock(cache_mutex_);
      kept_.emplace(static_cast<size_t>(header[1]), block);
      kept_bytes_ += static_cast<size_t>(header[1]);
    } else
      base_free_(block);
  }

  c10::Allocator* base_;
  static inline c10::DeleterFnPtr base_free_ = nullptr;
  static std::atomic<int64_t> live_, peak_;
  // Mappings of freed large blocks by length, and the byte counts of the mappings (guarded by
  // cache_mutex_): all of them, the kept ones, and the most ever live at once.
  static inline std::mutex cache_mutex_;
  static inline std::multimap<size_t, void*> kept_;
  static inline size_t mapped_ = 0, kept_bytes_ = 0, mapped_peak_live_ = 0;
};

std::atomic<int64_t> TensorAllocator::live_{0};
std::atomic<int64_t> TensorAllocator::peak_{0};

TensorAllocator* installed = nullptr;

}  // namespace

void install_tensor_allocator() {
  if (installed != nullptr) return;
  installed = new TensorAllocator(c10::GetCPUAllocator());  // lives as long as the process
  c10::SetCPUAllocator(installed, /*priority=*/1);
}

TensorBytes tensor_bytes() { return installed != nullptr ? installed->bytes() : TensorBytes{}; }

void reset_peak_tensor_bytes() {
  if (installed != nullptr) installed->reset_peak();
}

void StepPeaks::begin_step() {
  before_ = std::max(before_, tensor_bytes().peak);
  reset_peak_tensor_bytes();
}

void StepPeaks::end_step() { steps_ = std::max(steps_, tensor_bytes().peak); }

int64_t StepPeaks::whole_run() const { return std::max(before_, tensor_bytes().peak); }

void ignore_broken_pipes() { ::signal(SIGPIPE, SIG_IGN); }

}  // namespace moeplan::executor
