#include "moeplan/executor/training/run.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/rules.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/ranks/stop.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

void check_run_inputs(const Plan& plan, const TokenDataset& data, const RunOptions& o, Diagnostics& d) {
  // Every rule of the plan, the executor's own (what it trains) among them: the same rules the
  // search applies for `--target moeplan`, so that it never writes a plan this refuses.
  RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  config.target = executor_framework().target;
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
  if (o.planted_fault != RehearsalFault::kNone && o.record_routing.empty())
    d.error("--planted-fault", "is a rehearsal's test hook: only a layout that records its routing for a rehearsal "
                               "(--record-routing) plants a fault");
  if (o.grace_seconds < 1) d.error("--grace-seconds", "must be at least 1");
  if (o.max_nonfinite_steps < 1) d.error("--max-nonfinite-steps", "must be at least 1");
  if (o.stop_after_seconds < 0) d.error("--stop-after", "must not be negative");
}

std::vector<Json> read_metrics(const std::string& run_dir) {
  std::vector<Json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline yet: a line the run is still writing
    if (!line.empty()) lines.push_back(Json::parse(line));
  }
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
  // A metrics file that is there but empty: a run stopped before its first step.
  std::error_code ec;
  const auto metrics_bytes = fs::file_size(o.out_dir + "/metrics.jsonl", ec);
  if ((!ec && metrics_bytes > 0) || !latest_checkpoint(checkpoints).empty())
    throw InputError("--out", {{"", o.out_dir + " already holds a run; pass --resume to continue it or choose another folder"}});
  return "";
}

namespace {

std::string format_progress(const StepRecord& r, int64_t last_step) {
  char line[200];
  std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  %.3f s",
                static_cast<long long>(r.step), static_cast<long long>(last_step), r.loss, r.learning_rate,
                r.grad_norm, r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, r.seconds);
  if (r.skipped) return std::string(line) + "  skipped: NaN or Inf, first in " + r.nonfinite;
  return line;
}

// Where the run starts: a checkpoint of any layout, a Hugging Face model, or the plan's
// initialisation. Returns the samples the world has consumed and the updates applied.
CheckpointState start(const Plan& plan, const RunOptions& o, StepTrainer& trainer, const RunRank& me,
              const std::string& resume_from) {
  const bool leader = me.rank == 0;
  if (!resume_from.empty()) {
    const LoadedCheckpoint c = open_checkpoint(resume_from);
    Diagnostics d;
    const CheckpointState state = CheckpointState::read(plan, c.state, d);
    if (c.files.empty()) d.error("files", "the checkpoint lists no shard");
    d.throw_if_any(resume_from + "/manifest.json");
    // Only what this rank holds is kept ("exp_avg/<name>#cols0:8of16@40" belongs to <name>).
    const std::set<std::string> held = trainer.held_parameters();
    auto held_here = [&held](const std::string& key) {
      const size_t begin = key.find('/') + 1;
      return held.empty() || held.count(key.substr(begin, key.find_first_of("@#", begin) - begin)) != 0;
    };
    SlicedState sliced;
    for (const CheckpointFile& f : c.files) {
      NamedTensors tensors = read_checkpoint_shard(c, f.name).tensors;
      std::erase_if(tensors, [&](const auto& t) { return !held_here(t.first); });
      sliced.add(tensors);
    }
    trainer.load_state(sliced, c.step, state.optimizer_step, d);
    d.throw_if_any(resume_from);
    if (leader) {
      truncate_metrics(o.out_dir + "/metrics.jsonl", trainer.step_count());
      if (o.progress) *o.progress << "resumed from " << resume_from << " at step " << c.step << "\n";
    }
    return state;
  }
  if (!o.init_from.empty()) {
    trainer.load_hugging_face(o.init_from);
    if (leader && o.progress) *o.progress << "started from the Hugging Face model in " << o.init_from << "\n";
  }
  return {};
}

// The ranks whose `failed` is true, on every rank (one collective, so every rank calls it at
// the same point).
std::vector<int64_t> ranks_that_failed(const RunRank& me, bool failed) {
  torch::Tensor votes = torch::zeros({me.world_size}, torch::kLong);
  votes[me.rank] = int64_t{failed};
  me.sum_over_ranks(votes);
  std::vector<int64_t> ranks;
  for (int64_t r = 0; r < me.world_size; ++r)
    if (votes[r].item<int64_t>() != 0) ranks.push_back(r);
  return ranks;
}

