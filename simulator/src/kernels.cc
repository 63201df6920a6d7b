#include "moeplan/simulator/kernels.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/units.h"

namespace moeplan::sim {

void KernelList::add(std::string_view name, KernelClass kind, double seconds, double flops) {
  assert(size_ < kCapacity && "a part of a block has more kernels than KernelList holds");
  if (size_ < kCapacity) items_[size_++] = {name, kind, seconds, flops};
}

void KernelList::append(const KernelList& other, double times) {
  for (const Kernel& k : other.kernels()) add(k.name, k.kind, k.seconds * times, k.flops * times);
}

double KernelList::seconds() const {
  double s = 0;
  for (const Kernel& k : kernels()) s += k.seconds;
  return s;
}

double KernelList::seconds(KernelClass kind) const {
  double s = 0;
  for (const Kernel& k : kernels())
    if (k.kind == kind) s += k.seconds;
  return s;
}

std::array<double, 3> KernelList::seconds_by_class() const {
  std::array<double, 3> s{};
  for (const Kernel& k : kernels()) s[static_cast<size_t>(k.kind)] += k.seconds;
  return s;
}

double KernelList::flops() const {
  double f = 0;
  for (const Kernel& k : kernels()) f += k.flops;
  return f;
}

namespace {

// The output tiles cuBLAS picks among for tensor-core GEMMs, from the largest (NVIDIA, "Matrix
// Multiplication Background User's Guide", section "Tile Quantization": 256x128 and 128x256
// are the most efficient, 64x64 the least), as log2 of their sides.
constexpr std::array<std::pair<int, int>, 5> kTileShifts{{{8, 7}, {7, 8}, {7, 7}, {7, 6}, {6, 6}}};
// Split-k stops at this many reduction elements per split.
constexpr int64_t kMinSplitK = 256;

double element_bytes(GemmType type) {
  switch (type) {
    case GemmType::kFp8: return 1;
    case GemmType::kFp32: return kBytesFp32;
    case GemmType::kBf16: return kBytesBf16;
  }
  return kBytesBf16;
}

// The FLOPs one SM executes for a GEMM's tile waves: whole waves of output tiles (every SM
// busy or not), each tile over the whole reduction (or 1/split of it with split-k). In
// integers: the search times millions of GEMMs.
double tile_wave_flops(double m, double n, double k, double batch, int64_t sms) {
  // Whole rows and columns; a size a rounding error above a whole number is that number (an
  // expert's rows are a share of the slots).
  auto whole = [](double x) { return static_cast<int64_t>(std::ceil(x * (1.0 - 1e-9))); };
  const int64_t mi = whole(m), ni = whole(n), ki = whole(k), bi = whole(batch);
  double best = std::numeric_limits<double>::infinity();
  for (const auto& [sm, sn] : kTileShifts) {
    const int64_t tiles = bi * ((mi + (int64_t{1} << sm) - 1) >> sm) * ((ni + (int64_t{1} << sn) - 1) >> sn);
    const double area = static_cast<double>(int64_t{1} << (sm + sn));
    best = std::min(best, static_cast<double>((tiles + sms - 1) / sms) * area * static_cast<double>(ki));
    // Fewer tiles than SMs: cuBLAS splits the reduction (split-k) to fill them.
    for (int64_t split = 2; split <= 16 && tiles * split / 2 < sms && ki / split >= kMinSplitK; split *= 2)
      best = std::min(best, static_cast<double>((tiles * split + sms - 1) / sms) * area *
                                static_cast<double>((ki + split - 1) / split));
  }
  return 2.0 * best;
}

}  // namespace

double memory_seconds(const ClusterSpec& c, double bytes) {
  if (bytes <= 0) return 0;
  return bytes / (c.hbm_bandwidth_bytes_per_s * c.memory_bound_efficiency) + c.kernel_overhead_s;
}

double gemm_seconds(const ClusterSpec& c, double m, double n, double k, GemmType type, double batch) {
  if (m <= 0 || n <= 0 || k <= 0 || batch <= 0) return 0;
  const double flops = 2.0 * m * n * k * batch;
  if (!c.has_kernel_model()) {
    const double peak = type == GemmType::kFp32 ? c.peak_fp32_flops : c.peak_bf16_flops;
    return flops / (peak * c.efficiency_at(2.0 * m * n * k)) + c.kernel_overhead_s;
  }
  double peak = c.peak_bf16_flops * c.matmul_peak_efficiency;
  if (type == GemmType::kFp32) peak = c.peak_fp32_flops * c.matmul_peak_efficiency;
  if (type == GemmType::kFp8 && c.peak_fp8_flops > 0) peak = c.peak_fp8_flops * c.fp8_matmul_peak_efficiency;
  const double compute = tile_wave_flops(m, n, k, batch, c.streaming_multiprocessors) *
                        static_cast<double>(c.streaming_multiprocessors) / peak;
  // The operands read once and the output written once (in the compute dtype, bf16 for FP8).
  const double in = element_bytes(type);
  const double out = type == GemmType::kFp32 ? kBytesFp32 : kBytesBf16;
  const double bytes = batch * ((m * k + k * n) * in + m * n * out);
  return compute + bytes / (c.hbm_bandwidth_bytes_per_s * c.memory_bound_efficiency) + c.kernel_overhead_s;
}

namespace {

// Everything the lists below need from one configuration.
class KernelListBuilder {
 public:
  explicit KernelListBuilder(const RunConfig& c) : c_(c), hw_(c.cluster), m_(c.model) {
    const ParallelConfig& p = c.parallel;
    fp32_ = c.training.precision == Precision::kFp32;
    a_ = fp32_ ? kBytesFp32 : kBytesBf16;
    linear_ = fp32_ ? GemmType::kFp32 : c.training.fp8 ? GemmType::kFp8 : GemmType::kBf16;
    plain_ = fp32_ ? GemmType::kFp32 : GemmType::kBf16;
    tp_ = static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
    sp_ = p.sequence_parallel ? tp_ : 1.0;
    // A rank's share of each sequence: 1 / C of it under context parallelism.
    seq_ = static_cast<double>(p.local_seq_len(c.training.seq_len));
    context_chunks_ = static_cast<double>(std::max<int64_t>(1, p.context_parallel_degree));
    mbs_ = static_cast<double>(p.micro_batch_size);
    tokens_ = mbs_ * seq_;
    local_ = tokens_ / sp_;
    h_ = static_cast<double>(m_.hidden_size);
    f_ = static_cast<double>(m_.intermediate_size) / tp_;
    // Routed experts split over ETP ranks; with ETP < T (folded) a rank computes the slots of
    // its 1/T of the tokens' ETP-gathered share, its experts' columns over ETP.
    etp_ = m_.dense() ? tp_ : static_cast<double>(p.expert_tensor_degree());
    expert_f_ = static_cast<double>(m_.intermediate_size) / etp_;
    shared_ = static_cast<double>(m_.shared_expert_intermediate_size) / tp_;
    q_ = static_cast<double>(m_.num_attention_heads * m_.head_dim) / tp_;
    kv_ = static_cast<double>(m_.num_key_value_heads * m_.head_dim) / tp_;
    heads_ = static_cast<double>(m_.num_attention_heads) / tp_;
    head_dim_ = static_cast<double>(m_.head_dim);
    value_dim_ = static_cast<double>(m_.value_head_dim());
    v_ = m_.mla() ? heads_ * value_dim_ : q_;
    vocab_ = std::ceil(static_cast<double>(m_.vocab_size) / tp_);
    fused_ = hw_.kernels == Kernels::kFused;
    flash_ = hw_.attention == AttentionKernel::kFlash;
    dropout_ = m_.dropout > 0;
    // Causal: a query sees half the sequence on average, or the window where blocks have one
    // (the whole sequence's, also for a rank's chunks under context parallelism: their
    // balanced pairs see as much as the average query).
    context_ = m_.attention_context(c.training.seq_len);
  }

