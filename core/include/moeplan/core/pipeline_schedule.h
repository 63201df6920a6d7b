#pragma once
// The order in which one pipeline rank runs its forwards and backwards, in core so that the
// simulator times the same order a pipeline-parallel executor runs.
//
// 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
// Megatron-LM", SC21, section 2.2), chunks = 1: stage s runs min(P - 1 - s, m) forwards first,
// then alternates one forward and one backward, then runs the backwards left.
//
// Interleaved (same paper, section 2.2.2), chunks = v > 1: each rank holds v chunks of the
// model, virtual stage s being chunk s / P of rank s % P. As in Megatron-LM's
// forward_backward_pipelining_with_interleaving, rank r runs min(2 (P - r - 1) + (v - 1) P, m v)
// forwards first; its k-th forward is chunk (k / P) % v and its k-th backward chunk
// v - 1 - (k / P) % v, each chunk taking its micro-batches in order, in rounds of P.
// Megatron-LM runs every forward before any backward when m = P; this keeps the formula above
// there too (a valid order as well, and the one the simulator's golden times assume).

#include <cstdint>
#include <vector>

namespace moeplan {

struct PipelineAction {
  bool forward = true;  // false: backward
  int64_t micro_batch = 0;
  int64_t chunk = 0;  // the rank's model chunk, 0 .. chunks - 1
};

// Rank `stage`'s actions, in order: 2 m v of them, each (micro-batch, chunk) once forward and
// once backward, the backward after the forward. Needs stages >= 1, 0 <= stage < stages,
// micro_batches >= 1 and chunks >= 1; chunks > 1 also needs stages to divide micro_batches (as
// Megatron-LM requires). Throws std::invalid_argument otherwise.
std::vector<PipelineAction> pipeline_schedule(int64_t stages, int64_t stage, int64_t micro_batches, int64_t chunks);

}  // namespace moeplan
