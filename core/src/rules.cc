#include "moeplan/core/rules.h"

#include <algorithm>
#include <array>

namespace moeplan {

namespace {

constexpr std::array<std::string_view, kRuleCount> kRuleNames = {
    "top_k_within_experts",
    "kv_heads_divide_heads",
    "head_dim_even",
    "model_size",
    "world_size_fits_cluster",
    "whole_nodes",
    "expert_degree_divides_experts",
    "expert_degree_divides_world",
    "shard_degree_resolved",
    "shard_expert_divides_world",
    "tensor_degree_divides_heads",
    "tensor_degree_divides_intermediate",
    "sequence_parallel_needs_tensor",
    "expert_tensor_needs_sequence_parallel",
    "smp_expert_with_tensor",
    "pipeline_degree_divides_layers",
    "virtual_stages_fit_the_pipeline",
    "seq_len_within_positions",
    "micro_batch_tokens",
    "global_batch_matches",
    "offload_needs_checkpointing",
    "horizon_positive",
    "horizon_within_layers",
    "load_imbalance_range",
    "token_shuffle_needs_experts",
    "token_counts_match_experts",
    "min_lr_within_lr",
    "warmup_within_steps",
    "fp8_needs_hardware",
    "executor_trains_moe",
    "executor_pipeline_limits",
    "executor_layouts",
    "executor_tensor_splits",
    "smp_no_pipeline",
    "smp_layouts",
    "megatron_layouts",
    "megatron_routing",
    "torchtitan_layouts",
    "torchtitan_routing",
    "framework_rank_order",
};

// Largest model whose counts stay far from int64 overflow in every derived quantity.
constexpr double kMaxParameters = 1e15;
// Tokens of one micro-batch on one rank; keeps activation sizes far from overflow.
constexpr double kMaxMicroBatchTokens = 16777216;

std::string str(int64_t v) { return std::to_string(v); }
std::string str(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// Sinks receive (rule, field, message-maker); the mask sink never calls the maker.
struct MaskSink {
  RuleMask mask = 0;
  template <class F>
  void operator()(Rule r, const char*, F&&) { mask |= rule_bit(r); }
};
struct MessageSink {
  std::vector<Violation> out;
  template <class F>
  void operator()(Rule r, const char* field, F&& make) { out.push_back({r, field, make()}); }
};

template <class Sink>
void check_model(const ModelSpec& m, Sink& sink) {
  if (m.experts_per_token > m.num_experts)
    sink(Rule::kTopKWithinExperts, "experts_per_token", [&] {
      return "= " + str(m.experts_per_token) + " exceeds num_experts = " + str(m.num_experts);
    });
  if (m.num_key_value_heads <= 0 || m.num_attention_heads % m.num_key_value_heads != 0)
    sink(Rule::kKvHeadsDivideHeads, "num_key_value_heads", [&] {
      return "= " + str(m.num_key_value_heads) + " does not divide num_attention_heads = " +
             str(m.num_attention_heads);
    });
  if (m.head_dim % 2 != 0)
    sink(Rule::kHeadDimEven, "head_dim", [&] {
      return "= " + str(m.head_dim) + " is odd; rotary embeddings rotate pairs of dimensions";
    });
  // Counted in double so that a huge model cannot overflow before it is rejected.
  const double h = static_cast<double>(m.hidden_size);
  const double layers = static_cast<double>(m.num_layers);
  const double params =
      2.0 * static_cast<double>(m.vocab_size) * h +
      layers * (4.0 * h * static_cast<double>(m.num_attention_heads * m.head_dim) +
                static_cast<double>(m.num_experts * m.mlp_matrices()) * h * static_cast<double>(m.intermediate_size));
  if (params > kMaxParameters)
    sink(Rule::kModelSize, "num_layers", [&] {
      return "and the other sizes give about " + str(params) + " parameters, over the supported " +
             str(kMaxParameters);
    });
}

// The world, the cluster and the parallel degrees.
template <class Sink>
void check_degrees(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ClusterSpec& cl = c.cluster;
  const ParallelConfig& p = c.parallel;
  const int64_t w = p.world_size;
  const int64_t e = p.expert_parallel_degree;
  const int64_t s = p.hybrid_shard_degree;

  const int64_t cluster_gpus = cl.gpus_per_node * cl.num_nodes;
  if (w > cluster_gpus)
    sink(Rule::kWorldSizeFitsCluster, "parallel.world_size", [&] {
      return "= " + str(w) + " exceeds the cluster's " + str(cl.num_nodes) + " x " +
             str(cl.gpus_per_node) + " GPUs";
    });
  else if (cl.num_nodes > 1 && w != cluster_gpus)
    sink(Rule::kWholeNodes, "parallel.world_size", [&] {
      return "= " + str(w) + " leaves GPUs of a " + str(cl.num_nodes) +
             "-node cluster idle; use whole nodes (a multiple of " + str(cl.gpus_per_node) + ")";
    });

  if (e < 1 || m.num_experts % e != 0)
    sink(Rule::kExpertDegreeDividesExperts, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " does not divide num_experts = " + str(m.num_experts);
    });
  if (e < 1 || w % e != 0)
    sink(Rule::kExpertDegreeDividesWorld, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " does not divide world_size = " + str(w);
    });
  const int64_t tp = p.tensor_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree;
  if (s < 1)
    sink(Rule::kShardDegreeResolved, "parallel.hybrid_shard_degree", [&] {
      return "= " + str(s) + " must be a resolved degree of at least 1 (0, full sharding, is "
             "written as world_size / expert_parallel_degree)";
    });
  else if (e >= 1 && tp >= 1 && pp >= 1 && w % (s * e * tp * pp) != 0)
    sink(Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree", [&] {
      std::string degrees = "expert_parallel_degree = " + str(e);
      if (tp != 1) degrees += ", tensor_parallel_degree = " + str(tp);
      if (pp != 1) degrees += ", pipeline_parallel_degree = " + str(pp);
      return "= " + str(s) + " times " + degrees + " does not divide world_size = " + str(w);
    });
  // Megatron's split: attention by key-value head groups (each rank keeps whole groups), the
  // MLP (and every expert) by intermediate columns; the vocabulary is padded to a multiple of T.
  if (tp < 1 || m.num_key_value_heads % tp != 0 || m.num_attention_heads % tp != 0)
    sink(Rule::kTensorDividesHeads, "parallel.tensor_parallel_degree", [&] {
      return "= " + str(tp) + " must be at least 1 and divide num_key_value_heads = " + str(m.num_key_value_heads) +
             " (and num_attention_heads = " + str(m.num_attention_heads) + ")";
    });
  if (tp >= 1 && m.intermediate_size % tp != 0)
    sink(Rule::kTensorDividesIntermediate, "parallel.tensor_parallel_degree", [&] {
      return "= " + str(tp) + " does not divide intermediate_size = " + str(m.intermediate_size);
    });
  if (p.sequence_parallel && tp == 1)
    sink(Rule::kSequenceParallelNeedsTensor, "parallel.sequence_parallel", [&] {
      return std::string("= true needs tensor_parallel_degree > 1 (it splits along the sequence over the "
                         "tensor-parallel ranks)");
    });
  // As in Megatron-Core: MoE layers under tensor parallelism take their tokens split along
  // the sequence, so that each rank routes only its share.
  if (!m.dense() && tp > 1 && !p.sequence_parallel)
    sink(Rule::kExpertTensorNeedsSequenceParallel, "parallel.sequence_parallel", [&] {
      return "= false with tensor_parallel_degree = " + str(tp) +
             " and an MoE model: the tokens are routed per rank, so sequence parallelism is needed";
    });
  const bool uneven = p.first_stage_layers > 0 || p.last_stage_layers > 0;
  if (pp < 1 || (!uneven && m.num_layers % pp != 0))
    sink(Rule::kPipelineDividesLayers, "parallel.pipeline_parallel_degree", [&] {
      return "= " + str(pp) + " must be at least 1 and divide num_layers = " + str(m.num_layers) +
             " (equal stages; first_stage_layers and last_stage_layers set uneven ends)";
    });
  else if (uneven && !stage_layers_valid(m.num_layers, p))
    sink(Rule::kPipelineDividesLayers, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] {
           return "= " + str(p.first_stage_layers > 0 ? p.first_stage_layers : p.last_stage_layers) +
                  ": with first_stage_layers = " + str(p.first_stage_layers) + " and last_stage_layers = " +
                  str(p.last_stage_layers) + " the other " + str(pp - (p.first_stage_layers > 0) - (p.last_stage_layers > 0)) +
                  " of pipeline_parallel_degree = " + str(pp) + " stages must share the rest of num_layers = " +
                  str(m.num_layers) + " equally, each at least one block";
         });
  // Interleaved stages (Megatron-LM): P > 1, equal chunks, micro-batches in whole rounds of P.
  // Uneven end stages may hold chunks of other sizes, but at least one block each.
  const int64_t vp = p.virtual_pipeline_degree;
  const bool chunks_fit =
      uneven ? vp <= std::min(p.first_stage_layers > 0 ? p.first_stage_layers : m.num_layers,
                              p.last_stage_layers > 0 ? p.last_stage_layers : m.num_layers)
             : m.num_layers % (std::max<int64_t>(1, pp) * vp) == 0;
  if (vp < 1 || (vp > 1 && (pp <= 1 || !chunks_fit || p.gradient_accumulation_steps % std::max<int64_t>(1, pp) != 0)))
    sink(Rule::kVirtualStagesFitThePipeline, "parallel.virtual_pipeline_degree", [&] {
      if (vp >= 1 && pp <= 1)
        return "= " + str(vp) + " needs pipeline_parallel_degree > 1 (it splits pipeline stages into chunks)";
      return "= " + str(vp) + " must be at least 1 and divide the blocks of a stage (num_layers = " +
             str(m.num_layers) + " / pipeline_parallel_degree = " + str(pp) +
             "), with gradient_accumulation_steps = " + str(p.gradient_accumulation_steps) +
             " a multiple of pipeline_parallel_degree";
    });
}

