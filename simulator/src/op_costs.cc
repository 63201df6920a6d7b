#include "moeplan/simulator/op_costs.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/units.h"
#include "moeplan/core/fit.h"
#include "moeplan/simulator/kernels.h"

namespace moeplan::sim {

bool op_times_apply(const RunConfig& c) {
  const OpTimes& t = c.cluster.op_times;
  const ModelSpec& m = c.model;
  // The executor measures the blocks it trains (Mixtral's, Qwen3-MoE's, DeepSeek's), at the
  // measured model's attention, shared experts, dense blocks and multi-token prediction: no
  // biases or GPT-OSS's variants.
  return !t.empty() && t.blocks == OpTimesBlocks::of(m) && !m.qkv_bias && gpt_oss_variant_field(m) == nullptr &&
         c.parallel.context_parallel_degree == 1 &&
         t.hidden_size == m.hidden_size &&
         t.intermediate_size == m.intermediate_size &&
         t.num_attention_heads == m.num_attention_heads && t.num_key_value_heads == m.num_key_value_heads &&
         t.head_dim == m.head_dim && t.num_experts == m.num_experts && t.experts_per_token == m.experts_per_token &&
         t.vocab_size == m.vocab_size && t.seq_len == c.training.seq_len &&
         t.precision == name_of(kPrecisionNames, c.training.precision) &&
         (c.parallel.tensor_parallel_degree == 1 || t.split(c.parallel.tensor_parallel_degree) != nullptr);
}

namespace {

// One expert's measured time, forward or backward, under the plan's tensor split.
const CurvePoints& expert_curve(const OpTimes& t, const TensorSplitTimes* split, bool backward) {
  return backward ? (split ? split->expert_backward : t.expert_backward)
                  : (split ? split->expert_forward : t.expert_forward);
}

// A SwiGLU layer of `width` on every token of a micro-batch (shared experts, a dense block's
// layer): the measured expert on the rows that hold as many multiply-adds at its width (split
// over T as the routed experts are).
double swiglu_seconds(const CurvePoints& expert, const ModelSpec& m, double tokens, int64_t width) {
  if (width <= 0) return 0;
  return curve_at(expert, tokens * static_cast<double>(width) / static_cast<double>(m.intermediate_size));
}

// Router (and dispatch bookkeeping) plus each local expert on its share of the rank's slots,
// and the shared experts on every token, from measured times. Under a tensor split every rank
// routes the whole micro-batch and runs its part of each expert's width (TensorSplitTimes);
// folded (ETP = 1) each routes its own 1/T of the tokens to whole experts, and only the shared
// experts stay split over T.
double measured_moe_seconds(const RunConfig& c, double load, bool backward) {
  const OpTimes& t = c.cluster.op_times;
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const double tokens = static_cast<double>(p.micro_batch_size) * static_cast<double>(c.training.seq_len);
  const double routed = tokens / static_cast<double>(p.expert_tensor_fold());
  const double local = static_cast<double>(m.num_experts) / static_cast<double>(p.expert_parallel_degree);
  const double rows = static_cast<double>(m.experts_per_token) * routed * load / local;
  const CurvePoints& expert = expert_curve(t, t.split(p.expert_tensor_degree()), backward);
  const CurvePoints& shared = expert_curve(t, t.split(p.tensor_parallel_degree), backward);
  return curve_at(backward ? t.router_backward : t.router_forward, routed) + local * curve_at(expert, rows) +
         swiglu_seconds(shared, m, tokens, m.shared_expert_intermediate_size);
}

}  // namespace

double moe_backward_seconds(const RunConfig& c, double load) {
  return op_times_apply(c) ? measured_moe_seconds(c, load, true) : moe_kernels(c, load, true).seconds();
}

double moe_forward_seconds(const RunConfig& c, double load) {
  return op_times_apply(c) ? measured_moe_seconds(c, load, false) : moe_kernels(c, load, false).seconds();
}

ModelSpec stage_model(const RunConfig& c) {
  return stage_blocks(c.model, c.parallel, std::max<int64_t>(1, c.parallel.pipeline_parallel_degree) - 1);
}

StageCompute stage_compute(const OpCosts& o, const ParallelConfig& p, StageBlockCounts blocks) {
  const double moe = static_cast<double>(blocks.moe_layers);
  const double dense = static_cast<double>(blocks.layers - blocks.moe_layers);
  const double layers = static_cast<double>(blocks.layers);
  // Each sub-block's feed-forward part: the experts on the busiest rank, or a dense block's.
  const double ffn_forward = moe * o.moe_forward_busiest_s + dense * o.dense_forward_s;
  StageCompute out;
  out.forward = layers * o.attention_forward_s + ffn_forward;
  out.backward = layers * o.attention_backward_s + moe * o.moe_backward_busiest_s + dense * o.dense_backward_s;
  if (p.activation_checkpointing == Checkpointing::kFull)
    out.recompute = std::max(0.0, out.forward + layers * o.recompute_beyond_forward_s);
  if (p.activation_checkpointing == Checkpointing::kSelective) out.recompute = ffn_forward;
  if (p.activation_checkpointing == Checkpointing::kAttentionCore) out.recompute = layers * o.core_forward_s;
  if (p.activation_checkpointing == Checkpointing::kLatentUpProjections) out.recompute = layers * o.latent_up_forward_s;
  return out;
}

namespace {

// A dense block's feed-forward layer among MoE blocks: the MoE sub-block of the dense block's
// own model (dense_block_model), every token on every rank (no expert split).
void add_dense_blocks(const RunConfig& c, KernelCosts& o) {
  const MicroBatchKernels k = dense_block_kernels(c);
  o.dense_forward_s = k.moe_forward.seconds();
  o.dense_backward_s = k.moe_backward.seconds();
  o.dense_flops = k.moe_forward.flops();
  if (c.parallel.tensor_parallel_degree > 1) o.tensor_dense_overlap_s = k.moe_wgrad_s;
  for (const KernelList* l : {&k.attention_forward, &k.attention_backward, &k.moe_forward, &k.moe_backward}) {
    const std::array<double, 3> by_class = l->seconds_by_class();
    for (size_t i = 0; i < 3; ++i) o.dense_block_by_class[i] += by_class[i];
  }
}

// Measured operation times (a calibrated profile) in place of the kernel model's, and what
// the executor's whole micro-batch took beyond them.
void add_measured_times(const RunConfig& c, double tokens, KernelCosts& o) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const OpTimes& t = c.cluster.op_times;
  const TensorSplitTimes* split = t.split(p.tensor_parallel_degree);
  o.measured = true;
  o.attention_forward_s = curve_at(split ? split->attention_forward : t.attention_forward, tokens);
  o.attention_backward_s = curve_at(split ? split->attention_backward : t.attention_backward, tokens);
  // The head once, and again for each multi-token prediction module's loss.
  const double heads = static_cast<double>(1 + m.mtp_layers);
  o.head_s = heads * curve_at(split ? split->head : t.head, tokens);
  o.head_forward_s = o.head_s / 3.0;
  o.block_by_class = {o.attention_forward_s + o.attention_backward_s + o.moe_forward_busiest_s + o.moe_backward_busiest_s, 0, 0};
  o.head_by_class = {o.head_s, 0, 0};
  if (m.has_dense_layers()) {
    o.dense_forward_s = swiglu_seconds(expert_curve(t, split, false), m, tokens, m.dense_intermediate_size);
    o.dense_backward_s = swiglu_seconds(expert_curve(t, split, true), m, tokens, m.dense_intermediate_size);
    o.dense_flops = 2.0 * tokens * static_cast<double>(m.mlp_matrices() * m.hidden_size * m.dense_intermediate_size) /
                    static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
    o.dense_block_by_class = {o.attention_forward_s + o.attention_backward_s + o.dense_forward_s + o.dense_backward_s, 0, 0};
  }
  // What the executor's whole micro-batch took beyond its operations, spread over the blocks
  // of the model it ran (not this stage's): it runs with their attention, and again where a
  // block is recomputed. At a split whose whole micro-batch was measured (sequence parallel), against the split
  // operations (the router whole), and its collectives priced as they ran there; otherwise
  // the unsplit micro-batch (one rank, experts on it, balanced routing) against the unsplit
  // operations, what it took beyond them charged to a split block unchanged. With the experts
  // over E ranks (T = 1), the micro-batch measured so (its dispatch and combine, the time inside
  // the exchanges left out) against the operations of E's local experts on their rows.
  const bool split_whole = split != nullptr && p.sequence_parallel && !split->micro_batch_forward.empty();
  const ExpertSplitTimes* experts_whole =
      p.tensor_parallel_degree <= 1 && p.expert_parallel_degree > 1 ? t.expert_split(p.expert_parallel_degree) : nullptr;
  // With the states sharded over S ranks (experts, tensors and context whole on each), the
  // micro-batch measured so: its gathers and reduce-scatters as they ran, beside the compute.
  const ShardSplitTimes* sharded_whole =
      p.tensor_parallel_degree <= 1 && p.expert_parallel_degree <= 1 && p.context_parallel_degree <= 1 &&
              p.dense_shard_degree() == p.hybrid_shard_degree && p.hybrid_shard_degree > 1
          ? t.shard_split(p.hybrid_shard_degree)
          : nullptr;
  const CurvePoints& whole_forward = split_whole     ? split->micro_batch_forward
                                     : experts_whole ? experts_whole->micro_batch_forward
                                                     : t.micro_batch_forward;
  const CurvePoints& whole_backward = split_whole     ? split->micro_batch_backward
                                      : experts_whole ? experts_whole->micro_batch_backward
                                                      : t.micro_batch_backward;
  if (whole_forward.empty() || whole_backward.empty() || t.num_layers <= 0) return;
  // The blocks of the model the whole micro-batches ran: these blocks at its depth.
  const double blocks = static_cast<double>(t.num_layers + m.mtp_layers);
  const double moe_blocks = static_cast<double>(m.moe_layers_in(0, t.num_layers) + m.mtp_layers);
  const double experts = static_cast<double>(m.num_experts) /
                         static_cast<double>(experts_whole ? experts_whole->expert_parallel_degree : 1);
  const double rows = static_cast<double>(m.experts_per_token) * tokens / experts;  // balanced
  const TensorSplitTimes* ops = split_whole ? split : nullptr;
  const double head = heads * curve_at(ops ? ops->head : t.head, tokens);
  auto operations = [&](bool backward) {
    const CurvePoints& expert = expert_curve(t, ops, backward);
    const double attention = curve_at(
        backward ? (ops ? ops->attention_backward : t.attention_backward) : (ops ? ops->attention_forward : t.attention_forward),
        tokens);
    const double moe = curve_at(backward ? t.router_backward : t.router_forward, tokens) +
                       experts * curve_at(expert, rows) + swiglu_seconds(expert, m, tokens, m.shared_expert_intermediate_size);
    return blocks * attention + moe_blocks * moe +
           (blocks - moe_blocks) * swiglu_seconds(expert, m, tokens, m.dense_intermediate_size) +
           head * (backward ? 2.0 / 3.0 : 1.0 / 3.0);
  };
  if (sharded_whole != nullptr) {
    o.shard_measured = true;
    o.shard_forward_s = std::max(0.0, curve_at(sharded_whole->micro_batch_forward, tokens) - curve_at(whole_forward, tokens)) / blocks;
    o.shard_backward_s =
        std::max(0.0, curve_at(sharded_whole->micro_batch_backward, tokens) - curve_at(whole_backward, tokens)) / blocks;
  }
  o.framework_forward_s = std::max(0.0, curve_at(whole_forward, tokens) - operations(false)) / blocks;
  o.framework_backward_s = std::max(0.0, curve_at(whole_backward, tokens) - operations(true)) / blocks;
  o.attention_forward_s += o.framework_forward_s;
  o.attention_backward_s += o.framework_backward_s;
  // Every block checkpointed whole: its forward runs without autograd and its recompute with it.
  // From the whole micro-batch measured so against the one without (one rank, unsplit; per block,
  // charged to a split or sharded block unchanged): the forward's difference, and what the
  // backward took beyond the other's less the blocks' forward with autograd (the micro-batch's
  // forward without the head's part) -- the recompute beyond its forward.
  if (p.activation_checkpointing == Checkpointing::kFull && !t.recomputed_micro_batch_forward.empty() &&
      !t.micro_batch_forward.empty()) {
    const double plain_forward = curve_at(t.micro_batch_forward, tokens);
    const double forward_delta = (curve_at(t.recomputed_micro_batch_forward, tokens) - plain_forward) / blocks;
    const double recompute = (curve_at(t.recomputed_micro_batch_backward, tokens) -
                              curve_at(t.micro_batch_backward, tokens)) / blocks;
    const double blocks_forward = (plain_forward - heads * curve_at(t.head, tokens) / 3.0) / blocks;
    o.attention_forward_s = std::max(0.0, o.attention_forward_s + forward_delta);
    o.recompute_beyond_forward_s = recompute - blocks_forward - forward_delta;
  }
  if (split_whole) {
    o.tensor_region_forward_s = curve_at(split->collectives_forward, tokens) / (2.0 * blocks);
    o.tensor_region_backward_s = curve_at(split->collectives_backward, tokens) / (2.0 * blocks);
  }
  // The executor's exchange: per MoE block three sync points forward (counts, dispatch,
  // combine) and two backward, each paying an equal share of what the whole micro-batch spent
  // inside them (a step waits at each for the rank that comes last).
  if (experts_whole && c.moe.dispatcher == Dispatcher::kAllToAll && !c.moe.overlap_exchange &&
      !experts_whole->exchange_forward.empty() && !experts_whole->exchange_backward.empty() && moe_blocks > 0) {
    o.expert_exchange_forward_s = curve_at(experts_whole->exchange_forward, tokens) / (3.0 * moe_blocks);
    o.expert_exchange_backward_s = curve_at(experts_whole->exchange_backward, tokens) / (2.0 * moe_blocks);
  }
}

}  // namespace

