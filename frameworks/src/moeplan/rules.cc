// moeplan's own executor: the layouts it runs, as rules (rules.h TargetRules).
#include <array>
#include <string>
#include <string_view>

#include "moeplan/core/rules.h"
#include "moeplan.h"

namespace moeplan::frameworks {
// Its own namespace: the frameworks' files may be compiled together (unity builds).
namespace moeplan_rules {
namespace {

enum : int {
  kTrainsMoe,
  kPipelineLimits,
  kLayouts,
  kTensorSplits,
  kCount
};
constexpr std::array<std::string_view, kCount> kNames = {
    "executor_trains_moe",
    "executor_pipeline_limits",
    "executor_layouts",
    "executor_tensor_splits",
};
static_assert(kCount <= kMaxTargetRules);

// What moeplan's executor trains (executor/): Mixtral-, Qwen3-MoE- and DeepSeek-style models
// with or without shared experts, dense blocks and latent attention, softmax or DeepSeek-V3's
// sigmoid routers, equal pipeline stages, the Megatron splits it implements. The planner and simulator know more
// layouts than it runs.
void check(const RunConfig& c, RuleSink& sink) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const TrainingConfig& t = c.training;
  if (m.dense())
    sink(kTrainsMoe, "model.num_experts", [&] {
      return std::string("= 1 (a dense model): the executor trains Mixture-of-Experts models; dense models are "
                         "planned and simulated only");
    });
  if (m.mlp != Mlp::kSwiGlu)
    sink(kTrainsMoe, "model.mlp", [&] {
      return "= \"" + std::string(name_of(kMlpNames, m.mlp)) + "\": the executor trains SwiGLU feed-forward layers only";
    });
  // The executor drops at capacity with either dispatcher; it pads in the all-to-all only.
  if (c.moe.capacity_factor > 0 && c.moe.pad_to_capacity && c.moe.dispatcher == Dispatcher::kAllGather)
    sink(kTrainsMoe, "moe.pad_to_capacity", [&] {
      return std::string(
          "= true with dispatcher \"allgather\": the executor pads experts' input in the all-to-all exchange only");
    });
  // Mixtral's, Qwen3-MoE's and DeepSeek's blocks (dense blocks among them): no attention biases;
  // latent attention's values no wider than its query and key heads (the flash kernel takes one
  // width, the values padded to it).
  if (m.qkv_bias)
    sink(kTrainsMoe, "model.qkv_bias",
         [&] { return std::string("= true: the executor trains attention without biases"); });
  if (m.mla() && m.v_head_dim > m.head_dim)
    sink(kTrainsMoe, "model.v_head_dim", [&] {
      return "= " + rule_number(m.v_head_dim) + " over head_dim = " + rule_number(m.head_dim) +
             ": the executor's latent attention pads values to the query and key width, not the other way";
    });
  // The router: softmax over every expert, or DeepSeek-V3's sigmoid with its balancing bias and
  // group-limited choice.
  if (m.router_scoring == RouterScoring::kSoftmax && m.router_groups > 1)
    sink(kTrainsMoe, "model.router_groups", [&] {
      return "= " + rule_number(m.router_groups) +
             " with softmax scoring: the executor limits the choice to groups under sigmoid scoring only "
             "(DeepSeek-V3's); its softmax router takes the top-k over every expert";
    });
  if (m.router_scoring == RouterScoring::kSigmoid &&
      (c.moe.load_balancing == LoadBalancing::kSinkhorn || c.moe.load_balancing == LoadBalancing::kBalanced))
    sink(kTrainsMoe, "moe.load_balancing", [&] {
      return "= \"" + std::string(name_of(kLoadBalancingNames, c.moe.load_balancing)) +
             "\" with sigmoid scoring: the executor balances a sigmoid router by its bias, with aux_loss or none";
    });
  // GPT-OSS's blocks: the window on some blocks and the whole sequence on the others trains;
  // its attention sinks, biases and clamped gate do not.
  const char* gpt_oss = m.attention_sinks ? "model.attention_sinks"
                        : m.output_bias   ? "model.output_bias"
                        : m.expert_bias   ? "model.expert_bias"
                        : m.glu_limit > 0 ? "model.glu_limit"
                                          : nullptr;
  if (gpt_oss != nullptr)
    sink(kTrainsMoe, gpt_oss, [&] {
      return std::string("is set: the executor trains Mixtral-style blocks (GPT-OSS's attention sinks, biases and "
                         "clamped gate are planned and simulated only)");
    });
  // Depth k predicts the token k + 1 ahead: a sequence must hold one such pair at the deepest.
  if (m.mtp_layers > 0 && t.seq_len <= m.mtp_layers + 1)
    sink(kTrainsMoe, "training.seq_len", [&] {
      return "= " + rule_number(t.seq_len) + " with mtp_layers = " + rule_number(m.mtp_layers) +
             ": the deepest multi-token prediction module would have no token to predict";
    });
  // Pipeline stages: the router's losses are reported across stages but not trained through
  // them, and offloaded block inputs are kept per block, not per micro-batch in flight.
  if (const int64_t pp = p.pipeline_parallel_degree; pp > 1) {
    const std::string stages = " with pipeline_parallel_degree = " + rule_number(pp);
    if (c.moe.load_balancing == LoadBalancing::kAuxLoss && c.moe.aux_loss_coef != 0)
      sink(kPipelineLimits, "moe.load_balancing", [&] {
        return "= \"aux_loss\"" + stages +
               ": the executor trains the load-balancing loss without pipeline stages only (use sinkhorn, balanced or "
               "none)";
      });
    if (c.moe.z_loss_coef != 0)
      sink(kPipelineLimits, "moe.z_loss_coef", [&] {
        return "= " + rule_number(c.moe.z_loss_coef) + stages +
               ": the executor trains the z-loss without pipeline stages only (use 0)";
      });
    if (p.activation_offloading)
      sink(kPipelineLimits, "parallel.activation_offloading",
           [&] { return "= true" + stages + ": the executor offloads without pipeline stages only"; });
  }
  // Layouts the planner and simulator know that the executor does not run yet.
  // One rank trains through the reference trainer, which keeps every activation in memory.
  if (p.world_size == 1 && p.activation_checkpointing != Checkpointing::kNone)
    sink(kLayouts, "parallel.activation_checkpointing", [&] {
      return checkpointing_name(p) + " on one rank: the executor recomputes blocks in runs of two or more ranks only";
    });
  if (p.world_size == 1 && p.activation_offloading)
    sink(kLayouts, "parallel.activation_offloading",
         [&] { return std::string("= true on one rank: the executor offloads in runs of two or more ranks only"); });
  if (c.moe.overlap_exchange)
    sink(kLayouts, "moe.overlap_exchange", [&] {
      return std::string("= true: the executor runs each micro-batch's exchanges on its own compute chain");
    });
  if (c.moe.dispatcher == Dispatcher::kDeepEp)
    sink(kLayouts, "moe.dispatcher",
         [&] { return std::string("= \"deepep\": the executor exchanges tokens over c10d (alltoall or allgather)"); });
  if (p.activation_checkpointing == Checkpointing::kAttentionCore ||
      p.activation_checkpointing == Checkpointing::kLatentUpProjections)
    sink(kLayouts, "parallel.activation_checkpointing", [&] {
      return "= \"" + std::string(name_of(kCheckpointingNames, p.activation_checkpointing)) +
             "\": the executor recomputes whole blocks (full) or MoE sub-blocks (selective) only";
    });
  if (p.distributed_optimizer)
    sink(kLayouts, "parallel.distributed_optimizer", [&] {
      return std::string("= true: the executor shards optimizer states over hybrid_shard_degree only (use S instead)");
    });
  if (p.dense_shard_spanning())
    sink(kLayouts, "parallel.dense_shard_spans_experts", [&] {
      return std::string("= true: the executor shards the dense parameters over hybrid_shard_degree only");
    });
  // Context parallelism: balanced assignment is solved over one rank's tokens; sinkhorn, the
  // losses and the top-k routers see the whole sequence across the context ranks.
  if (p.context_parallel_degree > 1 && c.moe.load_balancing == LoadBalancing::kBalanced)
    sink(kLayouts, "moe.load_balancing", [&] {
      return "= \"balanced\" with context_parallel_degree = " + rule_number(p.context_parallel_degree) +
             ": the executor solves the balanced assignment over a whole sequence on one rank only (use sinkhorn, "
             "aux_loss or none)";
    });
  if (p.first_stage_layers > 0 || p.last_stage_layers > 0)
    sink(kLayouts, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] { return std::string("is set: the executor runs equal pipeline stages only"); });
  if (t.fp8 && c.cluster.peak_fp8_flops > 0 && t.precision != Precision::kFp32)  // else fp8_needs_hardware says it
    sink(kLayouts, "training.fp8",
         [&] { return std::string("= true: the executor computes in bf16 or fp32 only"); });
  if (!t.fp32_gradients && t.precision == Precision::kMixed)
    sink(kLayouts, "training.fp32_gradients",
         [&] { return std::string("= false: the executor keeps mixed-precision gradients in fp32"); });
  // Tensor parallelism splits the vocabulary (embedding, lm head) and the sequence over T ranks.
  if (const int64_t tp = p.tensor_parallel_degree; tp > 1) {
    if (m.vocab_size % tp != 0)
      sink(kTensorSplits, "model.vocab_size", [&] {
        return "= " + rule_number(m.vocab_size) + " is not divisible by tensor_parallel_degree = " + rule_number(tp) +
               " (the executor splits the embedding and lm head over the vocabulary)";
      });
    if (t.seq_len % tp != 0)
      sink(kTensorSplits, "training.seq_len", [&] {
        return "= " + rule_number(t.seq_len) + " is not divisible by tensor_parallel_degree = " + rule_number(tp) +
               " (sequence parallelism splits it)";
      });
    if (!p.sequence_parallel)
      sink(kTensorSplits, "parallel.sequence_parallel", [&] {
        return "= false with tensor_parallel_degree = " + rule_number(tp) +
               ": the executor runs tensor parallelism with sequence parallelism";
      });
  }
}

}  // namespace
}  // namespace moeplan_rules

const TargetRules kMoeplanRules{.names = moeplan_rules::kNames, .check = moeplan_rules::check};

}  // namespace moeplan::frameworks