  // A forward GEMM [m, k] x [k, n], and in backward its two: the input's gradient [m, n] x
  // [n, k] and the weight's [k, m] x [m, n]. FP8 GEMMs cast their input (and in backward the
  // output's gradient, with its transpose) to FP8 first.
  void gemm(KernelList& l, std::string_view name, double m, double n, double k, bool backward, GemmType type,
            double batch = 1, bool weight = true) {
    double s = 0;
    if (!backward) {
      s = gemm_seconds(hw_, m, n, k, type, batch);
    } else {
      last_wgrad_s_ = gemm_seconds(hw_, k, n, m, type, batch);
      s = gemm_seconds(hw_, m, k, n, type, batch) + last_wgrad_s_;
    }
    l.add(name, KernelClass::kGemm, s, (backward ? 4.0 : 2.0) * m * n * k * batch);
    if (type != GemmType::kFp8) return;
    // Transformer Engine casts the input (forward) or the output's gradient and its transpose
    // (backward); the weight's FP8 copy and transpose are made once per micro-batch.
    double bytes = backward ? batch * m * n * (a_ + 2.0) : batch * m * k * (a_ + 1.0);
    if (!backward && weight) bytes += batch * k * n * (kBytesBf16 + 2.0);
    l.add("fp8.cast", KernelClass::kMemoryBound, memory_seconds(hw_, bytes) + hw_.kernel_overhead_s);
  }

