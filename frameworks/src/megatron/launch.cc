// Megatron-LM: the arguments of pretrain_gpt.py (megatron/training/arguments.py) for the
// plan's model and layout, one per line, and a torchrun line that passes them.
#include <string>
#include <utility>
#include <vector>

#include "launch_files.h"
#include "megatron.h"

namespace moeplan::frameworks {

namespace {

using Args = std::vector<std::pair<std::string, std::string>>;  // flag, value ("" for a switch)

void model_args(const Plan& plan, Args& a) {
  const ModelSpec& m = plan.model;
  a.push_back({"--num-layers", std::to_string(m.num_layers)});
  a.push_back({"--hidden-size", std::to_string(m.hidden_size)});
  // Dense blocks among MoE blocks take --ffn-hidden-size, the experts --moe-ffn-hidden-size.
  a.push_back({"--ffn-hidden-size", std::to_string(m.has_dense_layers() ? m.dense_intermediate_size : m.intermediate_size)});
  a.push_back({"--num-attention-heads", std::to_string(m.num_attention_heads)});
  if (m.mla()) {
    a.push_back({"--multi-latent-attention", ""});
    if (m.q_lora_rank > 0) a.push_back({"--q-lora-rank", std::to_string(m.q_lora_rank)});
    a.push_back({"--kv-lora-rank", std::to_string(m.kv_lora_rank)});
    a.push_back({"--qk-head-dim", std::to_string(m.head_dim - m.qk_rope_head_dim)});
    a.push_back({"--qk-pos-emb-head-dim", std::to_string(m.qk_rope_head_dim)});
    a.push_back({"--v-head-dim", std::to_string(m.v_head_dim)});
    a.push_back({"--kv-channels", std::to_string(m.v_head_dim)});
  } else if (m.head_dim * m.num_attention_heads != m.hidden_size) {
    a.push_back({"--kv-channels", std::to_string(m.head_dim)});
  }
  if (m.num_key_value_heads != m.num_attention_heads) {
    a.push_back({"--group-query-attention", ""});
    a.push_back({"--num-query-groups", std::to_string(m.num_key_value_heads)});
  }
  a.push_back({"--seq-length", std::to_string(plan.training.seq_len)});
  a.push_back({"--max-position-embeddings", std::to_string(m.max_position_embeddings)});
  a.push_back({"--position-embedding-type", "rope"});
  a.push_back({"--rotary-base", number(m.rope_theta)});
  if (m.norm == Norm::kRmsNorm) a.push_back({"--normalization", "RMSNorm"});
  a.push_back({"--norm-epsilon", number(m.rms_norm_eps)});
  if (m.mlp == Mlp::kSwiGlu && m.glu_limit > 0) {  // GPT-OSS's gate
    a.push_back({"--quick-geglu", ""});
    a.push_back({"--glu-linear-offset", "1.0"});
    a.push_back({"--activation-func-clamp-value", number(m.glu_limit)});
  } else if (m.mlp == Mlp::kSwiGlu) {
    a.push_back({"--swiglu", ""});
  }
  // Megatron-LM's linear layers take biases all or none; the q, k and v ones alone by their flag.
  if (!m.output_bias && !m.expert_bias) a.push_back({"--disable-bias-linear", ""});
  if (m.sliding_window) {
    a.push_back({"--window-size", std::to_string(*m.sliding_window) + ",0"});
    if (m.full_attention_step > 0) a.push_back({"--window-attn-skip-freq", std::to_string(m.full_attention_step)});
  }
  if (m.attention_sinks) a.push_back({"--softmax-type", "learnable"});
  if (m.qkv_bias) a.push_back({"--add-qkv-bias", ""});
  if (m.qk_norm) a.push_back({"--qk-layernorm", ""});  // of the --normalization kind
  if (!m.tie_word_embeddings) a.push_back({"--untie-embeddings-and-output-weights", ""});
  if (m.mtp_layers > 0) {
    a.push_back({"--mtp-num-layers", std::to_string(m.mtp_layers)});
    a.push_back({"--mtp-loss-scaling-factor", number(m.mtp_loss_weight)});
  }
  a.push_back({"--attention-dropout", number(m.dropout)});
  a.push_back({"--hidden-dropout", number(m.dropout)});
  a.push_back({"--init-method-std", number(m.initializer_range)});
  // The vocabulary as moeplan planned it: NullTokenizer adds an end-of-document token to the
  // size given (and Megatron pads the sum to a multiple of 128 x T); a real tokenizer replaces it.
  a.push_back({"--tokenizer-type", "NullTokenizer"});
  a.push_back({"--vocab-size", std::to_string(m.vocab_size - 1)});
}

void layout_args(const Plan& plan, Args& a) {
  const ParallelConfig& p = plan.parallel;
  a.push_back({"--tensor-model-parallel-size", std::to_string(p.tensor_parallel_degree)});
  if (p.sequence_parallel) a.push_back({"--sequence-parallel", ""});
  a.push_back({"--pipeline-model-parallel-size", std::to_string(p.pipeline_parallel_degree)});
  if (p.context_parallel_degree > 1) {
    a.push_back({"--context-parallel-size", std::to_string(p.context_parallel_degree)});
    a.push_back({"--cp-comm-type", std::string(name_of(kContextExchangeNames, p.context_exchange))});
  }
  if (p.first_stage_layers > 0) a.push_back({"--decoder-first-pipeline-num-layers", std::to_string(p.first_stage_layers)});
  if (p.last_stage_layers > 0) a.push_back({"--decoder-last-pipeline-num-layers", std::to_string(p.last_stage_layers)});
  // Chunks per stage rather than blocks per chunk: Megatron-LM takes only this form with uneven
  // end stages.
  if (p.virtual_pipeline_degree > 1)
    a.push_back({"--num-virtual-stages-per-pipeline-rank", std::to_string(p.virtual_pipeline_degree)});
  if (!plan.model.dense()) {
    a.push_back({"--num-experts", std::to_string(plan.model.num_experts)});
    a.push_back({"--moe-router-topk", std::to_string(plan.model.experts_per_token)});
    if (plan.model.has_dense_layers()) {
      // Which blocks have experts, block by block (1) or are dense (0).
      std::string pattern = "[";
      for (int64_t i = 0; i < plan.model.num_layers; ++i)
        pattern += std::string(i > 0 ? "," : "") + (plan.model.moe_layer(i) ? "1" : "0");
      a.push_back({"--moe-layer-freq", pattern + "]"});
      a.push_back({"--moe-ffn-hidden-size", std::to_string(plan.model.intermediate_size)});
    }
    if (plan.model.router_scoring == RouterScoring::kSigmoid) {
      a.push_back({"--moe-router-score-function", "sigmoid"});
      a.push_back({"--moe-router-enable-expert-bias", ""});
      a.push_back({"--moe-router-bias-update-rate", number(plan.model.router_bias_update_rate)});
    }
    // The softmax over every expert before the top-k keeps each chosen expert's own probability
    // (norm_topk_prob false); after it, over the k chosen, renormalises them.
    if (plan.model.router_scoring == RouterScoring::kSoftmax && !plan.model.norm_topk_prob)
      a.push_back({"--moe-router-pre-softmax", ""});
    if (plan.model.routed_scaling_factor != 1.0)
      a.push_back({"--moe-router-topk-scaling-factor", number(plan.model.routed_scaling_factor)});
    if (plan.model.router_groups > 1) {
      a.push_back({"--moe-router-num-groups", std::to_string(plan.model.router_groups)});
      a.push_back({"--moe-router-group-topk", std::to_string(plan.model.router_group_topk)});
    }
    if (plan.model.shared_experts()) {
      a.push_back({"--moe-shared-expert-intermediate-size", std::to_string(plan.model.shared_expert_intermediate_size)});
      if (plan.model.shared_expert_gate) a.push_back({"--moe-shared-expert-gate", ""});
    }
    a.push_back({"--expert-model-parallel-size", std::to_string(p.expert_parallel_degree)});
    // Each routed expert over ETP ranks: T, or 1 with the tensor ranks folded into the expert
    // group (Megatron-Core's parallel folding).
    a.push_back({"--expert-tensor-parallel-size", std::to_string(p.expert_tensor_degree())});
    a.push_back({"--moe-router-load-balancing-type", std::string(name_of(kLoadBalancingNames, plan.moe.load_balancing))});
    // Megatron-LM asserts a zero coefficient unless the router balances by the loss.
    const bool aux = plan.moe.load_balancing == LoadBalancing::kAuxLoss;
    a.push_back({"--moe-aux-loss-coeff", aux ? number(plan.moe.aux_loss_coef) : "0"});
    if (plan.moe.z_loss_coef != 0) a.push_back({"--moe-z-loss-coeff", number(plan.moe.z_loss_coef)});
    // DeepEP runs as Megatron-Core's flex dispatcher.
    if (plan.moe.dispatcher == Dispatcher::kDeepEp) {
      a.push_back({"--moe-token-dispatcher-type", "flex"});
      a.push_back({"--moe-enable-deepep", ""});
    } else {
      a.push_back({"--moe-token-dispatcher-type", std::string(name_of(kDispatcherNames, plan.moe.dispatcher))});
    }
    // Token dropping: each expert's capacity, which slots go when it is full, and padding.
    if (plan.moe.capacity_factor > 0) {
      a.push_back({"--moe-expert-capacity-factor", number(plan.moe.capacity_factor)});
      a.push_back({"--moe-token-drop-policy", std::string(name_of(kTokenDropPolicyNames, plan.moe.drop_policy))});
      if (plan.moe.pad_to_capacity) a.push_back({"--moe-pad-expert-input-to-capacity", ""});
    }
    if (plan.moe.overlap_exchange) a.push_back({"--overlap-moe-expert-parallel-comm", ""});
    if (overlaps_shared_expert(plan.model, plan.moe, p)) a.push_back({"--moe-shared-expert-overlap", ""});
    a.push_back({"--moe-grouped-gemm", ""});
  }
  switch (p.activation_checkpointing) {
    case Checkpointing::kNone: break;
    case Checkpointing::kFull:
      a.push_back({"--recompute-granularity", "full"});
      a.push_back({"--recompute-method", "uniform"});
      a.push_back({"--recompute-num-layers", "1"});
      break;
    case Checkpointing::kAttentionCore: a.push_back({"--recompute-granularity", "selective"}); break;
    case Checkpointing::kLatentUpProjections:
      a.push_back({"--recompute-granularity", "selective"});
      a.push_back({"--recompute-modules", "mla_up_proj"});
      break;
    case Checkpointing::kSelective:
      a.push_back({"--recompute-granularity", "selective"});
      a.push_back({"--recompute-modules", plan.model.dense() ? "mlp" : "moe"});
      break;
  }
  if (p.distributed_optimizer) a.push_back({"--use-distributed-optimizer", ""});
  a.push_back({"--micro-batch-size", std::to_string(p.micro_batch_size)});
  a.push_back({"--global-batch-size", std::to_string(global_batch_sequences(plan))});
}

void training_args(const Plan& plan, Args& a) {
  const TrainingConfig& t = plan.training;
  // Megatron's --bf16 is mixed precision: fp32 main parameters and optimizer states.
  if (t.precision == Precision::kMixed) a.push_back({"--bf16", ""});
  if (t.fp8) {
    a.push_back({"--fp8-format", "hybrid"});
  }
  if (t.precision == Precision::kMixed && !t.fp32_gradients) a.push_back({"--grad-reduce-in-bf16", ""});
  a.push_back({"--train-iters", std::to_string(t.steps)});
  a.push_back({"--lr", number(t.learning_rate)});
  a.push_back({"--min-lr", number(t.min_learning_rate)});
  a.push_back({"--lr-decay-style", "cosine"});
  a.push_back({"--lr-warmup-iters", std::to_string(t.warmup_steps)});
  a.push_back({"--weight-decay", number(t.weight_decay)});
  a.push_back({"--adam-beta1", number(t.adam_beta1)});
  a.push_back({"--adam-beta2", number(t.adam_beta2)});
  a.push_back({"--clip-grad", number(t.max_grad_norm)});
  a.push_back({"--seed", std::to_string(t.seed)});
}

}  // namespace

std::vector<launch::LaunchFile> export_megatron(const Plan& plan, Diagnostics& problems) {
  if (plan.model.rope_theta != static_cast<double>(static_cast<int64_t>(plan.model.rope_theta)))
    problems.error("model.rope_theta", "= " + number(plan.model.rope_theta) + ": Megatron-LM's --rotary-base is an integer");
  Args args;
  model_args(plan, args);
  layout_args(plan, args);
  training_args(plan, args);

  std::string list;
  for (const auto& [flag, value] : args) list += value.empty() ? flag + "\n" : flag + " " + value + "\n";
  // Run from Megatron-LM's folder; the data arguments (--data-path, a tokenizer) go after it.
  const std::string sh = torchrun_script(
      plan, "Megatron-LM pretraining",
      "mapfile -t LINES < \"$(dirname \"$0\")/megatron-args.txt\"\n"
      "ARGS=()\n"
      "for line in \"${LINES[@]}\"; do read -r -a words <<< \"$line\"; ARGS+=(\"${words[@]}\"); done\n",
      "pretrain_gpt.py \"${ARGS[@]}\"");
  return {{"megatron-args.txt", list}, {"megatron-launch.sh", sh}};
}

}  // namespace moeplan::frameworks
