#pragma once
// Offloaded activations. A GPU rank's go to pinned host memory, copied on a stream of their own
// (the copy stream) that waits for the activation to be made, and come back on it where read
// ahead: the compute stream waits only when it needs the tensor. A CPU rank's "device" memory
// is its host memory, so its activations go to a file (in the page cache or on disk, outside
// the rank's resident set) and the saving is real and measurable. Reads can be started ahead of
// use, which is how the backward pass prefetches `activation_loading_horizon` blocks ahead.

#include "moeplan/executor/libtorch.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace moeplan::executor {

class ActivationStore {
 public:
  // Creates (truncates) the file at path; it is removed when the store is destroyed.
  explicit ActivationStore(std::string path);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // Writes t under key (replacing an earlier entry of the same key).
  void put(int64_t key, const torch::Tensor& t);
  // Starts reading key in the background, if it is stored and not already on its way.
  void prefetch(int64_t key);
  // The tensor of key (waits for a prefetch); the entry is dropped afterwards.
  torch::Tensor take(int64_t key);
  // Forgets every entry and starts the file over (at the start of a step).
  void clear();

  // Called after each write ("offload") and each read back ("reload": from the start of the
  // read, or of its prefetch, to when the tensor was handed over), for the measured trace. A GPU
  // rank's copies are timed on the copy stream, by events, and reported by report_copies().
  using Observer = std::function<void(const char* op, int64_t bytes, std::chrono::steady_clock::time_point start,
                                      std::chrono::steady_clock::time_point end)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  // With the device idle (the step's work waited for): the GPU copies since the last call, each
  // placed on the host clock from its events' times after a reference event recorded when the
  // device was last idle, to the observer; then a new reference.
  void report_copies();
  // The device is idle now (a step starts): the reference the next copies are timed against.
  void device_idle(const torch::Device& device);

  int64_t bytes_written() const { return bytes_written_; }
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct DeviceCopies;  // a GPU rank's copy stream and events (offload.cc)
  struct Entry {
    int64_t offset = 0;
    std::vector<int64_t> shape;
    torch::ScalarType dtype = torch::kFloat;
    torch::Device device = torch::kCPU;  // where the tensor was, and is taken back to
    std::shared_future<torch::Tensor> loading;
    std::chrono::steady_clock::time_point loading_since;
    // A GPU tensor's: its pinned host copy, and the tensor coming back on the copy stream once
    // prefetched.
    torch::Tensor host, back;
  };
  torch::Tensor read(const Entry& e) const;
  DeviceCopies& copies(const torch::Device& device);
  void put_on_host(int64_t key, const torch::Tensor& t);
  void prefetch_to_device(Entry& e, int64_t key);
  torch::Tensor take_from_host(Entry& e, int64_t key);

  std::string path_;
  int fd_ = -1;
  int64_t end_ = 0;
  std::map<int64_t, Entry> entries_;
  int64_t bytes_written_ = 0, bytes_read_ = 0;
  Observer observer_;
  std::unique_ptr<DeviceCopies> copies_;
};

}  // namespace moeplan::executor
