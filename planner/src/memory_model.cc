#include "moeplan/planner/memory_model.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/units.h"

namespace moeplan::planner {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sizes are products of validated integers; they are formed in double, exact below 2^53
// bytes, and saturate at 2^59 bytes (far beyond any device), so that the sum of all items
// still fits in int64.
int64_t to_bytes(double bytes) {
  constexpr double kSaturate = 576460752303423488.0;  // 2^59
  return static_cast<int64_t>(std::min(bytes, kSaturate));
}
}  // namespace

BlockActivations block_activations(const ModelSpec& m, int64_t micro_batch, int64_t seq_len, int64_t slots,
                                   int64_t a, Kernels kernels, TensorSplit split) {
  return block_activations(m, micro_batch, seq_len, slots, a, kernels,
                           kernels == Kernels::kFused ? AttentionKernel::kFlash : AttentionKernel::kUnfused, split);
}

BlockActivations block_activations(const ModelSpec& m, int64_t micro_batch, int64_t seq_len, int64_t slots,
                                   int64_t a, Kernels kernels, AttentionKernel attention, TensorSplit split, bool fp8) {
  const double t = static_cast<double>(micro_batch * seq_len);
  const double bytes = static_cast<double>(a);
  const double h = static_cast<double>(m.hidden_size);
  const double f = static_cast<double>(m.intermediate_size);
  const double shared = static_cast<double>(m.shared_expert_intermediate_size);
  const double q = static_cast<double>(m.num_attention_heads * m.head_dim);
  const double kv = static_cast<double>(m.num_key_value_heads * m.head_dim);
  // Values (kv_heads x their width) and the attention output that o_proj takes (heads x it).
  const double v = static_cast<double>(m.num_key_value_heads * m.value_head_dim());
  const double o_in = static_cast<double>(m.num_attention_heads * m.value_head_dim());
  // Latent attention's latents, whole on every tensor-parallel rank: the query latent (the
  // norm's input and output, the latter the up projection's input), the key-value latent
  // with the rotary key (the down projection's output), and the normed key-value latent.
  const double q_rank = static_cast<double>(m.q_lora_rank), kv_rank = static_cast<double>(m.kv_lora_rank);
  const double rope = static_cast<double>(m.qk_rope_head_dim);
  const double heads = static_cast<double>(m.num_attention_heads);
  const double routed = static_cast<double>(slots);
  const double router = static_cast<double>(m.router_width());
  const bool dense = m.dense();
  // Dropout keeps a one-byte mask of what it dropped (and, after the softmax, its output too).
  const double mask = m.dropout > 0 ? 1.0 : 0.0;
  // Under tensor parallelism a rank keeps 1/T of what lies inside the split regions (heads,
  // intermediate columns) and, with sequence parallelism, 1/T of the rest too (Korthikanti et
  // al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2).
  const double inside = 1.0 / static_cast<double>(std::max<int64_t>(1, split.degree));
  const double outside = split.sequence ? inside : 1.0;
  // Intermediate-width tensors kept per slot: SwiGLU w1 and w3 outputs and their product; GELU
  // fc1's output and its GELU.
  const double mlp_kept = m.mlp == Mlp::kGelu ? 2.0 : 3.0;
  // The attention core's own: flash attention keeps an fp32 log-sum-exp per head and token;
  // unfused attention keeps the T x T softmax output per head (fp32 and its copy in the compute
  // type where eager PyTorch takes the softmax in fp32), and under dropout its mask and output.
  const double square = static_cast<double>(micro_batch) * heads * static_cast<double>(seq_len) * static_cast<double>(seq_len);
  double core = t * heads * kBytesFp32 * inside;
  if (attention == AttentionKernel::kUnfused) {
    const double softmax = kernels == Kernels::kFused ? bytes : kBytesFp32 + (a < kBytesFp32 ? bytes : 0.0);
    core = square * (softmax + mask * (1.0 + bytes)) * inside;
  }
  BlockActivations out;
  out.block_input = to_bytes(t * h * bytes * outside);
  out.core = to_bytes(core);
  // Latent attention's up projections make every head's query, key and value from the latents;
  // the attention core keeps them for its backward.
  if (m.mla()) out.latent_up = to_bytes(t * (q + kv + v) * bytes * inside);
  if (kernels == Kernels::kFused) {
    // What a GEMM keeps of its input for the weight gradient: with FP8 GEMMs (Transformer
    // Engine), the input's one-byte FP8 copy.
    const double gemm_input = fp8 ? 1.0 : bytes;
    // The norm's input and output (the q/k/v input), q, k and v (after RoPE), the attention
    // output (o_proj input), the core's, and dropout's mask on the sub-block's output.
    // q and k's norms (qk_norm) keep their inputs.
    const double qk_norm = m.qk_norm ? q + kv : 0.0;
    const double latents = m.mla() ? t * (q_rank * (bytes + gemm_input) + (kv_rank + rope) * bytes + kv_rank * gemm_input)
                                   : 0.0;
    out.attention = to_bytes(t * (h * bytes + h * gemm_input + mask * h) * outside +
                             t * ((q + kv + v + qk_norm) * bytes + o_in * gemm_input) * inside + latents + core);
    // The norm's input and output (the first GEMM's input), dropout's mask; an MoE keeps the
    // fp32 router probabilities and per token-expert slot the expert input (the permuted copy,
    // fc1's input) with its fp32 routing weight, which scales the activation (Megatron-Core's
    // grouped experts, activation_func_with_probs), so that the combine is an unweighted sum
    // that keeps nothing; then per slot the intermediate-width tensors (GELU: fc1's output and
    // its GELU, the fc2 input).
    // Shared experts take every token through the same intermediate-width tensors at their
    // width, from the input the router reads; a gate keeps their output and its fp32 value.
    out.moe = to_bytes((t * (h * bytes + h * gemm_input + mask * h) +
                        (dense ? 0.0 : t * router * kBytesFp32 + routed * (h * gemm_input + kBytesFp32)) +
                        (m.shared_expert_gate ? t * (h * bytes + kBytesFp32) : 0.0)) *
                           outside +
                       (routed * f + t * shared) * ((mlp_kept - 1) * bytes + gemm_input) * inside);
    return out;
  }
  // Eager: each norm keeps its input and fp32 statistics per row (the executor's fused RMSNorm:
  // one reciprocal; LibTorch's layer norm: mean and reciprocal); SiLU keeps its output beside
  // w1's; the expert output returns to the token's rank, k rows per token, where it is kept for
  // the weighted sum. Inside attention: q, k and v after
  // RoPE and the core's output, and that output again as o_proj's input (a copy in the
  // [tokens, heads x head_dim] layout); unfused attention keeps keys and values repeated to
  // every query head, scaled-dot-product attention (flash) keeps them as they are.
  const double k = static_cast<double>(m.experts_per_token);
  const double norm_stats = t * (m.norm == Norm::kRmsNorm ? 1.0 : 2.0) * kBytesFp32;
  // q, k and v after RoPE (unfused: k and v repeated to every query head), the core's output
  // and its copy as o_proj's input.
  const double qkv_kept = attention == AttentionKernel::kFlash ? q + kv + v + 2 * o_in : 2 * q + 2 * o_in;
  // Latent attention's latents and their norms' fp32 statistics.
  const double latents =
      m.mla() ? t * ((2 * q_rank + kv_rank + rope + kv_rank) * bytes + (q_rank > 0 ? 2.0 : 1.0) * kBytesFp32) : 0.0;
  // q and k's norms keep their inputs and an fp32 statistic per head and token.
  const double qk_norm = m.qk_norm ? t * ((q + kv) * bytes + static_cast<double>(m.num_attention_heads +
                                                                                    m.num_key_value_heads) *
                                                                   kBytesFp32)
                                   : 0.0;
  out.attention = to_bytes((t * 2 * h * bytes + norm_stats + t * mask * h) * outside +
                           (t * qkv_kept * bytes + qk_norm) * inside + latents + core);
  out.moe = to_bytes((t * 2 * h * bytes + norm_stats + t * mask * h +
                      (dense ? 0.0 : t * router * kBytesFp32 + routed * h * bytes + k * t * h * bytes) +
                      (m.shared_expert_gate ? t * (h * bytes + kBytesFp32) : 0.0)) *
                         outside +
                     (routed * f + t * shared) * (mlp_kept + (m.mlp == Mlp::kSwiGlu ? 1.0 : 0.0)) * bytes * inside);
  return out;
}