// Sequence, batch, checkpointing and offloading.
template <class Sink>
void check_batch(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const TrainingConfig& t = c.training;
  const int64_t w = p.world_size;
  const int64_t tp = p.tensor_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree;

  if (t.seq_len > m.max_position_embeddings)
    sink(Rule::kSeqLenWithinPositions, "training.seq_len", [&] {
      return "= " + str(t.seq_len) + " exceeds the model's max_position_embeddings = " +
             str(m.max_position_embeddings);
    });
  if (static_cast<double>(p.micro_batch_size) * static_cast<double>(t.seq_len) > kMaxMicroBatchTokens)
    sink(Rule::kMicroBatchTokens, "parallel.micro_batch_size", [&] {
      return "= " + str(p.micro_batch_size) + " times seq_len = " + str(t.seq_len) +
             " exceeds the supported " + str(static_cast<int64_t>(kMaxMicroBatchTokens)) +
             " tokens per micro-batch";
    });
  // Every rank reads its own micro-batch, except that the T ranks of a tensor-parallel group
  // share one and the P stages of a pipeline pass it on: W / (T * P) ranks read data.
  const int64_t readers = w / (std::max<int64_t>(1, tp) * std::max<int64_t>(1, pp));
  const double step_tokens = static_cast<double>(readers) * static_cast<double>(p.micro_batch_size) *
                             static_cast<double>(p.gradient_accumulation_steps) *
                             static_cast<double>(t.seq_len);
  if (step_tokens != static_cast<double>(t.global_batch_tokens))
    sink(Rule::kGlobalBatchMatches, "training.global_batch_tokens", [&] {
      const std::string ranks = readers == w ? std::string("world_size")
                                             : "world_size / (tensor_parallel_degree x pipeline_parallel_degree)";
      return "= " + str(t.global_batch_tokens) + " does not equal " + ranks +
             " x micro_batch_size x gradient_accumulation_steps x seq_len = " + str(readers) + " x " +
             str(p.micro_batch_size) +
             " x " + str(p.gradient_accumulation_steps) + " x " + str(t.seq_len) + " = " +
             str(step_tokens);
    });

  if (p.activation_offloading) {
    if (p.activation_checkpointing == Checkpointing::kNone || p.activation_checkpointing == Checkpointing::kAttentionCore)
      sink(Rule::kOffloadNeedsCheckpointing, "parallel.activation_offloading", [&] {
        return std::string("= true needs activation_checkpointing full or selective (only checkpointed block "
                           "inputs are offloaded)");
      });
    if (p.activation_loading_horizon < 1)
      sink(Rule::kHorizonPositive, "parallel.activation_loading_horizon", [&] {
        return "= " + str(p.activation_loading_horizon) + " must be at least 1 with offloading";
      });
    else if (p.activation_loading_horizon > m.num_layers)
      sink(Rule::kHorizonWithinLayers, "parallel.activation_loading_horizon", [&] {
        return "= " + str(p.activation_loading_horizon) + " exceeds num_layers = " + str(m.num_layers);
      });
  }
}

