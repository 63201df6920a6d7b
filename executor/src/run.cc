#include "moeplan/executor/run.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/rules.h"
#include "moeplan/executor/device.h"
#include "moeplan/executor/runtime.h"
#include "moeplan/executor/tokens.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

std::string to_json_line(const StepRecord& r) {
  Json j;
  j["step"] = r.step;
  j["loss"] = r.loss;
  j["aux_loss"] = r.aux_loss;
  j["z_loss"] = r.z_loss;
  j["total_loss"] = r.total_loss;
  j["lr"] = r.learning_rate;
  j["grad_norm"] = r.grad_norm;
  j["tokens"] = r.tokens;
  j["step_s"] = r.seconds;
  j["tokens_per_s"] = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0;
  j["tokens_per_expert"] = r.tokens_per_expert;
  return j.dump();
}

void check_run_inputs(const Plan& plan, const TokenDataset& data, const RunOptions& o, Diagnostics& d) {
  // Every rule of the plan, the executor's own (what it trains) among them: the same rules the
  // search applies for `--target moeplan`, so that it never writes a plan this refuses.
  RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  config.target = Target::kMoeplan;
  for (const Violation& v : validate(config)) d.error(v.field, v.message);
  if (data.vocab_size() != plan.model.vocab_size)
    d.error("model.vocab_size", std::to_string(plan.model.vocab_size) + " does not match the tokenizer of " +
                                    data.dir() + " (" + std::to_string(data.vocab_size()) + " pieces)");
  if (data.block_size() != plan.training.seq_len)
    d.error("training.seq_len", std::to_string(plan.training.seq_len) + " does not match the block size of " +
                                    data.dir() + " (" + std::to_string(data.block_size()) + ")");
  if (o.stop_after_step < 0 || o.stop_after_step > plan.training.steps)
    d.error("--steps", std::to_string(o.stop_after_step) + " is outside 1.." + std::to_string(plan.training.steps) +
                           " (training.steps of the plan)");
  if (o.checkpoint_every < 0) d.error("--checkpoint-every", "must not be negative");
}

std::vector<Json> read_metrics(const std::string& run_dir) {
  std::vector<Json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(Json::parse(line));
  return lines;
}

void truncate_metrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error&) {
      break;  // a line cut by a crash ends the usable part
    }
    if (!j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() > last_step) break;
    kept += line + '\n';
  }
  write_file_atomic(path, kept);
}

Json CheckpointState::to_json(const Plan& plan, const TokenDataset& data) const {
  Json state;
  state["samples_consumed"] = samples_consumed;
  state["optimizer_step"] = optimizer_step;
  state["precision"] = name_of(kPrecisionNames, plan.training.precision);
  state["seed"] = plan.training.seed;
  state["model"] = moeplan::to_json(plan.model);
  state["parallel"] = moeplan::to_json(plan.parallel);
  state["data"] = {{"dir", data.dir()}, {"blocks", data.num_blocks()}, {"block_size", data.block_size()}};
  return state;
}

CheckpointState CheckpointState::read(const Plan& plan, const Json& s, Diagnostics& d) {
  CheckpointState state;
  if (!s.is_object() || !s.contains("model") || s["model"] != moeplan::to_json(plan.model))
    d.error("state.model", "the checkpoint's model differs from the plan's model");
  if (!s.is_object() || !s.contains("precision") || s["precision"] != name_of(kPrecisionNames, plan.training.precision))
    d.error("state.precision", "the checkpoint was saved with another precision");
  if (!s.is_object() || !s.contains("samples_consumed") || !s["samples_consumed"].is_number_integer())
    d.error("state.samples_consumed", "missing");
  else
    state.samples_consumed = s["samples_consumed"].get<int64_t>();
  if (!s.is_object() || !s.contains("optimizer_step") || !s["optimizer_step"].is_number_integer())
    d.error("state.optimizer_step", "missing");
  else
    state.optimizer_step = s["optimizer_step"].get<int64_t>();
  return state;
}

