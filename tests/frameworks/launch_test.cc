// export-launch: the files each framework is given, checked field by field against the plan,
// and the plans each framework cannot run, refused by rule.
#include "moeplan/frameworks/launch.h"

#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <string>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/planner/search.h"
#include "framework_rules.h"
#include "refusal.h"
#include "test_support.h"

namespace moeplan {
namespace {

// The best plan of `moeplan search --target <target>` with the pins given.
Plan searched(const std::string& model_name, const std::string& instance, int64_t gpus, Target target,
              const planner::SearchOptions::Pins& pins, Precision precision, int64_t global_batch_tokens = 0,
              LoadBalancing routing = LoadBalancing::kSinkhorn, bool ignore_memory = false) {
  planner::SearchOptions options = test::search_options(gpus);
  // What is exported or refused is the plan's layout, pinned here; the analytic ranking picks it
  // as the simulator would among so few, at a fraction of the time under the sanitizers.
  options.estimator = planner::Estimator::kAnalytic;
  options.moe.load_balancing = routing;
  // SMP's bf16 = 1 reduces gradients in bf16.
  options.training.fp32_gradients = target != test::framework_rules("smp");
  if (global_batch_tokens > 0) options.training.global_batch_tokens = global_batch_tokens;
  options.training.precision = precision;
  options.target = target;
  options.pins = pins;
  options.ignore_memory_limits = ignore_memory;
  const ModelSpec& model = test::model(model_name);
  const ClusterSpec cluster = test::hardware(instance, gpus);
  const planner::SearchResult result = planner::search(model, cluster, options);
  if (result.ranked.empty()) throw std::runtime_error("no plan for " + model_name);
  return planner::make_plan(model, cluster, options, result, "test");
}

const launch::LaunchFile& file(const std::vector<launch::LaunchFile>& files, const std::string& name) {
  for (const launch::LaunchFile& f : files)
    if (f.name == name) return f;
  throw std::runtime_error("no file " + name);
}

using test::refusal;

// "--flag value" lines as a map ("" for a switch).
std::map<std::string, std::string> megatron_args(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    out[line.substr(0, space)] = space == std::string::npos ? "" : line.substr(space + 1);
  }
  return out;
}

// key = value lines of a TOML file, as "section.key" -> value text.
std::map<std::string, std::string> toml_values(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line, section;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      section = line.substr(1, line.find(']') - 1);
      continue;
    }
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) out[section + "." + line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

// The example of SageMaker's Mixtral 8x7B post: two ml.p4d.24xlarge, expert_parallel_degree 2,
// hybrid_shard_degree 8, activation checkpointing, bf16 (FSDP mixed precision: fp32 parameters,
// bf16 compute and reduction), Sinkhorn routing with the all-to-all dispatcher, delayed
// parameter initialisation, hybrid sharding.
TEST(ExportLaunch, SmpReproducesTheSageMakerMixtralExample) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 2;
  pins.hybrid_shard_degree = 8;
  pins.checkpointing = Checkpointing::kFull;
  pins.offloading = false;
  pins.micro_batch_size = 1;
  // The layout as the post ran it, whatever moeplan's memory model says of it: 52.2 GiB per
  // GPU, over an A100's 40 GB (the fp32 parameters and Adam moments of a sixteenth of 46.7B
  // parameters alone take 32.6 GiB).
  const Plan plan = searched("mixtral-8x7b", "p4d.24xlarge", 16, test::framework_rules("smp"), pins, Precision::kMixed, 64 * 2048,
                             LoadBalancing::kSinkhorn, true);
  ASSERT_EQ(plan.parallel.gradient_accumulation_steps, 4);
  EXPECT_GT(plan.prediction.memory.device_total_bytes, plan.prediction.memory.device_limit_bytes);
  const std::vector<launch::LaunchFile> files = launch::export_launch(plan, test::framework_rules("smp"), "plan.json");
  const Json smp = Json::parse(file(files, "smp.json").text);
  EXPECT_EQ(smp.at("instance_type"), "ml.p4d.24xlarge");
  EXPECT_EQ(smp.at("instance_count"), 2);
  const Json& d = smp.at("distribution");
  EXPECT_EQ(d.at("torch_distributed").at("enabled"), true);
  EXPECT_EQ(d.at("smdistributed").at("modelparallel").at("enabled"), true);
  const Json& p = d.at("smdistributed").at("modelparallel").at("parameters");
  EXPECT_EQ(p.at("expert_parallel_degree"), 2);
  EXPECT_EQ(p.at("hybrid_shard_degree"), 8);
  EXPECT_EQ(p.at("tensor_parallel_degree"), 1);
  EXPECT_EQ(p.at("sm_activation_offloading"), false);
  const Json& h = smp.at("hyperparameters");
  EXPECT_EQ(h.at("moe"), 1);
  EXPECT_EQ(h.at("moe_load_balancing"), "sinkhorn");
  EXPECT_EQ(h.at("moe_all_to_all_dispatcher"), 1);
  EXPECT_EQ(h.at("model_type"), "mixtral");
  EXPECT_EQ(h.at("sharding_strategy"), "hybrid_shard");
  EXPECT_EQ(h.at("delayed_param"), 1);
  EXPECT_EQ(h.at("activation_checkpointing"), 1);
  EXPECT_EQ(h.at("bf16"), 1);
  EXPECT_EQ(h.at("fp8"), 0);
  EXPECT_EQ(h.at("seed"), 12345);
  // The model's shape and the batch, field by field.
  EXPECT_EQ(h.at("hidden_width"), plan.model.hidden_size);
  EXPECT_EQ(h.at("num_layers"), plan.model.num_layers);
  EXPECT_EQ(h.at("num_heads"), plan.model.num_attention_heads);
  EXPECT_EQ(h.at("num_key_value_heads"), plan.model.num_key_value_heads);
  EXPECT_EQ(h.at("intermediate_size"), plan.model.intermediate_size);
  EXPECT_EQ(h.at("vocab_size"), plan.model.vocab_size);
  EXPECT_EQ(h.at("num_local_experts"), 8);
  EXPECT_EQ(h.at("num_experts_per_tok"), 2);
  EXPECT_EQ(h.at("max_context_width"), 2048);
  EXPECT_EQ(h.at("train_batch_size"), 1);
  EXPECT_EQ(h.at("gradient_accumulation_steps"), 4);
  // The script counts micro-batches; its learning rate decays over optimizer steps.
  EXPECT_EQ(h.at("max_steps"), 4 * plan.training.steps);
  EXPECT_EQ(h.at("lr_decay_iters"), plan.training.steps);
  EXPECT_EQ(h.at("use_smp_implementation"), 1);
  EXPECT_DOUBLE_EQ(h.at("lr").get<double>(), plan.training.learning_rate);
  const std::string& py = file(files, "smp_launch.py").text;
  EXPECT_NE(py.find("from sagemaker.pytorch import PyTorch"), std::string::npos);
  EXPECT_NE(py.find("distribution=settings[\"distribution\"]"), std::string::npos);
}