double fused_network_bytes(const ModelSpec& m, double send_bytes, const GroupShape& g) {
  if (!g.crosses_nodes() || m.experts_per_token <= 0) return 0;
  const double nodes = static_cast<double>(g.nodes);
  const double experts = static_cast<double>(m.num_experts);
  const double on_a_node = experts / nodes;
  double missed = 1.0;  // P(none of the k experts on a given node)
  for (int64_t i = 0; i < m.experts_per_token; ++i)
    missed *= std::max(0.0, (experts - on_a_node - static_cast<double>(i)) / (experts - static_cast<double>(i)));
  // Group-limited routing with whole groups on each node: a node is missed when none of its
  // groups is among the router_group_topk chosen (fewer nodes than the experts alone would hit).
  if (m.router_groups > 1 && m.router_groups % g.nodes == 0) {
    const double groups = static_cast<double>(m.router_groups), on_a_node_g = groups / nodes;
    double groups_missed = 1.0;
    for (int64_t i = 0; i < m.router_group_topk; ++i)
      groups_missed *= std::max(0.0, (groups - on_a_node_g - static_cast<double>(i)) / (groups - static_cast<double>(i)));
    missed = std::max(missed, groups_missed);
  }
  return send_bytes / static_cast<double>(m.experts_per_token) * (nodes - 1.0) * (1.0 - missed);
}

