#include "moeplan/executor/model/offload.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moeplan/executor/ranks/device.h"

#if MOEPLAN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace moeplan::executor {

#if MOEPLAN_WITH_CUDA
// A GPU rank's copy stream, and the events that time its copies: each copy between a start and
// an end event, placed on the host clock against a reference event recorded when the device was
// idle (report_copies).
struct ActivationStore::DeviceCopies {
  explicit DeviceCopies(const torch::Device& device)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
    mark_reference();
  }
  struct Copy {
    const char* op;
    int64_t bytes;
    std::unique_ptr<c10::cuda::CUDAEvent> start, end;
    std::chrono::steady_clock::time_point issued;  // when its start was queued: no sooner on the device
  };
  static std::unique_ptr<c10::cuda::CUDAEvent> timed() {
    return std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault);
  }
  void mark_reference() {
    reference = timed();
    reference->record(stream);
    reference_time = std::chrono::steady_clock::now();
  }
  c10::cuda::CUDAStream stream;
  std::unique_ptr<c10::cuda::CUDAEvent> reference;
  std::chrono::steady_clock::time_point reference_time;
  std::vector<Copy> done;                           // copies of this step, reported by report_copies
  std::map<int64_t, std::unique_ptr<c10::cuda::CUDAEvent>> stored, loaded;  // per key: copy ends
};
#else
struct ActivationStore::DeviceCopies {};
#endif

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error("activation offload file " + path + ": " + what + ": " + std::strerror(errno));
}

}  // namespace

ActivationStore::ActivationStore(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd_ < 0) fail("cannot create", path_);
}

ActivationStore::~ActivationStore() {
  for (auto& [key, e] : entries_)
    if (e.loading.valid()) e.loading.wait();
#if MOEPLAN_WITH_CUDA
  if (copies_) {
    try {
      copies_->stream.synchronize();  // no copy still reading or writing what goes now
    } catch (const std::exception&) {
      // A device already in error: nothing left to wait for.
    }
  }
#endif
  ::close(fd_);
  ::unlink(path_.c_str());
}

void ActivationStore::put(int64_t key, const torch::Tensor& t) {
  if (t.is_cuda()) {
    put_on_host(key, t);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const torch::Tensor c = t.detach().contiguous();
  const auto* data = static_cast<const char*>(c.data_ptr());
  const int64_t n = static_cast<int64_t>(c.nbytes());
  for (int64_t done = 0; done < n;) {
    const ssize_t w = ::pwrite(fd_, data + done, static_cast<size_t>(n - done), end_ + done);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write failed", path_);
    }
    done += w;
  }
  Entry e;
  e.offset = end_;
  e.shape = c.sizes().vec();
  e.dtype = c.scalar_type();
  e.device = t.device();
  entries_[key] = std::move(e);
  end_ += n;
  bytes_written_ += n;
  if (observer_) observer_("offload", n, start, std::chrono::steady_clock::now());
}

torch::Tensor ActivationStore::read(const Entry& e) const {
  torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  auto* data = static_cast<char*>(t.data_ptr());
  const int64_t n = static_cast<int64_t>(t.nbytes());
  for (int64_t done = 0; done < n;) {
    const ssize_t r = ::pread(fd_, data + done, static_cast<size_t>(n - done), e.offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail("read failed", path_);
    done += r;
  }
  return t;
}

void ActivationStore::prefetch(int64_t key) {
  const auto it = entries_.find(key);
  if (it == entries_.end() || it->second.loading.valid()) return;
  if (it->second.host.defined()) {
    prefetch_to_device(it->second, key);
    return;
  }
  const Entry entry = it->second;
  it->second.loading_since = std::chrono::steady_clock::now();
  it->second.loading = std::async(std::launch::async, [this, entry] { return read(entry); }).share();
}

torch::Tensor ActivationStore::take(int64_t key) {
  const auto it = entries_.find(key);
  if (it == entries_.end()) throw std::logic_error("activation " + std::to_string(key) + " was never offloaded");
  if (it->second.host.defined()) {
    torch::Tensor t = take_from_host(it->second, key);
    entries_.erase(it);
    return t;
  }
  const bool prefetched = it->second.loading.valid();
  const auto start = prefetched ? it->second.loading_since : std::chrono::steady_clock::now();
  torch::Tensor t = prefetched ? it->second.loading.get() : read(it->second);
  t = t.to(it->second.device);
  bytes_read_ += static_cast<int64_t>(t.nbytes());
  if (observer_) observer_("reload", static_cast<int64_t>(t.nbytes()), start, std::chrono::steady_clock::now());
  entries_.erase(it);
  if (entries_.empty()) end_ = 0;  // every entry was read back: reuse the file from its start
  return t;
}

void ActivationStore::clear() {
  for (auto& [key, e] : entries_)
    if (e.loading.valid()) e.loading.wait();
  entries_.clear();
  if (copies_) copies_->stream.synchronize();  // the host copies are unused from here
  end_ = 0;
  if (::ftruncate(fd_, 0) != 0) fail("truncate failed", path_);
}


// ---------------------------------------------------------------------------------------------
// A GPU rank's activations: pinned host memory over the copy stream.

#if MOEPLAN_WITH_CUDA

ActivationStore::DeviceCopies& ActivationStore::copies(const torch::Device& device) {
  if (!copies_) copies_ = std::make_unique<DeviceCopies>(device);
  return *copies_;
}

void ActivationStore::put_on_host(int64_t key, const torch::Tensor& t) {
  DeviceCopies& c = copies(t.device());
  const torch::Tensor source = t.detach().contiguous();
  // The copy stream starts once the compute stream has made the tensor.
  c10::cuda::CUDAEvent made;
  made.record(c10::cuda::getCurrentCUDAStream(t.device().index()));
  made.block(c.stream);
  torch::Tensor host = torch::empty(source.sizes(), source.options().device(torch::kCPU).pinned_memory(true));
  DeviceCopies::Copy copy{"offload", static_cast<int64_t>(source.nbytes()), DeviceCopies::timed(), DeviceCopies::timed(),
                          std::chrono::steady_clock::now()};
  {
    const c10::cuda::CUDAStreamGuard on_copy_stream(c.stream);
    copy.start->record(c.stream);
    host.copy_(source, /*non_blocking=*/true);
    copy.end->record(c.stream);
  }
  // The tensor's memory goes back to the caching allocator when its last user lets go, the
  // compute stream's; this keeps it from being handed out again before the copy has read it.
  c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), c.stream);
  auto stored = std::make_unique<c10::cuda::CUDAEvent>();
  stored->record(c.stream);
  c.stored[key] = std::move(stored);
  c.loaded.erase(key);
  c.done.push_back(std::move(copy));
  Entry e;
  e.shape = source.sizes().vec();
  e.dtype = source.scalar_type();
  e.device = t.device();
  e.host = std::move(host);
  entries_[key] = std::move(e);
  bytes_written_ += static_cast<int64_t>(source.nbytes());
}