namespace {
// Which ends of the model a stage holds beside its blocks: the first stage the embedding, the
// last the head, one stage both, a middle stage neither; kLarger: whichever is larger, and
// kNone none (stages standing for any: each counts the larger end's unit as gathered).
enum class Ends : uint8_t { kNone, kFirst, kLast, kBoth, kMiddle, kLarger };

// The dense parameters are split over `s` ranks, the routed experts over `expert_s` (0: s).
ShardSizes shard_sizes_with(const ModelSpec& model, StageBlockCounts blocks, int64_t e, int64_t s, int64_t t, int64_t p,
                            Ends which, int64_t etp, int64_t expert_s = 0) {
  if (expert_s <= 0) expert_s = s;
  const ParamCounts c = count_parameters(model);
  t = std::max<int64_t>(1, t);
  const int64_t experts_per_layer = ceil_div(model.num_experts / e * c.expert, etp > 0 ? etp : t);
  // Latent attention's down projections are whole on every tensor-parallel rank.
  const int64_t whole = c.tensor_replicated_per_layer;
  const int64_t dense_per_layer = ceil_div(c.dense_per_layer() - whole, t) + whole;
  const int64_t dense_block = ceil_div(c.dense_block() - whole, t) + whole;
  const int64_t moe_layers = blocks.moe_layers, dense_layers = blocks.layers - blocks.moe_layers;
  const int64_t embedding = ceil_div(c.embedding, t);
  // The last stage's: the final norm, the lm head and multi-token prediction's projections, and
  // under a pipeline the embedding again when multi-token prediction looks tokens up there.
  const int64_t head = ceil_div(c.final_norm + c.lm_head + c.mtp_projection, t) +
                       (p > 1 && model.mtp_layers > 0 ? embedding : 0);
  const bool first = which == Ends::kFirst || which == Ends::kBoth, last = which == Ends::kLast || which == Ends::kBoth;
  const int64_t ends = which == Ends::kLarger ? std::max(embedding, head) : (first ? embedding : 0) + (last ? head : 0);
  ShardSizes out;
  out.local_params = ends + moe_layers * (dense_per_layer + experts_per_layer) + dense_layers * dense_block;
  // Flat parameters (FSDP units): the embedding; per block its dense part and its experts
  // (they reduce over different groups); the final norm with the lm head. Each is padded to
  // a multiple of S before it is split.
  const int64_t ends_shard = which == Ends::kLarger ? std::max(ceil_div(embedding, s), ceil_div(head, s))
                                                    : (first ? ceil_div(embedding, s) : 0) + (last ? ceil_div(head, s) : 0);
  out.shard_expert_params = moe_layers * ceil_div(experts_per_layer, expert_s);
  out.shard_params = ends_shard + moe_layers * ceil_div(dense_per_layer, s) + out.shard_expert_params +
                     dense_layers * ceil_div(dense_block, s);
  const bool any = which == Ends::kNone || which == Ends::kLarger;
  // What is gathered of an MoE block: its dense part, and its experts where they are sharded
  // too (a dense shard over the expert ranks leaves them whole with S = 1).
  const int64_t moe_gathered = dense_per_layer + (expert_s > 1 || s <= 1 ? experts_per_layer : 0);
  out.largest_unit_params = std::max({any ? std::max(embedding, head) : std::max(first ? embedding : 0, last ? head : 0),
                                      moe_layers > 0 ? moe_gathered : 0, dense_layers > 0 ? dense_block : 0});
  return out;
}
}  // namespace