CollectiveCost token_exchange_cost(const CostModel& cost, const RunConfig& c, double send_bytes, const GroupShape& g) {
  if (c.moe.dispatcher == Dispatcher::kDeepEp)
    return cost.fused_dispatch_cost(send_bytes, fused_network_bytes(c.model, send_bytes, g), g);
  if (c.moe.dispatcher == Dispatcher::kAllGather) {
    // The dispatch gathers every rank's tokens and the combine reduce-scatters the experts'
    // outputs back: each exchange is priced as half of the pair.
    const ParallelConfig& p = c.parallel;
    const double a = c.training.precision == Precision::kFp32 ? kBytesFp32 : kBytesBf16;
    const double group_bytes = static_cast<double>(p.expert_parallel_degree * p.micro_batch_size *
                                                   p.local_seq_len(c.training.seq_len) * c.model.hidden_size) * a;
    const CollectiveCost gather = cost.all_gather_cost(group_bytes, g), scatter = cost.reduce_scatter_cost(group_bytes, g);
    return {0.5 * (gather.latency_s + scatter.latency_s), 0.5 * (gather.intra_s + scatter.intra_s),
            0.5 * (gather.nic_bytes_per_node + scatter.nic_bytes_per_node)};
  }
  return cost.all_to_all_cost(send_bytes, g);
}