TEST(ExportLaunch, MegatronArgumentsFollowThePlan) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 8;
  pins.tensor_parallel_degree = 1;
  pins.pipeline_parallel_degree = 4;
  pins.virtual_pipeline_degree = 2;
  pins.distributed_optimizer = true;
  pins.checkpointing = Checkpointing::kSelective;
  pins.micro_batch_size = 1;
  const Plan plan = searched("mixtral-8x7b", "p5.48xlarge", 64, test::framework_rules("megatron"), pins, Precision::kMixed);
  const std::vector<launch::LaunchFile> files = launch::export_launch(plan, test::framework_rules("megatron"), "plan.json");
  const auto a = megatron_args(file(files, "megatron-args.txt").text);
  EXPECT_EQ(a.at("--tensor-model-parallel-size"), "1");
  EXPECT_EQ(a.at("--pipeline-model-parallel-size"), "4");
  EXPECT_EQ(a.at("--num-virtual-stages-per-pipeline-rank"), "2");
  EXPECT_EQ(a.at("--expert-model-parallel-size"), "8");
  EXPECT_EQ(a.count("--use-distributed-optimizer"), 1u);
  EXPECT_EQ(a.at("--recompute-granularity"), "selective");
  EXPECT_EQ(a.at("--recompute-modules"), "moe");
  EXPECT_EQ(a.at("--micro-batch-size"), "1");
  EXPECT_EQ(a.at("--global-batch-size"), std::to_string(plan.training.global_batch_tokens / 2048));
  EXPECT_EQ(a.at("--num-experts"), "8");
  EXPECT_EQ(a.at("--moe-router-topk"), "2");
  EXPECT_EQ(a.at("--moe-router-load-balancing-type"), "sinkhorn");
  EXPECT_EQ(a.at("--moe-token-dispatcher-type"), "alltoall");
  EXPECT_EQ(a.at("--moe-aux-loss-coeff"), "0");  // Sinkhorn: Megatron asserts no loss
  EXPECT_EQ(a.at("--vocab-size"), "31999");      // NullTokenizer adds its end-of-document token
  EXPECT_EQ(a.at("--num-layers"), "32");
  EXPECT_EQ(a.at("--hidden-size"), "4096");
  EXPECT_EQ(a.at("--ffn-hidden-size"), "14336");
  EXPECT_EQ(a.at("--num-query-groups"), "8");
  EXPECT_EQ(a.at("--seq-length"), "2048");
  EXPECT_EQ(a.at("--rotary-base"), "1000000");
  EXPECT_EQ(a.count("--bf16"), 1u);
  EXPECT_EQ(a.count("--sequence-parallel"), 0u);
  const std::string& sh = file(files, "megatron-launch.sh").text;
  EXPECT_NE(sh.find("torchrun --nnodes 8 --nproc-per-node 8"), std::string::npos) << sh;
  EXPECT_NE(sh.find("pretrain_gpt.py"), std::string::npos);
}