// Every rank writes its shard into the step's folder; rank 0 prepares the folder first and
// commits the manifest (with the run's state) after all have written. When a write fails on
// any rank (a full disk, say), the save fails on every rank: each removes what it wrote, rank 0
// removes the step's folder, the older checkpoints stay as they were, and the rank that failed
// names its file. Returns the folder.
std::string save(const Plan& plan, const RunOptions& o, const TokenDataset& data, const StepTrainer& trainer,
                 const RunRank& me, const CheckpointState& state) {
  const bool leader = me.rank == 0;
  const std::string checkpoints = o.out_dir + "/checkpoints";
  const std::string dir = step_folder(checkpoints, trainer.step_count());
  std::exception_ptr failure;
  const auto attempt = [&](auto&& part) {
    try {
      part();
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
  };
  std::vector<int64_t> failed;
  // Unpublishes an older save of this step first.
  if (leader) attempt([&] { begin_checkpoint(checkpoints, trainer.step_count()); });
  if ((failed = ranks_that_failed(me, failure != nullptr)).empty()) {
    const NamedTensors mine = trainer.state();
    if (!mine.empty()) attempt([&] { write_checkpoint_shard(dir, me.rank, mine); });
    if ((failed = ranks_that_failed(me, failure != nullptr)).empty()) {
      if (leader)
        attempt([&] {
          std::vector<CheckpointFile> files;
          for (int64_t rank = 0; rank < me.world_size; ++rank) {
            const std::string path = dir + "/" + shard_name(rank);
            if (fs::exists(path))
              files.push_back({shard_name(rank), static_cast<int64_t>(fs::file_size(path)), crc32_file(path)});
          }
          commit_checkpoint(dir, trainer.step_count(), state.to_json(plan, data), files);
        });
      if ((failed = ranks_that_failed(me, failure != nullptr)).empty()) {
        if (leader && o.progress) *o.progress << "saved " << dir << std::endl;
        return dir;
      }
    }
  }
  std::error_code ec;
  remove_checkpoint_shard(dir, me.rank);
  me.barrier();
  if (leader) fs::remove_all(dir, ec);
  // A rank whose own write failed reports that; rank 0 also says what became of the save, even
  // when its own write failed too (a full disk fails every rank at once).
  if (failure && !leader) std::rethrow_exception(failure);
  std::string names;
  for (const int64_t r : failed) names += (names.empty() ? "" : ", ") + std::to_string(r);
  const std::string newest = latest_checkpoint(checkpoints);
  const Diagnostic summary{"", "not saved: the save failed on rank " + names +
                                   " (its error names the file); what the save wrote is removed, the newest "
                                   "checkpoint is " + (newest.empty() ? "none" : newest)};
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const InputError& e) {
      std::vector<Diagnostic> own;
      for (const std::string& line : e.lines()) own.push_back({"", line});
      own.push_back(summary);
      throw InputError(dir, own);
    } catch (const std::exception& e) {
      throw InputError(dir, {{"", e.what()}, summary});
    }
  }
  throw InputError(dir, {summary});
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

// Before each step the ranks vote, so that they all stop before the same step: a rank caught a
// stop signal, the time limit would pass during the next step and its save, or a save would no
// longer fit in what is left of the signal's grace period.
struct StopVote {
  int64_t sigterm = 0, sigint = 0;  // ranks that caught each
  int64_t out_of_time = 0;          // ranks that see the time limit coming
  int64_t no_time_to_save = 0;
  bool stop() const { return sigterm > 0 || sigint > 0 || out_of_time > 0; }
};

StopVote vote_to_stop(const RunOptions& o, const RunRank& me, std::chrono::steady_clock::time_point started,
                      double longest_step_seconds, double save_seconds) {
  using Seconds = std::chrono::duration<double>;
  const auto now = std::chrono::steady_clock::now();
  const int signal = stop_signal();
  const double since_start = Seconds(now - started).count();
  const bool out_of_time = o.stop_after_seconds > 0 && since_start + longest_step_seconds + save_seconds >=
                                                          static_cast<double>(o.stop_after_seconds);
  const bool no_time_to_save =
      signal != 0 && Seconds(now - stop_signal_time()).count() + save_seconds > static_cast<double>(o.grace_seconds);
  torch::Tensor votes = torch::tensor(
      {int64_t{signal == SIGTERM}, int64_t{signal == SIGINT}, int64_t{out_of_time}, int64_t{no_time_to_save}});
  me.sum_over_ranks(votes);
  return {votes[0].item<int64_t>(), votes[1].item<int64_t>(), votes[2].item<int64_t>(), votes[3].item<int64_t>()};
}

