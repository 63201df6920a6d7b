#include "moeplan/executor/model/offload.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace moeplan::executor {

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
  ::close(fd_);
  ::unlink(path_.c_str());
}

void ActivationStore::put(int64_t key, const torch::Tensor& t) {
  const auto start = std::chrono::steady_clock::now();
  // A device's tensor is copied to the host first (and waited for), then written.
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
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
  entries_[key] = Entry{end_, c.sizes().vec(), c.scalar_type(), t.device(), {}, {}};
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
  const Entry entry = it->second;
  it->second.loading_since = std::chrono::steady_clock::now();
  it->second.loading = std::async(std::launch::async, [this, entry] { return read(entry); }).share();
}

torch::Tensor ActivationStore::take(int64_t key) {
  const auto it = entries_.find(key);
  if (it == entries_.end()) throw std::logic_error("activation " + std::to_string(key) + " was never offloaded");
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
  end_ = 0;
  if (::ftruncate(fd_, 0) != 0) fail("truncate failed", path_);
}

}  // namespace moeplan::executor