// Qwen2-MoE's gated shared expert and q/k/v biases, and Qwen3's q/k norms, in Megatron-LM's own
// flags; Mixtral has none of them.
TEST(ExportLaunch, MegatronArgumentsCarrySharedExpertsAndAttentionExtras) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 8;
  pins.tensor_parallel_degree = 1;
  pins.pipeline_parallel_degree = 2;
  // The Megatron-LM arguments of the model's searched plan, with `mtp_layers` modules.
  const auto args_of = [&](const char* model, int64_t mtp_layers = 0) {
    Plan plan = searched(model, "p5.48xlarge", 64, test::framework_rules("megatron"), pins, Precision::kMixed);
    plan.model.mtp_layers = mtp_layers;
    return megatron_args(file(launch::export_launch(plan, test::framework_rules("megatron"), "plan.json"),
                              "megatron-args.txt")
                             .text);
  };
  const auto qwen2 = args_of("qwen2-57b-a14b");
  EXPECT_EQ(qwen2.at("--moe-shared-expert-intermediate-size"), "20480");
  EXPECT_EQ(qwen2.count("--moe-shared-expert-gate"), 1u);
  EXPECT_EQ(qwen2.count("--add-qkv-bias"), 1u);
  EXPECT_EQ(qwen2.count("--qk-layernorm"), 0u);
  EXPECT_EQ(qwen2.at("--ffn-hidden-size"), "2560");
  const auto qwen3 = args_of("qwen3-30b-a3b");
  EXPECT_EQ(qwen3.count("--qk-layernorm"), 1u);
  EXPECT_EQ(qwen3.count("--moe-shared-expert-intermediate-size"), 0u);
  EXPECT_EQ(qwen3.at("--num-experts"), "128");
  EXPECT_EQ(qwen3.at("--moe-router-topk"), "8");
  const auto mixtral = args_of("mixtral-8x7b");
  for (const char* flag : {"--qk-layernorm", "--add-qkv-bias", "--moe-shared-expert-intermediate-size",
                           "--moe-layer-freq", "--moe-ffn-hidden-size"})
    EXPECT_EQ(mixtral.count(flag), 0u) << flag;
  // DeepSeekMoE's first block is dense: Megatron-LM's block pattern, the dense width as
  // --ffn-hidden-size and the experts' as --moe-ffn-hidden-size.
  const auto deepseek = args_of("deepseek-moe-16b");
  std::string pattern = "[0";
  for (int i = 1; i < 28; ++i) pattern += ",1";
  EXPECT_EQ(deepseek.at("--moe-layer-freq"), pattern + "]");
  EXPECT_EQ(deepseek.at("--ffn-hidden-size"), "10944");
  EXPECT_EQ(deepseek.at("--moe-ffn-hidden-size"), "1408");
  EXPECT_EQ(deepseek.at("--moe-shared-expert-intermediate-size"), "2816");
  // DeepSeek-V2-Lite's latent attention (no query latent) in Megatron-Core's MLA flags (27
  // blocks: one stage).
  pins.pipeline_parallel_degree = 1;
  const auto lite = args_of("deepseek-v2-lite");
  EXPECT_EQ(lite.count("--multi-latent-attention"), 1u);
  EXPECT_EQ(lite.count("--q-lora-rank"), 0u);
  EXPECT_EQ(lite.at("--kv-lora-rank"), "512");
  EXPECT_EQ(lite.at("--qk-head-dim"), "128");
  EXPECT_EQ(lite.at("--qk-pos-emb-head-dim"), "64");
  EXPECT_EQ(lite.at("--v-head-dim"), "128");
  EXPECT_EQ(lite.count("--num-query-groups"), 0u);
  EXPECT_EQ(lite.count("--moe-router-score-function"), 0u);
  // Its softmax weights each chosen expert by its own probability (norm_topk_prob false).
  EXPECT_EQ(lite.count("--moe-router-pre-softmax"), 1u);
  EXPECT_EQ(lite.count("--mtp-num-layers"), 0u);
  // A multi-token prediction module: Megatron-Core's --mtp-num-layers.
  const auto with_mtp = args_of("deepseek-v2-lite", 1);
  EXPECT_EQ(with_mtp.at("--mtp-num-layers"), "1");
  EXPECT_EQ(with_mtp.at("--mtp-loss-scaling-factor"), "0.1");
  EXPECT_EQ(lite.count("--moe-router-topk-scaling-factor"), 0u);  // 1 for V2-Lite
  // DeepSeek-V3's router (Moonlight's sizes: 27 blocks, one stage): sigmoid scores, the
  // balancing bias and its rate, the weights' scale.
  const auto moonlight = args_of("moonlight-16b-a3b");
  EXPECT_EQ(moonlight.at("--moe-router-score-function"), "sigmoid");
  EXPECT_EQ(moonlight.count("--moe-router-enable-expert-bias"), 1u);
  EXPECT_EQ(moonlight.at("--moe-router-bias-update-rate"), "0.001");
  EXPECT_EQ(moonlight.at("--moe-router-topk-scaling-factor"), "2.446");
  EXPECT_EQ(moonlight.count("--moe-router-pre-softmax"), 0u);
  // GPT-OSS: windows on every block but each second, sinks, biases everywhere, the clamped gate.
  const auto oss = args_of("gpt-oss-20b");
  EXPECT_EQ(oss.at("--window-size"), "128,0");
  EXPECT_EQ(oss.at("--window-attn-skip-freq"), "2");
  EXPECT_EQ(oss.at("--softmax-type"), "learnable");
  EXPECT_EQ(oss.at("--activation-func-clamp-value"), "7");
  EXPECT_EQ(oss.at("--glu-linear-offset"), "1.0");
  EXPECT_EQ(oss.count("--quick-geglu"), 1u);
  EXPECT_EQ(oss.count("--swiglu"), 0u);
  EXPECT_EQ(oss.count("--disable-bias-linear"), 0u);
  EXPECT_EQ(lite.count("--disable-bias-linear"), 1u);
}

