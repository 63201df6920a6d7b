// Speed of the step simulator: the event queue alone, one simulated step of Mixtral 8x7B, and
// searches that simulate their best candidates.

#include <benchmark/benchmark.h>

#include <random>

#include "moeplan/planner/search.h"
#include "moeplan/simulator/step.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

// Every step and search here is Mixtral 8x7B on p4d.24xlarge nodes.
const ModelSpec& mixtral() { return test::model("mixtral-8x7b"); }
ClusterSpec p4d(int64_t gpus) { return test::hardware("p4d.24xlarge", gpus); }

// Schedule and pop events with random times, 1,024 in flight: the kernel's own cost.
void BM_EventQueue(benchmark::State& state) {
  EventQueue q;
  std::mt19937_64 rng(1);
  SimTime now{0};
  for (int i = 0; i < 1024; ++i) q.schedule(SimTime(static_cast<int64_t>(rng() % 100000)), 0, 0);
  for (auto _ : state) {
    const Event e = q.pop();
    now = e.time;
    q.schedule(now + SimTime(static_cast<int64_t>(rng() % 100000)), 0, 0);
  }
  benchmark::DoNotOptimize(now);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_EventQueue);

// One step of the 16-GPU plan: graph building plus the run. items = events.
void BM_SimulateStep(benchmark::State& state) {
  const int64_t gpus = state.range(0);
  const ClusterSpec cluster = p4d(gpus);
  planner::SearchOptions o = test::search_options(gpus);
  const planner::SearchResult r = planner::search(mixtral(), cluster, o);
  const RunConfig config{mixtral(), cluster, r.ranked.front().parallel, o.moe, o.training};
  StepSimOptions sim_options;
  sim_options.all_ranks = state.range(1) != 0;
  uint64_t events = 0;
  for (auto _ : state) {
    const StepSimulation s = simulate_step(config, sim_options);
    events = s.times.events;
    benchmark::DoNotOptimize(s.estimate.step_time_s);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(events));
  state.counters["events"] = static_cast<double>(events);
  state.SetLabel(describe(config.parallel));
}
BENCHMARK(BM_SimulateStep)->Args({16, 0})->Args({16, 1})->Args({64, 0})->Unit(benchmark::kMillisecond);

// The event-processing part alone: the graph of the 16-GPU plan, run again and again.
void BM_RunGraph(benchmark::State& state) {
  const ClusterSpec cluster = p4d(16);
  planner::SearchOptions o = test::search_options(16);
  const planner::SearchResult r = planner::search(mixtral(), cluster, o);
  const RunConfig config{mixtral(), cluster, r.ranked.front().parallel, o.moe, o.training};
  StepSimOptions all;
  all.all_ranks = true;
  const StepSimulation s = simulate_step(config, all);
  for (auto _ : state) {
    const GraphTimes t = run_graph(s.graph, cluster.inter_node_bandwidth_bytes_per_s);
    benchmark::DoNotOptimize(t.makespan);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(s.times.events));
  state.counters["events"] = static_cast<double>(s.times.events);
  state.counters["ops"] = static_cast<double>(s.graph.ops().size());
}
BENCHMARK(BM_RunGraph)->Unit(benchmark::kMillisecond);

// A whole search that ranks by simulation.
void BM_SearchSimulated(benchmark::State& state) {
  const int64_t gpus = state.range(0);
  const ClusterSpec cluster = p4d(gpus);
  const planner::SearchOptions o = test::search_options(gpus);
  int64_t simulated = 0;
  for (auto _ : state) {
    const planner::SearchResult r = planner::search(mixtral(), cluster, o);
    simulated = r.stats.simulated;
    benchmark::DoNotOptimize(r.ranked.data());
  }
  state.counters["simulated"] = static_cast<double>(simulated);
}
BENCHMARK(BM_SearchSimulated)->Arg(16)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
}  // namespace moeplan::sim