ShardSizes stage_shard_sizes(const ModelSpec& model, StageBlockCounts blocks, int64_t e, int64_t s, int64_t t,
                             int64_t p, bool with_ends, int64_t etp) {
  const Ends which = !with_ends ? Ends::kNone : p > 1 ? Ends::kLarger : Ends::kBoth;
  return shard_sizes_with(model, blocks, e, s, t, p, which, etp);
}

namespace {
// The busiest stage; `decoder_only`: counting the last stage without multi-token prediction's
// blocks.
StageBlockCounts busiest_of(const ModelSpec& m, const ParallelConfig& p, bool decoder_only) {
  const int64_t pp = std::max<int64_t>(1, p.pipeline_parallel_degree);
  StageBlockCounts busiest{};
  for (int64_t i = 0; i < pp; ++i) {
    StageBlockCounts stage = stage_block_counts(m, p, i);
    if (decoder_only && i + 1 == pp) {
      stage.layers -= m.mtp_layers;
      stage.moe_layers -= m.mtp_layers;
    }
    if (i == 0 || stage.moe_layers > busiest.moe_layers ||
        (stage.moe_layers == busiest.moe_layers && stage.layers > busiest.layers))
      busiest = stage;
  }
  return busiest;
}
}  // namespace

StageBlockCounts busiest_stage(const ModelSpec& m, const ParallelConfig& p) { return busiest_of(m, p, false); }