// Token dropping in Megatron-LM's names: the capacity factor, the drop policy and padding; a
// dropless plan carries none of them.
TEST(ExportLaunch, MegatronArgumentsCarryTheCapacityFactor) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 8;
  Plan plan = searched("mixtral-8x7b", "p5.48xlarge", 64, test::framework_rules("megatron"), pins, Precision::kMixed);
  const auto args_of = [](const Plan& p) {
    return megatron_args(
        file(launch::export_launch(p, test::framework_rules("megatron"), "plan.json"), "megatron-args.txt").text);
  };
  for (const char* flag : {"--moe-expert-capacity-factor", "--moe-token-drop-policy", "--moe-pad-expert-input-to-capacity"})
    EXPECT_EQ(args_of(plan).count(flag), 0u) << flag;
  plan.moe.load_balancing = LoadBalancing::kAuxLoss;
  plan.moe.capacity_factor = 1.25;
  plan.moe.drop_policy = TokenDropPolicy::kPosition;
  plan.moe.pad_to_capacity = true;
  const auto dropping = args_of(plan);
  EXPECT_EQ(dropping.at("--moe-expert-capacity-factor"), "1.25");
  EXPECT_EQ(dropping.at("--moe-token-drop-policy"), "position");
  EXPECT_EQ(dropping.count("--moe-pad-expert-input-to-capacity"), 1u);
  // Megatron-LM drops tokens only with aux_loss or no load balancing: refused by its rule.
  plan.moe.load_balancing = LoadBalancing::kSinkhorn;
  EXPECT_THROW(launch::export_launch(plan, test::framework_rules("megatron"), "plan.json"), InputError);
}

