// moeplan: plan, simulate and run Mixture-of-Experts pretraining.
// Composition root: parse the command line and hand over to a subcommand.

#include <CLI/CLI.hpp>

#include <map>

#include "commands.h"
#include "moeplan/validation/compare_profiles.h"
#include "moeplan/validation/published.h"
#include "moeplan/validation/validate.h"

namespace {

std::string command_line(int argc, char** argv) {
  std::string text = "moeplan";
  for (int i = 1; i < argc; ++i) {
    text += ' ';
    text += argv[i];
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moeplan::cli;
  namespace validation = moeplan::validation;
  CLI::App app{"moeplan: plan, simulate and run Mixture-of-Experts pretraining"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MOEPLAN_VERSION);

  SearchArgs search;
  search.command = command_line(argc, argv);
  CLI::App* search_cmd = app.add_subcommand("search", "Search parallel configurations and write the best as a plan");
  search_cmd->add_option("--gpus", search.gpus,
                         "Number of GPUs (ranks), or a range A:B of cluster sizes to search (whole nodes)")
      ->required();
  search_cmd->add_option("--train-tokens", search.train_tokens,
                         "Tokens to train (e.g. 1T, 300B, 2.5e12): prints each plan's days and dollars")
      ->transform(CLI::AsNumberWithUnit(std::map<std::string, double>{{"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"T", 1e12}},
                                        CLI::AsNumberWithUnit::CASE_SENSITIVE))
      ->check(CLI::Range(0.0, 1e18));
  search_cmd->add_option("--objective", search.objective,
                         "What ranks the cluster sizes of a --gpus range: time, cost or tokens-per-dollar")
      ->capture_default_str()->check(CLI::IsMember({"time", "cost", "tokens-per-dollar"}));
  search_cmd->add_option("--deadline-days", search.deadline_days,
                         "With --train-tokens: only cluster sizes that train them within this many days")
      ->check(CLI::Range(0.0, 1e6));
  search_cmd->add_option("--restart-minutes", search.restart_minutes,
                         "Minutes a restart after a node failure takes (detect, replace, reload)")
      ->capture_default_str()->check(CLI::Range(0.0, 1e5));
  search_cmd->add_option("--instance", search.instance, "Hardware profile name or .json file")->capture_default_str();
  search_cmd->add_option("--model", search.model, "Model profile name, or a profile or Hugging Face config.json file")
      ->capture_default_str();
  search_cmd->add_option("--profiles", search.profiles, "Folder with hardware/ and models/ profiles");
  search_cmd->add_option("--seq-len", search.seq_len, "Sequence length (block size)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  search_cmd->add_option("--global-batch-tokens", search.global_batch_tokens,
                         "Tokens per optimizer step (default: 4Mi rounded up to gpus x seq-len)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  search_cmd->add_option("--precision", search.precision,
                         "bf16 (parameters and moments too), mixed (fp32 parameters, bf16 compute) or fp32 "
                         "(default: mixed for megatron, smp and torchtitan, whose bf16 training keeps fp32 "
                         "parameters; bf16 otherwise)")
      ->check(CLI::IsMember({"bf16", "mixed", "fp32"}));
  search_cmd->add_option("--steps", search.steps, "Training steps (the length of the learning-rate schedule)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  search_cmd->add_option("--learning-rate", search.learning_rate, "Peak learning rate")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  search_cmd->add_option("--min-learning-rate", search.min_learning_rate, "Learning rate at the end of the cosine decay")
      ->capture_default_str()->check(CLI::Range(0.0, 10.0));
  search_cmd->add_option("--warmup-steps", search.warmup_steps, "Linear warmup steps")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  search_cmd->add_option("--expert-parallel-degree", search.expert_parallel_degree, "Fix E instead of searching it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--hybrid-shard-degree", search.hybrid_shard_degree, "Fix S instead of searching it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--tensor-parallel-degree", search.tensor_parallel_degree, "Fix T instead of searching it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--pipeline-parallel-degree", search.pipeline_parallel_degree,
                         "Fix P instead of searching it")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--virtual-pipeline-degree", search.virtual_pipeline_degree,
                         "Fix the interleaved chunks per pipeline stage (1: plain 1F1B)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--sequence-parallel", search.sequence_parallel, "Fix sequence parallelism (with T > 1)")
      ->check(CLI::IsMember({"on", "off"}));
  search_cmd->add_option("--placement", search.placement,
                         "Fix the placement: R, S, E (and P, T) outermost first, e.g. RSE or PRSET; SMP's "
                         "cluster, spread or D/P/T letters");
  search_cmd->add_option("--target", search.target,
                         "Where the plan trains, and so which layouts are searched: moeplan (what `moeplan run` "
                         "trains), megatron (Megatron-LM), smp (SageMaker model parallelism v2), torchtitan, or any "
                         "(every layout moeplan models); `moeplan export-launch` writes the other frameworks' files")
      ->capture_default_str()->check(CLI::IsMember({"moeplan", "megatron", "smp", "torchtitan", "any"}));
  search_cmd->add_option("--checkpointing", search.checkpointing,
                         "Fix activation checkpointing (selective: the MoE sub-block; attention_core: Megatron's "
                         "selective recomputation)")
      ->check(CLI::IsMember({"none", "selective", "full", "attention_core"}));
  search_cmd->add_option("--distributed-optimizer", search.distributed_optimizer,
                         "Fix the distributed optimizer (states sharded over the replicas, ZeRO-1)")
      ->check(CLI::IsMember({"on", "off"}));
  search_cmd->add_option("--first-stage-layers", search.first_stage_layers, "Fix the blocks of the first pipeline stage")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--last-stage-layers", search.last_stage_layers, "Fix the blocks of the last pipeline stage")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_flag("--fp8", search.fp8, "FP8 GEMMs (Transformer Engine's recipe; GPUs with FP8 tensor cores)");
  search_cmd->add_option("--gradients", search.gradients,
                         "Mixed precision's gradients: fp32 or bf16 (default: bf16 for smp, whose FSDP reduces in "
                         "bf16; fp32 otherwise)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  search_cmd->add_option("--load-balancing", search.load_balancing,
                         "The router's load balancing: sinkhorn, balanced, aux_loss or none (default: aux_loss for "
                         "megatron and torchtitan, sinkhorn, SMP's default, otherwise)")
      ->check(CLI::IsMember({"sinkhorn", "balanced", "aux_loss", "none"}));
  search_cmd->add_option("--kernels", search.kernels, "What the framework runs: fused or eager (default: the profile's)")
      ->check(CLI::IsMember({"fused", "eager"}));
  search_cmd->add_option("--attention", search.attention, "Attention kernel: flash or unfused (default: the profile's)")
      ->check(CLI::IsMember({"flash", "unfused"}));
  search_cmd->add_option("--offload", search.offloading, "Fix activation offloading")->check(CLI::IsMember({"on", "off"}));
  search_cmd->add_option("--loading-horizon", search.loading_horizon, "Fix the offload loading horizon")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 10));
  search_cmd->add_option("--micro-batch", search.micro_batch_size, "Fix the micro-batch size")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  search_cmd->add_option("--expert-load-imbalance", search.expert_load_imbalance,
                         "Tokens of the busiest expert over the mean")
      ->capture_default_str()->check(CLI::Range(1.0, 1e6));
  search_cmd->add_option("--tokens-per-expert", search.tokens_per_expert,
                         "Token counts per expert, e.g. measured (comma-separated); overrides the imbalance")
      ->delimiter(',')->check(CLI::Range(0.0, 1e18));
  search_cmd->add_option("--max-micro-batch", search.max_micro_batch, "Largest micro-batch size tried")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  search_cmd->add_option("--top", search.top, "Candidates shown")->capture_default_str()->check(CLI::Range(1, 1000));
  search_cmd->add_option("--estimator", search.estimator, "Rank by the step simulator or the analytic estimate")
      ->capture_default_str()->check(CLI::IsMember({"simulator", "analytic"}));
  search_cmd->add_flag("--explain", search.explain, "Show how many candidates each rule or limit removed");
  search_cmd->add_flag("--json", search.json, "Print the plan as JSON instead of the table");
  search_cmd->add_option("--out", search.out, "Plan file to write (empty: none)")->capture_default_str();
  search_cmd->add_option("--data", search.data,
                         "Folder written by `moeplan data prepare` that the plan trains on (`moeplan run` takes it)");

  CheckArgs check;
  CLI::App* check_cmd = app.add_subcommand("check", "Validate a plan file and report every problem");
  check_cmd->add_option("plan", check.plan, "plan.json")->required();

  SimulateArgs simulate;
  ExportLaunchArgs launch_args;
  CLI::App* launch_cmd = app.add_subcommand(
      "export-launch", "Write the files that launch a plan in SMP, Megatron-LM or torchtitan");
  launch_cmd->add_option("plan", launch_args.plan, "plan.json")->required();
  launch_cmd->add_option("--to", launch_args.to, "The framework: smp, megatron or torchtitan")
      ->required()->check(CLI::IsMember({"smp", "megatron", "torchtitan"}));
  launch_cmd->add_option("--out", launch_args.out, "Folder for the files")->capture_default_str();

  CompareLogArgs compare_log;
  CLI::App* compare_log_cmd = app.add_subcommand(
      "compare", "Put a plan's prediction beside a run's log from Megatron-LM, torchtitan or SMP's script");
  compare_log_cmd->add_option("plan", compare_log.plan, "plan.json")->required();
  compare_log_cmd->add_option("--log", compare_log.log, "The run's log (its per-iteration lines)")->required();
  compare_log_cmd->add_option("--skip-iterations", compare_log.skip, "Logged iterations left out at the start")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 30));

  CLI::App* simulate_cmd = app.add_subcommand("simulate", "Simulate one training step of a plan");
  simulate_cmd->add_option("plan", simulate.plan, "plan.json")->required();
  simulate_cmd->add_option("--trace", simulate.trace, "Write the step as a Chrome trace (Perfetto, chrome://tracing)");
  simulate_cmd->add_flag("--all-ranks", simulate.all_ranks, "Simulate every rank, not one node");
  simulate_cmd->add_flag("--all-micro-batches", simulate.all_micro_batches, "Simulate every micro-batch, not two");
  simulate_cmd->add_option("--measured", simulate.measured,
                           "A run's report.json: simulate with its measured expert load and compare phase by phase");

  CLI::App* data_cmd = app.add_subcommand("data", "Prepare training data: `moeplan data prepare --help`");
  data_cmd->prefix_command();  // everything after `data` goes to moeplan-data

  CLI::App* view_cmd = app.add_subcommand(
      "view", "Show a step's timeline, simulated and measured (`moeplan view trace.json [measured.json] [--png F]`)");
  view_cmd->prefix_command();  // everything after `view` goes to moeplan-view

  RunArgs run;
  CLI::App* run_cmd = app.add_subcommand("run", "Train with a plan and compare with its prediction");
  run_cmd->add_option("plan", run.plan, "plan.json")->required();
  run_cmd->add_option("--data", run.data,
                      "Folder written by `moeplan data prepare` (default: the plan's training.data)");
  run_cmd->add_option("--out", run.out, "Run folder: metrics.jsonl, checkpoints/")->capture_default_str();
  run_cmd->add_option("--steps", run.steps, "Stop after this step (default: the plan's training.steps)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  CLI::Option* every = run_cmd->add_option("--checkpoint-every", run.checkpoint_every, "Save a checkpoint every N steps and at the end")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  CLI::Option* resume = run_cmd->add_flag("--resume", run.resume, "Continue from the newest complete checkpoint in --out");
  CLI::Option* init_from = run_cmd->add_option("--init-from", run.init_from,
                      "Start from a Hugging Face Mixtral folder (config.json + safetensors) instead of random weights");
  CLI::Option* rehearse = run_cmd->add_flag("--rehearse", run.rehearse,
                    "Rehearse the plan's layout on local CPU ranks with the model shrunk, against one rank, and "
                    "give a verdict (--out is the rehearsal's folder)");
  rehearse->excludes(every)->excludes(resume)->excludes(init_from);
  run_cmd->add_option("--shrink-width", run.shrink_width, "With --rehearse: divide hidden and intermediate sizes by this")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->needs(rehearse);
  run_cmd->add_option("--shrink-layers", run.shrink_layers,
                      "With --rehearse: layers kept (rounded up to a multiple of the pipeline's chunks)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->needs(rehearse);
  run_cmd->add_option("--shrink-micro-batches", run.shrink_micro_batches,
                      "With --rehearse: micro-batches a step at most (0: the plan's)")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 20))->needs(rehearse);
  // A rehearsal's child runs (docs/executor.md, "Rehearsal"): the rehearsal passes these; hidden.
  run_cmd->add_option("--record-routing", run.record_routing, "Record every layer's routing into this folder")
      ->group("")->excludes(rehearse);
  run_cmd->add_option("--replay-routing", run.replay_routing, "Route as the record in this folder says (one rank)")
      ->group("")->excludes(rehearse);
  run_cmd->add_option("--planted-fault", run.planted_fault, "A rehearsal's test hook (MOEPLAN_REHEARSAL_FAULT)")
      ->group("");
  run_cmd->add_option("--threads", run.threads, "Intra-op threads per rank (default: 1)")->check(CLI::Range(1, 1024));
  run_cmd->add_option("--timeout", run.timeout_seconds, "Seconds a collective may wait for a peer")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{3600}));
  run_cmd->add_option("--grace-seconds", run.grace_seconds,
                      "After SIGTERM or SIGINT: seconds to end the step in flight, save and exit (SLURM's KillWait)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400}))
      ->excludes(rehearse);
  run_cmd->add_option("--max-nonfinite-steps", run.max_nonfinite_steps,
                      "Steps in a row with a NaN or Inf loss or gradient that are skipped before the run stops")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->excludes(rehearse);
  run_cmd->add_option("--stop-after", run.stop_after,
                      "Time limit (3600, 45m, 4h, 1h30m, HH:MM:SS): stop, saved, before a step would pass it")
      ->excludes(rehearse);

  CalibrateArgs calibrate;
  calibrate.command = command_line(argc, argv);
  CLI::App* calibrate_cmd =
      app.add_subcommand("calibrate", "Measure this machine as a cluster of CPU ranks (or its GPU, with a GPU "
                                         "profile as --base) and write a hardware profile");
  calibrate_cmd->add_option("--ranks", calibrate.ranks, "Ranks (processes) measured together")
      ->capture_default_str()->check(CLI::Range(1, 64));
  calibrate_cmd->add_option("--model", calibrate.model, "Model whose shapes are measured (profile name or file)")
      ->capture_default_str();
  calibrate_cmd->add_option("--base", calibrate.base, "Hardware profile whose other numbers are kept")
      ->capture_default_str();
  calibrate_cmd->add_option("--profiles", calibrate.profiles, "Folder with hardware/ and models/ profiles");
  calibrate_cmd->add_option("--name", calibrate.name, "Name of the new profile (default: local-<host name>)");
  calibrate_cmd->add_option("--out", calibrate.out, "Profile file to write (default: <name>.json)");
  calibrate_cmd->add_option("--seq-len", calibrate.seq_len, "Sequence length measured")
      ->capture_default_str()->check(CLI::Range(2, 1 << 16));
  calibrate_cmd->add_option("--precision", calibrate.precision, "bf16, mixed or fp32")
      ->capture_default_str()->check(CLI::IsMember({"bf16", "mixed", "fp32"}));
  calibrate_cmd->add_option("--load-balancing", calibrate.load_balancing, "Routing measured")
      ->capture_default_str()->check(CLI::IsMember({"sinkhorn", "balanced", "aux_loss", "none"}));
  calibrate_cmd->add_option("--max-micro-batch", calibrate.max_micro_batch, "Largest micro-batch measured")
      ->capture_default_str()->check(CLI::Range(1, 256));
  calibrate_cmd->add_flag("--quick", calibrate.quick, "Fewer sizes and repeats");
  calibrate_cmd->add_option("--passes", calibrate.passes,
                            "Measure every figure this many times over the calibration and keep the lower quartile "
                            "(default 5, 1 with --quick)")
      ->check(CLI::Range(1, 20));
  calibrate_cmd->add_option("--timeout", calibrate.timeout_seconds, "Seconds a collective may wait for a peer")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{3600}));

  validation::ValidateOptions validate;
  CLI::App* validate_cmd =
      app.add_subcommand("validate", "Plan, run and compare a matrix of configurations: how right are the predictions?");
  validate_cmd->add_option("--profile", validate.profile, "Hardware profile file (from moeplan calibrate)")->required();
  validate_cmd->add_option("--model", validate.model, "Model profile name or file")->capture_default_str();
  validate_cmd->add_option("--profiles", validate.profiles, "Folder with hardware/ and models/ profiles");
  validate_cmd->add_option("--data", validate.data, "Folder written by `moeplan data prepare`")->required();
  validate_cmd->add_option("--out", validate.out, "Folder for the runs, the table and the plot")->capture_default_str();
  validate_cmd->add_option("--ranks", validate.ranks, "Ranks per run (default: the profile's gpus_per_node)")
      ->check(CLI::Range(1, 64));
  validate_cmd->add_option("--steps", validate.steps, "Training steps per run (the first is not timed)")
      ->capture_default_str()->check(CLI::Range(2, 10000));
  validate_cmd->add_option("--seq-len", validate.seq_len, "Sequence length")->capture_default_str()->check(CLI::Range(2, 1 << 16));
  validate_cmd->add_option("--global-batch-tokens", validate.global_batch_tokens, "Tokens per step")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  validate_cmd->add_option("--precision", validate.precision, "bf16, mixed or fp32")
      ->capture_default_str()->check(CLI::IsMember({"bf16", "mixed", "fp32"}));
  validate_cmd->add_flag("--quick", validate.quick, "The reduced matrix (four configurations of experts, shards and replicas, a tensor split, a pipeline)");
  validate_cmd->add_option("--rounds", validate.rounds,
                           "Runs of every configuration, the matrix in alternating order; the fastest counts "
                           "(default 3, 1 with --quick)")
      ->check(CLI::Range(int64_t{1}, int64_t{100}));
  validate_cmd->add_flag("--check", validate.check, "Exit 1 when an error bound below is broken");
  validate_cmd->add_option("--max-median-error", validate.max_median_error, "Bound on the median |step-time error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  validate_cmd->add_option("--max-worst-error", validate.max_worst_error, "Bound on the worst |step-time error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  validate_cmd->add_option("--max-memory-error", validate.max_memory_error, "Bound on the worst |peak-memory error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  validate_cmd->add_option("--min-kendall", validate.min_kendall, "Least Kendall tau of predicted vs measured order")
      ->capture_default_str()->check(CLI::Range(-1.0, 1.0));

  ExportArgs export_args;
  CLI::App* export_cmd =
      app.add_subcommand("export", "Write a checkpoint as a Hugging Face folder (config.json + safetensors shards)");
  export_cmd->add_option("checkpoint", export_args.checkpoint, "Step folder, checkpoints folder or run folder")
      ->required();
  export_cmd->add_option("--hf", export_args.hf, "Output folder")->required();
  export_cmd->add_option("--max-shard-bytes", export_args.max_shard_bytes, "Largest shard file")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 50));

  validation::ComparePublishedOptions published;
  CLI::App* published_cmd = app.add_subcommand(
      "compare-published", "moeplan's predictions for published training runs in their own layouts, beside the published step");
  published_cmd->add_option("cases", published.cases, "Cases file (e.g. docs/validation/published/cases.json)")->required();
  published_cmd->add_option("--profiles", published.profiles, "Folder with hardware/ and models/ profiles");
  published_cmd->add_flag("--check", published.check, "Exit 1 when an error bound is broken or a case has no plan");
  published_cmd->add_option("--max-median-error", published.max_median_error, "Largest median |step error|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  published_cmd->add_option("--max-worst-error", published.max_worst_error, "Largest |step error| of any case")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));
  published_cmd->add_option("--fit", published.fit,
                            "Fit these kernel-model numbers per chip on the cases of the fit part (matmul_peak_efficiency, "
                            "fp8_matmul_peak_efficiency, memory_bound_efficiency, flash_attention_efficiency, "
                            "kernel_overhead_s, overlap_slowdown), then predict every case with them")
      ->delimiter(',')
      ->check(CLI::IsMember({"matmul_peak_efficiency", "fp8_matmul_peak_efficiency", "memory_bound_efficiency",
                             "flash_attention_efficiency", "kernel_overhead_s", "overlap_slowdown"}));
  published_cmd->add_option("--max-mean-error", published.max_mean_error,
                            "Largest |mean signed step error| (the bias)")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));

  validation::CompareProfilesOptions compare;
  CLI::App* compare_cmd = app.add_subcommand(
      "compare-profiles", "How far apart two hardware profiles are: figure by figure, and in predicted step times");
  compare_cmd->add_option("first", compare.first, "Hardware profile file")->required();
  compare_cmd->add_option("second", compare.second, "Hardware profile file compared with the first")->required();
  compare_cmd->add_option("--model", compare.model, "Model of the validation matrix")->capture_default_str();
  compare_cmd->add_option("--profiles", compare.profiles, "Folder with hardware/ and models/ profiles");
  compare_cmd->add_option("--ranks", compare.ranks, "Ranks (default: the first profile's gpus_per_node)")
      ->check(CLI::Range(1, 64));
  compare_cmd->add_option("--seq-len", compare.seq_len, "Sequence length")->capture_default_str()->check(CLI::Range(2, 1 << 16));
  compare_cmd->add_option("--global-batch-tokens", compare.global_batch_tokens, "Tokens per step")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  compare_cmd->add_option("--precision", compare.precision, "bf16, mixed or fp32")
      ->capture_default_str()->check(CLI::IsMember({"bf16", "mixed", "fp32"}));
  compare_cmd->add_flag("--quick", compare.quick, "The reduced matrix (as validate --quick)");
  compare_cmd->add_option("--top", compare.top, "Figures listed, the most different first")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{10000}));
  compare_cmd->add_option("--out", compare.out, "Folder for the plans (default: a temporary one, removed)");
  compare_cmd->add_flag("--check", compare.check, "Exit 1 when a predicted step time differs by more than the bound");
  compare_cmd->add_option("--max-difference", compare.max_difference, "Bound on |predicted step time difference|")
      ->capture_default_str()->check(CLI::Range(0.0, 100.0));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints help with exit 0 and errors with its own code; keep bad input at 2.
    const int code = app.exit(e);
    return code == 0 ? moeplan::kExitOk : moeplan::kExitBadInput;
  }
  if (search_cmd->parsed()) return run_search(search);
  if (check_cmd->parsed()) return run_check(check);
  if (launch_cmd->parsed()) return run_export_launch(launch_args);
  if (compare_log_cmd->parsed()) return run_compare_log(compare_log);
  if (simulate_cmd->parsed()) return run_simulate(simulate);
  if (data_cmd->parsed()) return run_data(data_cmd->remaining(), argv[0]);
  if (view_cmd->parsed()) return run_view(view_cmd->remaining(), argv[0]);
  if (validate_cmd->parsed()) return validation::run_validation(validate);
  if (compare_cmd->parsed()) return validation::compare_profiles(compare);
  if (published_cmd->parsed()) return validation::compare_published(published);
  if (export_cmd->parsed()) return run_export(export_args);
  if (calibrate_cmd->parsed()) {
    calibrate.argv.assign(argv, argv + argc);
    return run_calibrate(calibrate);
  }
  if (run_cmd->parsed()) {
    run.argv.assign(argv, argv + argc);
    return run_run(run);
  }
  return moeplan::kExitBadInput;
}