ShardSizes shard_sizes(const ModelSpec& model, int64_t e, int64_t s, int64_t t, int64_t p) {
  ParallelConfig even;
  even.pipeline_parallel_degree = std::max<int64_t>(1, p);
  return stage_shard_sizes(model, busiest_stage(model, even), e, s, t, p, true);
}

int64_t host_limit_bytes(const ClusterSpec& cluster, int64_t world_size) {
  const int64_t ranks_per_node = std::max<int64_t>(1, std::min(world_size, cluster.gpus_per_node));
  return cluster.host_memory_bytes / ranks_per_node;
}

namespace {

// Parameters, gradients, master weights and optimizer moments of the rank's shard, and what
// sharding gathers of one unit at a time; `a` is the compute dtype's bytes.
void add_model_states(const RunConfig& c, const ShardSizes& sizes, int64_t a, MemoryEstimate& out) {
  const ParallelConfig& p = c.parallel;
  const int64_t shard = sizes.shard_params;
  switch (c.training.precision) {
    case Precision::kBf16:  // parameters, gradients and moments all in bf16
      out.parameters = 2 * shard;
      out.gradients = 2 * shard;
      out.optimizer_states = 2 * 2 * shard;
      break;
    case Precision::kMixed:  // bf16 compute copy, fp32 master, fp32 (or bf16) gradients, fp32 moments
      out.parameters = 2 * shard;
      out.master_weights = 4 * shard;
      out.gradients = (c.training.fp32_gradients ? 4 : 2) * shard;
      out.optimizer_states = 2 * 4 * shard;
      break;
    case Precision::kFp32:
      out.parameters = 4 * shard;
      out.gradients = 4 * shard;
      out.optimizer_states = 2 * 4 * shard;
      break;
  }
  // The distributed optimizer splits the master weights and the moments over the ranks that
  // hold the same parameters (Megatron-Core's data-parallel group for the dense ones: E x C x R,
  // the mesh's E; its expert data-parallel group for the experts: R, and C where the expert
  // group does not span it; where the dense shard spans E and C, R alone); the gradients stay
  // whole for the reduce-scatter.
  const int64_t cp = p.dense_shard_spanning() ? 1 : std::max<int64_t>(1, p.context_parallel_degree);
  const int64_t r = p.replica_degree();
  const int64_t dense_ranks = p.dense_shard_spanning() ? r : r * std::max<int64_t>(1, p.expert_data_degree()) * cp;
  const int64_t expert_ranks = p.expert_spans_context() ? r : r * cp;
  if (p.distributed_optimizer && dense_ranks > 1 && shard > 0) {
    const int64_t experts = sizes.shard_expert_params;
    const int64_t kept = ceil_div(shard - experts, dense_ranks) + ceil_div(experts, expert_ranks);
    out.master_weights = out.master_weights / shard * kept;
    out.optimizer_states = out.optimizer_states / shard * kept;
  }
  // FP8 GEMMs: Transformer Engine keeps each weight's FP8 copy for the step's micro-batches.
  if (c.training.fp8) out.parameters += shard;
  if (p.shards_states()) {
    out.gathered_parameters = 2 * sizes.largest_unit_params * a;
    out.gradient_buffers = sizes.largest_unit_params * a;
  }
}

// Token-expert slots on the busiest expert's rank for one micro-batch of `tokens`.
int64_t busiest_rank_slots(const RunConfig& c, int64_t tokens) {
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(c.model.experts_per_token * tokens) *
                busiest_expert_rank_load(c.model, c.moe, c.parallel.expert_parallel_degree)));
}