  double last_wgrad_s() const { return last_wgrad_s_; }

  // `kernels` streaming kernels moving `bytes` together.
  void memory(KernelList& l, std::string_view name, double bytes, double kernels = 1) {
    if (bytes <= 0) return;
    l.add(name, KernelClass::kMemoryBound, memory_seconds(hw_, bytes) + (kernels - 1) * hw_.kernel_overhead_s);
  }

  // A norm over `rows` x hidden. A fused kernel (or eager LayerNorm, one kernel in PyTorch)
  // reads the input and writes the output, and in backward reads input and gradient and
  // writes the gradient. Hugging Face's eager RMSNorm runs eight kernels: to fp32, pow, mean,
  // add, rsqrt, multiply, back to the compute dtype, times the weight.
  void norm(KernelList& l, std::string_view name, double rows, bool backward, double width = 0) {
    const double e = rows * (width > 0 ? width : h_);
    if (fused_ || m_.norm == Norm::kLayerNorm) {
      memory(l, name, backward ? 3.0 * e * a_ : 2.0 * e * a_, backward ? 2 : 1);
      return;
    }
    const double cast = a_ < kBytesFp32 ? 2.0 * (a_ + kBytesFp32) : 0.0;
    const double forward = e * (cast + 8 + 4 + 8 + 2 * a_);
    memory(l, name, backward ? 2.0 * forward : forward, backward ? 12 : (a_ < kBytesFp32 ? 8 : 6));
  }

  // The residual add at the end of a sub-block over rows x hidden, after dropout where the
  // model has it (Megatron fuses bias, dropout and add in one kernel). In backward the
  // residual stream's gradient is summed, and dropout's mask applied.
  void residual(KernelList& l, double rows, bool backward) {
    const double e = rows * h_;
    const double add = 3.0 * e * a_;
    if (!dropout_) {
      memory(l, "residual", add);
      return;
    }
    const double drop = e * (2.0 * a_ + 1.0);  // the values and a one-byte mask
    if (fused_) memory(l, "residual", backward ? add + drop : add + e * 1.0, backward ? 2 : 1);
    else memory(l, "residual", add + drop, 2);
  }

  // Rotary embedding on q and k (its backward is the same rotation of the gradient). Fused:
  // one kernel reads and writes them. Eager (Hugging Face): rotate_half's slice, negation and
  // concatenation, two multiplies and an add, each over the tensor.
  void rotary(KernelList& l) {
    // Under MLA only the rotary part of each query and the one shared rotary key turn.
    const double e = m_.mla() ? tokens_ * (heads_ + 1.0) * static_cast<double>(m_.qk_rope_head_dim)
                              : tokens_ * (q_ + kv_);
    if (fused_) memory(l, "rotary", 2.0 * e * a_);
    else memory(l, "rotary", 10.0 * e * a_, 12);
  }