std::string stop_reason(const StopVote& vote, const RunOptions& o, const RunRank& me) {
  if (vote.sigterm == 0 && vote.sigint == 0) return "--stop-after " + std::to_string(o.stop_after_seconds) + " s";
  const std::string name = vote.sigint == 0 ? "SIGTERM" : vote.sigterm == 0 ? "SIGINT" : "SIGTERM and SIGINT";
  if (me.world_size == 1) return name;
  return name + " on " + std::to_string(std::min(me.world_size, vote.sigterm + vote.sigint)) + " of " +
         std::to_string(me.world_size) + " ranks";
}

}  // namespace

RunResult run_steps(const Plan& plan, const RunOptions& o, const TokenDataset& data, StepTrainer& trainer,
                    const RunRank& me, const std::string& resume_from, int64_t baseline_rss_bytes) {
  const bool leader = me.rank == 0;
  CheckpointState state = start(plan, o, trainer, me, resume_from);
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
  const auto started = std::chrono::steady_clock::now();
  using Seconds = std::chrono::duration<double>;
  double longest_step_seconds = 0, save_seconds = 0;
  int64_t saved_step = resume_from.empty() ? -1 : trainer.step_count();
  int64_t nonfinite_in_a_row = 0;
  StepRecord first_nonfinite;
  const auto save_now = [&] {
    const auto begin = std::chrono::steady_clock::now();
    result.last_checkpoint = save(plan, o, data, trainer, me, state);
    save_seconds = std::max(save_seconds, Seconds(std::chrono::steady_clock::now() - begin).count());
    saved_step = trainer.step_count();
  };
  while (trainer.step_count() < last_step) {
    if (const StopVote vote = vote_to_stop(o, me, started, longest_step_seconds, save_seconds); vote.stop()) {
      result.stopped_by = stop_reason(vote, o, me);
      const bool unsaved = trainer.step_count() > std::max<int64_t>(saved_step, 0);
      if (unsaved && vote.no_time_to_save == 0) save_now();
      if (leader && o.progress) {
        *o.progress << "stopped before step " << trainer.step_count() + 1 << " (" << result.stopped_by << "): ";
        if (trainer.step_count() == saved_step)
          *o.progress << "saved " << step_folder(o.out_dir + "/checkpoints", saved_step) << "; continue with --resume";
        else if (unsaved)
          *o.progress << "not saved, a save (" << save_seconds << " s) would outlast --grace-seconds "
                      << o.grace_seconds << "; --resume continues from the newest checkpoint";
        else
          *o.progress << "nothing trained, nothing saved";
        *o.progress << std::endl;
      }
      break;
    }
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
    const bool traced = o.kernel_trace_step == trainer.step_count() + 1;
    if (traced) start_kernel_trace(me.device);
    // The leader reads the machine's steal around the step: the ranks share its processors.
    const std::optional<ProcessorTimes> before = leader ? processor_times() : std::nullopt;
    StepRecord r = trainer.step(micro_batches);
    if (leader) r.steal = steal_share(before, processor_times());
    if (traced) save_kernel_trace(me.device, o.out_dir + "/kernels-rank-" + std::to_string(me.rank) + ".json");
    peaks.end_step();
    if (!r.skipped) ++state.optimizer_step;
    nonfinite_in_a_row = r.skipped ? nonfinite_in_a_row + 1 : 0;
    if (nonfinite_in_a_row == 1) first_nonfinite = r;
    busiest_rows = std::max(busiest_rows, trainer.take_busiest_expert_rows());
    if (leader) {
      metrics << to_json_line(r) << '\n' << std::flush;
      if (!metrics) throw InputError(o.out_dir + "/metrics.jsonl", {{"", "write failed (is the disk full?)"}});
      if (o.progress) *o.progress << format_progress(r, last_step) << std::endl;
    }
    longest_step_seconds = std::max(longest_step_seconds, r.seconds);
    if (nonfinite_in_a_row >= o.max_nonfinite_steps) {
      const std::string newest = latest_checkpoint(o.out_dir + "/checkpoints");
      throw std::runtime_error(
          "steps " + std::to_string(first_nonfinite.step) + ".." + std::to_string(r.step) +
          " had a NaN or an Inf in the loss or the gradients, " + std::to_string(nonfinite_in_a_row) +
          " in a row (--max-nonfinite-steps); it first appeared in " + first_nonfinite.nonfinite +
          ". Stopped without applying them; " +
          (newest.empty() ? "there is no checkpoint" : "the newest checkpoint is " + newest));
    }
    if (o.checkpoint_every > 0 && (r.step % o.checkpoint_every == 0 || r.step == last_step)) save_now();
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
  m.device_workspace_bytes = device.blas_workspaces;
  m.events = trainer.clock().events();
  m.memory = trainer.clock().memory();
  if (result.stopped_by.empty()) result.report = report(plan, o, me, m, result.steps);
  return result;
}

}  // namespace moeplan::executor
