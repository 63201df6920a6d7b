#pragma once
// The discrete-event kernel: integer nanosecond time and a binary-heap event queue ordered by
// (time, sequence number stamped at scheduling), so equal-time events run in the order they
// were scheduled and every run is the same. Events are plain data; the owner dispatches them.

#include <chrono>
#include <cstdint>
#include <vector>

namespace moeplan::sim {

using SimTime = std::chrono::duration<int64_t, std::nano>;

// Seconds to simulated time, rounded to the nearest nanosecond.
SimTime to_sim_time(double seconds);
inline double to_seconds(SimTime t) { return static_cast<double>(t.count()) * 1e-9; }

struct Event {
  SimTime time{0};
  uint64_t sequence = 0;
  uint32_t kind = 0;    // what happens; the owner's enum
  uint32_t target = 0;  // which op, collective or resource
  uint64_t tag = 0;     // e.g. a generation number that lets stale events be dropped
};

class EventQueue {
 public:
  void schedule(SimTime time, uint32_t kind, uint32_t target, uint64_t tag = 0);
  bool empty() const { return heap_.empty(); }
  // Removes and returns the earliest event.
  Event pop();
  uint64_t scheduled() const { return next_sequence_; }
  void reserve(size_t n) { heap_.reserve(n); }

 private:
  std::vector<Event> heap_;
  uint64_t next_sequence_ = 0;
};

}  // namespace moeplan::sim