  KernelList attention_core(bool backward) {
    KernelList l;
    // Scores (the query's and key's width) and weighted sum (the value's), causal work.
    const double flops = 2.0 * mbs_ * seq_ * context_ * (q_ + v_);
    if (flash_) {
      // One kernel; its backward recomputes the scores (FlashAttention-2: 2.5 times the
      // forward's FLOPs). The profile's efficiency is of forward and backward together.
      const double rate = hw_.has_kernel_model() ? hw_.peak_bf16_flops * hw_.flash_attention_efficiency
                                                 : (fp32_ ? hw_.peak_fp32_flops : hw_.peak_bf16_flops) *
                                                       hw_.efficiency_at(flops);
      const double f = backward ? 2.5 * flops : flops;
      // Under context parallelism one kernel per ring step (C of them), each on the keys and
      // values that step brings.
      l.add("attention.flash", KernelClass::kAttention, f / rate + context_chunks_ * hw_.kernel_overhead_s, f);
      return l;
    }
    // Unfused: the whole T x T square per head is computed and masked.
    const double batch = mbs_ * heads_;
    const double square = batch * seq_ * seq_;
    auto gemm_core = [&](std::string_view name, double m, double n, double k) {
      const double s = gemm_seconds(hw_, m, n, k, plain_, batch);
      l.add(name, KernelClass::kAttention, s, 2.0 * m * n * k * batch);
    };
    // Softmax over the scores: Megatron's fused scale-mask-softmax reads and writes them once;
    // eager PyTorch scales, adds the mask, takes the softmax in fp32 and casts back.
    const double softmax_forward = fused_ ? 2.0 * a_ : 4.0 * a_ + (a_ + 4.0) + (a_ < kBytesFp32 ? 4.0 + a_ : 0.0);
    const double softmax_kernels = fused_ ? 1.0 : (a_ < kBytesFp32 ? 4.0 : 3.0);
    const double drop = 2.0 * a_ + 1.0;
    if (!backward) {
      gemm_core("attention.scores", seq_, seq_, head_dim_);
      l.add("attention.softmax", KernelClass::kAttention,
            memory_seconds(hw_, square * softmax_forward) + (softmax_kernels - 1) * hw_.kernel_overhead_s);
      if (dropout_) l.add("attention.dropout", KernelClass::kAttention, memory_seconds(hw_, square * drop));
      gemm_core("attention.context", seq_, value_dim_, seq_);
      return l;
    }
    gemm_core("attention.context", seq_, seq_, value_dim_);  // gradient of the probabilities
    gemm_core("attention.context", seq_, value_dim_, seq_);  // gradient of v
    if (dropout_) l.add("attention.dropout", KernelClass::kAttention, memory_seconds(hw_, square * drop));
    l.add("attention.softmax", KernelClass::kAttention,
          memory_seconds(hw_, square * (fused_ ? 3.0 * a_ : 2.0 * softmax_forward)) +
              (fused_ ? 0.0 : 2.0 * softmax_kernels - 1) * hw_.kernel_overhead_s);
    gemm_core("attention.scores", seq_, head_dim_, seq_);  // gradient of q
    gemm_core("attention.scores", seq_, head_dim_, seq_);  // gradient of k
    return l;
  }