// Routing, precision and the learning-rate schedule.
template <class Sink>
void check_moe_and_training(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ClusterSpec& cl = c.cluster;
  const TrainingConfig& t = c.training;
  const int64_t e = c.parallel.expert_parallel_degree;

  // The busiest expert can take at most every token's top-k slots: num_experts / top_k times
  // the mean.
  const double max_imbalance =
      static_cast<double>(m.num_experts) / static_cast<double>(std::max<int64_t>(1, m.experts_per_token));
  if (c.moe.expert_load_imbalance < 1.0 || c.moe.expert_load_imbalance > max_imbalance)
    sink(Rule::kLoadImbalanceRange, "moe.expert_load_imbalance", [&] {
      return "= " + str(c.moe.expert_load_imbalance) + " must be in [1, num_experts / "
             "experts_per_token] = [1, " + str(max_imbalance) + "]";
    });
  if (!c.moe.tokens_per_expert.empty()) {
    double total = 0, most = 0;
    for (double n : c.moe.tokens_per_expert) {
      total += n;
      most = std::max(most, n);
    }
    // Each token takes k distinct experts, so no expert gets more than 1/k of the slots.
    const double k = static_cast<double>(std::max<int64_t>(1, m.experts_per_token));
    if (static_cast<int64_t>(c.moe.tokens_per_expert.size()) != m.num_experts)
      sink(Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert", [&] {
        return "has " + str(static_cast<int64_t>(c.moe.tokens_per_expert.size())) + " counts for num_experts = " +
               str(m.num_experts);
      });
    else if (!(total > 0) || most > total / k * (1 + 1e-9))
      sink(Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert", [&] {
        return "must have a positive total and no expert above 1/experts_per_token of it (total " + str(total) +
               ", largest " + str(most) + ")";
      });
  }
  if (c.moe.global_token_shuffle && e == 1)
    sink(Rule::kTokenShuffleNeedsExperts, "moe.global_token_shuffle", [&] {
      return std::string("= true needs expert_parallel_degree > 1 (it shuffles tokens across the "
                         "expert-parallel group)");
    });

  if (t.fp8 && (cl.peak_fp8_flops <= 0 || t.precision == Precision::kFp32))
    sink(Rule::kFp8NeedsHardware, "training.fp8", [&] {
      if (t.precision == Precision::kFp32) return std::string("= true needs precision bf16 or mixed, not fp32");
      return "= true needs FP8 tensor cores; the cluster's " + cl.gpu_name + " has none (gpu.peak_fp8_flops)";
    });
  if (t.min_learning_rate > t.learning_rate)
    sink(Rule::kMinLrWithinLr, "training.min_learning_rate", [&] {
      return "= " + str(t.min_learning_rate) + " exceeds learning_rate = " + str(t.learning_rate);
    });
  if (t.warmup_steps > t.steps)
    sink(Rule::kWarmupWithinSteps, "training.warmup_steps", [&] {
      return "= " + str(t.warmup_steps) + " exceeds steps = " + str(t.steps);
    });
}

