#pragma once
// A cluster plan made small enough to rehearse on local CPU ranks (`moeplan run --rehearse`):
// the same layout (world size; expert, shard and replica degrees; placement; checkpointing;
// offloading; dispatcher; micro-batch size and count), with a model narrower and shallower that
// keeps its experts and top-k, on the vocabulary and sequence length of the local data.

#include <cstdint>
#include <vector>

#include "moeplan/core/plan.h"

namespace moeplan::planner {

struct Shrink {
  int64_t width = 32;  // hidden and intermediate sizes are divided by this
  int64_t layers = 2;  // blocks kept
  // Micro-batches a step at most: past its warm-up a pipeline's schedule repeats every P
  // micro-batches, so more add time, not mechanics. 0: the plan's.
  int64_t micro_batches = 32;
};

// The model shrunk: hidden and intermediate sizes / width; of the width, the largest factor d
// with d * d <= width that divides the head counts divides them, head_dim takes the rest (so
// Mixtral's 32 heads of 128 at width 32 become 8 heads of 16, 2 key-value heads). Latent
// attention's latents shrink by the width, its rotary and value head parts with head_dim; dense
// first blocks are kept to at most half of the blocks. Experts, top-k, norms, RoPE, the router
// and multi-token prediction stay. Throws InputError naming --shrink-width or --shrink-layers
// when a size does not divide.
ModelSpec shrink_model(const ModelSpec& model, const Shrink& shrink, int64_t vocab_size, int64_t seq_len);

// The plan to rehearse: `plan`'s cluster and layout with the shrunk model (its blocks rounded up
// to a multiple of the pipeline's P x V chunks, so that each chunk keeps one or more), fp32 (so that losses
// can be compared with one rank's to 1e-4), `steps` steps without warm-up, the global batch of
// seq_len-token sequences the layout implies, and the memory model's prediction for it with the
// executor's eager kernels (cluster.kernels = eager).
Plan rehearsal_plan(const Plan& plan, const Shrink& shrink, int64_t vocab_size, int64_t seq_len, int64_t steps);

// One rank that trains the rehearsal's whole global batch (its micro-batches one after another,
// no checkpointing or offloading): the losses the layout must reproduce.
Plan reference_plan(const Plan& rehearsal);

// The rehearsal plan predicted again with the expert load its run measured: `load` is the most
// token-expert rows one rank's experts computed in a layer of a micro-batch, over the mean
// (k x micro-batch tokens). It becomes moe.tokens_per_expert with the first expert rank that busy
// and the others even. The memory model takes the load as an input (a plan on a cluster is given
// one); a randomly initialised router is uneven, and the busiest micro-batch sizes the peak.
Plan with_measured_load(const Plan& rehearsal, double load);

// Bytes of live tensors per CPU rank the memory model predicts for a plan: its device items
// without the framework's own memory and the caching allocator's fragmentation (a CPU rank counts
// tensors, not a GPU's reserved memory). On gloo the executor's reduce-scatter is an all-to-all
// that receives a whole unit's gradient, not one shard; it is not counted, because that
// moment is not the peak (the peak is in a block's backward, before its gradients leave).
int64_t predicted_cpu_tensor_bytes(const Plan& plan);

}  // namespace moeplan::planner
