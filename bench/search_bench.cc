// Speed of the configuration search: candidates scored per second by the rules, the memory
// model and the analytic estimate, and whole searches for 16 to 1,024 GPUs.

#include <benchmark/benchmark.h>

#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan::planner {
namespace {

// Every search here plans Mixtral 8x7B on p4d.24xlarge nodes.
// Held here so the timed loop of BM_ScoreCandidate does not pay for the cache's lookup and lock.
const ModelSpec& mixtral() {
  static const ModelSpec& m = test::model("mixtral-8x7b");
  return m;
}
ClusterSpec p4d(int64_t gpus) { return test::hardware("p4d.24xlarge", gpus); }
SearchOptions options_for(int64_t gpus) {
  SearchOptions o = test::search_options(gpus);
  o.estimator = Estimator::kAnalytic;  // this file measures the analytic ranking
  return o;
}

// Every rule-valid configuration of a 16-GPU search, with its layout's group shapes.
struct Scored {
  ParallelConfig parallel;
  sim::LayoutShapes shapes;
};
std::vector<Scored> valid_candidates(const ClusterSpec& cluster, const SearchOptions& o) {
  std::vector<Scored> out;
  const int64_t per_rank = o.training.global_batch_tokens / (o.training.seq_len * o.gpus);
  for (int64_t e : {1, 2, 4, 8})
    for (int64_t s = 1; s <= o.gpus; ++s)
      for (const char* placement : {"RSE", "RES", "SRE", "SER", "ERS", "ESR"})
        for (Checkpointing ckpt : {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull})
          for (int64_t horizon : {0, 1, 2, 4})
            for (int64_t mbs = 1; mbs <= 64; mbs *= 2) {
              ParallelConfig p;
              p.world_size = o.gpus;
              p.expert_parallel_degree = e;
              p.hybrid_shard_degree = s;
              p.placement = *Placement::parse(placement);
              p.activation_checkpointing = ckpt;
              p.activation_offloading = horizon > 0;
              p.activation_loading_horizon = std::max<int64_t>(1, horizon);
              p.micro_batch_size = mbs;
              p.gradient_accumulation_steps = std::max<int64_t>(1, per_rank / mbs);
              if (violated_rules({mixtral(), cluster, p, o.moe, o.training}) != 0) continue;
              out.push_back({p, sim::layout_shapes(cluster, p)});
            }
  return out;
}

// The per-candidate work of the search: rules, memory model and analytic step estimate, the
// kernel times looked up in the search's cache (computed once per micro-batch shape, as the
// search does; the first pass over the candidates fills it).
void BM_ScoreCandidate(benchmark::State& state) {
  const ClusterSpec cluster = p4d(16);
  const SearchOptions o = options_for(16);
  const std::vector<Scored> candidates = valid_candidates(cluster, o);
  sim::KernelCostCache kernel_costs;
  size_t i = 0;
  double sink = 0;
  for (auto _ : state) {
    const Scored& c = candidates[i];
    i = i + 1 == candidates.size() ? 0 : i + 1;
    const RunConfig config{mixtral(), cluster, c.parallel, o.moe, o.training};
    const RuleMask broken = violated_rules(config);
    const MemoryEstimate memory = estimate_memory(config);
    const sim::StepEstimate step = sim::estimate_step(config, c.shapes, &kernel_costs);
    sink += static_cast<double>(broken) + static_cast<double>(memory.device_total) + step.step_time_s;
  }
  benchmark::DoNotOptimize(sink);
  state.SetItemsProcessed(state.iterations());
  state.counters["candidates"] = static_cast<double>(candidates.size());
}
BENCHMARK(BM_ScoreCandidate);

// A whole search ranked by the analytic estimate, from enumeration to the ranked list.
void BM_Search(benchmark::State& state) {
  const int64_t gpus = state.range(0);
  const ClusterSpec cluster = p4d(gpus);
  const SearchOptions o = options_for(gpus);
  int64_t enumerated = 0;
  for (auto _ : state) {
    const SearchResult r = search(mixtral(), cluster, o);
    enumerated = r.stats.enumerated;
    benchmark::DoNotOptimize(r.ranked.data());
  }
  state.SetItemsProcessed(state.iterations() * enumerated);
  state.counters["enumerated"] = static_cast<double>(enumerated);
}
BENCHMARK(BM_Search)->Arg(16)->Arg(64)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond);

// `moeplan search --gpus N --routing skew:2` as the command runs it: the step simulator ranks,
// and the best 32 plans are drawn 16 times each under a skewed router and ranked again.
void BM_SearchRouting(benchmark::State& state) {
  const int64_t gpus = state.range(0);
  const ClusterSpec cluster = p4d(gpus);
  SearchOptions o = options_for(gpus);
  o.estimator = Estimator::kSimulator;
  o.routing = "skew:2";
  for (auto _ : state) {
    const SearchResult r = search(mixtral(), cluster, o);
    benchmark::DoNotOptimize(r.ranked.data());
  }
}
BENCHMARK(BM_SearchRouting)->Arg(1024)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
}  // namespace moeplan::planner