std::string checkpointing_name(const ParallelConfig& p) {
  return "= \"" + std::string(name_of(kCheckpointingNames, p.activation_checkpointing)) + "\"";
}

// What moeplan's executor trains (executor/): Mixtral-style models, equal pipeline stages, the
// Megatron splits it implements. The planner and simulator know more layouts than it runs.
template <class Sink>
void check_executor(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const TrainingConfig& t = c.training;
  if (m.dense())
    sink(Rule::kExecutorTrainsMoe, "model.num_experts", [&] {
      return std::string("= 1 (a dense model): the executor trains Mixture-of-Experts models; dense models are "
                         "planned and simulated only");
    });
  if (m.mlp != Mlp::kSwiGlu)
    sink(Rule::kExecutorTrainsMoe, "model.mlp", [&] {
      return "= \"" + std::string(name_of(kMlpNames, m.mlp)) + "\": the executor trains SwiGLU feed-forward layers only";
    });
  // Pipeline stages: the router's losses are reported across stages but not trained through
  // them, and offloaded block inputs are kept per block, not per micro-batch in flight.
  if (const int64_t pp = p.pipeline_parallel_degree; pp > 1) {
    const std::string stages = " with pipeline_parallel_degree = " + str(pp);
    if (c.moe.load_balancing == LoadBalancing::kAuxLoss && c.moe.aux_loss_coef != 0)
      sink(Rule::kExecutorPipelineLimits, "moe.load_balancing", [&] {
        return "= \"aux_loss\"" + stages +
               ": the executor trains the load-balancing loss without pipeline stages only (use sinkhorn, balanced or "
               "none)";
      });
    if (c.moe.z_loss_coef != 0)
      sink(Rule::kExecutorPipelineLimits, "moe.z_loss_coef", [&] {
        return "= " + str(c.moe.z_loss_coef) + stages + ": the executor trains the z-loss without pipeline stages only (use 0)";
      });
    if (p.activation_offloading)
      sink(Rule::kExecutorPipelineLimits, "parallel.activation_offloading",
           [&] { return "= true" + stages + ": the executor offloads without pipeline stages only"; });
  }
  // Layouts the planner and simulator know that the executor does not run yet.
  // One rank trains through the reference trainer, which keeps every activation in memory.
  if (p.world_size == 1 && p.activation_checkpointing != Checkpointing::kNone)
    sink(Rule::kExecutorLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) + " on one rank: the executor recomputes blocks in runs of two or more ranks only";
    });
  if (p.world_size == 1 && p.activation_offloading)
    sink(Rule::kExecutorLayouts, "parallel.activation_offloading",
         [&] { return std::string("= true on one rank: the executor offloads in runs of two or more ranks only"); });
  if (p.activation_checkpointing == Checkpointing::kAttentionCore)
    sink(Rule::kExecutorLayouts, "parallel.activation_checkpointing", [&] {
      return std::string(
          "= \"attention_core\": the executor recomputes whole blocks (full) or MoE sub-blocks (selective) only");
    });
  if (p.distributed_optimizer)
    sink(Rule::kExecutorLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: the executor shards optimizer states over hybrid_shard_degree only (use S instead)");
    });
  if (p.first_stage_layers > 0 || p.last_stage_layers > 0)
    sink(Rule::kExecutorLayouts, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] { return std::string("is set: the executor runs equal pipeline stages only"); });
  if (t.fp8 && c.cluster.peak_fp8_flops > 0 && t.precision != Precision::kFp32)  // else fp8_needs_hardware says it
    sink(Rule::kExecutorLayouts, "training.fp8",
         [&] { return std::string("= true: the executor computes in bf16 or fp32 only"); });
  if (!t.fp32_gradients && t.precision == Precision::kMixed)
    sink(Rule::kExecutorLayouts, "training.fp32_gradients",
         [&] { return std::string("= false: the executor keeps mixed-precision gradients in fp32"); });
  // Tensor parallelism splits the vocabulary (embedding, lm head) and the sequence over T ranks.
  if (const int64_t tp = p.tensor_parallel_degree; tp > 1) {
    if (m.vocab_size % tp != 0)
      sink(Rule::kExecutorTensorSplits, "model.vocab_size", [&] {
        return "= " + str(m.vocab_size) + " is not divisible by tensor_parallel_degree = " + str(tp) +
               " (the executor splits the embedding and lm head over the vocabulary)";
      });
    if (t.seq_len % tp != 0)
      sink(Rule::kExecutorTensorSplits, "training.seq_len", [&] {
        return "= " + str(t.seq_len) + " is not divisible by tensor_parallel_degree = " + str(tp) +
               " (sequence parallelism splits it)";
      });
    if (!p.sequence_parallel)
      sink(Rule::kExecutorTensorSplits, "parallel.sequence_parallel", [&] {
        return "= false with tensor_parallel_degree = " + str(tp) +
               ": the executor runs tensor parallelism with sequence parallelism";
      });
  }
}