// What one block keeps from forward to backward, and what the block recomputed during
// backward holds meanwhile.
struct KeptActivations {
  int64_t stored_per_block = 0;
  int64_t working_set = 0;
};

KeptActivations kept_activations(const BlockActivations& block, Checkpointing checkpointing) {
  KeptActivations kept;
  switch (checkpointing) {
    case Checkpointing::kNone: kept.stored_per_block = block.full(); break;
    case Checkpointing::kSelective:
      kept.stored_per_block = block.attention + block.block_input;  // the MoE sub-block's input
      kept.working_set = block.moe;
      break;
    case Checkpointing::kFull:
      kept.stored_per_block = block.block_input;
      kept.working_set = block.full();
      break;
    case Checkpointing::kAttentionCore:  // the core's tensors are made again from q, k and v
      kept.stored_per_block = block.full() - block.core;
      kept.working_set = block.core;
      break;
    case Checkpointing::kLatentUpProjections:  // q, k and v are made again from the latents
      kept.stored_per_block = block.full() - block.latent_up;
      kept.working_set = block.latent_up;
      break;
  }
  return kept;
}

// A pipeline stage keeps its blocks' activations for every micro-batch in flight: under 1F1B
// stage s runs P - s forwards before its first backward (the first stage P).
// Interleaved (V chunks of L / (P V) blocks), rank s runs 2 (P - 1 - s) + (V - 1) P chunk
// forwards before its first backward, and keeps them and the one in use.
double micro_batches_in_flight(const ParallelConfig& p, int64_t stage) {
  const int64_t pp = std::max<int64_t>(1, p.pipeline_parallel_degree);
  const int64_t vp = std::max<int64_t>(1, p.virtual_pipeline_degree);
  double in_flight = static_cast<double>(std::min(pp - stage, p.gradient_accumulation_steps));
  if (vp > 1) {
    const int64_t chunks = std::min(2 * (pp - 1 - stage) + (vp - 1) * pp + 1, p.gradient_accumulation_steps * vp);
    in_flight = static_cast<double>(chunks) / static_cast<double>(vp);
  }
  return in_flight;
}

// The activations the stage's blocks keep on the device and, offloaded, on the host: `moe`
// of its MoE blocks and `dense` of its dense blocks.
void add_activations(const ParallelConfig& p, const BlockActivations& moe, const BlockActivations& dense,
                     StageBlockCounts blocks, double in_flight, MemoryEstimate& out) {
  const KeptActivations kept = kept_activations(moe, p.activation_checkpointing);
  const KeptActivations kept_dense = kept_activations(dense, p.activation_checkpointing);
  const double moe_layers = static_cast<double>(blocks.moe_layers);
  const double dense_layers = static_cast<double>(blocks.layers - blocks.moe_layers);
  out.activation_working_set = std::max(kept.working_set, dense_layers > 0 ? kept_dense.working_set : 0);
  // What offloading moves is the checkpointed input (the block input, which is also the MoE
  // sub-block's input under selective checkpointing; the same for either kind of block);
  // attention's activations stay.
  const int64_t offloadable = recomputes_moe(p.activation_checkpointing) ? moe.block_input : 0;
  const double resident = moe_layers * static_cast<double>(kept.stored_per_block - offloadable) +
                          dense_layers * static_cast<double>(kept_dense.stored_per_block - offloadable);
  const int64_t stage_layers = blocks.layers;
  int64_t blocks_on_device = stage_layers;
  if (p.activation_offloading && offloadable > 0) {
    // Offloaded during forward; in backward, the block in use and `horizon` prefetched ones.
    blocks_on_device = std::min(stage_layers, p.activation_loading_horizon + 1);
    out.offloaded_activations =
        to_bytes(in_flight * static_cast<double>(stage_layers) * static_cast<double>(offloadable));
  }
  const double layers = static_cast<double>(stage_layers);
  const double offloadable_on_device =
      p.activation_offloading ? static_cast<double>(blocks_on_device) : in_flight * layers;
  out.activations = to_bytes(in_flight * resident + offloadable_on_device * static_cast<double>(offloadable) +
                             static_cast<double>(out.activation_working_set));
}

