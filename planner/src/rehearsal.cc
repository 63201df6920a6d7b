#include "moeplan/planner/rehearsal.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "moeplan/core/errors.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"

namespace moeplan::planner {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

ModelSpec shrink_model(const ModelSpec& model, const Shrink& shrink, int64_t vocab_size, int64_t seq_len) {
  Diagnostics d;
  const int64_t w = shrink.width;
  if (w < 1) d.error("--shrink-width", "= " + str(w) + " must be at least 1");
  if (shrink.layers < 1 || shrink.layers > model.num_layers)
    d.error("--shrink-layers", "= " + str(shrink.layers) + " is outside 1.." + str(model.num_layers) + " (the layers of " +
                                   model.name + ")");
  d.throw_if_any("rehearsal");
  // Heads shrink by the largest d (d * d <= w) dividing both head counts; head_dim by w / d.
  int64_t heads_by = 1;
  const int64_t common = std::gcd(model.num_attention_heads, model.num_key_value_heads);
  for (int64_t f = 1; f * f <= w; ++f)
    if (w % f == 0 && common % f == 0) heads_by = f;
  const int64_t dim_by = w / heads_by;
  auto divides = [&](const char* field, int64_t value, int64_t by) {
    if (value % by != 0)
      d.error("--shrink-width", "= " + str(w) + ": " + field + " = " + str(value) + " of " + model.name +
                                    " is not divisible by " + str(by));
    return value / by;
  };
  ModelSpec m = model;
  m.hidden_size = divides("hidden_size", model.hidden_size, w);
  m.intermediate_size = divides("intermediate_size", model.intermediate_size, w);
  m.shared_expert_intermediate_size =
      divides("shared_expert_intermediate_size", model.shared_expert_intermediate_size, w);
  m.dense_intermediate_size = divides("dense_intermediate_size", model.dense_intermediate_size, w);
  m.head_dim = divides("head_dim", model.head_dim, dim_by);
  m.num_attention_heads = model.num_attention_heads / heads_by;
  m.num_key_value_heads = model.num_key_value_heads / heads_by;
  // Latent attention: its latents shrink with the hidden size, a head's rotary and value parts
  // with head_dim.
  m.kv_lora_rank = divides("kv_lora_rank", model.kv_lora_rank, w);
  m.q_lora_rank = divides("q_lora_rank", model.q_lora_rank, w);
  m.qk_rope_head_dim = divides("qk_rope_head_dim", model.qk_rope_head_dim, dim_by);
  m.v_head_dim = divides("v_head_dim", model.v_head_dim, dim_by);
  d.throw_if_any("rehearsal");
  m.num_layers = shrink.layers;
  // Dense blocks first: at most half of the blocks kept, so that experts remain to rehearse.
  m.first_dense_layers = std::min(model.first_dense_layers, shrink.layers / 2);
  m.vocab_size = vocab_size;
  m.max_position_embeddings = std::max(model.max_position_embeddings, seq_len);
  m.name = model.name + "-rehearsal";
  m.source = model.name + " with hidden, feed-forward and head sizes / " + str(w) + ", " + str(shrink.layers) +
             " of " + str(model.num_layers) + " layers and the local data's " + str(vocab_size) +
             "-piece vocabulary (moeplan run --rehearse)";
  return m;
}

namespace {

// The plan's prediction recomputed for its own model and layout (the closed form: no simulated
// timeline is needed for a rehearsal).
void repredict(Plan& p) {
  p.prediction = predict({p.model, p.cluster, p.parallel, p.moe, p.training}, Estimator::kAnalytic);
  p.alternatives.clear();
}

}  // namespace

Plan rehearsal_plan(const Plan& plan, const Shrink& shrink, int64_t vocab_size, int64_t seq_len, int64_t steps) {
  Plan p = plan;
  // Every chunk of every pipeline stage keeps at least one block (and all the same number).
  Shrink kept = shrink;
  const int64_t chunks = std::max<int64_t>(1, plan.parallel.pipeline_parallel_degree * plan.parallel.virtual_pipeline_degree);
  if (kept.layers >= 1) kept.layers = (kept.layers + chunks - 1) / chunks * chunks;
  p.model = shrink_model(plan.model, kept, vocab_size, seq_len);
  ParallelConfig& q = p.parallel;
  if (shrink.micro_batches > 0 && q.gradient_accumulation_steps > shrink.micro_batches) {
    // The interleaved schedule runs micro-batches in rounds of P.
    const int64_t round = q.virtual_pipeline_degree > 1 ? q.pipeline_parallel_degree : 1;
    q.gradient_accumulation_steps = (shrink.micro_batches + round - 1) / round * round;
  }
  p.training.seq_len = seq_len;
  p.training.global_batch_tokens = seq_len * q.micro_batch_size * q.gradient_accumulation_steps * q.data_parallel_degree();
  p.training.precision = Precision::kFp32;
  p.training.steps = steps;
  p.training.warmup_steps = 0;
  // Offloaded blocks prefetched ahead: no more than the blocks kept (the same as all of them).
  p.parallel.activation_loading_horizon = std::min(p.parallel.activation_loading_horizon, p.model.num_layers);
  // The executor runs LibTorch operations one by one on the CPU: its activations are eager ones,
  // its attention LibTorch's scaled-dot-product attention.
  p.cluster.kernels = Kernels::kEager;
  p.cluster.attention = AttentionKernel::kFlash;
  p.cluster.device = DeviceKind::kCpu;  // a rehearsal's ranks, and its one-rank reference, are CPU processes
  p.provenance.command = "moeplan run --rehearse (from " + plan.model.name + " on " + plan.cluster.name + ")";
  repredict(p);
  return p;
}

Plan reference_plan(const Plan& rehearsal) {
  Plan p = rehearsal;
  ParallelConfig& q = p.parallel;
  q.gradient_accumulation_steps *= q.data_parallel_degree();
  q.world_size = 1;
  q.expert_parallel_degree = q.hybrid_shard_degree = 1;
  q.tensor_parallel_degree = q.pipeline_parallel_degree = q.virtual_pipeline_degree = 1;
  q.context_parallel_degree = 1;
  q.sequence_parallel = false;
  q.activation_checkpointing = Checkpointing::kNone;
  q.activation_offloading = false;
  p.cluster = size_cluster(rehearsal.cluster, 1);
  repredict(p);
  return p;
}

Plan with_measured_load(const Plan& rehearsal, double load) {
  Plan p = rehearsal;
  const int64_t ranks = p.parallel.expert_parallel_degree, experts = p.model.num_experts;
  const int64_t local = experts / ranks;
  // Expert rank 0 at `load` times the mean, the other ranks share the rest evenly.
  const double busiest = std::clamp(load, 1.0, static_cast<double>(ranks));
  const double rest = ranks > 1 ? (static_cast<double>(ranks) - busiest) / static_cast<double>(ranks - 1) : 1.0;
  p.moe.tokens_per_expert.assign(static_cast<size_t>(experts), rest);
  for (int64_t i = 0; i < local; ++i) p.moe.tokens_per_expert[static_cast<size_t>(i)] = busiest;
  repredict(p);
  return p;
}

int64_t predicted_cpu_tensor_bytes(const Plan& plan) {
  int64_t bytes = 0;
  for (const MemoryItem& item : plan.prediction.memory.device)
    if (item.name != "framework_overhead" && item.name != "fragmentation") bytes += item.bytes;
  return bytes;
}

}  // namespace moeplan::planner