// Whether the mesh dimensions of more than one rank come in `order` (outermost first); the
// dimensions of degree 1 may sit anywhere. Allocation-free: the search calls it per candidate.
bool ranks_ordered(const ParallelConfig& p, const Placement& order) {
  size_t j = 0;
  for (MeshDim d : p.placement.outer_to_inner) {
    if (p.degree(d) <= 1) continue;
    while (j < kMeshDims && p.degree(order.outer_to_inner[j]) <= 1) ++j;
    if (j == kMeshDims || order.outer_to_inner[j] != d) return false;
    ++j;
  }
  return true;
}

// SageMaker's model parallelism library v2 (SMP v2): PyTorch FSDP with hybrid sharding,
// expert parallelism and Transformer Engine's tensor parallelism. No pipeline (SMP v1 had
// one); optimizer states are sharded with the parameters; its example training script
// (aws/amazon-sagemaker-examples, model_parallel_v2/shared-scripts) checkpoints whole
// transformer layers.
template <class Sink>
void check_smp(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t e = p.expert_parallel_degree, tp = p.tensor_parallel_degree;
  if (e > 1 && tp > 1)
    sink(Rule::kSmpExpertWithTensor, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " with tensor_parallel_degree = " + str(tp) +
             ": SMP does not combine expert and tensor parallelism (moeplan's simulator does)";
    });
  if (p.pipeline_parallel_degree > 1)
    sink(Rule::kSmpNoPipeline, "parallel.pipeline_parallel_degree", [&] {
      return "= " + str(p.pipeline_parallel_degree) + ": SMP v2 has no pipeline parallelism (SMP v1 had)";
    });
  if (p.distributed_optimizer)
    sink(Rule::kSmpLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: SMP (FSDP) shards optimizer states with the parameters over hybrid_shard_degree");
    });
  if (p.activation_checkpointing == Checkpointing::kSelective ||
      p.activation_checkpointing == Checkpointing::kAttentionCore)
    sink(Rule::kSmpLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) + ": SMP's activation_checkpointing recomputes whole transformer layers (full)";
    });
  // SMP's bf16 = 1 is FSDP's mixed precision: fp32 parameters, bf16 compute and gradient
  // reduction (MixedPrecision(param_dtype=bf16, reduce_dtype=bf16) in its example script).
  if (c.training.precision == Precision::kBf16)
    sink(Rule::kSmpLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": SMP keeps fp32 parameters (its bf16 = 1 is FSDP mixed precision; plan with "
                         "mixed and bf16 gradients)");
    });
  if (c.training.precision == Precision::kMixed && c.training.fp32_gradients)
    sink(Rule::kSmpLayouts, "training.fp32_gradients", [&] {
      return std::string("= true: SMP's mixed precision reduces gradients in bf16 (plan with bf16 gradients)");
    });
}

