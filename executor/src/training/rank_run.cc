// One rank of a multi-rank run: rendezvous, the data slice of each rank, checkpoints written by
// every rank and committed by rank 0, heartbeats that name a lost rank, and the measured trace
// and report.
#include "moeplan/executor/training/rank_run.h"

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
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/parallel_trainer.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// Every rank bumps its counter in the store twice a second, with what its collectives are doing;
// a rank whose counter stops, and which did not report an error itself, is lost, and one that
// beats but has long been outside any collective while the others wait in one is stuck there.
class Heartbeat {
 public:
  // `store` answers lost(); the beats go through a connection of their own (a store client is
  // not shared between threads).
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, const RankEnv& env, std::chrono::milliseconds timeout,
            std::shared_ptr<const CollectiveActivity> activity)
      : store_(std::move(store)), rank_(env.rank), activity_(std::move(activity)) {
    beats_ = join_store(env, timeout, StoreRole::kClient);
    thread_ = std::thread([this] {
      int64_t beat = 0;
      while (!stop_) {
        try {
          beats_->set("beat/" + std::to_string(rank_),
                      bytes_of(std::to_string(++beat) + "\n" + activity_->describe()));
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
      std::string names, stuck;
      for (int64_t r = 0; r < world; ++r) {
        const std::string& beat = after[static_cast<size_t>(r)];
        if (r == rank_ || store_->check({"error/" + std::to_string(r)})) continue;
        if (beat == before[static_cast<size_t>(r)]) {
          names += (names.empty() ? "" : ", ") + std::to_string(r);
        } else if (const auto newline = beat.find('\n');
                   newline != std::string::npos && beat.compare(newline + 1, 7, "outside") == 0) {
          stuck += (stuck.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " is " + beat.substr(newline + 1));
        }
      }
      std::string said = names.empty() ? "" : "lost rank " + names + " (no heartbeat for 2 s)";
      if (!stuck.empty()) said += (said.empty() ? "" : "; ") + stuck;
      return said;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return "the heartbeats could not be read (" + what.substr(0, what.find('\n')) + ")";
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_, beats_;
  int64_t rank_;
  std::shared_ptr<const CollectiveActivity> activity_;
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
  const c10::intrusive_ptr<c10d::Store> store = join_store(env, timeout);
  const auto activity = std::make_shared<CollectiveActivity>();
  Heartbeat heartbeat(store, env, timeout, activity);
  try {
    const RankPlace place = place_rank(plan.cluster.device, env.local_rank, cuda_device_count());
    const std::vector<RankPlace> places = places_of_world(*store, env.rank, env.world_size, place);
    const GroupBackend backend = choose_backend(places, nccl_built());
    if (places.front().gpu >= 0 && plan.parallel.context_parallel_degree > 1) {
      // Every rank sees the same places and plan: all stop here alike.
      Diagnostics d;
      d.error("parallel.context_parallel_degree",
              std::to_string(plan.parallel.context_parallel_degree) +
                  ": context parallelism trains on CPU ranks only (its attention calls the CPU's flash kernels)");
      d.throw_if_any("run");
    }
    const ComputeDevice device = rank_device(place);
    if (const std::string said = describe_placement(places, backend); env.rank == 0 && o.progress && !said.empty())
      *o.progress << (device.is_cuda() ? "" : gpu_plan_but(plan.cluster)) << said << "\n";
    DeviceMesh mesh(plan.parallel, env.rank, store, timeout, env.bind_address, {device.device, backend});
    mesh.set_activity(activity);
    const std::string resume_from = prepare_run_folder(o);
    mesh.world.barrier();  // every rank has looked at the folder before anyone writes to it
    std::unique_ptr<ActivationStore> offload;
    if (plan.parallel.activation_offloading)
      offload = std::make_unique<ActivationStore>(o.out_dir + "/.offload-rank-" + std::to_string(env.rank));
    const int64_t baseline_rss = current_rss_bytes();
    const int64_t baseline_device = device_memory(device.device).used;
    ShardedTrainer trainer(plan, mesh, offload.get());
    // Only a rehearsal's layout records its routing, and only it plants a fault.
    if (!o.record_routing.empty()) trainer.rehearse(o.record_routing, o.planted_fault);
    RunRank me;
    me.rank = env.rank;
    me.world_size = env.world_size;
    me.reader = mesh.layout().reader(env.rank);
    me.readers = plan.parallel.data_parallel_degree();
    me.baseline_device_bytes = baseline_device;
    me.barrier = [&mesh] { mesh.world.barrier(); };
    me.sum_over_ranks = [&mesh](torch::Tensor& t) { mesh.world.all_reduce_sum(t); };
    me.device = device.device;
    me.where = (device.is_cuda() ? "GPU ranks (" + std::string(name_of(backend)) + ", rank 0 on " + device.name
                                 : std::string("CPU ranks (gloo")) +
               ", started by " + env.launcher + ")";
    return run_steps(plan, o, data, trainer, me, resume_from, baseline_rss);
  } catch (const CollectiveError& e) {
    const std::string lost = heartbeat.lost(env.world_size);
    throw CollectiveError("rank " + std::to_string(env.rank) + ": " + e.what() + (lost.empty() ? "" : "; " + lost));
  }
}

}  // namespace moeplan::executor
