#include "moeplan/core/pipeline_schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moeplan {

std::vector<PipelineAction> pipeline_schedule(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks) {
  const int64_t p = stages, r = stage, m = micro_batches, v = chunks;
  if (p < 1 || r < 0 || r >= p)
    throw std::invalid_argument("pipeline stage " + std::to_string(r) + " is not one of " + std::to_string(p) +
                                " stages");
  if (m < 1) throw std::invalid_argument("a pipeline needs a micro-batch, not " + std::to_string(m));
  if (v < 1) throw std::invalid_argument("a pipeline rank needs a model chunk, not " + std::to_string(v));
  if (v > 1 && m % p != 0)
    throw std::invalid_argument("an interleaved pipeline needs its micro-batches in whole rounds of the stages: " +
                                std::to_string(m) + " micro-batches over " + std::to_string(p) + " stages");
  std::vector<PipelineAction> order;
  order.reserve(static_cast<size_t>(2 * m * v));
  if (v == 1) {
    const int64_t warmup = std::min(p - 1 - r, m);
    for (int64_t i = 0; i < warmup; ++i) order.push_back({true, i, 0});
    for (int64_t i = 0; i < m - warmup; ++i) {
      order.push_back({true, warmup + i, 0});
      order.push_back({false, i, 0});
    }
    for (int64_t i = m - warmup; i < m; ++i) order.push_back({false, i, 0});
    return order;
  }
  // The k-th forward of a rank is micro-batch (k / (P v)) P + k % P: each chunk takes P
  // micro-batches per round, and a round visits the chunks in turn.
  auto micro_batch = [&](int64_t k) { return k / (p * v) * p + k % p; };
  auto forward_chunk = [&](int64_t k) { return k / p % v; };
  auto backward_chunk = [&](int64_t k) { return v - 1 - k / p % v; };
  const int64_t total = m * v;
  const int64_t warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
  for (int64_t k = 0; k < warmup; ++k) order.push_back({true, micro_batch(k), forward_chunk(k)});
  for (int64_t i = 0; i < total - warmup; ++i) {
    const int64_t k = warmup + i;
    order.push_back({true, micro_batch(k), forward_chunk(k)});
    order.push_back({false, micro_batch(i), backward_chunk(i)});
  }
  for (int64_t i = total - warmup; i < total; ++i) order.push_back({false, micro_batch(i), backward_chunk(i)});
  return order;
}

}  // namespace moeplan