ContextExchangeCost context_exchange_cost(const CostModel& cost, const OpCosts& o, const ParallelConfig& p,
                                          const GroupShape& g) {
  ContextExchangeCost out;
  const double chunks = static_cast<double>(p.context_parallel_degree);
  if (p.context_parallel_degree <= 1 || o.context_kv_bytes <= 0) return out;
  if (p.context_exchange == ContextExchange::kAllGather) {
    const double whole = chunks * o.context_kv_bytes;
    out.forward_s = cost.all_gather_seconds(whole, g);
    out.backward_s = out.forward_s + cost.reduce_scatter_seconds(whole, g);
    return out;
  }
  // Each of the C - 1 steps beside one chunk pair's attention (1 / C of the core's time).
  const double steps = chunks - 1.0;
  out.forward_s = steps * std::max(0.0, cost.send_seconds(o.context_kv_bytes, g) - o.core_forward_s / chunks);
  out.backward_s = steps * std::max(0.0, cost.send_seconds(2.0 * o.context_kv_bytes, g) - o.core_backward_s / chunks);
  return out;
}

KernelCosts kernel_costs(const RunConfig& c) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const ParamCounts params = count_parameters(m);
  const double h = static_cast<double>(m.hidden_size);
  const double ffn = static_cast<double>(m.intermediate_size);
  // Tensor parallelism splits heads, intermediate columns and the (padded) vocabulary over T
  // ranks; sequence parallelism splits the tokens between those regions.
  const double tp = static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
  const double sp = p.sequence_parallel ? tp : 1.0;
  const double vocab = std::ceil(static_cast<double>(m.vocab_size) / tp);
  const double seq = static_cast<double>(p.local_seq_len(c.training.seq_len));
  const double tokens = static_cast<double>(p.micro_batch_size) * seq;
  // Token-expert pairs per rank: each rank routes k per token and the E ranks of the group
  // share the pairs; the busiest rank gets its load (moe_load.h) times the mean.
  const double mean_slots = static_cast<double>(m.experts_per_token) * tokens;
  const double busiest_slots = mean_slots * busiest_expert_rank_load(m, c.moe, p.expert_parallel_degree);

  const double q_width = static_cast<double>(m.num_attention_heads * m.head_dim);
  const double busiest_load = busiest_slots / mean_slots;

  KernelCosts o;
  if (!op_times_apply(c)) {
    // Every kernel of the micro-batch, from the profile's kernel model.
    const MicroBatchKernels k = micro_batch_kernels(c);
    // Balanced routing (the busiest rank at the mean) needs no second pass.
    const bool balanced = busiest_load == 1.0;
    KernelList busiest_forward, busiest_backward;
    if (!balanced) {
      busiest_forward = moe_kernels(c, busiest_load, false);
      busiest_backward = moe_kernels(c, busiest_load, true);
    }
    const KernelList& moe_busiest_forward = balanced ? k.moe_forward : busiest_forward;
    const KernelList& moe_busiest_backward = balanced ? k.moe_backward : busiest_backward;
    o.attention_forward_s = k.attention_forward.seconds();
    o.attention_backward_s = k.attention_backward.seconds();
    o.core_forward_s = k.core_forward.seconds();
    o.core_backward_s = k.attention_backward.seconds(KernelClass::kAttention);
    o.latent_up_forward_s = k.latent_up_forward.seconds();
    o.latent_up_flops = k.latent_up_forward.flops();
    o.moe_forward_s = k.moe_forward.seconds();
    o.moe_forward_busiest_s = moe_busiest_forward.seconds();
    o.moe_backward_busiest_s = moe_busiest_backward.seconds();
    for (const Kernel& kernel : k.moe_forward.kernels()) {
      if (!kernel.name.starts_with("shared_expert.")) continue;
      (kernel.name == "shared_expert.fc2" ? o.shared_down_forward_s : o.shared_up_forward_s) += kernel.seconds;
    }
    o.head_forward_s = k.head_forward.seconds();
    o.head_s = o.head_forward_s + k.head_backward.seconds();
    if (p.tensor_parallel_degree > 1) {
      o.tensor_overlap_s = k.attention_wgrad_s;
      // Folded routed experts end no tensor-parallel region: without shared experts there is no
      // collective for their weight gradients to run beside.
      if (p.expert_tensor_fold() == 1 || m.shared_experts()) o.tensor_moe_overlap_s = k.moe_wgrad_s;
    }
    o.attention_flops = k.attention_forward.flops();
    o.moe_flops = k.moe_forward.flops();
    o.head_flops = k.head_forward.flops();
    o.core_flops = k.core_forward.flops();
    for (const KernelList* l : {&k.attention_forward, &k.attention_backward, &moe_busiest_forward, &moe_busiest_backward}) {
      const std::array<double, 3> by_class = l->seconds_by_class();
      for (size_t i = 0; i < 3; ++i) o.block_by_class[i] += by_class[i];
    }
    for (const KernelList* l : {&k.head_forward, &k.head_backward}) {
      const std::array<double, 3> by_class = l->seconds_by_class();
      for (size_t i = 0; i < 3; ++i) o.head_by_class[i] += by_class[i];
    }
    if (m.dense_intermediate_size > 0) add_dense_blocks(c, o);  // on this stage or another
  } else {
    o.moe_forward_s = moe_forward_seconds(c, 1.0);
    o.moe_forward_busiest_s = moe_forward_seconds(c, busiest_load);
    o.moe_backward_busiest_s = moe_backward_seconds(c, busiest_load);
    const double proj_flops = 2.0 * tokens * static_cast<double>(params.attention_per_layer) / tp;
    o.attention_flops = proj_flops + 4.0 * tokens * q_width * seq / 2.0 / tp;
    o.moe_flops = 2.0 * tokens / sp * h * static_cast<double>(m.router_width()) +
                  2.0 * mean_slots * static_cast<double>(m.mlp_matrices()) * h * ffn / tp;
    o.head_flops = 2.0 * tokens * vocab * h;
  }
  if (op_times_apply(c)) add_measured_times(c, tokens, o);

  return o;
}