TEST(ExportLaunch, TorchtitanConfigFollowsThePlan) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 4;
  pins.hybrid_shard_degree = 2;
  pins.tensor_parallel_degree = 2;
  pins.sequence_parallel = true;
  pins.pipeline_parallel_degree = 1;
  pins.checkpointing = Checkpointing::kFull;
  pins.micro_batch_size = 2;
  pins.placement = "PRSET";
  const Plan plan = searched("mixtral-8x7b", "p5.48xlarge", 32, test::framework_rules("torchtitan"), pins, Precision::kMixed, 0,
                             LoadBalancing::kAuxLoss);
  const std::vector<launch::LaunchFile> files = launch::export_launch(plan, test::framework_rules("torchtitan"), "plan.json");
  const auto t = toml_values(file(files, "torchtitan.toml").text);
  EXPECT_EQ(t.at("parallelism.data_parallel_replicate_degree"), "2");  // 32 / (2 x 4 x 2)
  EXPECT_EQ(t.at("parallelism.data_parallel_shard_degree"), "8");      // S x E
  EXPECT_EQ(t.at("parallelism.expert_parallel_degree"), "4");
  EXPECT_EQ(t.at("parallelism.tensor_parallel_degree"), "2");
  EXPECT_EQ(t.at("parallelism.pipeline_parallel_degree"), "1");
  EXPECT_EQ(t.at("activation_checkpoint.mode"), "\"full\"");
  EXPECT_EQ(t.at("training.local_batch_size"), "2");
  EXPECT_EQ(t.at("training.global_batch_size"), std::to_string(plan.training.global_batch_tokens / 2048));
  EXPECT_EQ(t.at("training.seq_len"), "2048");
  EXPECT_EQ(t.at("training.mixed_precision_param"), "\"bfloat16\"");
  EXPECT_EQ(t.at("training.mixed_precision_reduce"), "\"float32\"");
  const std::string& sh = file(files, "torchtitan-launch.sh").text;
  EXPECT_NE(sh.find("torchrun --nnodes 4 --nproc-per-node 8"), std::string::npos) << sh;

  // Interleaved stages: the local batch is the step's micro-batches, split by the schedule.
  planner::SearchOptions::Pins staged;
  staged.expert_parallel_degree = 8;
  staged.hybrid_shard_degree = 1;
  staged.tensor_parallel_degree = 1;
  staged.pipeline_parallel_degree = 4;
  staged.virtual_pipeline_degree = 2;
  staged.micro_batch_size = 1;
  staged.placement = "PRSET";
  const Plan piped = searched("mixtral-8x7b", "p5.48xlarge", 64, test::framework_rules("torchtitan"), staged, Precision::kMixed, 0,
                              LoadBalancing::kAuxLoss);
  const auto s = toml_values(file(launch::export_launch(piped, test::framework_rules("torchtitan"), "plan.json"), "torchtitan.toml").text);
  EXPECT_EQ(s.at("parallelism.pipeline_parallel_schedule"), "\"Interleaved1F1B\"");
  EXPECT_EQ(s.at("parallelism.pipeline_parallel_layers_per_stage"), "4");  // 32 blocks / (4 x 2)
  EXPECT_EQ(s.at("parallelism.pipeline_parallel_microbatch_size"), "1");
  EXPECT_EQ(s.at("parallelism.pipeline_parallel_first_stage_less_layers"), "0");
  EXPECT_EQ(s.at("parallelism.pipeline_parallel_last_stage_less_layers"), "0");
  EXPECT_EQ(s.at("training.local_batch_size"), std::to_string(piped.parallel.gradient_accumulation_steps));
  EXPECT_EQ(s.at("parallelism.data_parallel_shard_degree"), "8");
}