// With sequence parallelism a rank routes (and dispatches) its 1/T of the tokens.
double sequence_share(const ParallelConfig& p) {
  return p.sequence_parallel ? static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree)) : 1.0;
}

// The expert exchange's buffers for one micro-batch of `tokens` with `slots` on this rank.
// All-to-all: the k copies of each local token going out, and the slots coming in.
// All-gather: every token of the expert group, and the slots computed here.
int64_t dispatch_buffer_bytes(const RunConfig& c, int64_t tokens, int64_t slots, int64_t a) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  if (p.expert_parallel_degree <= 1) return 0;
  const double share = sequence_share(p);
  const double t = static_cast<double>(tokens) / share;
  const double sent = c.moe.dispatcher != Dispatcher::kAllGather ? static_cast<double>(m.experts_per_token) * t
                                                                : static_cast<double>(p.expert_parallel_degree) * t;
  return to_bytes((sent + static_cast<double>(slots) / share) * static_cast<double>(m.hidden_size * a));
}

// DeepEP's buffers as Megatron-Core's flex dispatcher allocates them (fused_a2a.get_buffer):
// the larger of the dispatch and combine configs' size hints for the expert group, with a
// token's hidden state in bf16 (deepseek-ai/DeepEP, csrc/config.hpp get_nvl_buffer_size_hint
// and get_rdma_buffer_size_hint; deep_ep/buffer.py, the configs for each group size and 20
// SMs, 10 channels). Each channel keeps, per NVLink peer, a ring of received tokens with their
// top-k indices and weights (room for 128 of each) and 128 scales; across nodes each RDMA
// peer's ring again, for sending and receiving.
int64_t deepep_buffer_bytes(int64_t hidden, int64_t group) {
  constexpr int64_t kNvlPeers = 8, kChannels = 10, kMaxTopK = 128, kMaxScales = 128, kSourceMeta = 8;
  // The received tokens each channel holds, the larger of the dispatch and combine configs' for
  // the group size: NVLink rings of 256 tokens up to 8 ranks, 288 up to 64, 560 at 128, 720
  // beyond; RDMA rings of 128 rounded up to a whole number of chunked sends (140 up to 64
  // ranks, 132 beyond).
  const int64_t nvl_tokens = group <= 8 ? 256 : group <= 64 ? 288 : group <= 128 ? 560 : 720;
  const int64_t rdma_tokens = group <= 64 ? 140 : 132;
  const int64_t hidden_bytes = hidden * kBytesBf16;
  const int64_t rdma_ranks = std::max<int64_t>(1, group / kNvlPeers), nvl_ranks = std::min(group, kNvlPeers);
  const int64_t per_token = hidden_bytes + kSourceMeta + kMaxTopK * (8 + 4) + kMaxScales * 4;
  auto align = [](int64_t bytes) { return (bytes + 127) / 128 * 128; };
  const int64_t nvl = align(kChannels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + nvl_tokens * per_token));
  if (group <= kNvlPeers) return nvl;
  const int64_t rdma = align(kChannels * rdma_ranks * ((kNvlPeers * 2 + 2) * 2 * 4 + rdma_tokens * 2 * (per_token + 16)) +
                             (int64_t{1} << 20));
  return nvl + rdma;
}