std::string prepare_run_folder(const RunOptions& o) {
  fs::create_directories(o.out_dir);
  const std::string checkpoints = o.out_dir + "/checkpoints";
  if (o.resume) {
    const std::string from = latest_checkpoint(checkpoints);
    if (from.empty()) throw InputError("--resume", {{"", "no complete checkpoint in " + checkpoints}});
    return from;
  }
  if (fs::exists(o.out_dir + "/metrics.jsonl") || !latest_checkpoint(checkpoints).empty())
    throw InputError("--out", {{"", o.out_dir + " already holds a run; pass --resume to continue it or choose another folder"}});
  return "";
}

namespace {

std::string format_progress(const StepRecord& r, int64_t last_step) {
  char line[200];
  std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  %.3f s",
                static_cast<long long>(r.step), static_cast<long long>(last_step), r.loss, r.learning_rate,
                r.grad_norm, r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, r.seconds);
  return line;
}

// Where the run starts: a checkpoint of any layout, a Hugging Face model, or the plan's
// initialisation. Returns the samples the world has consumed.
int64_t start(const Plan& plan, const RunOptions& o, StepTrainer& trainer, const RunRank& me,
              const std::string& resume_from) {
  const bool leader = me.rank == 0;
  if (!resume_from.empty()) {
    const LoadedCheckpoint c = open_checkpoint(resume_from);
    Diagnostics d;
    const CheckpointState state = CheckpointState::read(plan, c.state, d);
    if (c.files.empty()) d.error("files", "the checkpoint lists no shard");
    d.throw_if_any(resume_from + "/manifest.json");
    SlicedState sliced;
    for (const CheckpointFile& f : c.files) sliced.add(read_checkpoint_shard(c, f.name).tensors);
    trainer.load_state(sliced, c.step, state.optimizer_step, d);
    d.throw_if_any(resume_from);
    if (leader) {
      truncate_metrics(o.out_dir + "/metrics.jsonl", trainer.step_count());
      if (o.progress) *o.progress << "resumed from " << resume_from << " at step " << c.step << "\n";
    }
    return state.samples_consumed;
  }
  if (!o.init_from.empty()) {
    trainer.load_hugging_face(o.init_from);
    if (leader && o.progress) *o.progress << "started from the Hugging Face model in " << o.init_from << "\n";
  }
  return 0;
}

// Every rank writes its shard into the step's folder; rank 0 prepares the folder first and
// commits the manifest (with the run's state) after all have written. Returns the folder.
std::string save(const Plan& plan, const RunOptions& o, const TokenDataset& data, const StepTrainer& trainer,
                 const RunRank& me, const CheckpointState& state) {
  const bool leader = me.rank == 0;
  const std::string checkpoints = o.out_dir + "/checkpoints";
  if (leader) begin_checkpoint(checkpoints, trainer.step_count());  // unpublishes an older save of this step
  me.barrier();
  const std::string dir = step_folder(checkpoints, trainer.step_count());
  const NamedTensors mine = trainer.state();
  if (!mine.empty()) write_checkpoint_shard(dir, me.rank, mine);
  me.barrier();
  if (leader) {
    std::vector<CheckpointFile> files;
    for (int64_t rank = 0; rank < me.world_size; ++rank) {
      char name[40];
      std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
      const std::string path = dir + "/" + name;
      if (fs::exists(path)) files.push_back({name, static_cast<int64_t>(fs::file_size(path)), crc32_file(path)});
    }
    commit_checkpoint(dir, trainer.step_count(), state.to_json(plan, data), files);
    if (o.progress) *o.progress << "saved " << dir << std::endl;
  }
  me.barrier();
  return dir;
}