// Parallel folding: the experts outside the tensor split (ETP 1), the two tensor-parallel ranks in
// each expert group, so that E = 8 spans four data-parallel ranks. Megatron-LM takes ETP as
// its own flag; torchtitan's expert ranks come from data_parallel_shard_degree (S x the mesh's
// E) and, with ETP 1, the tensor ranks.
TEST(ExportLaunch, FoldedExpertsExportWithEachFrameworksNames) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 8;
  pins.expert_tensor_parallel_degree = 1;
  pins.hybrid_shard_degree = 1;
  pins.tensor_parallel_degree = 2;
  pins.sequence_parallel = true;
  pins.pipeline_parallel_degree = 1;
  pins.micro_batch_size = 1;
  pins.placement = "PRSET";
  const Plan megatron = searched("mixtral-8x7b", "p5.48xlarge", 32, test::framework_rules("megatron"), pins,
                                 Precision::kMixed, 0, LoadBalancing::kAuxLoss);
  EXPECT_EQ(megatron.parallel.expert_fold(), 2);
  EXPECT_EQ(megatron.parallel.replica_degree(), 4);  // 32 / (8 / 2 x 1 x 2)
  const auto a = megatron_args(file(launch::export_launch(megatron, test::framework_rules("megatron"), "plan.json"),
                                    "megatron-args.txt").text);
  EXPECT_EQ(a.at("--expert-model-parallel-size"), "8");
  EXPECT_EQ(a.at("--expert-tensor-parallel-size"), "1");
  EXPECT_EQ(a.at("--tensor-model-parallel-size"), "2");
  EXPECT_EQ(a.count("--overlap-moe-expert-parallel-comm"), 0u);
  // The merged 1F1B schedule, each exchange beside another micro-batch's compute, is
  // Megatron-Core's own flag; torchtitan's rules refuse it by name.
  Plan overlapped = megatron;
  overlapped.moe.overlap_exchange = true;
  overlapped.parallel.activation_checkpointing = Checkpointing::kNone;
  EXPECT_EQ(megatron_args(file(launch::export_launch(overlapped, test::framework_rules("megatron"), "plan.json"),
                               "megatron-args.txt").text)
                .count("--overlap-moe-expert-parallel-comm"),
            1u);
  EXPECT_NE(refusal([&] { launch::export_launch(overlapped, test::framework_rules("torchtitan"), "plan.json"); })
                .find("moe.overlap_exchange"),
            std::string::npos);

  pins.hybrid_shard_degree = 2;  // torchtitan shards the parameters (FSDP)
  const Plan titan = searched("mixtral-8x7b", "p5.48xlarge", 32, test::framework_rules("torchtitan"), pins,
                              Precision::kMixed, 0, LoadBalancing::kAuxLoss);
  const auto t = toml_values(
      file(launch::export_launch(titan, test::framework_rules("torchtitan"), "plan.json"), "torchtitan.toml").text);
  EXPECT_EQ(t.at("parallelism.expert_parallel_degree"), "8");
  EXPECT_EQ(t.at("parallelism.expert_tensor_parallel_degree"), "1");
  EXPECT_EQ(t.at("parallelism.data_parallel_shard_degree"), "8");  // S 2 x the mesh's E 4
  EXPECT_EQ(t.at("parallelism.data_parallel_replicate_degree"), "2");

}