  // q, k and v: one GEMM where fused (Megatron's), three in eager PyTorch (whose input
  // gradients are then summed); eager grouped-query attention repeats keys and values to every
  // query head.
  void projections(KernelList& l, bool backward) {
    if (m_.mla()) {
      latent_projections(l, backward);
      return;
    }
    if (fused_) {
      gemm(l, "qkv", tokens_, q_ + 2.0 * kv_, h_, backward, linear_);
    } else {
      for (double width : {q_, kv_, kv_}) gemm(l, "qkv", tokens_, width, h_, backward, linear_);
      if (backward) memory(l, "qkv.grad_sum", 2.0 * 3.0 * tokens_ * h_ * a_, 2);
    }
  }
  // Multi-head latent attention (Megatron-Core's MLASelfAttention): the down projections to the
  // query latent and to the key-value latent with the shared rotary key are whole on every
  // tensor-parallel rank (over the gathered tokens), each latent normed, then the up projections
  // to the rank's heads: queries, and keys without their rotary part with the values.
  void latent_projections(KernelList& l, bool backward) {
    const double q_rank = static_cast<double>(m_.q_lora_rank);
    const double kv_rank = static_cast<double>(m_.kv_lora_rank);
    const double rope = static_cast<double>(m_.qk_rope_head_dim);
    const double kv_up = heads_ * (head_dim_ - rope + value_dim_);
    auto query = [&] {
      if (q_rank <= 0) {
        gemm(l, "q_proj", tokens_, q_, h_, backward, linear_);
        return;
      }
      if (!backward) {
        gemm(l, "q_down", tokens_, q_rank, h_, false, linear_);
        norm(l, "q_norm", tokens_, false, q_rank);
        gemm(l, "q_up", tokens_, q_, q_rank, false, linear_);
        return;
      }
      gemm(l, "q_up", tokens_, q_, q_rank, true, linear_);
      norm(l, "q_norm", tokens_, true, q_rank);
      gemm(l, "q_down", tokens_, q_rank, h_, true, linear_);
    };
    if (!backward) {
      query();
      gemm(l, "kv_down", tokens_, kv_rank + rope, h_, false, linear_);
      norm(l, "kv_norm", tokens_, false, kv_rank);
      gemm(l, "kv_up", tokens_, kv_up, kv_rank, false, linear_);
      return;
    }
    gemm(l, "kv_up", tokens_, kv_up, kv_rank, true, linear_);
    norm(l, "kv_norm", tokens_, true, kv_rank);
    gemm(l, "kv_down", tokens_, kv_rank + rope, h_, true, linear_);
    query();
  }

  // What latent_up checkpointing runs again before attention's backward (Megatron-Core's
  // mla_up_proj recompute module): the up projections to every head's query, key and value,
  // and the rotary embedding on them.
  KernelList latent_up() {
    KernelList l;
    if (!m_.mla()) return l;
    const double q_rank = static_cast<double>(m_.q_lora_rank);
    const double kv_rank = static_cast<double>(m_.kv_lora_rank);
    const double rope = static_cast<double>(m_.qk_rope_head_dim);
    if (q_rank > 0) gemm(l, "q_up", tokens_, q_, q_rank, false, linear_, 1, false);
    else gemm(l, "q_proj", tokens_, q_, h_, false, linear_, 1, false);
    gemm(l, "kv_up", tokens_, heads_ * (head_dim_ - rope + value_dim_), kv_rank, false, linear_, 1, false);
    rotary(l);
    return l;
  }

  void repeat_kv(KernelList& l) {
    if (!flash_ && !fused_ && kv_ < q_) memory(l, "attention.repeat_kv", 2.0 * tokens_ * (kv_ + q_) * a_, 2);
  }

  KernelList attention(bool backward, const KernelList& core) {
    KernelList l;
    if (!backward) {
      norm(l, "norm", local_, false);
      projections(l, false);
      if (m_.qk_norm) norm(l, "qk_norm", tokens_, false, q_ + kv_);
      rotary(l);
      repeat_kv(l);
      l.append(core);
      gemm(l, "o_proj", tokens_, h_, v_, false, linear_);
      residual(l, local_, false);
      return l;
    }
    residual(l, local_, true);
    gemm(l, "o_proj", tokens_, h_, v_, true, linear_);
    l.append(core);
    repeat_kv(l);
    rotary(l);
    if (m_.qk_norm) norm(l, "qk_norm", tokens_, true, q_ + kv_);
    projections(l, true);
    norm(l, "norm", local_, true);
    return l;
  }

