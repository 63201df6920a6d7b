// Fixtures shared by the tests and the benchmarks: the shipped profiles, the search options
// `moeplan search` uses by default, and a temporary folder. Header-only, no GoogleTest, so
// bench/ can use it too. Every target that includes it defines MOEPLAN_PROFILE_DIR.

#pragma once

#include <stdlib.h>  // mkdtemp

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/core/trace.h"
#include "moeplan/planner/search.h"

namespace moeplan::test {

// A file of the shipped profile folder, e.g. profile_path("models/mixtral-8x7b.json"); the
// folder MOEPLAN_PROFILES names where it is set (a test binary run from another checkout).
inline std::string profile_path(const std::string& relative) { return profile_dir("") + "/" + relative; }

// profiles/models/<name>.json, read once per process. std::map never moves its nodes, so the
// reference stays valid; the lock keeps the cache safe for benchmarks run on several threads.
// A file under tests/data.
inline std::string data_path(const std::string& relative) {
  return std::string(MOEPLAN_TEST_DATA_DIR) + "/" + relative;
}

inline const ModelSpec& model(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, ModelSpec> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, read_model_file(profile_path("models/" + name + ".json"))).first;
  return it->second;
}

// profiles/hardware/<name>.json as written, read once per process.
inline const ClusterSpec& hardware_profile(const std::string& name) {
  static std::mutex mutex;
  static std::map<std::string, ClusterSpec> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(name);
  if (it == cache.end())
    it = cache.emplace(name, read_cluster_file(profile_path("hardware/" + name + ".json"))).first;
  return it->second;
}

// The hardware profile sized to `gpus` GPUs, as `moeplan search --gpus <gpus>` sizes it.
inline ClusterSpec hardware(const std::string& name, int64_t gpus) {
  return planner::size_cluster(hardware_profile(name), gpus);
}

// The options of `moeplan search --gpus <gpus>`: the default global batch for seq_len.
inline planner::SearchOptions search_options(int64_t gpus, int64_t seq_len = 2048) {
  planner::SearchOptions options;
  options.gpus = gpus;
  options.training.seq_len = seq_len;
  options.training.global_batch_tokens = planner::default_global_batch_tokens(gpus, seq_len);
  return options;
}

// The whole file; empty when it cannot be opened.
inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One op of a trace, as the simulator or the executor records it.
inline TraceEvent trace_op(std::string name, std::string category, int64_t rank, TraceStream stream, int64_t start_ns,
                           int64_t duration_ns) {
  TraceEvent e;
  e.name = std::move(name);
  e.category = std::move(category);
  e.rank = rank;
  e.stream = stream;
  e.start_ns = start_ns;
  e.duration_ns = duration_ns;
  return e;
}

// A folder under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "moeplan-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  // Writes `text` to the file `name` here and returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream out(file(name), std::ios::binary);
    out << text;
    return file(name);
  }
  // A literal would convert to std::string and to Json alike.
  std::string write(const std::string& name, const char* text) const { return write(name, std::string(text)); }
  std::string write(const std::string& name, const Json& json) const { return write(name, json.dump(2)); }

 private:
  std::filesystem::path path_;
};

// RunConfig only refers to its parts; a Scenario owns them, so a test can copy one and change
// a field.
struct Scenario {
  ModelSpec model;
  ClusterSpec cluster;
  ParallelConfig parallel;
  MoeConfig moe;
  TrainingConfig training;
  Target target = nullptr;  // no framework's rules

  RunConfig config() const { return {model, cluster, parallel, moe, training, target}; }
  std::string describe() const {
    std::ostringstream out;
    out << model.name << " on " << parallel.world_size << " x " << cluster.name << ": "
        << moeplan::describe(parallel) << " seq=" << training.seq_len
        << " imbalance=" << moe.expert_load_imbalance;
    return out.str();
  }
};

// `world` ranks of `hardware_name` training `model_name` in bf16 over E experts and S shards
// placed as given, with `micro_batch` x `accumulation` sequences of `seq_len` a rank and step.
inline Scenario make_scenario(const std::string& model_name, const std::string& hardware_name, int64_t world,
                              int64_t e, int64_t s, const char* placement, Checkpointing ckpt = Checkpointing::kNone,
                              int64_t micro_batch = 1, int64_t accumulation = 2, int64_t seq_len = 2048) {
  Scenario c{model(model_name), hardware(hardware_name, world), {}, {}, {}};
  c.parallel.world_size = world;
  c.parallel.expert_parallel_degree = e;
  c.parallel.hybrid_shard_degree = s;
  c.parallel.placement = *Placement::parse(placement);
  c.parallel.activation_checkpointing = ckpt;
  c.parallel.micro_batch_size = micro_batch;
  c.parallel.gradient_accumulation_steps = accumulation;
  c.training.seq_len = seq_len;
  c.training.precision = Precision::kBf16;
  c.training.global_batch_tokens = world * micro_batch * accumulation * seq_len;
  return c;
}

// The same scenario with links that cost nothing: infinite bandwidths, zero latencies.
inline Scenario with_free_communication(Scenario c) {
  c.cluster.intra_node_bandwidth_bytes_per_s = 1e30;
  c.cluster.inter_node_bandwidth_bytes_per_s = 1e30;
  c.cluster.pcie_bandwidth_bytes_per_s = 1e30;
  c.cluster.intra_node_latency_s = 0;
  c.cluster.inter_node_latency_s = 0;
  c.cluster.collective_base_latency_s = 0;
  c.cluster.overlap_slowdown = 0;  // nothing runs beside compute long enough to slow it
  return c;
}

}  // namespace moeplan::test
