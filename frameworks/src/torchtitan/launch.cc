// torchtitan: a job config (TOML) with the plan's parallel degrees, batch, activation
// checkpointing, precision and optimizer, and a torchrun line that trains it.
#include <string>
#include <vector>

#include "launch_files.h"
#include "torchtitan.h"

namespace moeplan::frameworks {

namespace {

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

std::string line(const std::string& key, const std::string& value) { return key + " = " + value + "\n"; }
std::string line(const std::string& key, int64_t value) { return line(key, std::to_string(value)); }

}  // namespace

std::vector<launch::LaunchFile> export_torchtitan(const Plan& plan, Diagnostics&) {
  const ModelSpec& m = plan.model;
  const ParallelConfig& p = plan.parallel;
  const TrainingConfig& t = plan.training;
  const bool pipelined = p.pipeline_parallel_degree > 1;
  std::string toml = "# torchtitan job for " + summary(plan) + ".\n# Written by `moeplan export-launch --to torchtitan`.\n";
  toml += "# The model's shape, for a flavor of torchtitan's MoE model: dim " + std::to_string(m.hidden_size) +
          ", n_layers " + std::to_string(m.num_layers) + ", n_heads " + std::to_string(m.num_attention_heads) +
          ", n_kv_heads " + std::to_string(m.num_key_value_heads) + ",\n# vocab_size " + std::to_string(m.vocab_size) +
          ", expert hidden_dim " + std::to_string(m.intermediate_size) + ", num_experts " +
          std::to_string(m.num_experts) + ", top_k " + std::to_string(m.experts_per_token) + ", rope_theta " +
          number(m.rope_theta) + ", norm_eps " + number(m.rms_norm_eps) +
          (m.shared_experts() ? ", shared expert hidden_dim " + std::to_string(m.shared_expert_intermediate_size) : "") +
          (m.qk_norm ? ", q/k norms" : "") + ".\n\n";

  toml += "[job]\n" + line("description", quoted("moeplan plan: " + describe(p))) + "\n";
  // qwen3: dense and MoE flavors; deepseek_v3: latent attention.
  const char* model = m.mla() ? "deepseek_v3" : m.qk_norm ? "qwen3" : m.dense() ? "llama3" : "llama4";
  toml += "[model]\n" + line("name", quoted(model)) + line("flavor", quoted(m.name));
  if (t.fp8) toml += line("converters", "[\"float8\"]");
  toml += "\n[optimizer]\n" + line("name", quoted("AdamW")) + line("lr", number(t.learning_rate)) +
          line("weight_decay", number(t.weight_decay)) +
          line("beta1", number(t.adam_beta1)) + line("beta2", number(t.adam_beta2)) + "\n";
  toml += "[lr_scheduler]\n" + line("warmup_steps", t.warmup_steps) + line("decay_type", quoted("cosine")) +
          line("min_lr_factor", number(t.learning_rate > 0 ? t.min_learning_rate / t.learning_rate : 0.0)) + "\n";

  toml += "[training]\n";
  // Per data-parallel rank: one micro-batch, accumulated up to the global batch; under a
  // pipeline the local batch is the step's micro-batches, split by the schedule.
  toml += line("local_batch_size", pipelined ? p.micro_batch_size * p.gradient_accumulation_steps : p.micro_batch_size);
  toml += line("global_batch_size", global_batch_sequences(plan));
  toml += line("seq_len", t.seq_len) + line("steps", t.steps) + line("max_norm", number(t.max_grad_norm));
  const bool fp32 = t.precision == Precision::kFp32;
  toml += line("mixed_precision_param", quoted(fp32 ? "float32" : "bfloat16"));
  toml += line("mixed_precision_reduce", quoted(fp32 || t.fp32_gradients ? "float32" : "bfloat16")) + "\n";

  toml += "[parallelism]\n";
  toml += line("data_parallel_replicate_degree", p.replica_degree());
  // Expert parallelism borrows its ranks from data_parallel_shard_degree (and with
  // expert_tensor_parallel_degree = 1 from the tensor-parallel ranks too).
  toml += line("data_parallel_shard_degree", p.hybrid_shard_degree * p.expert_data_degree());
  toml += line("tensor_parallel_degree", p.tensor_parallel_degree);
  toml += line("pipeline_parallel_degree", p.pipeline_parallel_degree);
  if (pipelined) {
    toml += line("pipeline_parallel_schedule", quoted(p.virtual_pipeline_degree > 1 ? "Interleaved1F1B" : "1F1B"));
    toml += line("pipeline_parallel_layers_per_stage",
                 m.num_layers / (p.pipeline_parallel_degree * p.virtual_pipeline_degree));
    toml += line("pipeline_parallel_microbatch_size", p.micro_batch_size);
    // Equal stages: torchtitan's default gives the first and last one block fewer.
    toml += line("pipeline_parallel_first_stage_less_layers", 0);
    toml += line("pipeline_parallel_last_stage_less_layers", 0);
  }
  toml += line("context_parallel_degree", p.context_parallel_degree);
  // Its ring passes the keys and values on by all-to-all ("alltoall"), or gathers them whole.
  if (p.context_parallel_degree > 1)
    toml += line("context_parallel_rotate_method",
                 quoted(p.context_exchange == ContextExchange::kAllGather ? "allgather" : "alltoall"));
  if (!m.dense()) {
    toml += line("expert_parallel_degree", p.expert_parallel_degree);
    toml += line("expert_tensor_parallel_degree", p.expert_tensor_degree());
  }
  toml += "\n[activation_checkpoint]\n" +
          line("mode", quoted(p.activation_checkpointing == Checkpointing::kFull ? "full" : "none"));
  toml += "\n[debug]\n" + line("seed", t.seed);

  // Run from torchtitan's folder; data and other overrides go after it.
  const std::string sh = torchrun_script(plan, "torchtitan training", "",
                                         "-m torchtitan.train --job.config_file \"$(dirname \"$0\")/torchtitan.toml\"");
  return {{"torchtitan.toml", toml}, {"torchtitan-launch.sh", sh}};
}

}  // namespace moeplan::frameworks