  // The activation of a feed-forward layer over `elements` intermediate values. SwiGLU:
  // silu(w1 x) * w3 x, fused one kernel, eager a SiLU and a multiply. GELU: one.
  void feed_forward_activation(KernelList& l, std::string_view name, double elements, bool backward) {
    const bool swiglu = m_.mlp == Mlp::kSwiGlu;
    double bytes = swiglu ? 3.0 * elements * a_ : 2.0 * elements * a_;
    double kernels = 1;
    if (swiglu && !fused_) {
      bytes = 5.0 * elements * a_;
      kernels = 2;
    }
    memory(l, name, backward ? (swiglu ? 5.0 : 3.0) / (swiglu ? 3.0 : 2.0) * bytes : bytes,
           backward ? 2 * kernels : kernels);
  }

  // Shared experts: a feed-forward layer of their width on every token (all of them gathered
  // under sequence parallelism), after the routed experts (Megatron-Core computes them in turn
  // unless told to overlap them with the dispatch); a gate scales their output by a sigmoid.
  void shared_experts(KernelList& l, bool backward) {
    if (!m_.shared_experts()) return;
    const bool swiglu = m_.mlp == Mlp::kSwiGlu;
    auto up = [&] {
      if (swiglu && !fused_) {
        gemm(l, "shared_expert.w1", tokens_, shared_, h_, backward, linear_);
        gemm(l, "shared_expert.w3", tokens_, shared_, h_, backward, linear_);
      } else {
        gemm(l, "shared_expert.fc1", tokens_, swiglu ? 2.0 * shared_ : shared_, h_, backward, linear_);
      }
    };
    auto activation = [&] { feed_forward_activation(l, "shared_expert.activation", tokens_ * shared_, backward); };
    auto gate = [&] {
      if (!m_.shared_expert_gate) return;
      gemm(l, "shared_expert.gate", local_, 1, h_, backward, plain_, 1, false);
      memory(l, "shared_expert.gate_scale", (backward ? 4.0 : 3.0) * local_ * h_ * a_, 2);  // sigmoid, scale
    };
    if (!backward) {
      up();
      activation();
      gemm(l, "shared_expert.fc2", tokens_, h_, shared_, false, linear_);
      gate();
      return;
    }
    gate();
    gemm(l, "shared_expert.fc2", tokens_, h_, shared_, true, linear_);
    activation();
    up();
  }

