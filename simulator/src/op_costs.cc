#include "moeplan/simulator/op_costs.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/units.h"
#include "moeplan/core/fit.h"

namespace moeplan::sim {

bool op_times_apply(const RunConfig& c) {
  const OpTimes& t = c.cluster.op_times;
  const ModelSpec& m = c.model;
  return !t.empty() && t.hidden_size == m.hidden_size && t.intermediate_size == m.intermediate_size &&
         t.num_attention_heads == m.num_attention_heads && t.num_key_value_heads == m.num_key_value_heads &&
         t.head_dim == m.head_dim && t.num_experts == m.num_experts && t.experts_per_token == m.experts_per_token &&
         t.vocab_size == m.vocab_size && t.seq_len == c.training.seq_len &&
         t.precision == name_of(kPrecisionNames, c.training.precision) && c.parallel.tensor_parallel_degree == 1;
}

namespace {

// Router (and dispatch bookkeeping) plus each local expert on its share of the rank's slots,
// from measured times.
double measured_moe_seconds(const RunConfig& c, double load, bool backward) {
  const OpTimes& t = c.cluster.op_times;
  const double tokens = static_cast<double>(c.parallel.micro_batch_size) * static_cast<double>(c.training.seq_len);
  const double local = static_cast<double>(c.model.num_experts) / static_cast<double>(c.parallel.expert_parallel_degree);
  const double rows = static_cast<double>(c.model.experts_per_token) * tokens * load / local;
  return curve_at(backward ? t.router_backward : t.router_forward, tokens) +
         local * curve_at(backward ? t.expert_backward : t.expert_forward, rows);
}

}  // namespace

double moe_backward_seconds(const RunConfig& c, double load) {
  return op_times_apply(c) ? measured_moe_seconds(c, load, true) : 2.0 * moe_forward_seconds(c, load);
}

double moe_forward_seconds(const RunConfig& c, double load) {
  if (op_times_apply(c)) return measured_moe_seconds(c, load, false);
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const CostModel cost(c.cluster);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double h = static_cast<double>(m.hidden_size);
  // Under tensor parallelism each expert's columns are split over the T ranks, which all see
  // every slot (gathered); the router runs on the rank's share of the tokens (sequence parallel).
  const double tp = static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
  const double ffn = static_cast<double>(m.intermediate_size) / tp;
  const double slots = static_cast<double>(m.experts_per_token) * static_cast<double>(p.micro_batch_size) *
                       static_cast<double>(c.training.seq_len) * load;
  const double tokens = static_cast<double>(p.micro_batch_size) * static_cast<double>(c.training.seq_len) /
                        (p.sequence_parallel ? tp : 1.0);
  const double local_experts = static_cast<double>(m.num_experts) / static_cast<double>(c.parallel.expert_parallel_degree);
  const double router_flops = 2.0 * tokens * h * static_cast<double>(m.router_width());
  const double matrices = static_cast<double>(m.mlp_matrices());
  // Each local expert runs its GEMMs (three for SwiGLU, two for GELU) on its share of the
  // rank's slots.
  return (router_flops > 0 ? cost.matmul_seconds(router_flops, router_flops, fp32) : 0.0) +
         cost.matmul_seconds(2.0 * slots * matrices * h * ffn, 2.0 * slots / local_experts * h * ffn, fp32);
}

ModelSpec stage_model(const RunConfig& c) {
  ModelSpec m = c.model;
  m.num_layers = c.model.num_layers / std::max<int64_t>(1, c.parallel.pipeline_parallel_degree);
  return m;
}

OpCosts op_costs(const RunConfig& c) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const CostModel cost(c.cluster);
  const ParamCounts params = count_parameters(m);
  const bool fp32 = c.training.precision == Precision::kFp32;
  const double a = fp32 ? kBytesFp32 : kBytesBf16;
  const double e = static_cast<double>(p.expert_parallel_degree);
  const double s = static_cast<double>(p.hybrid_shard_degree);
  const double h = static_cast<double>(m.hidden_size);
  const double ffn = static_cast<double>(m.intermediate_size);
  // Tensor parallelism splits heads, intermediate columns and the (padded) vocabulary over T
  // ranks; sequence parallelism splits the tokens between those regions.
  const double tp = static_cast<double>(std::max<int64_t>(1, p.tensor_parallel_degree));
  const double sp = p.sequence_parallel ? tp : 1.0;
  const double vocab = std::ceil(static_cast<double>(m.vocab_size) / tp);
  const double seq = static_cast<double>(c.training.seq_len);
  const double tokens = static_cast<double>(p.micro_batch_size) * seq;
  // Token-expert pairs per rank: each rank routes k per token and the E ranks of the group
  // share the pairs; the busiest rank gets its load (moe_load.h) times the mean.
  const double mean_slots = static_cast<double>(m.experts_per_token) * tokens;
  const double busiest_slots = mean_slots * busiest_expert_rank_load(m, c.moe, p.expert_parallel_degree);

  const double q_width = static_cast<double>(m.num_attention_heads * m.head_dim);
  const double kv_width = static_cast<double>(m.num_key_value_heads * m.head_dim);
  double context = seq / 2.0;  // causal: a token sees half the sequence on average
  if (m.sliding_window && *m.sliding_window < c.training.seq_len) context = static_cast<double>(*m.sliding_window);
  const double proj_flops = 2.0 * tokens * static_cast<double>(params.attention_per_layer) / tp;
  const double core_flops = 4.0 * tokens * q_width * context / tp;
  const double router_flops = 2.0 * tokens / sp * h * static_cast<double>(m.router_width());
  auto expert_flops = [&](double slots) { return 2.0 * slots * static_cast<double>(m.mlp_matrices()) * h * ffn / tp; };
  auto moe_seconds = [&](double slots) { return moe_forward_seconds(c, slots / mean_slots); };

