#include "moeplan/simulator/engine.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace moeplan::sim {

namespace {
// Heap order: the earliest (time, sequence) on top.
bool later(const Event& a, const Event& b) {
  return a.time != b.time ? a.time > b.time : a.sequence > b.sequence;
}
}  // namespace

SimTime to_sim_time(double seconds) {
  assert(std::isfinite(seconds) && seconds >= 0 && "durations are finite and non-negative");
  return SimTime(std::llround(seconds * 1e9));
}

void EventQueue::schedule(SimTime time, uint32_t kind, uint32_t target, uint64_t tag) {
  heap_.push_back({time, next_sequence_++, kind, target, tag});
  std::push_heap(heap_.begin(), heap_.end(), later);
}

Event EventQueue::pop() {
  assert(!heap_.empty() && "pop from an empty event queue");
  std::pop_heap(heap_.begin(), heap_.end(), later);
  Event e = heap_.back();
  heap_.pop_back();
  return e;
}

}  // namespace moeplan::sim