OpCosts op_costs(const RunConfig& c) { return op_costs(c, kernel_costs(c)); }

ExchangeCover exchange_cover(const KernelCosts& k) {
  return {k.moe_backward_busiest_s, k.attention_backward_s, k.attention_forward_s, k.moe_forward_busiest_s};
}

double ExchangeCover::exposed(double exchange_s, double moe_beside, double attention_beside) const {
  auto beyond = [&](double cover) { return std::max(0.0, exchange_s - cover); };
  return beyond(dispatch) + beyond(combine) + std::max(0.0, beyond(combine_backward) - attention_beside) +
         std::max(0.0, beyond(dispatch_backward) - moe_beside);
}

double SharedExpertCover::hidden(double exchange_s, bool recomputed) const {
  return (recomputed ? 2.0 : 1.0) * (std::min(exchange_s, dispatch) + std::min(exchange_s, combine));
}

SharedExpertCover shared_expert_cover(const RunConfig& c, const KernelCosts& k) {
  SharedExpertCover out;
  if (!overlaps_shared_expert(c.model, c.moe, c.parallel) || c.moe.overlap_exchange) return out;
  out.dispatch = k.shared_up_forward_s;
  out.combine = k.shared_down_forward_s;
  return out;
}

double ExchangeCover::covered(double exchange_s) const {
  return std::min(exchange_s, dispatch) + std::min(exchange_s, combine) + std::min(exchange_s, combine_backward) +
         std::min(exchange_s, dispatch_backward);
}