// Megatron-LM (Megatron-Core): tensor, sequence, pipeline (interleaved, uneven ends), expert
// and data parallelism, the distributed optimizer. Parameters are replicated over the data-
// parallel ranks (no hybrid sharding); ranks are ordered tensor innermost, then expert, data,
// pipeline (its default order "tp-cp-ep-dp-pp"); routing by its own load-balancing types.
template <class Sink>
void check_megatron(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  if (p.hybrid_shard_degree > 1)
    sink(Rule::kMegatronLayouts, "parallel.hybrid_shard_degree", [&] {
      return "= " + str(p.hybrid_shard_degree) +
             ": Megatron-LM replicates parameters over the data-parallel ranks and shards optimizer states "
             "(distributed_optimizer) instead";
    });
  if (p.activation_offloading)
    sink(Rule::kMegatronLayouts, "parallel.activation_offloading", [&] {
      return std::string("= true: moeplan exports no activation offloading to Megatron-LM (its CPU offloading has "
                         "no loading horizon)");
    });
  if (c.training.precision == Precision::kBf16)
    sink(Rule::kMegatronLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": Megatron-LM keeps fp32 main parameters and optimizer states (its --bf16 is "
                         "mixed precision; plan with mixed)");
    });
  // Interleaving with uneven ends: every stage's blocks split into the V chunks evenly.
  if (const int64_t vp = p.virtual_pipeline_degree; vp > 1 && (p.first_stage_layers > 0 || p.last_stage_layers > 0)) {
    const int64_t others = p.pipeline_parallel_degree - (p.first_stage_layers > 0) - (p.last_stage_layers > 0);
    const int64_t middle =
        others > 0 ? (c.model.num_layers - p.first_stage_layers - p.last_stage_layers) / others : vp;
    if (p.first_stage_layers % vp != 0 || p.last_stage_layers % vp != 0 || middle % vp != 0)
      sink(Rule::kMegatronLayouts, "parallel.virtual_pipeline_degree", [&] {
        return "= " + str(vp) + " with first_stage_layers = " + str(p.first_stage_layers) + ", last_stage_layers = " +
               str(p.last_stage_layers) + " and " + str(middle) +
               " blocks on each other stage: Megatron-LM splits every stage into equal chunks";
      });
  }
  if (!ranks_ordered(p, Placement{}))  // the default placement: P, R, S, E, T outermost first
    sink(Rule::kFrameworkRankOrder, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() +
             "\": Megatron-LM orders ranks tensor innermost, then expert, data and pipeline (PRSET)";
    });
  if (c.moe.load_balancing == LoadBalancing::kBalanced)
    sink(Rule::kMegatronRouting, "moe.load_balancing", [&] {
      return std::string("= \"balanced\": Megatron-LM routes by aux_loss, sinkhorn or none");
    });
  if (c.moe.global_token_shuffle)
    sink(Rule::kMegatronRouting, "moe.global_token_shuffle",
         [&] { return std::string("= true: Megatron-LM has no global token shuffle"); });
}

