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

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), static_cast<int64_t>(n)};
    const int64_t live = live_.fetch_add(context->bytes) + context->bytes;
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
    return {data, context, &CountingAllocator::free, device};
  }

  TensorBytes bytes() const { return {live_.load(), peak_.load()}; }
  void reset_peak() const { peak_.store(live_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;  // frees the memory when the context is deleted
    int64_t bytes;
  };
  static void free(void* p) {
    auto* context = static_cast<Context*>(p);
    live_.fetch_sub(context->bytes);
    delete context;
  }

  c10::Allocator* base_;
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
