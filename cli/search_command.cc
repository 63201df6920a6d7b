// `moeplan search`: its flags, into the planner's search request and report options; what the
// planner's report gives (moeplan/planner/search_report.h) is printed.
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "choice.h"
#include "command.h"
#include "moeplan/core/rules.h"
#include "moeplan/planner/request.h"
#include "moeplan/planner/search.h"
#include "moeplan/planner/search_report.h"
#include "moeplan/planner/sweep.h"

namespace moeplan::cli {

namespace {

constexpr NameTable<bool, 2> kOnOff{{{"on", true}, {"off", false}}};
// Mixed precision's gradients: kept and reduced in fp32 (true) or in bf16.
constexpr NameTable<bool, 2> kGradientNames{{{"fp32", true}, {"bf16", false}}};

struct Search {
  planner::SearchRequest request;
  planner::ReportOptions report;
  std::string command;  // the command line, recorded in the plan
};

// The cluster, the profiles, the time and cost inputs and the training schedule.
void add_setting_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  TrainingConfig& training = r.options.training;
  cmd.add_option("--gpus", r.gpus, "Number of GPUs (ranks), or a range A:B of cluster sizes to search (whole nodes)")
      ->required();
  cmd.add_option("--train-tokens", r.goal.tokens,
                 "Tokens to train (e.g. 1T, 300B, 2.5e12): prints each plan's days and dollars")
      ->transform(CLI::AsNumberWithUnit(std::map<std::string, double>{{"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"T", 1e12}},
                                        CLI::AsNumberWithUnit::CASE_SENSITIVE))
      ->check(CLI::Range(0.0, 1e18));
  add_choice(cmd, "--objective", r.goal.objective, planner::kObjectiveNames,
             "What ranks the cluster sizes of a --gpus range: time, cost or tokens-per-dollar")
      ->capture_default_str();
  cmd.add_option("--deadline-days", r.goal.deadline_days,
                 "With --train-tokens: only cluster sizes that train them within this many days")
      ->check(CLI::Range(0.0, 1e6));
  cmd.add_option("--restart-minutes", r.goal.restart_minutes,
                 "Minutes a restart after a node failure takes (detect, replace, reload)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e5));
  cmd.add_option("--instance", r.instance, "Hardware profile name or .json file")->capture_default_str();
  cmd.add_option("--model", r.model, "Model profile name, or a profile or Hugging Face config.json file")
      ->capture_default_str();
  cmd.add_option("--profiles", r.profiles, "Folder with hardware/ and models/ profiles");
  cmd.add_option("--seq-len", training.seq_len, "Sequence length (block size)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  cmd.add_option("--global-batch-tokens", training.global_batch_tokens,
                 "Tokens per optimizer step (default: 4Mi rounded up to gpus x seq-len)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  add_choice(cmd, "--precision", r.precision, kPrecisionNames,
             "bf16 (parameters and moments too), mixed (fp32 parameters, bf16 compute) or fp32 (default: mixed for "
             "megatron, smp and torchtitan, whose bf16 training keeps fp32 parameters; bf16 otherwise)");
  cmd.add_option("--steps", training.steps, "Training steps (the length of the learning-rate schedule)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd.add_option("--learning-rate", training.learning_rate, "Peak learning rate")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  cmd.add_option("--min-learning-rate", training.min_learning_rate, "Learning rate at the end of the cosine decay")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  cmd.add_option("--warmup-steps", training.warmup_steps, "Linear warmup steps")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
}

// The degrees and layout choices a user may fix, and the target framework.
void add_layout_options(CLI::App& cmd, Search& s) {
  planner::SearchOptions& o = s.request.options;
  planner::SearchOptions::Pins& pin = o.pins;
  const auto degree = CLI::Range(int64_t{1}, int64_t{1} << 20);
  cmd.add_option("--expert-parallel-degree", pin.expert_parallel_degree, "Fix E instead of searching it")->check(degree);
  cmd.add_option("--hybrid-shard-degree", pin.hybrid_shard_degree, "Fix S instead of searching it")->check(degree);
  cmd.add_option("--tensor-parallel-degree", pin.tensor_parallel_degree, "Fix T instead of searching it")->check(degree);
  cmd.add_option("--expert-tensor-parallel-degree", pin.expert_tensor_parallel_degree,
                 "Fix the routed experts' tensor split ETP (T, or 1 to fold the tensor ranks into the expert group) "
                 "instead of searching it")
      ->check(degree);
  cmd.add_option("--pipeline-parallel-degree", pin.pipeline_parallel_degree, "Fix P instead of searching it")
      ->check(degree);
  cmd.add_option("--context-parallel-degree", pin.context_parallel_degree,
                 "Fix C, the ranks each sequence is split over (context parallelism), instead of searching it")
      ->check(degree);
  add_choice(cmd, "--context-exchange", o.context_exchange, kContextExchangeNames,
             "How context-parallel ranks pass keys and values: p2p (a ring beside the attention, the default) or "
             "all_gather");
  cmd.add_option("--virtual-pipeline-degree", pin.virtual_pipeline_degree,
                 "Fix the interleaved chunks per pipeline stage (1: plain 1F1B)")
      ->check(degree);
  add_choice(cmd, "--sequence-parallel", pin.sequence_parallel, kOnOff, "Fix sequence parallelism (with T > 1)");
  // Empty: not fixed, as if not given.
  cmd.add_option(
         "--placement",
         [&pin](const CLI::results_t& text) {
           pin.placement = text.front().empty() ? std::nullopt : std::optional<std::string>(text.front());
           return true;
         },
         "Fix the placement: R, S, E (and P, T) outermost first, e.g. RSE or PRSET; SMP's cluster, spread or "
         "D/P/T letters")
      ->type_name("TEXT");
  o.target = executor_framework().target;  // what `moeplan run` trains, unless asked for another framework
  add_framework_choice(cmd, "--target", o.target, false, "Where the plan trains, and so which layouts are searched: ",
                       "; `moeplan export-launch` writes the other frameworks' files")
      ->capture_default_str();
  add_choice(cmd, "--checkpointing", pin.checkpointing, kCheckpointingNames,
             "Fix activation checkpointing (selective: the MoE sub-block; attention_core: Megatron's selective "
             "recomputation; latent_up: latent attention's up projections, Megatron's mla_up_proj)");
  add_choice(cmd, "--dense-shard-spans-experts", pin.dense_shard_spans_experts, kOnOff,
             "Fix whether the dense parameters are sharded over the expert and context ranks too (FSDP2's shard "
             "dimension spanning EP and CP)");
  add_choice(cmd, "--distributed-optimizer", pin.distributed_optimizer, kOnOff,
             "Fix the distributed optimizer (states sharded over the data-parallel ranks, ZeRO-1)");
  cmd.add_option("--first-stage-layers", pin.first_stage_layers, "Fix the blocks of the first pipeline stage")
      ->check(degree);
  cmd.add_option("--last-stage-layers", pin.last_stage_layers, "Fix the blocks of the last pipeline stage")
      ->check(degree);
}

// What the framework runs, offloading, and the expert load.
void add_framework_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  planner::SearchOptions::Pins& pin = r.options.pins;
  cmd.add_flag("--fp8", r.options.training.fp8, "FP8 GEMMs (Transformer Engine's recipe; GPUs with FP8 tensor cores)");
  add_choice(cmd, "--gradients", r.fp32_gradients, kGradientNames,
             "Mixed precision's gradients: fp32 or bf16 (default: bf16 for smp, whose FSDP reduces in bf16; fp32 "
             "otherwise)");
  add_choice(cmd, "--load-balancing", r.load_balancing, kLoadBalancingNames,
             "The router's load balancing: sinkhorn, balanced, aux_loss or none (default: aux_loss for megatron and "
             "torchtitan, sinkhorn, SMP's default, otherwise)");
  add_choice(cmd, "--kernels", r.kernels, kKernelNames, "What the framework runs: fused or eager (default: the profile's)");
  add_choice(cmd, "--attention", r.attention, kAttentionKernelNames,
             "Attention kernel: flash or unfused (default: the profile's)");
  add_choice(cmd, "--offload", pin.offloading, kOnOff, "Fix activation offloading");
  cmd.add_option("--loading-horizon", pin.loading_horizon, "Fix the offload loading horizon")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  cmd.add_option("--micro-batch", pin.micro_batch_size, "Fix the micro-batch size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  add_choice(cmd, "--dispatcher", r.options.moe.dispatcher, kDispatcherNames,
             "How tokens reach their experts: alltoall (NCCL), allgather, or deepep (DeepEP's fused kernels, "
             "Megatron-Core's flex dispatcher; across nodes it needs InfiniBand or RoCE)");
  cmd.add_flag("--overlap-exchange", r.options.moe.overlap_exchange,
               "Each token exchange beside another micro-batch's compute (Megatron-Core's merged 1F1B schedule, "
               "--overlap-moe-expert-parallel-comm)");
  cmd.add_flag("--overlap-shared-expert", r.options.moe.overlap_shared_expert,
               "The shared experts' forward beside the dispatch and combine, on a stream of its own "
               "(Megatron-Core's --moe-shared-expert-overlap)");
  cmd.add_option("--expert-load-imbalance", r.options.moe.expert_load_imbalance,
                 "Tokens of the busiest expert over the mean")
      ->capture_default_str()->check(CLI::Range(1.0, 1e6));
  cmd.add_option("--capacity-factor", r.capacity_factors,
                 "Drop the slots over this many times an expert's mean share of a micro-batch (Megatron-Core's "
                 "--moe-expert-capacity-factor; default: dropless); a list (e.g. 0,1.25,1.5; 0: dropless) searches "
                 "each and plans the fastest that drops at most --max-dropped-fraction")
      ->delimiter(',')->check(CLI::Range(0.0, 1e6));
  cmd.add_option("--max-dropped-fraction", r.max_dropped_fraction,
                 "Under a --capacity-factor list, the largest share of the slots a chosen factor may drop")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  add_choice(cmd, "--drop-policy", r.options.moe.drop_policy, kTokenDropPolicyNames,
             "Under --capacity-factor, drop the slots of the lowest router probability (probs) or the last (position)");
  cmd.add_flag("--pad-to-capacity", r.options.moe.pad_to_capacity,
               "Under --capacity-factor, every expert computes its whole capacity (Megatron-Core's "
               "--moe-pad-expert-input-to-capacity)");
  cmd.add_option("--routing", r.options.routing,
                 "balanced, skew:X (the busiest expert X times the mean) or a routing profile file: rank the best "
                 "plans by steps drawn under it, each micro-batch's expert loads drawn anew");
  add_choice(cmd, "--rank-by", r.options.rank_by, planner::kRankByNames,
             "Under --routing, rank by the median (p50) or the p95 of the drawn steps")
      ->capture_default_str();
  cmd.add_option("--tokens-per-expert", r.options.moe.tokens_per_expert,
                 "Token counts per expert, e.g. measured (comma-separated); overrides the imbalance")
      ->delimiter(',')->check(CLI::Range(0.0, 1e18));
}

// How the search ranks, and what it prints and writes.
void add_output_options(CLI::App& cmd, Search& s) {
  planner::SearchRequest& r = s.request;
  cmd.add_option("--max-micro-batch", r.options.max_micro_batch, "Largest micro-batch size tried")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  cmd.add_option("--top", r.top, "Candidates shown")->capture_default_str()->check(CLI::Range(1, 1000));
  add_choice(cmd, "--estimator", r.options.estimator, planner::kEstimatorNames,
             "Rank by the step simulator or the analytic estimate")
      ->capture_default_str();
  cmd.add_flag_callback("--exhaustive", [&r] { r.options.prune = false; },
                        "Simulate every candidate that fits instead of pruning by the compute bound");
  cmd.add_flag("--explain", s.report.explain, "Show how many candidates each rule or limit removed");
  cmd.add_flag("--json", s.report.json, "Print the plan as JSON instead of the table");
  cmd.add_option("--out", s.report.out, "Plan file to write (empty: none)")->capture_default_str();
  cmd.add_option("--data", r.options.training.data,
                 "Folder written by `moeplan data prepare` that the plan trains on (`moeplan run` takes it)");
}

int run_search(const Search& c) {
  try {
    const planner::SearchReport report = planner::search_and_report(
        c.request, c.report, c.command, [](const std::string& text) { std::fputs(text.c_str(), stdout); });
    std::fputs(report.err.c_str(), stderr);
    return report.exit_code;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  }
}

}  // namespace

Command add_search_command(CLI::App& app, const Invocation& invocation) {
  auto search = std::make_shared<Search>();
  search->command = invocation.text();
  CLI::App* cmd = app.add_subcommand("search", "Search parallel configurations and write the best as a plan");
  add_setting_options(*cmd, *search);
  add_layout_options(*cmd, *search);
  add_framework_options(*cmd, *search);
  add_output_options(*cmd, *search);
  return {cmd, [search] { return run_search(*search); }};
}

}  // namespace moeplan::cli