// Context parallelism exports with each framework's names: Megatron-LM's --context-parallel-size
// and --cp-comm-type, torchtitan's context_parallel_degree and rotate method; SMP refuses it by
// rule.
TEST(ExportLaunch, ContextParallelismExportsWithEachFrameworksNames) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 8;
  pins.context_parallel_degree = 2;
  pins.tensor_parallel_degree = 2;
  pins.expert_tensor_parallel_degree = 2;
  pins.sequence_parallel = true;
  pins.hybrid_shard_degree = 1;
  pins.pipeline_parallel_degree = 1;
  pins.micro_batch_size = 1;
  pins.placement = "PRSET";
  const Plan megatron = searched("mixtral-8x7b", "p5.48xlarge", 32, test::framework_rules("megatron"), pins,
                                 Precision::kMixed, 0, LoadBalancing::kAuxLoss);
  EXPECT_EQ(megatron.parallel.context_parallel_degree, 2);
  EXPECT_EQ(megatron.parallel.expert_fold(), 2);         // the expert group spans the two context ranks
  EXPECT_EQ(megatron.parallel.replica_degree(), 2);      // 32 / (8 / 2 x 2 x 2)
  EXPECT_EQ(megatron.parallel.data_parallel_degree(), 8);  // sequences read: 32 / (2 x 2)
  const auto a = megatron_args(file(launch::export_launch(megatron, test::framework_rules("megatron"), "plan.json"),
                                    "megatron-args.txt").text);
  EXPECT_EQ(a.at("--context-parallel-size"), "2");
  EXPECT_EQ(a.at("--cp-comm-type"), "p2p");
  EXPECT_EQ(a.at("--expert-model-parallel-size"), "8");

  Plan gathered = megatron;
  gathered.parallel.context_exchange = ContextExchange::kAllGather;
  EXPECT_EQ(megatron_args(file(launch::export_launch(gathered, test::framework_rules("megatron"), "plan.json"),
                               "megatron-args.txt").text)
                .at("--cp-comm-type"),
            "all_gather");

  pins.hybrid_shard_degree = 2;  // torchtitan shards the parameters (FSDP)
  const Plan titan = searched("mixtral-8x7b", "p5.48xlarge", 32, test::framework_rules("torchtitan"), pins,
                              Precision::kMixed, 0, LoadBalancing::kAuxLoss);
  const auto t = toml_values(
      file(launch::export_launch(titan, test::framework_rules("torchtitan"), "plan.json"), "torchtitan.toml").text);
  EXPECT_EQ(t.at("parallelism.context_parallel_degree"), "2");
  EXPECT_EQ(t.at("parallelism.context_parallel_rotate_method"), "\"alltoall\"");
  EXPECT_EQ(t.at("parallelism.data_parallel_shard_degree"), "8");  // S 2 x the mesh's E 4

  EXPECT_NE(refusal([&] { launch::export_launch(megatron, test::framework_rules("smp"), "plan.json"); })
                .find("parallel.context_parallel_degree"),
            std::string::npos);

  // DeepEP is Megatron-Core's flex dispatcher; the others refuse it by rule. Qwen3-30B-A3B's
  // expert group of 16 consecutive ranks spans two nodes: on p5's EFA the core rule
  // deepep_layout refuses it, on DGX H100's InfiniBand it exports.
  planner::SearchOptions::Pins ep16;
  ep16.expert_parallel_degree = 16;
  ep16.tensor_parallel_degree = 1;
  ep16.context_parallel_degree = 1;
  ep16.pipeline_parallel_degree = 1;
  ep16.micro_batch_size = 1;
  ep16.placement = "PRSET";
  Plan fused = searched("qwen3-30b-a3b", "p5.48xlarge", 32, test::framework_rules("megatron"), ep16,
                        Precision::kMixed, 0, LoadBalancing::kAuxLoss);
  fused.moe.dispatcher = Dispatcher::kDeepEp;
  EXPECT_NE(refusal([&] { launch::export_launch(fused, test::framework_rules("megatron"), "plan.json"); })
                .find("deepep_layout"),
            std::string::npos);
  fused.cluster = test::hardware("dgx-h100", 32);
  // With the experts split over the tensor ranks Megatron-LM's flex dispatcher is refused.
  Plan split = megatron;
  split.moe.dispatcher = Dispatcher::kDeepEp;
  split.cluster = test::hardware("dgx-h100", 32);
  EXPECT_NE(refusal([&] { launch::export_launch(split, test::framework_rules("megatron"), "plan.json"); })
                .find("megatron_layouts"),
            std::string::npos);
  const auto f = megatron_args(
      file(launch::export_launch(fused, test::framework_rules("megatron"), "plan.json"), "megatron-args.txt").text);
  EXPECT_EQ(f.at("--moe-token-dispatcher-type"), "flex");
  EXPECT_EQ(f.count("--moe-enable-deepep"), 1u);
  Plan fused_titan = titan;
  fused_titan.moe.dispatcher = Dispatcher::kDeepEp;
  fused_titan.cluster = test::hardware("dgx-h100", 32);
  EXPECT_NE(refusal([&] { launch::export_launch(fused_titan, test::framework_rules("torchtitan"), "plan.json"); })
                .find("moe.dispatcher"),
            std::string::npos);
}

