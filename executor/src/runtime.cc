#include "moeplan/executor/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <c10/core/CPUAllocator.h>
#include <signal.h>

#include <algorithm>
#include <atomic>

namespace moeplan::executor {

void set_compute_threads(int threads) {
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")); set != nullptr)
    set(threads);
}

void keep_freed_memory() {
#ifdef __GLIBC__
  ::mallopt(M_MMAP_MAX, 0);                  // large blocks come from the heap too
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);      // and stay there once freed (up to 1 GiB of slack)
  ::mallopt(M_TOP_PAD, 64 << 20);            // grow the heap in 64 MiB steps
#endif
}

namespace {

// Each block carries its size in a header one alignment unit wide in front of the tensor data, so
// the data pointer is its own context: LibTorch's raw_allocate (used by some kernels) requires that.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {
    base_free_ = base->raw_deleter();
    TORCH_CHECK(base_free_ != nullptr, "the CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n + kHeader);
    const c10::Device device = inner.device();
    void* block = inner.get();
    if (block == nullptr) return {nullptr, nullptr, &CountingAllocator::free, device};
    TORCH_CHECK(inner.get_context() == block && inner.release_context() == block,
                "the CPU allocator's blocks are not their own context");
    *static_cast<int64_t*>(block) = static_cast<int64_t>(n);
    void* data = static_cast<char*>(block) + kHeader;
    const int64_t live = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
    return {data, data, &CountingAllocator::free, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free; }

  TensorBytes bytes() const { return {live_.load(), peak_.load()}; }
  void reset_peak() const { peak_.store(live_.load()); }

 private:
  static constexpr size_t kHeader = c10::gAlignment;  // keeps the data as aligned as the block

  static void free(void* data) {
    if (data == nullptr) return;
    void* block = static_cast<char*>(data) - kHeader;
    live_.fetch_sub(*static_cast<int64_t*>(block));
    base_free_(block);
  }

  c10::Allocator* base_;
  static inline c10::DeleterFnPtr base_free_ = nullptr;
  static std::atomic<int64_t> live_, peak_;
};

std::atomic<int64_t> CountingAllocator::live_{0};
std::atomic<int64_t> CountingAllocator::peak_{0};

CountingAllocator* counting = nullptr;

}  // namespace

void count_tensor_bytes() {
  if (counting != nullptr) return;
  counting = new CountingAllocator(c10::GetCPUAllocator());  // lives as long as the process
  c10::SetCPUAllocator(counting, /*priority=*/1);
}

TensorBytes tensor_bytes() { return counting != nullptr ? counting->bytes() : TensorBytes{}; }

void reset_peak_tensor_bytes() {
  if (counting != nullptr) counting->reset_peak();
}

void ignore_broken_pipes() { ::signal(SIGPIPE, SIG_IGN); }

}  // namespace moeplan::executor