// Logits in the compute dtype and the fp32 log-probabilities the loss keeps. They are freed
// when the lm head has run backward, before any block does: the peak is either at the loss
// (kept activations + logits) or in a block's backward (kept activations + its recompute
// working set, gathered units, gradient buffers and dispatch buffers). Only what the logits add
// over the second is counted.
int64_t logits_bytes(const RunConfig& c, int64_t tokens, int64_t a, const MemoryEstimate& out) {
  // The vocabulary is split over the tensor-parallel ranks (padded to a multiple of T).
  const double vocab_share =
      static_cast<double>(ceil_div(c.model.vocab_size, std::max<int64_t>(1, c.parallel.tensor_parallel_degree)));
  // Each multi-token prediction module's loss keeps its own logits until the backward pass
  // reaches it, and its projection its joined input (2 x hidden, split like the block inputs).
  const double losses = static_cast<double>(1 + c.model.mtp_layers);
  const double mtp_inputs = static_cast<double>(c.model.mtp_layers) * 2.0 * static_cast<double>(c.model.hidden_size) /
                            sequence_share(c.parallel) * static_cast<double>(a);
  const int64_t loss_bytes = to_bytes(static_cast<double>(tokens) *
                                      (losses * vocab_share * static_cast<double>(a + kBytesFp32) + mtp_inputs));
  const int64_t block_backward =
      out.activation_working_set + out.gathered_parameters + out.gradient_buffers + out.moe_dispatch_buffers;
  return std::max<int64_t>(0, loss_bytes - block_backward);
}

// The framework's own, fragmentation of the transient items, and the device total.
void add_totals(const ClusterSpec& cluster, MemoryEstimate& out) {
  out.framework_overhead = cluster.framework_overhead_bytes;
  const int64_t transient = out.gathered_parameters + out.gradient_buffers + out.activations +
                            out.moe_dispatch_buffers + out.logits;
  out.fragmentation = to_bytes(std::round(static_cast<double>(transient) * (cluster.fragmentation_factor - 1.0)));
  out.device_total =
      out.model_states() + transient + out.communication_buffers + out.framework_overhead + out.fragmentation;
}

// One stage's memory: its blocks and `ends`, with `in_flight` micro-batches' activations kept,
// and with `loss` the logits.
MemoryEstimate estimate_stage_memory(const RunConfig& c, Ends ends, StageBlockCounts blocks, double in_flight, bool loss) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const int64_t a = c.training.precision == Precision::kFp32 ? kBytesFp32 : kBytesBf16;
  const ShardSizes sizes = shard_sizes_with(m, blocks, p.expert_parallel_degree, p.dense_shard_degree(),
                                            p.tensor_parallel_degree, p.pipeline_parallel_degree, ends,
                                            p.expert_tensor_degree(), p.expert_shard_degree());
  MemoryEstimate out;
  add_model_states(c, sizes, a, out);
  // A rank's share of each sequence: 1 / C of it under context parallelism (with flash
  // attention, rule context_needs_flash_attention, nothing of a block grows with the whole).
  const int64_t seq = p.local_seq_len(c.training.seq_len);
  const int64_t tokens = p.micro_batch_size * seq;
  const int64_t slots = busiest_rank_slots(c, tokens);
  const TensorSplit split{p.tensor_parallel_degree, p.sequence_parallel};
  const BlockActivations block = block_activations(m, p.micro_batch_size, seq, slots, a, c.cluster.kernels,
                                                   c.cluster.attention, split, c.training.fp8);
  // A dense block among MoE blocks: its feed-forward layer takes every token.
  const BlockActivations dense =
      blocks.moe_layers < blocks.layers
          ? block_activations(dense_block_model(m), p.micro_batch_size, seq, tokens, a, c.cluster.kernels,
                              c.cluster.attention, split, c.training.fp8)
          : BlockActivations{};
  add_activations(p, block, dense, blocks, in_flight, out);
  out.moe_dispatch_buffers = dispatch_buffer_bytes(c, tokens, slots, a);
  if (c.moe.dispatcher == Dispatcher::kDeepEp && p.expert_parallel_degree > 1)
    out.communication_buffers = deepep_buffer_bytes(m.hidden_size, p.expert_parallel_degree);
  if (loss) out.logits = logits_bytes(c, tokens, a, out);
  add_totals(c.cluster, out);
  return out;
}

}  // namespace

