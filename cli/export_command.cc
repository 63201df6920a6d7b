// `moeplan export CHECKPOINT --hf DIR`: a checkpoint as a Hugging Face folder; the work is the
// executor's (executor_commands.h).
#include <memory>

#include "command.h"
#include "executor_commands.h"

namespace moeplan::cli {

Command add_export_command(CLI::App& app) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd =
      app.add_subcommand("export", "Write a checkpoint as a Hugging Face folder (config.json + safetensors shards)");
  cmd->add_option("checkpoint", args->checkpoint, "Step folder, checkpoints folder or run folder")->required();
  cmd->add_option("--hf", args->hf, "Output folder")->required();
  cmd->add_option("--max-shard-bytes", args->max_shard_bytes, "Largest shard file")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  return {cmd, [args] { return run_export(*args); }};
}

}  // namespace moeplan::cli
