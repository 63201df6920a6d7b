#include "moeplan/planner/search.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "moeplan/core/units.h"
#include "moeplan/simulator/step.h"

namespace moeplan::planner {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    out.push_back(d);
    if (d != n / d) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

constexpr std::array<const char*, 6> kPlacements = {"RSE", "RES", "SRE", "SER", "ERS", "ESR"};

std::string gib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / static_cast<double>(kGiB));
  return text;
}

bool better(const Candidate& a, const Candidate& b) {
  if (a.estimate.tokens_per_s != b.estimate.tokens_per_s)
    return a.estimate.tokens_per_s > b.estimate.tokens_per_s;
  if (a.memory.device_total != b.memory.device_total) return a.memory.device_total < b.memory.device_total;
  return a.index < b.index;
}

// A candidate that differs from a better-ranked one only in its loading horizon, at the same
// predicted speed, just holds more memory: it is not worth showing.
bool horizon_duplicate(const Candidate& c, const std::vector<Candidate>& ranked) {
  return std::any_of(ranked.begin(), ranked.end(), [&](const Candidate& r) {
    ParallelConfig same_horizon = c.parallel;
    same_horizon.activation_loading_horizon = r.parallel.activation_loading_horizon;
    return same_horizon == r.parallel && r.estimate.tokens_per_s == c.estimate.tokens_per_s;
  });
}

// Simulates candidates in order of their analytic estimate until no candidate left can enter
// the top `keep` (its lower bound is above the keep-th best simulated time), then ranks the
// simulated ones.
std::vector<Candidate> simulate_best(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                                     const std::vector<Candidate>& fitting, SearchStats& stats) {
  std::vector<Candidate> simulated;
  std::vector<double> best_times;  // ascending, at most `keep`
  for (const Candidate& c : fitting) {
    // The bound is in double, the simulation rounds each op to a nanosecond: leave a margin.
    if (options.prune && best_times.size() >= options.keep && c.estimate.lower_bound_s > best_times.back() * (1 + 1e-6))
      continue;
    const RunConfig config{model, cluster, c.parallel, options.moe, options.training};
    Candidate s = c;
    s.estimate = sim::simulate_step(config).estimate;
    s.simulated = true;
    ++stats.simulated;
    if (horizon_duplicate(s, simulated)) continue;
    best_times.insert(std::upper_bound(best_times.begin(), best_times.end(), s.estimate.step_time_s),
                      s.estimate.step_time_s);
    if (best_times.size() > options.keep) best_times.pop_back();
    simulated.push_back(s);
  }
  return simulated;
}

}  // namespace

ClusterSpec size_cluster(ClusterSpec profile, int64_t gpus) {
  profile.num_nodes = std::max<int64_t>(1, (gpus + profile.gpus_per_node - 1) / profile.gpus_per_node);
  return profile;
}

int64_t default_global_batch_tokens(int64_t gpus, int64_t seq_len) {
  constexpr int64_t kTarget = int64_t{4} << 20;
  const int64_t unit = gpus * seq_len;
  return (kTarget + unit - 1) / unit * unit;
}

SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options) {
  SearchResult result;
  SearchStats& stats = result.stats;
  const int64_t w = options.gpus;
  const TrainingConfig& training = options.training;
  const int64_t host_limit = host_limit_bytes(cluster, w);
  const int64_t device_limit = cluster.usable_memory_bytes();
  const int64_t seqs_per_rank = training.seq_len > 0 && w > 0
                                    ? training.global_batch_tokens / (training.seq_len * w)
                                    : 0;

  // The raw space: degrees that divide the world size or the expert count (the rules reject
  // the ones that do not fit both), every placement, every checkpointing and offload option,
  // power-of-two micro-batches and the divisors of the per-rank batch.
  std::vector<int64_t> expert_degrees = divisors(w);
  for (int64_t e : divisors(model.num_experts)) expert_degrees.push_back(e);
  std::sort(expert_degrees.begin(), expert_degrees.end());
  expert_degrees.erase(std::unique(expert_degrees.begin(), expert_degrees.end()), expert_degrees.end());
  std::vector<int64_t> shard_degrees = divisors(w);
  std::vector<int64_t> micro_batches;
  for (int64_t b = 1; b <= options.max_micro_batch; ++b) {
    const bool power_of_two = (b & (b - 1)) == 0;
    if (power_of_two || (seqs_per_rank > 0 && seqs_per_rank % b == 0)) micro_batches.push_back(b);
  }
  struct OffloadOption {
    bool on;
    int64_t horizon;
  };
  std::vector<OffloadOption> offloads = {{false, 1}};
  for (int64_t h : options.loading_horizons) offloads.push_back({true, h});
  std::vector<Checkpointing> checkpointing = {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull};
  std::vector<const char*> placements(kPlacements.begin(), kPlacements.end());
  // What the user fixed: the one value, even where the search would not have tried it (the
  // rules then say why it cannot work).
  const SearchOptions::Pins& pin = options.pins;
  if (pin.expert_parallel_degree) expert_degrees = {*pin.expert_parallel_degree};
  if (pin.hybrid_shard_degree) shard_degrees = {*pin.hybrid_shard_degree};
  if (pin.micro_batch_size) micro_batches = {*pin.micro_batch_size};
  if (pin.checkpointing) checkpointing = {*pin.checkpointing};
  if (pin.offloading) {
    if (!*pin.offloading) offloads = {{false, 1}};
    else if (pin.loading_horizon) offloads = {{true, *pin.loading_horizon}};
    else offloads.erase(offloads.begin());
  } else if (pin.loading_horizon) {
    offloads = {{false, 1}, {true, *pin.loading_horizon}};
  }
  if (pin.placement) placements = {pin.placement->c_str()};
  const int64_t inner = static_cast<int64_t>(checkpointing.size() * offloads.size() * micro_batches.size());

  std::vector<Candidate> fitting;
  int64_t index = 0;
  for (int64_t e : expert_degrees) {
    for (int64_t s : shard_degrees) {
      std::set<std::array<int64_t, 3>> layouts;
      for (const char* placement : placements) {
        ParallelConfig p;
        p.world_size = w;
        p.expert_parallel_degree = e;
        p.hybrid_shard_degree = s;
        p.placement = *Placement::parse(placement);
        stats.enumerated += inner;
        // Placements differ only in the strides of dimensions with more than one member.
        std::array<int64_t, 3> layout{};
        if (w % (e * s) == 0) {
          for (MeshDim d : {MeshDim::kReplica, MeshDim::kShard, MeshDim::kExpert})
            layout[static_cast<size_t>(d)] = p.degree(d) > 1 ? p.stride(d) : 0;
          if (!layouts.insert(layout).second) {
            stats.duplicate_placements += inner;
            index += inner;
            continue;
          }
        }
        const sim::LayoutShapes shapes = sim::layout_shapes(cluster, p);
        for (Checkpointing ckpt : checkpointing) {
          p.activation_checkpointing = ckpt;
          for (const OffloadOption& offload : offloads) {
            p.activation_offloading = offload.on;
            p.activation_loading_horizon = offload.horizon;
            for (int64_t mbs : micro_batches) {
              p.micro_batch_size = mbs;
              p.gradient_accumulation_steps = std::max<int64_t>(1, seqs_per_rank / mbs);
              const int64_t candidate_index = index++;
              const RunConfig config{model, cluster, p, options.moe, training};
              const RuleMask broken = violated_rules(config);
              if (broken != 0) {
                ++stats.rule_rejected;
                for (int r = 0; r < kRuleCount; ++r)
                  if (broken & (RuleMask{1} << r)) ++stats.rejected_by_rule[static_cast<size_t>(r)];
                continue;
              }
              ++stats.rule_valid;
              Candidate c{p, estimate_memory(config), {}, candidate_index};
              const bool device_ok = c.memory.device_total <= device_limit;
              const bool host_ok = c.memory.offloaded_activations <= host_limit;
              if (!device_ok) {
                ++stats.over_device_memory;
                if (!stats.closest_over_device ||
                    c.memory.device_total < stats.closest_over_device->memory.device_total)
                  stats.closest_over_device = c;
              }
              if (!host_ok) {
                ++stats.over_host_memory;
                if (!stats.closest_over_host ||
                    c.memory.offloaded_activations < stats.closest_over_host->memory.offloaded_activations)
                  stats.closest_over_host = c;
              }
              if (!device_ok || !host_ok) continue;
              c.estimate = sim::estimate_step(config, shapes);
              fitting.push_back(c);
            }
          }
        }
      }
    }
  }
  stats.fitting = static_cast<int64_t>(fitting.size());
  std::sort(fitting.begin(), fitting.end(), better);
  if (options.estimator == Estimator::kSimulator) {
    fitting = simulate_best(model, cluster, options, fitting, stats);
    std::sort(fitting.begin(), fitting.end(), better);
  }
  for (const Candidate& c : fitting) {
    if (result.ranked.size() >= options.keep) break;
    if (!horizon_duplicate(c, result.ranked)) result.ranked.push_back(c);
  }
  return result;
}