// The measured trace of the last step and the report: every rank hands rank 0 its part.
std::optional<RunReport> report(const Plan& plan, const RunOptions& o, const RunRank& me, const RankMeasurement& mine,
                                const std::vector<StepRecord>& steps) {
  std::vector<RankMeasurement> ranks{mine};
  if (me.world_size > 1) {
    const auto part = [&](int64_t rank) { return o.out_dir + "/.trace-rank-" + std::to_string(rank) + ".json"; };
    write_file_atomic(part(me.rank), to_json(mine).dump());
    me.barrier();
    ranks.clear();
    if (me.rank == 0)
      for (int64_t rank = 0; rank < me.world_size; ++rank) {
        ranks.push_back(rank_measurement_from_json(read_json_file(part(rank)), part(rank)));
        fs::remove(part(rank));
      }
  }
  std::optional<RunReport> out;
  if (me.rank == 0 && !steps.empty()) out = write_run_outputs(plan, o.out_dir, steps, ranks, me.where);
  me.barrier();
  return out;
}

}  // namespace

RunResult run_steps(const Plan& plan, const RunOptions& o, const TokenDataset& data, StepTrainer& trainer,
                    const RunRank& me, const std::string& resume_from, int64_t baseline_rss_bytes) {
  const bool leader = me.rank == 0;
  CheckpointState state;
  state.samples_consumed = start(plan, o, trainer, me, resume_from);
  const int64_t last_step = o.stop_after_step > 0 ? o.stop_after_step : plan.training.steps;
  RunResult result;
  result.first_step = trainer.step_count() + 1;
  std::ofstream metrics;
  if (leader) {
    metrics.open(o.out_dir + "/metrics.jsonl", std::ios::app);
    if (!metrics) throw InputError(o.out_dir + "/metrics.jsonl", {{"", "cannot write"}});
  }
  const int64_t ga = plan.parallel.gradient_accumulation_steps, mbs = plan.parallel.micro_batch_size;
  BlockOrder order(data.num_blocks(), static_cast<uint64_t>(plan.training.seed));
  StepPeaks peaks;
  reset_device_peaks(me.device);
  int64_t busiest_rows = 0;
  while (trainer.step_count() < last_step) {
    // Reader r's micro-batch m holds what a one-rank run with r * ga + m micro-batches before
    // it would train on (the ranks of a tensor-parallel group read the same ones).
    std::vector<torch::Tensor> micro_batches;
    for (int64_t m = 0; m < ga; ++m) {
      std::vector<int64_t> blocks;
      for (int64_t i = 0; i < mbs; ++i)
        blocks.push_back(order.block_of(state.samples_consumed + (me.reader * ga + m) * mbs + i));
      micro_batches.push_back(data.blocks(blocks));
    }
    state.samples_consumed += me.readers * ga * mbs;
    peaks.begin_step();
    StepRecord r = trainer.step(micro_batches);
    peaks.end_step();
    state.optimizer_step = r.step;
    busiest_rows = std::max(busiest_rows, trainer.take_busiest_expert_rows());
    if (leader) {
      metrics << to_json_line(r) << '\n' << std::flush;
      if (o.progress) *o.progress << format_progress(r, last_step) << std::endl;
    }
    if (o.checkpoint_every > 0 && (r.step % o.checkpoint_every == 0 || r.step == last_step))
      result.last_checkpoint = save(plan, o, data, trainer, me, state);
    result.steps.push_back(std::move(r));
  }
  result.last_step = trainer.step_count();
  result.peak_rss_bytes = peak_rss_bytes();
  RankMeasurement m;
  m.rank = me.rank;
  m.peak_rss_bytes = result.peak_rss_bytes;
  m.baseline_rss_bytes = baseline_rss_bytes;
  m.peak_tensor_bytes = peaks.whole_run();
  m.peak_step_tensor_bytes = peaks.steps();
  m.busiest_expert_rows = busiest_rows;
  const DeviceMemory device = device_memory(me.device);
  m.peak_device_allocated_bytes = device.peak_allocated;
  m.peak_device_reserved_bytes = device.peak_reserved;
  m.baseline_device_bytes = me.baseline_device_bytes;
  m.events = trainer.clock().events();
  m.memory = trainer.clock().memory();
  result.report = report(plan, o, me, m, result.steps);
  return result;
}

}  // namespace moeplan::executor