void ActivationStore::prefetch_to_device(Entry& e, int64_t key) {
  if (e.back.defined()) return;
  DeviceCopies& c = copies(e.device);
  DeviceCopies::Copy copy{"reload", static_cast<int64_t>(e.host.nbytes()), DeviceCopies::timed(), DeviceCopies::timed(),
                          std::chrono::steady_clock::now()};
  // On the copy stream, after the copy to the host (the same stream): memory for it from the
  // copy stream's pool, handed to the compute stream in take.
  const c10::cuda::CUDAStreamGuard on_copy_stream(c.stream);
  copy.start->record(c.stream);
  e.back = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype).device(e.device));
  e.back.copy_(e.host, /*non_blocking=*/true);
  copy.end->record(c.stream);
  auto loaded = std::make_unique<c10::cuda::CUDAEvent>();
  loaded->record(c.stream);
  c.loaded[key] = std::move(loaded);
  c.done.push_back(std::move(copy));
}

torch::Tensor ActivationStore::take_from_host(Entry& e, int64_t key) {
  DeviceCopies& c = copies(e.device);
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(e.device.index());
  torch::Tensor t;
  if (const auto it = c.loaded.find(key); it != c.loaded.end() && e.back.defined()) {
    it->second->block(compute);  // the compute stream waits for the read-ahead, the host does not
    c10::cuda::CUDACachingAllocator::recordStream(e.back.storage().data_ptr(), compute);
    t = std::move(e.back);
    c.loaded.erase(it);
  } else {
    // Not read ahead: copied now on the compute stream, after the copy to the host.
    if (const auto stored = c.stored.find(key); stored != c.stored.end()) stored->second->block(compute);
    DeviceCopies::Copy copy{"reload", static_cast<int64_t>(e.host.nbytes()), DeviceCopies::timed(), DeviceCopies::timed(),
                          std::chrono::steady_clock::now()};
    copy.start->record(compute);
    t = e.host.to(e.device, /*non_blocking=*/true);
    copy.end->record(compute);
    c.done.push_back(std::move(copy));
  }
  c.stored.erase(key);
  bytes_read_ += static_cast<int64_t>(t.nbytes());
  return t;
}

void ActivationStore::device_idle(const torch::Device& device) { copies(device).mark_reference(); }

void ActivationStore::report_copies() {
  if (!copies_) return;
  DeviceCopies& c = *copies_;
  c.stream.synchronize();
  if (observer_)
    for (const DeviceCopies::Copy& copy : c.done)
      observer_(copy.op, copy.bytes, host_time_of(*c.reference, c.reference_time, *copy.start, copy.issued),
                host_time_of(*c.reference, c.reference_time, *copy.end, copy.issued));
  c.done.clear();
  c.mark_reference();
}

#else

ActivationStore::DeviceCopies& ActivationStore::copies(const torch::Device& device) {
  throw std::logic_error("activation offload: a tensor on " + device.str() + ", but this moeplan has no CUDA");
}
void ActivationStore::put_on_host(int64_t, const torch::Tensor& t) { (void)copies(t.device()); }
void ActivationStore::prefetch_to_device(Entry& e, int64_t) { (void)copies(e.device); }
torch::Tensor ActivationStore::take_from_host(Entry& e, int64_t) {
  (void)copies(e.device);
  return {};
}
void ActivationStore::report_copies() {}
void ActivationStore::device_idle(const torch::Device& device) {
  if (device.is_cuda()) (void)copies(device);
}

#endif

}  // namespace moeplan::executor