MemoryEstimate estimate_memory(const RunConfig& c, StageView view) {
  const ParallelConfig& p = c.parallel;
  const int64_t pp = std::max<int64_t>(1, p.pipeline_parallel_degree);
  if (view == StageView::kBlocksOnly)  // the busiest blocks with the first stage's micro-batches
    return estimate_stage_memory(c, Ends::kNone, busiest_of(c.model, p, true), micro_batches_in_flight(p, 0), true);
  if (pp == 1) return estimate_stage_memory(c, Ends::kBoth, busiest_stage(c.model, p), micro_batches_in_flight(p, 0), true);
  // Under a pipeline each stage keeps its own blocks' activations for its own micro-batches in
  // flight (the first stage the most): the first stage with the embedding, the second with the
  // most micro-batches of the middle stages (they hold as many blocks), and the last with the
  // head, the loss's logits and multi-token prediction's blocks. The device must hold the
  // largest.
  MemoryEstimate worst = estimate_stage_memory(c, Ends::kFirst, stage_block_counts(c.model, p, 0),
                                               micro_batches_in_flight(p, 0), false);
  const MemoryEstimate last = estimate_stage_memory(c, Ends::kLast, stage_block_counts(c.model, p, pp - 1),
                                                    micro_batches_in_flight(p, pp - 1), true);
  if (last.device_total > worst.device_total) worst = last;
  if (pp > 2) {
    // The middle stages: the one with the most MoE blocks (then blocks), with the second stage's
    // micro-batches in flight, the most of any of them.
    StageBlockCounts middle{};
    for (int64_t i = 1; i + 1 < pp; ++i) {
      const StageBlockCounts here = stage_block_counts(c.model, p, i);
      if (i == 1 || here.moe_layers > middle.moe_layers || (here.moe_layers == middle.moe_layers && here.layers > middle.layers))
        middle = here;
    }
    const MemoryEstimate inner = estimate_stage_memory(c, Ends::kMiddle, middle, micro_batches_in_flight(p, 1), false);
    if (inner.device_total > worst.device_total) worst = inner;
  }
  return worst;
}

std::vector<MemoryItem> MemoryEstimate::device_items() const {
  return {{"parameters", parameters},
          {"master_weights", master_weights},
          {"gradients", gradients},
          {"optimizer_states", optimizer_states},
          {"gathered_parameters", gathered_parameters},
          {"gradient_buffers", gradient_buffers},
          {"activations", activations},
          {"moe_dispatch_buffers", moe_dispatch_buffers},
          {"logits", logits},
          {"communication_buffers", communication_buffers},
          {"framework_overhead", framework_overhead},
          {"fragmentation", fragmentation}};
}

std::vector<MemoryItem> MemoryEstimate::host_items() const {
  return {{"offloaded_activations", offloaded_activations}};
}

MemoryBreakdown to_breakdown(const MemoryEstimate& m, const ClusterSpec& cluster, int64_t world_size) {
  MemoryBreakdown b;
  b.device = m.device_items();
  b.device_total_bytes = m.device_total;
  b.device_limit_bytes = cluster.usable_memory_bytes();
  b.host = m.host_items();
  b.host_total_bytes = m.offloaded_activations;
  b.host_limit_bytes = host_limit_bytes(cluster, world_size);
  return b;
}

MemoryEstimate estimate_memory_at_load(const RunConfig& config, double load) {
  const MoeConfig moe = with_busiest_rank_load(config.model, config.moe, config.parallel.expert_parallel_degree, load);
  return estimate_memory({config.model, config.cluster, config.parallel, moe, config.training, config.target});
}

}  // namespace moeplan::planner
