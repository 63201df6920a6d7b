#pragma once
// The kernels one rank runs for one micro-batch: each GEMM by its shape, the attention core,
// and every memory-bound operation (norms, activations, residual adds, rotary embedding,
// dropout, softmax and cross-entropy, the MoE router, token permutation, FP8 casts, the
// optimizer), as the framework's kernel set runs them (docs/simulator.md, "Kernels"). Each is
// timed from the hardware profile; op_costs() sums them into the ops the step simulator
// schedules, and the trace draws them inside those ops.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/rules.h"

namespace moeplan::sim {

// What a kernel's time counts as in the step's breakdown.
enum class KernelClass : uint8_t { kGemm, kAttention, kMemoryBound };
inline constexpr std::array<std::string_view, 3> kKernelClassNames{"gemm", "attention", "memory_bound"};

// Plain data without initialisers: a KernelList's unused places cost nothing to create.
struct Kernel {
  std::string_view name;  // a constant: "qkv", "norm", "attention.softmax", ...
  KernelClass kind;
  double seconds;
  double flops;  // matrix-multiply FLOPs it executes (0 for memory-bound kernels)
};

// A list of kernels with room for every kernel of one part of a block, kept inline: the search
// builds several for each candidate, so it never allocates.
class KernelList {
 public:
  static constexpr size_t kCapacity = 48;
  void add(std::string_view name, KernelClass kind, double seconds, double flops = 0);
  // Appends another list's kernels, their times and FLOPs multiplied by `times`.
  void append(const KernelList& other, double times = 1.0);
  double seconds() const;
  double seconds(KernelClass kind) const;
  // Seconds of each class, in KernelClass order.
  std::array<double, 3> seconds_by_class() const;
  double flops() const;
  std::span<const Kernel> kernels() const { return {items_.data(), size_}; }
  size_t size() const { return size_; }

 private:
  std::array<Kernel, kCapacity> items_;
  size_t size_ = 0;
};

// The number format of a GEMM's inputs.
enum class GemmType : uint8_t { kBf16, kFp32, kFp8 };

// One GEMM, C[m, n] = A[m, k] B[k, n], `batch` times at once (a batched GEMM). With the
// profile's kernel model: the output split into tiles over the SMs, whole waves of tiles (and
// split-k where there are fewer tiles than SMs), each SM at the peak rate times the profile's
// achieved fraction, but no faster than its operands stream from memory; plus the per-kernel
// overhead. Without it (a CPU profile): FLOPs at the efficiency curve's rate.
double gemm_seconds(const ClusterSpec& cluster, double m, double n, double k, GemmType type, double batch = 1);
// A streaming kernel moving `bytes` to and from device memory.
double memory_seconds(const ClusterSpec& cluster, double bytes);

// The kernels of one micro-batch on one rank, by part.
struct MicroBatchKernels {
  // Attention sub-block: norm, q/k/v projections, rotary embedding, the attention core, the
  // output projection, the residual add (with dropout where the model has it).
  KernelList attention_forward, attention_backward;
  // The attention core alone (what attention_core checkpointing recomputes).
  KernelList core_forward;
  // Latent attention's up projections and rotary embedding (what latent_up checkpointing
  // recomputes); empty without latent attention.
  KernelList latent_up_forward;
  // MoE (or MLP) sub-block at the mean expert load: norm, router, permutation, experts,
  // activation, unpermutation, residual.
  KernelList moe_forward, moe_backward;
  // Final norm, lm head and loss, forward and backward, and the embedding.
  KernelList head_forward, head_backward;
  // The weight gradients of the q/k/v and first MLP GEMMs (the last of each sub-block's
  // backward), which run beside the tensor-parallel collective of the input gradient.
  double attention_wgrad_s = 0, moe_wgrad_s = 0;
};

MicroBatchKernels micro_batch_kernels(const RunConfig& config);
// A dense block's among MoE blocks: those of its one-expert model (dense_block_model), every
// token through its feed-forward layer on every rank.
MicroBatchKernels dense_block_kernels(const RunConfig& config);
// The MoE sub-block on a rank whose experts get `load` times the mean share of the slots.
KernelList moe_kernels(const RunConfig& config, double load, bool backward);
// AdamW over the rank's shard of `parameters` (with gradient clipping's norm), by precision.
KernelList optimizer_kernels(const RunConfig& config, double parameters);

}  // namespace moeplan::sim