  // The MoE (or MLP) sub-block on a rank whose experts get `load` times the mean share.
  KernelList moe(double load, bool backward) {
    KernelList l;
    const bool dense = m_.dense();
    const double k = static_cast<double>(m_.experts_per_token);
    const double experts = static_cast<double>(m_.num_experts);
    const double local_experts = experts / static_cast<double>(std::max<int64_t>(1, c_.parallel.expert_parallel_degree));
    // Every expert-tensor-parallel rank computes its columns of the experts for every slot
    // gathered over the ETP ranks (all T of them unless folded).
    const double slots = dense ? tokens_ : k * tokens_ * etp_ / tp_ * load;
    const double f = expert_f_;
    const double rows = slots / local_experts;  // per local expert
    const double sent = dense ? 0.0 : k * local_;  // slots leaving this rank's tokens
    const bool swiglu = m_.mlp == Mlp::kSwiGlu;
    // Grouped GEMM over the local experts (fused), or one GEMM per expert (eager).
    auto experts_gemm = [&](std::string_view name, double n, double kk) {
      if (fused_ || dense) {
        gemm(l, name, rows, n, kk, backward, linear_, local_experts);
      } else {  // the experts' GEMMs are alike: one is priced, and counted once per expert
        KernelList one;
        gemm(one, name, rows, n, kk, backward, linear_);
        l.append(one, local_experts);
      }
    };
    auto activation = [&] { feed_forward_activation(l, "activation", slots * f, backward); };
    auto routing = [&] {
      if (dense) return;
      gemm(l, "router", local_, experts, h_, backward, plain_, 1, false);
      // Softmax in fp32, top-k, renormalisation and the load-balancing statistics.
      memory(l, "router.topk", local_ * (experts * kBytesFp32 * 4.0 + k * 12.0), fused_ ? 4 : 8);
      // A sigmoid's scores take the balancing bias before the top-k (one pass more); group-limited
      // routing scores each group by its best experts, takes the top groups and masks the others
      // out (Megatron-Core's group_limited_topk: three passes more over the scores).
      const double sigmoid = m_.router_scoring == RouterScoring::kSigmoid ? 1.0 : 0.0;
      const double groups = m_.router_groups > 1 ? 3.0 : 0.0;
      if (sigmoid + groups > 0)
        memory(l, "router.groups", local_ * experts * kBytesFp32 * 2.0 * (sigmoid + groups), sigmoid + groups);
    };
    auto permute = [&](std::string_view name) {
      if (dense) return;
      // Gathering each slot's row (or scattering it back, summed with its weight).
      memory(l, name, 2.0 * std::max(sent, slots) * h_ * a_ + local_ * h_ * a_, fused_ ? 2 : 2 * local_experts);
    };
    if (!backward) {
      norm(l, "norm", local_, false);
      routing();
      permute("permute");
      if (swiglu && !fused_) {
        experts_gemm("w1", f, h_);
        experts_gemm("w3", f, h_);
      } else {
        experts_gemm("fc1", swiglu ? 2.0 * f : f, h_);
      }
      activation();
      experts_gemm("fc2", h_, f);
      permute("unpermute");
      shared_experts(l, false);
      residual(l, local_, false);
      return l;
    }
    residual(l, local_, true);
    shared_experts(l, true);
    permute("unpermute");
    experts_gemm("fc2", h_, f);
    activation();
    if (swiglu && !fused_) {
      experts_gemm("w1", f, h_);
      experts_gemm("w3", f, h_);
    } else {
      experts_gemm("fc1", swiglu ? 2.0 * f : f, h_);
    }
    const double fc1_wgrad = last_wgrad_s_;
    permute("permute");
    routing();
    last_wgrad_s_ = fc1_wgrad;
    norm(l, "norm", local_, true);
    return l;
  }

  // The embedding lookup (its gradient accumulated into fp32), then the final norm, lm head and
  // cross-entropy over the vocabulary (the rank's part of it); and each multi-token prediction
  // module's own (ModelSpec::mtp_layers; its block is priced with the others).
  KernelList head(bool backward) {
    KernelList l;
    if (!backward) memory(l, "embedding", 2.0 * local_ * h_ * a_);
    loss(l, backward);
    if (m_.mtp_layers > 0) l.append(mtp_module(backward), static_cast<double>(m_.mtp_layers));
    if (backward) memory(l, "embedding", local_ * h_ * (a_ + kBytesFp32));
    return l;
  }

 private:
  void loss(KernelList& l, bool backward) {
    const double logits = tokens_ * vocab_;
    if (!backward) {
      norm(l, "final_norm", local_, false);
      gemm(l, "lm_head", tokens_, vocab_, h_, false, plain_);
      // The loss reads the logits, keeps the fp32 softmax and reduces it: fused (Megatron's
      // vocabulary-parallel cross-entropy) in three passes, eager (a cast, log-softmax and
      // NLL) in four.
      memory(l, "cross_entropy", logits * (a_ + (fused_ ? 12.0 : 16.0)), fused_ ? 3 : 4);
      return;
    }
    memory(l, "cross_entropy", logits * (a_ + (fused_ ? 4.0 : 20.0)), fused_ ? 1 : 3);
    gemm(l, "lm_head", tokens_, vocab_, h_, true, plain_);
    norm(l, "final_norm", local_, true);
  }