const KernelCosts& KernelCostCache::get(const RunConfig& c) {
  const ParallelConfig& p = c.parallel;
  const std::array<int64_t, 9> key{p.tensor_parallel_degree,  p.sequence_parallel ? 1 : 0, p.micro_batch_size,
                                   p.expert_parallel_degree,  p.expert_tensor_degree(),     c.model.num_layers,
                                   c.model.first_dense_layers, c.model.mtp_layers,         p.context_parallel_degree};
  auto it = costs_.find(key);
  if (it == costs_.end()) it = costs_.emplace(key, kernel_costs(c)).first;
  return it->second;
}

OpCosts op_costs(const RunConfig& c, const KernelCosts& kernels) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const ParamCounts params = count_parameters(m);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double a = fp32 ? kBytesFp32 : kBytesBf16;
  const double e = static_cast<double>(p.expert_parallel_degree);
  // The dense parameters' shard group and the routed experts' (S, or S x E x C where the dense
  // shard spans the expert and context ranks).
  const double s = static_cast<double>(p.dense_shard_degree());
  const double expert_s = static_cast<double>(p.expert_shard_degree());
  const double h = static_cast<double>(m.hidden_size);
  const double tp = static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
  const double etp = static_cast<double>(p.expert_tensor_degree());  // the routed experts' split
  const double sp = p.sequence_parallel ? tp : 1.0;
  const double tokens =
      static_cast<double>(p.micro_batch_size) * static_cast<double>(p.local_seq_len(c.training.seq_len));
  const double mean_slots = static_cast<double>(m.experts_per_token) * tokens;
  const double busiest_slots = mean_slots * busiest_expert_rank_load(m, c.moe, p.expert_parallel_degree);
  const double q_width = static_cast<double>(m.num_attention_heads * m.head_dim);
  const double kv_width = static_cast<double>(m.num_key_value_heads * m.head_dim);
  // The keys (heads x head_dim, rotary part included) and values (heads x value width) of the
  // rank's kv heads: under latent attention the up projections' output for every head.
  const double context_kv_bytes =
      p.context_parallel_degree > 1
          ? tokens * (kv_width + static_cast<double>(m.num_key_value_heads * m.value_head_dim())) / tp * a
          : 0.0;

  OpCosts o;
  static_cast<KernelCosts&>(o) = kernels;
  if (!o.measured) {
    const double moe_layers = static_cast<double>(params.moe_layers);
    const double dense_layers = static_cast<double>(params.dense_layers());
    double total = 0;
    for (size_t i = 0; i < 3; ++i) {
      o.compute_share[i] = moe_layers * o.block_by_class[i] + dense_layers * o.dense_block_by_class[i] + o.head_by_class[i];
      total += o.compute_share[i];
    }
    for (double& share : o.compute_share) share = total > 0 ? share / total : 0.0;
  }

  o.dispatch_send_bytes = busiest_slots / sp * h * a;
  o.context_kv_bytes = context_kv_bytes;
  // Each tensor-parallel region ends in an all-reduce of its output (sequence parallel: a
  // reduce-scatter, and an all-gather where the next begins), attention's over the tokens,
  // the experts' over the slots they computed.
  if (p.tensor_parallel_degree > 1) {
    o.tensor_bytes = tokens * h * a;
    // Shared experts reduce their own output over the tokens. Routed experts folded out of the
    // tensor split (ETP = 1) end no region: each rank computes whole experts on its own slots.
    o.tensor_moe_bytes = ((p.expert_tensor_fold() > 1 ? 0.0 : busiest_slots) + (m.shared_experts() ? tokens : 0.0)) * h * a;
    o.tensor_dense_bytes = tokens * h * a;
  }
  // Each tensor-parallel rank sends its 1/T of the activation to the next stage, which gathers
  // it over the node's fabric (Narayanan et al. 2021, section 4.1, scatter/gather optimisation);
  // with sequence parallelism the activation is split that way already.
  o.stage_send_bytes = tokens / tp * h * a;
  // A block's non-expert parameters on one tensor-parallel rank (latent attention's down
  // projections whole on each).
  const double block_dense = params.tensor_share(static_cast<double>(params.dense_per_layer()), 1, tp);
  const double dense_block = params.tensor_share(static_cast<double>(params.dense_block()), 1, tp);
  const double block_whole = static_cast<double>(params.tensor_replicated_per_layer);
  const double block_experts = static_cast<double>(m.num_experts * params.expert) / e / etp;
  o.unit_bytes = (static_cast<double>(params.dense_per_layer()) - block_whole) / tp * a + block_experts * a +
                 block_whole * a;
  o.dense_block_bytes = dense_block * a;
  auto gathered = [&](double numel) { return std::ceil(numel / tp / s) * s * a; };
  auto gathered_share = [&](double share, double over) { return std::ceil(share / over) * over * a; };
  o.dense_block_unit_bytes = gathered_share(dense_block, s);
  o.dense_unit_bytes = gathered_share(block_dense, s);
  o.expert_unit_bytes = gathered_share(block_experts, expert_s);
  o.embed_unit_bytes = gathered(static_cast<double>(params.embedding));
  // The last stage's head unit: under a pipeline, multi-token prediction looks tokens up there too.
  const bool embedding_copy = p.pipeline_parallel_degree > 1 && m.mtp_layers > 0;
  o.head_unit_bytes = gathered(static_cast<double>(params.final_norm + params.lm_head + params.mtp_projection +
                                                   (embedding_copy ? params.embedding : 0)));
  o.offload_bytes = tokens / sp * h * a;  // the block input
  if (p.activation_checkpointing == Checkpointing::kSelective)
    o.offload_bytes += tokens * (3.0 * h / sp + (2.0 * q_width + 2.0 * kv_width) / tp) * a;
  const double layers = static_cast<double>(params.num_layers);
  const double dense_share = params.tensor_share(static_cast<double>(params.dense()), layers, tp);
  o.dense_shard_bytes = dense_share / s * a;
  o.expert_shard_bytes = static_cast<double>(params.experts()) / e / etp / expert_s * a;

  // AdamW over the rank's shard (the distributed optimizer divides it over the data-parallel
  // ranks that hold the same parameters: the dense ones' over E x C x R (the mesh's E), the
  // experts' over R, or C x R where the expert group does not span C; where the dense shard
  // spans E and C, over R alone).
  const double model_whole = layers * block_whole;
  // Context-parallel ranks hold the same dense parameters (and the same experts where the
  // expert group does not span them) unless the shard spans them.
  const double cp = p.dense_shard_spanning() ? 1.0 : static_cast<double>(std::max<int64_t>(1, p.context_parallel_degree));
  const double r = p.distributed_optimizer ? static_cast<double>(std::max<int64_t>(1, p.replica_degree())) : 1.0;
  const double expert_ranks = p.distributed_optimizer && !p.expert_spans_context() ? r * cp : r;
  const double dense_ranks =
      p.distributed_optimizer && !p.dense_shard_spanning() ? r * static_cast<double>(p.expert_data_degree()) * cp : r;
  const double shard_params = (static_cast<double>(params.dense()) - model_whole) / s / dense_ranks / tp +
                              static_cast<double>(params.experts()) / e / etp / expert_s / expert_ranks +
                              model_whole / s / dense_ranks;
  o.optimizer_s = o.measured ? curve_at(c.cluster.op_times.optimizer, shard_params)
                             : optimizer_kernels(c, shard_params).seconds();
  o.forward_flops_per_token = forward_flops_per_token(m, c.training.seq_len);
  return o;
}

}  // namespace moeplan::sim