// torchtitan: FSDP2 (sharded over data_parallel_shard_degree, replicated over
// data_parallel_replicate_degree), tensor parallelism with sequence parallelism, pipeline
// stages, expert parallelism inside the sharded ranks; its mesh is pipeline, replicate, shard,
// tensor outermost first; fp32 parameters with bf16 compute; full or no activation
// checkpointing of blocks.
template <class Sink>
void check_torchtitan(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t tp = p.tensor_parallel_degree;
  if (tp > 1 && !p.sequence_parallel)
    sink(Rule::kTorchtitanLayouts, "parallel.sequence_parallel", [&] {
      return "= false with tensor_parallel_degree = " + str(tp) +
             ": torchtitan's tensor parallelism always splits the sequence (sequence parallelism)";
    });
  if (p.activation_checkpointing == Checkpointing::kSelective ||
      p.activation_checkpointing == Checkpointing::kAttentionCore)
    sink(Rule::kTorchtitanLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) +
             ": torchtitan checkpoints whole blocks (full) or operators it picks itself, not a sub-block";
    });
  if (c.training.seq_len % (2 * std::max<int64_t>(1, tp)) != 0)
    sink(Rule::kTorchtitanLayouts, "training.seq_len", [&] {
      return "= " + str(c.training.seq_len) + " is not a multiple of 2 x tensor_parallel_degree = " + str(2 * tp) +
             " (torchtitan's sequence split)";
    });
  if (p.activation_offloading)
    sink(Rule::kTorchtitanLayouts, "parallel.activation_offloading",
         [&] { return std::string("= true: torchtitan does not offload activations"); });
  if (p.distributed_optimizer)
    sink(Rule::kTorchtitanLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: torchtitan (FSDP2) shards optimizer states with the parameters over "
                         "hybrid_shard_degree");
    });
  if (p.first_stage_layers > 0 || p.last_stage_layers > 0)
    sink(Rule::kTorchtitanLayouts, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] { return std::string("is set: moeplan exports equal pipeline stages to torchtitan"); });
  if (c.training.precision == Precision::kMixed && !c.training.fp32_gradients)
    sink(Rule::kTorchtitanLayouts, "training.fp32_gradients", [&] {
      return std::string("= false: torchtitan reduces gradients in fp32 (mixed_precision_reduce)");
    });
  // Its mixed precision is FSDP's: without sharding, tensor or pipeline parallelism trains in
  // fp32, and replicas over them are DDP, which it runs on one mesh dimension only.
  if (p.hybrid_shard_degree * p.expert_parallel_degree == 1 && (tp > 1 || p.pipeline_parallel_degree > 1))
    sink(Rule::kTorchtitanLayouts, "parallel.hybrid_shard_degree", [&] {
      return std::string("= 1 with expert_parallel_degree = 1 under tensor or pipeline parallelism: torchtitan "
                         "applies mixed precision and replicas through FSDP, so the shard degree must exceed 1");
    });
  if (c.training.precision == Precision::kBf16)
    sink(Rule::kTorchtitanLayouts, "training.precision", [&] {
      return std::string("= \"bf16\": torchtitan keeps fp32 parameters and computes in bf16 (plan with mixed)");
    });
  if (!ranks_ordered(p, Placement{}))
    sink(Rule::kFrameworkRankOrder, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() +
             "\": torchtitan's mesh is pipeline, replicate, shard (experts innermost), tensor (PRSET)";
    });
  if (c.moe.load_balancing == LoadBalancing::kSinkhorn || c.moe.load_balancing == LoadBalancing::kBalanced)
    sink(Rule::kTorchtitanRouting, "moe.load_balancing", [&] {
      return "= \"" + std::string(name_of(kLoadBalancingNames, c.moe.load_balancing)) +
             "\": torchtitan's routers balance by a load-balancing loss or expert biases (aux_loss or none)";
    });
  if (c.moe.global_token_shuffle)
    sink(Rule::kTorchtitanRouting, "moe.global_token_shuffle",
         [&] { return std::string("= true: torchtitan has no global token shuffle"); });
}

template <class Sink>
void check_config(const RunConfig& c, Sink& sink) {
  check_degrees(c, sink);
  check_batch(c, sink);
  check_moe_and_training(c, sink);
  switch (c.target) {
    case Target::kAny: break;
    case Target::kMoeplan: check_executor(c, sink); break;
    case Target::kMegatron: check_megatron(c, sink); break;
    case Target::kSmp: check_smp(c, sink); break;
    case Target::kTorchtitan: check_torchtitan(c, sink); break;
  }
}


}  // namespace

std::string_view rule_name(Rule rule) { return kRuleNames[static_cast<size_t>(rule)]; }

std::vector<Violation> validate_model(const ModelSpec& model) {
  MessageSink sink;
  check_model(model, sink);
  return std::move(sink.out);
}

std::vector<Violation> validate(const RunConfig& config) {
  MessageSink sink;
  check_model(config.model, sink);
  for (Violation& v : sink.out) v.field = "model." + v.field;
  check_config(config, sink);
  return std::move(sink.out);
}

RuleMask violated_rules(const RunConfig& config) {
  MaskSink sink;
  check_model(config.model, sink);
  check_config(config, sink);
  return sink.mask;
}

}  // namespace moeplan