  // One multi-token prediction module beside its block (Megatron-Core's
  // MultiTokenPredictionLayer): the embedding of the token it predicts, that and the previous
  // depth's output each normed, the two joined and projected 2h -> h (its output columns split
  // over the tensor-parallel ranks), and after the block a loss of its own.
  KernelList mtp_module(bool backward) {
    KernelList l;
    if (!backward) {
      memory(l, "mtp.embedding", 2.0 * local_ * h_ * a_);
      norm(l, "mtp.norms", 2.0 * local_, false);
      gemm(l, "mtp.eh_proj", tokens_, h_ / tp_, 2.0 * h_, false, linear_);
      loss(l, false);
      return l;
    }
    loss(l, true);
    gemm(l, "mtp.eh_proj", tokens_, h_ / tp_, 2.0 * h_, true, linear_);
    norm(l, "mtp.norms", 2.0 * local_, true);
    memory(l, "mtp.embedding", local_ * h_ * (a_ + kBytesFp32));
    return l;
  }

  const RunConfig& c_;
  const ClusterSpec& hw_;
  const ModelSpec& m_;
  bool fp32_ = false, fused_ = true, flash_ = true, dropout_ = false;
  // The weight gradient of the latest backward GEMM: what runs beside the tensor-parallel
  // collective of the input gradient that precedes it.
  double last_wgrad_s_ = 0;
  double a_ = 2;
  GemmType linear_ = GemmType::kBf16, plain_ = GemmType::kBf16;
  double etp_ = 1, expert_f_ = 0;  // the routed experts' split and width per rank
  double tp_ = 1, sp_ = 1, seq_ = 0, context_chunks_ = 1, mbs_ = 0, tokens_ = 0, local_ = 0, h_ = 0, f_ = 0, shared_ = 0, q_ = 0, kv_ = 0,
         heads_ = 0, head_dim_ = 0, vocab_ = 0, context_ = 0;
  double value_dim_ = 0, v_ = 0;  // a value's width per head, and the rank's values (the o_proj input)
};

}  // namespace

MicroBatchKernels micro_batch_kernels(const RunConfig& c) {
  KernelListBuilder b(c);
  MicroBatchKernels k;
  k.core_forward = b.attention_core(false);
  k.latent_up_forward = b.latent_up();
  k.attention_forward = b.attention(false, k.core_forward);
  k.attention_backward = b.attention(true, b.attention_core(true));
  k.attention_wgrad_s = b.last_wgrad_s();
  k.moe_forward = b.moe(1.0, false);
  k.moe_backward = b.moe(1.0, true);
  k.moe_wgrad_s = b.last_wgrad_s();
  k.head_forward = b.head(false);
  k.head_backward = b.head(true);
  return k;
}

MicroBatchKernels dense_block_kernels(const RunConfig& c) {
  const ModelSpec model = dense_block_model(c.model);
  ParallelConfig parallel = c.parallel;
  parallel.expert_parallel_degree = 1;
  parallel.expert_tensor_parallel_degree = 0;
  return micro_batch_kernels({model, c.cluster, parallel, c.moe, c.training, c.target});
}

KernelList moe_kernels(const RunConfig& c, double load, bool backward) { return KernelListBuilder(c).moe(load, backward); }

KernelList optimizer_kernels(const RunConfig& c, double parameters) {
  // AdamW reads the gradient and reads and writes the parameter and both moments (and the fp32
  // master, which mixed precision also writes back as the bf16 compute copy); the gradient
  // norm for clipping reads the gradient once more. Bytes per parameter, by precision.
  double bytes = 0;
  switch (c.training.precision) {
    case Precision::kBf16: bytes = 2 + 2 * 2 + 2 * 2 * 2 + 2; break;
    case Precision::kMixed: bytes = 4 + 2 * 4 + 2 * 2 * 4 + 2 + 4; break;
    case Precision::kFp32: bytes = 4 + 2 * 4 + 2 * 2 * 4 + 4; break;
  }
  KernelList l;
  l.add("optimizer", KernelClass::kMemoryBound, memory_seconds(c.cluster, bytes * parameters));
  return l;
}

}  // namespace moeplan::sim
