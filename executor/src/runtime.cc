#include "moeplan/executor/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <signal.h>

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

void ignore_broken_pipes() { ::signal(SIGPIPE, SIG_IGN); }

}  // namespace moeplan::executor