Prediction predict(const RunConfig& config, Estimator estimator) {
  const bool simulate = estimator == Estimator::kSimulator;
  const sim::StepEstimate step = simulate ? sim::simulate_step(config).estimate
                                          : sim::estimate_step(config, sim::layout_shapes(config.cluster, config.parallel));
  Prediction p;
  p.estimator = simulate ? "simulator" : "analytic";
  p.step_time_s = step.step_time_s;
  p.tokens_per_s = step.tokens_per_s;
  p.tflops_per_gpu = step.tflops_per_gpu;
  p.mfu = step.mfu;
  p.memory = to_breakdown(estimate_memory(config), config.cluster, config.parallel.world_size);
  p.time = {{"compute", step.compute_s}, {"recompute", step.recompute_s}, {"optimizer", step.optimizer_s}};
  if (simulate) {
    p.time.push_back({"exposed_comm", step.exposed_comm_s});
  } else {  // the closed form knows which communication it could not hide
    p.time.insert(p.time.end(), {{"expert_dispatch", step.expert_comm_s},
                                 {"shard_comm_exposed", step.shard_comm_exposed_s},
                                 {"offload_exposed", step.offload_exposed_s},
                                 {"grad_sync", step.grad_sync_s}});
  }
  return p;
}

Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
               const SearchResult& result, const std::string& command) {
  Plan plan;
  plan.model = model;
  plan.cluster = cluster;
  plan.moe = options.moe;
  plan.training = options.training;
  plan.parallel = result.ranked.front().parallel;
  plan.prediction = predict({plan.model, plan.cluster, plan.parallel, plan.moe, plan.training}, options.estimator);
  constexpr size_t kAlternatives = 4;
  for (size_t i = 1; i < result.ranked.size() && i <= kAlternatives; ++i) {
    const Candidate& c = result.ranked[i];
    plan.alternatives.push_back({c.parallel, c.estimate.step_time_s, c.estimate.tokens_per_s,
                                 c.estimate.mfu, c.memory.device_total});
  }
  plan.provenance.moeplan_version = MOEPLAN_VERSION;
  plan.provenance.command = command;
  return plan;
}

std::vector<std::string> explain_no_plan(const SearchResult& result, const ClusterSpec& cluster) {
  const SearchStats& stats = result.stats;
  std::vector<std::string> lines;
  if (stats.rule_valid == 0) {
    lines.push_back("every one of " + std::to_string(stats.enumerated) +
                    " candidate configurations breaks a validity rule (see --explain)");
    return lines;
  }
  if (const auto& c = stats.closest_over_device) {
    const int64_t limit = cluster.usable_memory_bytes();
    lines.push_back("device memory: " + std::to_string(stats.over_device_memory) + " of " +
                    std::to_string(stats.rule_valid) + " valid configurations exceed it; the closest (" +
                    describe(c->parallel) + ") needs " + gib(c->memory.device_total) + " per GPU against " +
                    gib(limit) + " usable (" + gib(cluster.gpu_memory_bytes) + " minus " +
                    gib(cluster.memory_headroom_bytes) + " headroom): over by " +
                    gib(c->memory.device_total - limit) + "; model states alone take " +
                    gib(c->memory.model_states()));
  }
  if (const auto& c = stats.closest_over_host) {
    const int64_t limit = host_limit_bytes(cluster, c->parallel.world_size);
    lines.push_back("host memory: " + std::to_string(stats.over_host_memory) +
                    " valid configurations exceed it; the closest (" + describe(c->parallel) +
                    ") offloads " + gib(c->memory.offloaded_activations) + " per rank against " + gib(limit) +
                    ": over by " + gib(c->memory.offloaded_activations - limit));
  }
  return lines;
}

}  // namespace moeplan::planner