// Recomputing latent attention's up projections is Megatron-LM's selective recompute module
// mla_up_proj; torchtitan, SMP and moeplan's executor have none and refuse it by rule.
TEST(ExportLaunch, LatentUpCheckpointingIsMegatronsUpProjectionModule) {
  planner::SearchOptions::Pins pins;
  pins.expert_parallel_degree = 64;
  pins.tensor_parallel_degree = 1;
  pins.pipeline_parallel_degree = 1;
  pins.checkpointing = Checkpointing::kLatentUpProjections;
  pins.micro_batch_size = 1;
  const Plan plan = searched("deepseek-v3", "p5.48xlarge", 64, test::framework_rules("megatron"), pins, Precision::kMixed,
                             0, LoadBalancing::kAuxLoss, true);
  const auto a = megatron_args(file(launch::export_launch(plan, test::framework_rules("megatron"), "plan.json"),
                                    "megatron-args.txt").text);
  EXPECT_EQ(a.at("--recompute-granularity"), "selective");
  EXPECT_EQ(a.at("--recompute-modules"), "mla_up_proj");
  EXPECT_EQ(a.count("--moe-shared-expert-overlap"), 0u);
  // Its shared expert beside the dispatch and combine: Megatron-LM's --moe-shared-expert-overlap.
  Plan overlapped = plan;
  overlapped.moe.overlap_shared_expert = true;
  EXPECT_EQ(megatron_args(file(launch::export_launch(overlapped, test::framework_rules("megatron"), "plan.json"),
                               "megatron-args.txt")
                              .text)
                .count("--moe-shared-expert-overlap"),
            1u);
  EXPECT_TRUE(plan_from_json(parse_json_text(plan_to_text(overlapped), "plan.json"), "plan.json").moe.overlap_shared_expert);
  for (const char* other : {"torchtitan", "smp", "moeplan"}) {
    RunConfig c{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training, test::framework_rules(other)};
    bool refused = false;
    for (const Violation& v : validate(c))
      refused = refused || (v.field == "parallel.activation_checkpointing" && v.message.find("latent_up") != std::string::npos);
    EXPECT_TRUE(refused) << other;
  }
}

// A plan another target searched, exported where it cannot run: refused with the rule's name.
TEST(ExportLaunch, EachFrameworkRefusesWhatItCannotRunByRule) {
  planner::SearchOptions::Pins pipeline;
  pipeline.expert_parallel_degree = 8;
  pipeline.pipeline_parallel_degree = 4;
  pipeline.hybrid_shard_degree = 1;
  const Plan staged = searched("mixtral-8x7b", "p5.48xlarge", 64, nullptr, pipeline, Precision::kBf16);
  EXPECT_NE(refusal([&] { launch::export_launch(staged, test::framework_rules("smp"), "p.json"); }).find("smp_no_pipeline"),
            std::string::npos);
  // Megatron-LM's bf16 keeps fp32 parameters: a pure-bf16 plan is refused.
  EXPECT_NE(refusal([&] { launch::export_launch(staged, test::framework_rules("megatron"), "p.json"); }).find("training.precision"),
            std::string::npos);

  planner::SearchOptions::Pins sharded;
  sharded.expert_parallel_degree = 2;
  sharded.hybrid_shard_degree = 8;
  const Plan fsdp = searched("mixtral-8x7b", "p4d.24xlarge", 16, nullptr, sharded, Precision::kBf16);
  const std::string megatron = refusal([&] { launch::export_launch(fsdp, test::framework_rules("megatron"), "p.json"); });
  EXPECT_NE(megatron.find("parallel.hybrid_shard_degree"), std::string::npos) << megatron;
  EXPECT_NE(megatron.find("megatron_layouts"), std::string::npos) << megatron;
  EXPECT_NE(megatron.find("p.json: "), std::string::npos) << megatron;
  // Sinkhorn routing is not torchtitan's.
  EXPECT_NE(refusal([&] { launch::export_launch(fsdp, test::framework_rules("torchtitan"), "p.json"); }).find("torchtitan_routing"),
            std::string::npos);

  planner::SearchOptions::Pins tensor;
  tensor.expert_parallel_degree = 2;
  tensor.tensor_parallel_degree = 2;
  tensor.pipeline_parallel_degree = 1;
  const Plan both = searched("mixtral-8x7b", "p5.48xlarge", 64, nullptr, tensor, Precision::kBf16);
  EXPECT_NE(refusal([&] { launch::export_launch(both, test::framework_rules("smp"), "p.json"); }).find("smp_expert_with_tensor"),
            std::string::npos);

  // Ranks in another order than the framework's mesh.
  planner::SearchOptions::Pins order;
  order.expert_parallel_degree = 2;
  order.tensor_parallel_degree = 2;
  order.pipeline_parallel_degree = 1;
  order.placement = "PERST";
  const Plan placed = searched("mixtral-8x7b", "p5.48xlarge", 64, nullptr, order, Precision::kMixed);
  EXPECT_NE(refusal([&] { launch::export_launch(placed, test::framework_rules("megatron"), "p.json"); }).find("framework_rank_order"),
            std::string::npos);

  // Not a framework: `moeplan run` trains the plan itself.
  EXPECT_NE(refusal([&] { launch::export_launch(fsdp, test::framework_rules("moeplan"), "p.json"); }).find("moeplan run"),
            std::string::npos);
}

}  // namespace
}  // namespace moeplan