  OpCosts o;
  o.attention_forward_s = cost.matmul_seconds(proj_flops, 2.0 * tokens * h * h / tp, fp32) +
                          cost.matmul_seconds(core_flops, 4.0 * seq * static_cast<double>(m.head_dim) * context, fp32);
  o.moe_forward_s = moe_seconds(mean_slots);
  o.moe_forward_busiest_s = moe_seconds(busiest_slots);

  o.head_forward_s = cost.matmul_seconds(2.0 * tokens * vocab * h, 2.0 * tokens * vocab * h, fp32);
  o.attention_flops = proj_flops + core_flops;
  o.moe_flops = router_flops + expert_flops(mean_slots);
  o.head_flops = 2.0 * tokens * vocab * h;
  const double busiest_load = busiest_slots / mean_slots;
  o.attention_backward_s = 2.0 * o.attention_forward_s;
  o.moe_backward_busiest_s = moe_backward_seconds(c, busiest_load);
  o.head_s = 3.0 * o.head_forward_s;
  if (op_times_apply(c)) {
    const OpTimes& t = c.cluster.op_times;
    o.measured = true;
    o.attention_forward_s = curve_at(t.attention_forward, tokens);
    o.attention_backward_s = curve_at(t.attention_backward, tokens);
    o.head_s = curve_at(t.head, tokens);
    o.head_forward_s = o.head_s / 3.0;
    // What the executor's whole micro-batch took beyond its operations (measured with the
    // experts on one rank and balanced routing), spread over the blocks: it runs with their
    // attention, and again where a block is recomputed.
    if (!t.micro_batch_forward.empty() && !t.micro_batch_backward.empty()) {
      const double layers = static_cast<double>(m.num_layers);
      const double experts = static_cast<double>(m.num_experts);
      const double rows = static_cast<double>(m.experts_per_token) * tokens / experts;
      const double forward = layers * (o.attention_forward_s + curve_at(t.router_forward, tokens) +
                                       experts * curve_at(t.expert_forward, rows)) +
                             o.head_s / 3.0;
      const double backward = layers * (o.attention_backward_s + curve_at(t.router_backward, tokens) +
                                        experts * curve_at(t.expert_backward, rows)) +
                              o.head_s * 2.0 / 3.0;
      o.framework_forward_s = std::max(0.0, curve_at(t.micro_batch_forward, tokens) - forward) / layers;
      o.framework_backward_s = std::max(0.0, curve_at(t.micro_batch_backward, tokens) - backward) / layers;
      o.attention_forward_s += o.framework_forward_s;
      o.attention_backward_s += o.framework_backward_s;
    }
  }

  o.dispatch_send_bytes = busiest_slots / sp * h * a;
  // Each tensor-parallel region ends in an all-reduce of its output (sequence parallel: a
  // reduce-scatter, and an all-gather where the next begins), attention's over the tokens,
  // the experts' over the slots they computed.
  if (p.tensor_parallel_degree > 1) {
    o.tensor_bytes = tokens * h * a;
    o.tensor_moe_bytes = busiest_slots * h * a;
  }
  o.stage_send_bytes = tokens / sp * h * a;
  o.unit_bytes = (static_cast<double>(params.dense_per_layer()) +
                  static_cast<double>(m.num_experts * params.expert) / e) / tp * a;
  auto gathered = [&](double numel) { return std::ceil(numel / tp / s) * s * a; };
  o.dense_unit_bytes = gathered(static_cast<double>(params.dense_per_layer()));
  o.expert_unit_bytes = gathered(static_cast<double>(m.num_experts * params.expert) / e);
  o.embed_unit_bytes = gathered(static_cast<double>(params.embedding));
  o.head_unit_bytes = gathered(static_cast<double>(params.final_norm + params.lm_head));
  o.offload_bytes = tokens / sp * h * a;  // the block input
  if (p.activation_checkpointing == Checkpointing::kSelective)
    o.offload_bytes += tokens * (3.0 * h / sp + (2.0 * q_width + 2.0 * kv_width) / tp) * a;
  o.dense_shard_bytes = static_cast<double>(params.dense()) / tp / s * a;
  o.expert_shard_bytes = static_cast<double>(params.experts()) / e / tp / s * a;

  // AdamW reads and writes parameter, gradient and both moments (and the fp32 master).
  const double shard_params =
      (static_cast<double>(params.dense()) / s + static_cast<double>(params.experts()) / e / s) / tp;
  double state_bytes = 0;
  switch (c.training.precision) {
    case Precision::kBf16: state_bytes = 2 + 2 + 2 + 2; break;
    case Precision::kMixed: state_bytes = 2 + 4 + 4 + 4 + 4; break;
    case Precision::kFp32: state_bytes = 4 + 4 + 4 + 4; break;
  }
  o.optimizer_s = o.measured ? curve_at(c.cluster.op_times.optimizer, shard_params)
                             : cost.memory_bound_seconds(2.0 * shard_params * state_bytes);
  o.forward_flops_per_token = forward_flops_per_token(m, c.training.seq_len);
  return o;
}

}  // namespace moeplan::sim
