// One rank of a multi-rank run: rendezvous, the data slice of each rank, checkpoints written by
// every rank and committed by rank 0, heartbeats that name a lost rank, and the measured trace
// and report.
#include "moeplan/executor/rank_run.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <thread>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/rules.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/hf_checkpoint.h"
#include "moeplan/executor/parallel_trainer.h"
#include "moeplan/executor/runtime.h"
#include "moeplan/executor/tokens.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// Every rank bumps its counter in the store twice a second; a rank whose counter stops, and
// which did not report an error itself, is lost.
class Heartbeat {
 public:
  // `store` answers lost(); the beats go through a connection of their own (a store client is
  // not shared between threads).
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, const RankEnv& env, std::chrono::milliseconds timeout)
      : store_(std::move(store)), rank_(env.rank) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = timeout;
    beats_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    thread_ = std::thread([this] {
      int64_t beat = 0;
      while (!stop_) {
        try {
          beats_->set("beat/" + std::to_string(rank_), bytes_of(std::to_string(++beat)));
        } catch (const std::exception&) {
          return;  // the store is gone; the collectives will say so
        }
        for (int i = 0; i < 5 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~Heartbeat() {
    stop_ = true;
    thread_.join();
  }

  // The ranks that stopped beating without reporting an error, or a note that the store is gone.
  std::string lost(int64_t world) {
    try {
      store_->set("error/" + std::to_string(rank_), bytes_of("1"));
      auto read = [&] {
        std::vector<std::string> beats;
        for (int64_t r = 0; r < world; ++r) {
          const std::string key = "beat/" + std::to_string(r);
          std::string value;
          if (store_->check({key})) {
            const std::vector<uint8_t> bytes = store_->get(key);
            value.assign(bytes.begin(), bytes.end());
          }
          beats.push_back(std::move(value));
        }
        return beats;
      };
      const std::vector<std::string> before = read();
      std::this_thread::sleep_for(std::chrono::seconds(2));
      const std::vector<std::string> after = read();
      std::string names;
      for (int64_t r = 0; r < world; ++r)
        if (before[static_cast<size_t>(r)] == after[static_cast<size_t>(r)] &&
            !store_->check({"error/" + std::to_string(r)}))
          names += (names.empty() ? "" : ", ") + std::to_string(r);
      return names.empty() ? "" : "lost rank " + names + " (no heartbeat for 2 s)";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return "the heartbeats could not be read (" + what.substr(0, what.find('\n')) + ")";
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_, beats_;
  int64_t rank_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

void check_plan(const Plan& plan, const TokenDataset& data, const RunOptions& o, const RankEnv& env) {
  Diagnostics d;
  if (plan.parallel.world_size != env.world_size)
    d.error("parallel.world_size", std::to_string(plan.parallel.world_size) + " ranks, but " + env.launcher +
                                       " started " + std::to_string(env.world_size));
  check_run_inputs(plan, data, o, d);
  d.throw_if_any("run");
}

}  // namespace

RunResult run_rank(const Plan& plan, const RunOptions& o, const RankEnv& env) {
  TokenDataset data = TokenDataset::open(o.data_dir);
  check_plan(plan, data, o, env);
  set_compute_threads(o.threads > 0 ? o.threads : 1);
  keep_freed_memory();
  install_tensor_allocator();
  ignore_broken_pipes();
  const auto timeout = std::chrono::milliseconds(1000 * o.timeout_seconds);

  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.store_hosted_elsewhere;
  so.numWorkers = c10::nullopt;
  so.waitWorkers = false;
  so.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  Heartbeat heartbeat(store, env, timeout);
  const bool leader = env.rank == 0;
  try {
    DeviceMesh mesh(plan.parallel, env.rank, store, timeout, env.bind_address);
    const ParallelConfig& p = plan.parallel;
    fs::create_directories(o.out_dir);
    const std::string metrics_path = o.out_dir + "/metrics.jsonl";
    const std::string checkpoints = o.out_dir + "/checkpoints";
    std::string resume_from;
    if (o.resume) {
      resume_from = latest_checkpoint(checkpoints);
      if (resume_from.empty()) throw InputError("--resume", {{"", "no complete checkpoint in " + checkpoints}});
    } else if (fs::exists(metrics_path) || !latest_checkpoint(checkpoints).empty()) {
      throw InputError("--out", {{"", o.out_dir + " already holds a run; pass --resume to continue it or choose another folder"}});
    }
    mesh.world.barrier();  // every rank has looked at the folder before anyone writes to it

    std::unique_ptr<ActivationStore> offload;
    if (p.activation_offloading)
      offload = std::make_unique<ActivationStore>(o.out_dir + "/.offload-rank-" + std::to_string(env.rank));
    const int64_t baseline_rss = current_rss_bytes();
    ShardedTrainer trainer(plan, mesh, offload.get());
    BlockOrder order(data.num_blocks(), static_cast<uint64_t>(plan.training.seed));
    int64_t samples = 0;  // of the whole world
    if (!resume_from.empty()) {
      const LoadedCheckpoint c = open_checkpoint(resume_from);
      Diagnostics d;
      const Json& s = c.state;
      check_checkpoint_state(plan, s, d);
      d.throw_if_any(resume_from + "/manifest.json");
      SlicedState sliced;
      for (const CheckpointFile& f : c.files) sliced.add(read_checkpoint_shard(c, f.name).tensors);
      trainer.load_state(sliced, c.step, d);
      d.throw_if_any(resume_from);
      samples = s["samples_consumed"].get<int64_t>();
      if (leader && o.progress) *o.progress << "resumed from " << resume_from << " at step " << c.step << "\n";
    } else if (!o.init_from.empty()) {
      // Each rank reads the tensors of its own shard and experts only.
      const std::set<std::string> held = trainer.held_parameters();
      const torch::ScalarType dtype = plan.training.precision == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat;
      const SlicedState sliced = read_hf_parameters(o.init_from, plan.model, dtype, &held);
      Diagnostics d;
      trainer.load_state(sliced, 0, d);
      d.throw_if_any(o.init_from);
      if (leader && o.progress) *o.progress << "started from the Hugging Face model in " << o.init_from << "\n";
    }
    if (leader && !resume_from.empty()) truncate_metrics(metrics_path, trainer.step_count());

    const int64_t last_step = o.stop_after_step > 0 ? o.stop_after_step : plan.training.steps;
    RunResult result;
    result.first_step = trainer.step_count() + 1;
    std::ofstream metrics;
    if (leader) {
      metrics.open(metrics_path, std::ios::app);
      if (!metrics) throw InputError(metrics_path, {{"", "cannot write"}});
    }
    const int64_t ga = p.gradient_accumulation_steps, mbs = p.micro_batch_size;
    StepPeaks peaks;
    int64_t busiest_rows = 0;
    const int64_t reader = mesh.layout().reader(env.rank), readers = p.data_parallel_degree();
    while (trainer.step_count() < last_step) {
      // Reader r's micro-batch m holds what a one-rank run with r * ga + m micro-batches before
      // it would train on (the ranks of a tensor-parallel group read the same ones).
      std::vector<torch::Tensor> micro_batches;
      for (int64_t m = 0; m < ga; ++m) {
        std::vector<int64_t> blocks;
        for (int64_t i = 0; i < mbs; ++i) blocks.push_back(order.block_of(samples + (reader * ga + m) * mbs + i));
        micro_batches.push_back(data.blocks(blocks));
      }
      samples += readers * ga * mbs;
      peaks.begin_step();
      StepRecord r = trainer.step(micro_batches);
      peaks.end_step();
      busiest_rows = std::max(busiest_rows, trainer.model().take_busiest_expert_rows());
      if (leader) {
        metrics << to_json_line(r) << '\n' << std::flush;
        if (o.progress) {
          char line[200];
          std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  %.3f s",
                        static_cast<long long>(r.step), static_cast<long long>(last_step), r.loss, r.learning_rate,
                        r.grad_norm, r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, r.seconds);
          *o.progress << line << std::endl;
        }
      }
      if (o.checkpoint_every > 0 && (r.step % o.checkpoint_every == 0 || r.step == last_step)) {
        // Rank 0 prepares the folder (and unpublishes an older save of this step) first.
        if (leader) begin_checkpoint(checkpoints, r.step);
        mesh.world.barrier();
        const std::string dir = step_folder(checkpoints, r.step);
        const NamedTensors mine = trainer.state();
        if (!mine.empty()) write_checkpoint_shard(dir, env.rank, mine);
        mesh.world.barrier();
        if (leader) {
          std::vector<CheckpointFile> files;
          for (int64_t rank = 0; rank < env.world_size; ++rank) {
            char name[40];
            std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank));
            const std::string path = dir + "/" + name;
            if (fs::exists(path))
              files.push_back({name, static_cast<int64_t>(fs::file_size(path)), crc32_file(path)});
          }
          Json state;
          state["samples_consumed"] = samples;
          state["optimizer_step"] = r.step;
          state["precision"] = name_of(kPrecisionNames, plan.training.precision);
          state["seed"] = plan.training.seed;
          state["model"] = to_json(plan.model);
          state["parallel"] = to_json(plan.parallel);
          state["data"] = {{"dir", data.dir()}, {"blocks", data.num_blocks()}, {"block_size", data.block_size()}};
          commit_checkpoint(dir, r.step, state, files);
          if (o.progress) *o.progress << "saved " << dir << std::endl;
        }
        mesh.world.barrier();
        result.last_checkpoint = dir;
      }
      result.steps.push_back(std::move(r));
    }
    result.last_step = trainer.step_count();
    result.peak_rss_bytes = peak_rss_bytes();

    // The measured trace of the last step and the report: every rank writes its part, rank 0
    // joins them.
    {
      RankMeasurement m;
      m.rank = env.rank;
      m.peak_rss_bytes = result.peak_rss_bytes;
      m.baseline_rss_bytes = baseline_rss;
      m.peak_tensor_bytes = peaks.whole_run();
      m.peak_step_tensor_bytes = peaks.steps();
      m.busiest_expert_rows = busiest_rows;
      m.events = trainer.clock().events();
      m.memory = trainer.clock().memory();
      write_file_atomic(o.out_dir + "/.trace-rank-" + std::to_string(env.rank) + ".json", to_json(m).dump());
    }
    mesh.world.barrier();
    if (leader) {
      std::vector<RankMeasurement> ranks;
      for (int64_t rank = 0; rank < env.world_size; ++rank) {
        const std::string path = o.out_dir + "/.trace-rank-" + std::to_string(rank) + ".json";
        ranks.push_back(rank_measurement_from_json(read_json_file(path), path));
        fs::remove(path);
      }
      if (!result.steps.empty())
        result.report = write_run_outputs(plan, o.out_dir, result.steps, ranks,
                                          "CPU ranks (gloo, started by " + env.launcher + ")");
    }
    mesh.world.barrier();
    return result;
  } catch (const CollectiveError& e) {
    const std::string lost = heartbeat.lost(env.world_size);
    throw CollectiveError("rank " + std::to_string(env.rank) + ": " + e.what() + (lost.empty() ? "" : "; " + lost));
  }
}

}  // namespace moeplan::executor
