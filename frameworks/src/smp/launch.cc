// SageMaker's model parallelism library v2: the PyTorch estimator's instance type and count,
// its `distribution` (SMP's parameters) and the hyperparameters of SMP's example training
// script, as JSON, and a Python snippet that launches them.
#include <regex>
#include <string>
#include <vector>

#include "launch_files.h"
#include "smp.h"
#include "moeplan/core/json_reader.h"

namespace moeplan::frameworks {

namespace {

// An EC2 instance type ("p4d.24xlarge", "p5.48xlarge"): SageMaker's is the same with "ml.".
bool ec2_instance(const std::string& name) {
  static const std::regex kInstance("[a-z]+[0-9][a-z0-9-]*\\.[0-9]*x?large");
  return std::regex_match(name, kInstance);
}

Json distribution(const ParallelConfig& p) {
  Json parameters = Json::object();
  parameters["hybrid_shard_degree"] = p.hybrid_shard_degree;
  parameters["expert_parallel_degree"] = p.expert_parallel_degree;
  parameters["tensor_parallel_degree"] = p.tensor_parallel_degree;
  parameters["sm_activation_offloading"] = p.activation_offloading;
  if (p.activation_offloading) parameters["activation_loading_horizon"] = p.activation_loading_horizon;
  Json d = Json::object();
  d["torch_distributed"] = {{"enabled", true}};
  d["smdistributed"] = {{"modelparallel", {{"enabled", true}, {"parameters", parameters}}}};
  return d;
}

// The arguments of SMP's example script (shared-scripts/arguments.py), which builds the model
// from them (train_utils.py get_model_config) and counts max_steps in micro-batches: the
// optimizer steps every gradient_accumulation_steps of them.
Json hyperparameters(const Plan& plan) {
  const ModelSpec& m = plan.model;
  const ParallelConfig& p = plan.parallel;
  const TrainingConfig& t = plan.training;
  Json h = Json::object();
  h["model_type"] = m.dense() ? "llama_v2" : "mixtral";
  h["use_smp_implementation"] = 1;
  h["vocab_size"] = m.vocab_size;
  h["hidden_width"] = m.hidden_size;
  h[m.dense() ? "llama_intermediate_size" : "intermediate_size"] = m.intermediate_size;
  h["num_layers"] = m.num_layers;
  h["num_heads"] = m.num_attention_heads;
  h["num_key_value_heads"] = m.num_key_value_heads;
  h["max_context_width"] = t.seq_len;
  if (m.sliding_window) h["sliding_window"] = *m.sliding_window;
  h["initializer_range"] = m.initializer_range;
  if (m.dense()) h["rotary_emb_base"] = static_cast<int64_t>(m.rope_theta);
  if (!m.dense()) {
    h["moe"] = 1;
    h["num_local_experts"] = m.num_experts;
    h["num_experts_per_tok"] = m.experts_per_token;
    h["moe_load_balancing"] = std::string(name_of(kLoadBalancingNames, plan.moe.load_balancing));
    h["global_token_shuffle"] = plan.moe.global_token_shuffle ? 1 : 0;
    h["moe_all_to_all_dispatcher"] = plan.moe.dispatcher == Dispatcher::kAllToAll ? 1 : 0;
  }
  // FSDP's strategy for the dense blocks, which every data-parallel rank holds: sharded over
  // all of them (FULL_SHARD), over groups of hybrid_shard_degree and replicated across the
  // groups (HYBRID_SHARD, as in the two-node Mixtral example), or not at all (NO_SHARD).
  const int64_t data_parallel = p.world_size / p.tensor_parallel_degree;
  h["sharding_strategy"] = p.hybrid_shard_degree == 1              ? "no_shard"
                           : p.hybrid_shard_degree == data_parallel ? "full_shard"
                                                                    : "hybrid_shard";
  h["delayed_param"] = 1;
  h["activation_checkpointing"] = p.activation_checkpointing == Checkpointing::kFull ? 1 : 0;
  h["bf16"] = t.precision == Precision::kFp32 ? 0 : 1;
  h["fp8"] = t.fp8 ? 1 : 0;  // the script's default is 1
  h["train_batch_size"] = p.micro_batch_size;
  h["gradient_accumulation_steps"] = p.gradient_accumulation_steps;
  h["max_steps"] = t.steps * p.gradient_accumulation_steps;
  h["lr"] = t.learning_rate;
  h["min_lr"] = t.min_learning_rate;
  h["lr_decay_style"] = "cosine";
  h["lr_decay_iters"] = t.steps;
  h["warmup"] = static_cast<double>(t.warmup_steps) / static_cast<double>(t.steps);
  h["weight_decay"] = t.weight_decay;
  h["beta1"] = t.adam_beta1;
  h["beta2"] = t.adam_beta2;
  h["grad_clip"] = t.max_grad_norm;
  h["seed"] = t.seed;
  h["checkpoint_dir"] = "/opt/ml/checkpoints";
  return h;
}

// What SMP's example script builds is fixed but for the sizes: Mixtral with rope_theta 1e6 and
// rms_norm_eps 1e-5, Llama 2 with rms_norm_eps 1e-5; both SwiGLU with RMSNorm, untied, no
// dropout (train_utils.py get_model_config).
void model_problems(const ModelSpec& m, Diagnostics& problems) {
  if (m.mlp != Mlp::kSwiGlu)
    problems.error("model.mlp", "SMP's example script trains Mixtral and Llama models (SwiGLU)");
  if (m.norm != Norm::kRmsNorm)
    problems.error("model.norm", "SMP's example script trains Mixtral and Llama models (RMSNorm)");
  if (!m.dense() && m.rope_theta != 1e6)
    problems.error("model.rope_theta", "= " + number(m.rope_theta) + ": SMP's example script builds Mixtral with 1e6");
  if (m.dense() && m.rope_theta != static_cast<double>(static_cast<int64_t>(m.rope_theta)))
    problems.error("model.rope_theta", "= " + number(m.rope_theta) + ": SMP's rotary_emb_base is an integer");
  if (m.rms_norm_eps != 1e-5)
    problems.error("model.rms_norm_eps", "= " + number(m.rms_norm_eps) + ": SMP's example script builds its models with 1e-5");
  if (m.tie_word_embeddings)
    problems.error("model.tie_word_embeddings", "= true: SMP's example script unties the embedding and the lm head");
  if (m.dropout != 0)
    problems.error("model.dropout", "= " + number(m.dropout) + ": SMP's example script builds its models without dropout");
}

}  // namespace

std::vector<launch::LaunchFile> export_smp(const Plan& plan, Diagnostics& problems) {
  const ClusterSpec& c = plan.cluster;
  if (plan.parallel.world_size != c.world_size())
    problems.error("parallel.world_size", "= " + std::to_string(plan.parallel.world_size) + " uses part of " +
                                              std::to_string(c.num_nodes) + " x " + c.name +
                                              ": SageMaker trains on every GPU of its instances");
  if (!ec2_instance(c.name))
    problems.error("cluster.name", "= \"" + c.name +
                                       "\" is not an EC2 instance type: SageMaker trains on ml. instances "
                                       "(p4d.24xlarge, p4de.24xlarge, p5.48xlarge)");
  model_problems(plan.model, problems);
  Json settings = Json::object();
  settings["instance_type"] = "ml." + c.name;
  settings["instance_count"] = c.num_nodes;
  settings["distribution"] = distribution(plan.parallel);
  settings["hyperparameters"] = hyperparameters(plan);
  settings["moeplan"] = {{"plan", summary(plan)},
                         {"predicted_step_time_s", plan.prediction.step_time_s},
                         {"predicted_tokens_per_s", plan.prediction.tokens_per_s}};
  const std::string json = settings.dump(2) + "\n";

  std::string py =
      "# Launches " + summary(plan) +
      "\n# on SageMaker with SMP v2. Written by `moeplan export-launch --to smp`. Set role, the data channels and\n"
      "# entry_point (SMP's example train.py) to yours.\n"
      "import json\n"
      "import pathlib\n\n"
      "from sagemaker.pytorch import PyTorch\n\n"
      "settings = json.loads((pathlib.Path(__file__).parent / \"smp.json\").read_text())\n"
      "estimator = PyTorch(\n"
      "    entry_point=\"train.py\",\n"
      "    role=role,\n"
      "    instance_type=settings[\"instance_type\"],\n"
      "    instance_count=settings[\"instance_count\"],\n"
      "    distribution=settings[\"distribution\"],\n"
      "    hyperparameters=settings[\"hyperparameters\"],\n"
      "    checkpoint_local_path=settings[\"hyperparameters\"][\"checkpoint_dir\"],\n"
      "    py_version=\"py310\",\n"
      "    framework_version=\"2.2.0\",\n"
      ")\n"
      "estimator.fit(inputs=data_channels)\n";
  return {{"smp.json", json}, {"smp_launch.py", py}};
}

}  // namespace moeplan::frameworks
