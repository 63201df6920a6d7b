// `moeplan run plan.json`: train with a plan (or rehearse its layout) and compare with its
// prediction; the work is the executor's (executor_commands.h).
#include <memory>

#include "command.h"
#include "executor_commands.h"

namespace moeplan::cli {

namespace {

// How long the run may take, and what ends it early.
void add_limit_options(CLI::App& cmd, RunArgs& run, CLI::Option* rehearse) {
  cmd.add_option("--threads", run.threads, "Intra-op threads per rank (default: 1)")->check(CLI::Range(1, 1024));
  cmd.add_option("--timeout", run.timeout_seconds, "Seconds a collective may wait for a peer")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{3600}));
  cmd.add_option("--grace-seconds", run.grace_seconds,
                 "After SIGTERM or SIGINT: seconds to end the step in flight, save and exit (SLURM's KillWait)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400}))
      ->excludes(rehearse);
  cmd.add_option("--max-nonfinite-steps", run.max_nonfinite_steps,
                 "Steps in a row with a NaN or Inf loss or gradient that are skipped before the run stops")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->excludes(rehearse);
  cmd.add_option("--kernel-trace", run.kernel_trace_step,
                 "Record step N's operators and GPU kernels (PyTorch's profiler) into OUT/kernels-rank-R.json, "
                 "a Chrome trace")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->excludes(rehearse);
  cmd.add_option("--stop-after", run.stop_after,
                 "Time limit (3600, 45m, 4h, 1h30m, HH:MM:SS): stop, saved, before a step would pass it")
      ->excludes(rehearse);
}

}  // namespace

Command add_run_command(CLI::App& app, const Invocation& invocation) {
  auto run = std::make_shared<RunArgs>();
  run->argv = invocation.words();
  CLI::App* cmd = app.add_subcommand("run", "Train with a plan and compare with its prediction");
  cmd->add_option("plan", run->plan, "plan.json")->required();
  cmd->add_option("--data", run->data, "Folder written by `moeplan data prepare` (default: the plan's training.data)");
  cmd->add_option("--out", run->out, "Run folder: metrics.jsonl, checkpoints/")->capture_default_str();
  cmd->add_option("--steps", run->steps, "Stop after this step (default: the plan's training.steps)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  CLI::Option* every = cmd->add_option("--checkpoint-every", run->checkpoint_every,
                                       "Save a checkpoint every N steps and at the end")
                           ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  CLI::Option* resume =
      cmd->add_flag("--resume", run->resume, "Continue from the newest complete checkpoint in --out");
  CLI::Option* init_from = cmd->add_option(
      "--init-from", run->init_from,
      "Start from a Hugging Face Mixtral folder (config.json + safetensors) instead of random weights");
  CLI::Option* rehearse = cmd->add_flag("--rehearse", run->rehearse,
                                        "Rehearse the plan's layout on local CPU ranks with the model shrunk, against "
                                        "one rank, and give a verdict (--out is the rehearsal's folder)");
  rehearse->excludes(every)->excludes(resume)->excludes(init_from);
  cmd->add_option("--shrink-width", run->shrink.width, "With --rehearse: divide hidden and intermediate sizes by this")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->needs(rehearse);
  cmd->add_option("--shrink-layers", run->shrink.layers,
                  "With --rehearse: layers kept (rounded up to a multiple of the pipeline's chunks)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->needs(rehearse);
  cmd->add_option("--shrink-micro-batches", run->shrink.micro_batches,
                  "With --rehearse: micro-batches a step at most (0: the plan's)")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 20))->needs(rehearse);
  // A rehearsal's child runs (docs/executor.md, "Rehearsal"): the rehearsal passes these; hidden.
  cmd->add_option("--record-routing", run->record_routing, "Record every layer's routing into this folder")
      ->group("")->excludes(rehearse);
  cmd->add_option("--replay-routing", run->replay_routing, "Route as the record in this folder says (one rank)")
      ->group("")->excludes(rehearse);
  cmd->add_option("--planted-fault", run->planted_fault, "A rehearsal's test hook (MOEPLAN_REHEARSAL_FAULT)")
      ->group("");
  add_limit_options(*cmd, *run, rehearse);
  return {cmd, [run] { return run_run(*run); }};
}

}  // namespace moeplan::cli
