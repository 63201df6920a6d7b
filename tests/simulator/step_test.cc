#include "moeplan/simulator/step.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/planner/search.h"
#include "moeplan/simulator/op_costs.h"
#include "test_support.h"

namespace moeplan::sim {
namespace {

using test::Scenario;
using test::make_scenario;

// rng() % n rather than std::uniform_int_distribution, whose output differs between standard
// libraries: the scenarios are the same everywhere.
int64_t pick(std::mt19937_64& rng, int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); }

Scenario random_scenario(std::mt19937_64& rng) {
  static const std::array<const char*, 2> kModels = {"mixtral-8x7b", "mixtral-tiny"};
  static const std::array<const char*, 2> kHardware = {"p4d.24xlarge", "p5.48xlarge"};
  static const std::array<const char*, 6> kPlacements = {"RSE", "RES", "SRE", "SER", "ERS", "ESR"};
  static const std::array<int64_t, 3> kWorlds = {8, 16, 32};
  const int64_t world = kWorlds[static_cast<size_t>(pick(rng, 3))];
  const int64_t e = int64_t{1} << pick(rng, 4);  // divisors of 8 experts
  std::vector<int64_t> shard_degrees;                // S with S * E dividing W
  for (int64_t s = 1; s * e <= world; s *= 2)
    if (world % (s * e) == 0) shard_degrees.push_back(s);
  const int64_t s = shard_degrees[static_cast<size_t>(pick(rng, static_cast<int64_t>(shard_degrees.size())))];
  const char* placement = kPlacements[static_cast<size_t>(pick(rng, 6))];
  const auto ckpt = static_cast<Checkpointing>(pick(rng, 3));
  const int64_t micro_batch = 1 + pick(rng, 4);
  const int64_t accumulation = 1 + pick(rng, 4);
  const int64_t seq_len = pick(rng, 2) == 0 ? 512 : 2048;
  Scenario c = make_scenario(kModels[static_cast<size_t>(pick(rng, 2))], kHardware[static_cast<size_t>(pick(rng, 2))],
                             world, e, s, placement, ckpt, micro_batch, accumulation, seq_len);
  if (ckpt != Checkpointing::kNone && pick(rng, 2) == 0) {
    c.parallel.activation_offloading = true;
    c.parallel.activation_loading_horizon = 1 + pick(rng, 4);
  }
  return c;
}

// The scenarios a property runs over, from an explicit seed (one seed per property).
std::vector<Scenario> random_scenarios(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::vector<Scenario> out;
  for (int i = 0; i < count; ++i) out.push_back(random_scenario(rng));
  return out;
}
constexpr int kScenariosPerProperty = 100;

int64_t step_ns(const StepSimulation& s) { return std::llround(s.estimate.step_time_s * 1e9); }

// The all-gather dispatcher gathers every rank's tokens of the expert group and reduce-scatters
// the outputs back: the estimate and the simulator price each exchange as half of that pair
// (Mixtral over E8 on each of two p4d nodes, 2,048-token sequences).
TEST(Step, AllGatherDispatchIsPricedAlikeByTheEstimateAndTheSimulator) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 1, "RSE");
  c.moe.dispatcher = Dispatcher::kAllGather;
  c.moe.load_balancing = LoadBalancing::kBalanced;
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  const CostModel cost(c.cluster);
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const double group_bytes = 8.0 * 2048 * 4096 * 2;
  const double pair = 0.5 * (cost.all_gather_seconds(group_bytes, shapes.exchange) +
                             cost.reduce_scatter_seconds(group_bytes, shapes.exchange));
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(cost.seconds(token_exchange_cost(cost, c.config(), o.dispatch_send_bytes, shapes.exchange), shapes.exchange),
              pair, 1e-9);
  const StepSimulation sim = simulate_step(c.config());
  double dispatch = 0;
  for (const Op& op : sim.graph.ops())
    if (op.rank == 0 && op.kind == OpKind::kDispatch && op.layer == 0 && op.micro_batch == 0)
      dispatch = to_seconds(sim.times.end[static_cast<size_t>(&op - sim.graph.ops().data())] -
                            sim.times.start[static_cast<size_t>(&op - sim.graph.ops().data())]);
  EXPECT_NEAR(dispatch, pair, 1e-6 + 0.01 * pair);
  // An all-to-all sends each rank's k slots instead: less than the whole group's tokens, in
  // both.
  Scenario a2a = c;
  a2a.moe.dispatcher = Dispatcher::kAllToAll;
  EXPECT_LT(simulate_step(a2a.config()).estimate.step_time_s, sim.estimate.step_time_s);
  EXPECT_LT(estimate_step(a2a.config(), shapes).step_time_s, estimate_step(c.config(), shapes).step_time_s);
}

TEST(StepProperties, RandomScenariosAreValid) {
  // The generator itself: every scenario passes the rules, and the draws cover the space.
  std::map<std::string, int> seen;
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    for (const Scenario& c : random_scenarios(seed, kScenariosPerProperty)) {
      const std::vector<Violation> v = validate(c.config());
      EXPECT_TRUE(v.empty()) << c.describe() << ": " << (v.empty() ? "" : v.front().to_string());
      ++seen[c.model.name];
      ++seen["E" + std::to_string(c.parallel.expert_parallel_degree)];
      ++seen["W" + std::to_string(c.parallel.world_size)];
      ++seen[c.parallel.placement.to_string()];
      ++seen[std::string(name_of(kCheckpointingNames, c.parallel.activation_checkpointing))];
      if (c.parallel.activation_offloading) ++seen["offload"];
    }
  }
  for (const char* key : {"mixtral-8x7b", "mixtral-tiny", "E1", "E2", "E4", "E8", "W8", "W16", "W32", "RSE", "RES",
                          "SRE", "SER", "ERS", "ESR", "none", "selective", "full", "offload"})
    EXPECT_GT(seen[key], 0) << key;
}

// (a) Twice the bandwidth of a link, or of all of them, never makes the step slower. Every
// duration is to_sim_time of a time that only shrinks, and rounding to the nearest ns is
// monotone, so the comparison is exact. Fair sharing of a node's card can reward a slower
// transfer, as it rewards slower compute in (b); found with the executor's per-unit gathers
// and reduce-scatters: 16 x p4d.24xlarge, E2 S4 R2 SRE, ckpt=full, seq=2048, twice the
// intra-node bandwidth: 1,778,884 ns against 1,777,032 ns.
TEST(StepProperties, MoreBandwidthIsNeverSlower) {
  using Field = double ClusterSpec::*;
  const std::array<std::pair<const char*, std::vector<Field>>, 4> kVariants = {{
      {"intra", {&ClusterSpec::intra_node_bandwidth_bytes_per_s}},
      {"inter", {&ClusterSpec::inter_node_bandwidth_bytes_per_s}},
      {"pcie", {&ClusterSpec::pcie_bandwidth_bytes_per_s}},
      {"all",
       {&ClusterSpec::intra_node_bandwidth_bytes_per_s, &ClusterSpec::inter_node_bandwidth_bytes_per_s,
        &ClusterSpec::pcie_bandwidth_bytes_per_s}},
  }};
  int strictly_faster = 0;
  for (Scenario base : random_scenarios(1, kScenariosPerProperty)) {
    // Where shard collectives cross the network card, a faster transfer elsewhere can reorder
    // them on the fairly shared card (see (b) below): there the card is taken out of play and
    // only the other bandwidths are varied.
    const bool card_shared = group_shape(base.cluster, base.parallel, MeshDim::kShard).crosses_nodes();
    if (card_shared) base.cluster.inter_node_bandwidth_bytes_per_s = 1e30;
    const int64_t before = step_ns(simulate_step(base.config()));
    for (const auto& [name, fields] : kVariants) {
      if (card_shared && fields.size() > 1) continue;
      Scenario faster = base;
      for (Field f : fields) faster.cluster.*f *= 2;
      const int64_t after = step_ns(simulate_step(faster.config()));
      EXPECT_LE(after, before) << base.describe() << ": 2 x " << name << " bandwidth";
      if (after < before) ++strictly_faster;
    }
  }
  // The property must be able to fail: doubling bandwidth does shorten most steps.
  EXPECT_GT(strictly_faster, kScenariosPerProperty);
}

// (b) A busier busiest expert never makes the step faster, where the simulator is a max-plus
// system: each op starts when its stream and its inputs are free, so longer compute can only
// push ends later. That holds exactly when no two collectives share a node's network card at
// once. It does not hold in general, because the card is shared fairly (processor sharing),
// and a transfer that starts later takes bandwidth from a critical transfer for less time.
// Seen here with the sharded gradient reduce-scatter (off the critical path) and the
// prefetched all-gather of the next block (on it); the smallest case found:
//   mixtral-tiny, 32 x p4d.24xlarge, E1 S8 R4 SRE, ckpt=none, mbs=4, ga=1, seq=512:
//   step 2,109,233 ns at imbalance 1.0, 2,057,611 ns at 2.0 (all_ranks gives the same): the
//   longer expert backward delays reduce_scatter(L3), which then shares the card with
//   gather_bwd(L2) for less time, and gather_bwd(L2) ends 25.8 us earlier.
// That is the documented card model at work (graph.h), not an error in the code, so the
// property is checked exactly (1) with the card out of play, for every scenario, and (2) with
// the real card where only one kind of collective crosses it at a time: the shard group stays
// inside a node (token exchanges are on the compute chain and cross the card in step on every
// group; the gradient all-reduces come after all of them).
TEST(StepProperties, MoreExpertSkewIsNeverFaster) {
  int strictly_slower = 0;
  int checked_with_card = 0;
  for (Scenario c : random_scenarios(2, kScenariosPerProperty)) {
    Scenario no_card = c;
    no_card.cluster.inter_node_bandwidth_bytes_per_s = 1e30;  // every crossing takes 1 ns
    const bool card_shared = group_shape(c.cluster, c.parallel, MeshDim::kShard).crosses_nodes();
    if (!card_shared) ++checked_with_card;
    int64_t previous = 0;
    int64_t previous_no_card = 0;
    for (double imbalance : {1.0, 1.5, 2.0}) {
      c.moe.expert_load_imbalance = imbalance;
      no_card.moe.expert_load_imbalance = imbalance;
      ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
      const int64_t t = step_ns(simulate_step(c.config()));
      const int64_t t_no_card = step_ns(simulate_step(no_card.config()));
      EXPECT_GE(t_no_card, previous_no_card) << c.describe() << ", inter-node bandwidth 1e30";
      if (!card_shared) {
        EXPECT_GE(t, previous) << c.describe();
      }
      // Sharing the card fairly can reorder, but never beat, a card that is never busy.
      EXPECT_GE(t, t_no_card) << c.describe();
      if (imbalance > 1.0 && t_no_card > previous_no_card) ++strictly_slower;
      previous = t;
      previous_no_card = t_no_card;
    }
  }
  EXPECT_GT(strictly_slower, kScenariosPerProperty);
  EXPECT_GT(checked_with_card, kScenariosPerProperty / 4);
}

// (c) No resource does more work than the simulated step lasts, and the step covers the
// busiest rank's compute, recompute and optimizer.
TEST(StepProperties, StepCoversTheBusiestResource) {
  for (const Scenario& c : random_scenarios(3, kScenariosPerProperty)) {
    const StepSimulation s = simulate_step(c.config());
    const SimTime makespan = s.times.makespan;
    ASSERT_EQ(s.times.stream_busy.size(), s.ranks.size() * kTraceStreamCount) << c.describe();
    for (size_t r = 0; r < s.ranks.size(); ++r)
      for (int stream = 0; stream < kTraceStreamCount; ++stream)
        EXPECT_LE(s.times.stream_busy[r * kTraceStreamCount + static_cast<size_t>(stream)], makespan)
            << c.describe() << ": rank " << r << " stream " << stream;
    // Recount the busy time per (rank, stream) from the op intervals: stream_busy must be their sum.
    std::vector<SimTime> busy(s.times.stream_busy.size(), SimTime(0));
    for (size_t i = 0; i < s.graph.ops().size(); ++i) {
      const Op& op = s.graph.ops()[i];
      busy[static_cast<size_t>(op.rank) * kTraceStreamCount + static_cast<size_t>(op.stream)] +=
          s.times.end[i] - s.times.start[i];
    }
    EXPECT_EQ(busy, s.times.stream_busy) << c.describe();
    for (size_t node = 0; node < s.times.nic_busy.size(); ++node)
      EXPECT_LE(s.times.nic_busy[node], makespan) << c.describe() << ": node " << node;

    // compute_s and recompute_s are sums of whole nanoseconds in doubles, scaled by ga over
    // the simulated micro-batches: their floating-point error is ~1e-11 s for 1e4 ops of a
    // 10 s step, so 1 ns of slack hides no real shortfall.
    const StepEstimate& e = s.estimate;
    EXPECT_GE(e.step_time_s, e.compute_s + e.recompute_s + e.optimizer_s - 1e-9) << c.describe();
    EXPECT_GT(e.compute_s, 0) << c.describe();
    EXPECT_EQ(e.recompute_s > 0, c.parallel.activation_checkpointing != Checkpointing::kNone) << c.describe();
  }
}

// (d) With free communication, full checkpointing adds exactly one forward of every block on
// the busiest rank (attention + MoE), selective the MoE part alone.
using test::with_free_communication;

void expect_recompute_cost(Scenario c) {
  c = with_free_communication(std::move(c));
  c.parallel.activation_offloading = false;
  auto run = [&](Checkpointing ckpt) {
    Scenario v = c;
    v.parallel.activation_checkpointing = ckpt;
    return step_ns(simulate_step(v.config()));
  };
  const int64_t none = run(Checkpointing::kNone);
  const int64_t selective = run(Checkpointing::kSelective);
  const int64_t full = run(Checkpointing::kFull);
  // Each op lasts to_sim_time of its own seconds (step.cc Builder::compute); the busiest rank
  // (expert coordinate 0) runs the MoE block at moe_forward_busiest_s and sets the pace.
  const OpCosts o = op_costs(c.config());
  const int64_t blocks = c.parallel.gradient_accumulation_steps * c.model.num_layers;
  const int64_t attention_ns = to_sim_time(o.attention_forward_s).count();
  const int64_t moe_ns = to_sim_time(o.moe_forward_busiest_s).count();
  // The recompute's token exchanges (dispatch and combine, and the all-gather of tokens per
  // expert that sizes the dispatch) take 0 ns inside a node, but a transfer through a node's
  // card is rounded up to whole nanoseconds (graph.cc reschedule: "a flow never finishes
  // before its last byte"), so an expert group that spans nodes pays 1 ns per exchange even
  // with an infinitely fast card.
  const int64_t exchanges = c.moe.dispatcher == Dispatcher::kAllToAll ? 3 : 2;
  const int64_t exchanges_ns = group_shape(c.cluster, c.parallel, MeshDim::kExpert).crosses_nodes() ? exchanges : 0;
  EXPECT_EQ(full - none, blocks * (attention_ns + moe_ns + exchanges_ns)) << c.describe();
  EXPECT_EQ(selective - none, blocks * (moe_ns + exchanges_ns)) << c.describe();
}

TEST(StepProperties, CheckpointingAddsOneForwardWhenCommunicationIsFree) {
  // Without experts and sharding.
  for (int64_t world : {8, 16, 32})
    for (const char* name : {"mixtral-8x7b", "mixtral-tiny"})
      expect_recompute_cost(make_scenario(name, "p4d.24xlarge", world, 1, 1, "RSE", Checkpointing::kNone, 2, 3));
  // Random layouts with experts, and a skewed busiest expert.
  int with_experts = 0;
  for (Scenario c : random_scenarios(4, kScenariosPerProperty)) {
    if (c.parallel.expert_parallel_degree == 1) continue;
    c.moe.expert_load_imbalance = with_experts % 2 == 0 ? 1.0 : 2.0;
    expect_recompute_cost(c);
    ++with_experts;
  }
  EXPECT_GT(with_experts, 30);
}

// The reductions of step.h (one node stands for all, a few micro-batches for all) change
// nothing: fixed layouts whose groups span nodes, then random ones on 16 and 32 GPUs.
std::vector<Scenario> reduction_scenarios() {
  std::vector<Scenario> out;
  out.push_back(make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "RSE", Checkpointing::kFull, 1, 4));
  out.push_back(make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "ESR", Checkpointing::kNone, 1, 6));
  out.push_back(make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 2, 4, "SER", Checkpointing::kSelective, 2, 4));
  out.push_back(make_scenario("mixtral-8x7b", "p5.48xlarge", 16, 4, 2, "ERS", Checkpointing::kFull, 1, 4));
  out.push_back(make_scenario("mixtral-8x7b", "p4d.24xlarge", 32, 8, 4, "ESR", Checkpointing::kFull, 1, 5));
  out.push_back(make_scenario("mixtral-8x7b", "p4d.24xlarge", 32, 2, 4, "RES", Checkpointing::kNone, 1, 4));
  out.push_back(make_scenario("mixtral-8x7b", "p5.48xlarge", 32, 4, 8, "SRE", Checkpointing::kSelective, 1, 5));
  out.push_back(make_scenario("mixtral-tiny", "p4d.24xlarge", 32, 8, 1, "ESR", Checkpointing::kFull, 4, 6, 512));
  Scenario offload = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "SRE", Checkpointing::kFull, 1, 5);
  offload.parallel.activation_offloading = true;
  offload.parallel.activation_loading_horizon = 2;
  out.push_back(offload);
  int n = 0;
  for (Scenario c : random_scenarios(5, 2 * kScenariosPerProperty)) {
    if (c.parallel.world_size == 8 || n == 40) continue;
    c.parallel.gradient_accumulation_steps = 4 + n++ % 3;
    c.training.global_batch_tokens = c.parallel.world_size * c.parallel.micro_batch_size *
                                     c.parallel.gradient_accumulation_steps * c.training.seq_len;
    out.push_back(c);
  }
  return out;
}

TEST(StepReductions, OneNodeStandsForAll) {
  for (const Scenario& c : reduction_scenarios()) {
    ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
    const StepSimulation reduced = simulate_step(c.config());
    const StepSimulation full = simulate_step(c.config(), {.all_ranks = true});
    EXPECT_EQ(reduced.ranks.size(), static_cast<size_t>(c.cluster.gpus_per_node));
    EXPECT_EQ(full.ranks.size(), static_cast<size_t>(c.parallel.world_size));
    EXPECT_EQ(step_ns(reduced), step_ns(full)) << c.describe();
  }
}

// The extrapolated step equals the fully simulated one to the nanosecond. The period repeated
// for the micro-batches not simulated is a middle one: the last micro-batch is shorter (no
// later all-gathers compete with its reduce-scatters for the card). Case that caught it
// (LastSimulatedMicroBatchIsNotAMiddleOne below): mixtral-tiny, 16 x p4d.24xlarge, E4 S4 R1
// RSE, ckpt=none, mbs=4, ga=4, seq=512: micro-batches end 763,804, 634,276, 634,276 and
// 602,674 ns apart; repeating the last gap came out 31,602 ns short.
// So does the time node 0's network card is busy: the step's gradient sync crosses it once,
// each micro-batch's collectives once per micro-batch.
TEST(StepReductions, FewMicroBatchesStandForAll) {
  int reduced_runs = 0, reduced_card_runs = 0;
  for (const Scenario& c : reduction_scenarios()) {
    const StepSimulation reduced = simulate_step(c.config());
    const StepSimulation full = simulate_step(c.config(), {.all_micro_batches = true});
    EXPECT_EQ(full.micro_batches, c.parallel.gradient_accumulation_steps);
    if (reduced.micro_batches < full.micro_batches) ++reduced_runs;
    if (reduced.micro_batches < full.micro_batches && full.nic_busy_s > 0) ++reduced_card_runs;
    EXPECT_EQ(step_ns(reduced), step_ns(full)) << c.describe();
    EXPECT_NEAR(reduced.nic_busy_s, full.nic_busy_s, 1e-4 * full.nic_busy_s) << c.describe();  // ns rounding of each flow
  }
  EXPECT_GT(reduced_runs, 0) << "no scenario exercises the extrapolation";
  EXPECT_GT(reduced_card_runs, 0) << "no scenario extrapolates the network card";
}

TEST(StepReductions, LastSimulatedMicroBatchIsNotAMiddleOne) {
  const Scenario c = make_scenario("mixtral-tiny", "p4d.24xlarge", 16, 4, 4, "RSE", Checkpointing::kNone, 4, 4, 512);
  ASSERT_TRUE(validate(c.config()).empty());
  const StepSimulation reduced = simulate_step(c.config());
  const StepSimulation full = simulate_step(c.config(), {.all_micro_batches = true});
  ASSERT_LT(reduced.micro_batches, full.micro_batches);
  EXPECT_EQ(step_ns(reduced), step_ns(full)) << c.describe();
}

// Trace structure, shared by the in-memory trace and the file the CLI writes.
void expect_trace_structure(const Json& j, int64_t world) {
  ASSERT_TRUE(j.contains("traceEvents"));
  const Json& events = j["traceEvents"];
  ASSERT_TRUE(events.is_array());
  std::map<int64_t, bool> process_named;
  std::map<std::pair<int64_t, int64_t>, bool> thread_named;
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> intervals;  // (start, end) ns
  size_t complete = 0;
  for (const Json& e : events) {
    ASSERT_TRUE(e.is_object());
    ASSERT_TRUE(e.contains("ph") && e["ph"].is_string());
    const std::string ph = e["ph"];
    if (ph == "M") {
      ASSERT_TRUE(e.contains("name") && e["name"].is_string()) << e.dump();
      ASSERT_TRUE(e.contains("pid") && e["pid"].is_number_integer()) << e.dump();
      const std::string name = e["name"];
      if (name == "thread_name") {
        ASSERT_TRUE(e.contains("tid") && e["tid"].is_number_integer()) << e.dump();
      }
      if (name == "process_name") process_named[e["pid"]] = true;
      else if (name == "thread_name") thread_named[{e["pid"], e["tid"]}] = true;
      else ADD_FAILURE() << "unexpected metadata event " << e.dump();
      continue;
    }
    if (ph == "C") {  // a rank's memory curve
      ASSERT_EQ(e.value("name", ""), "memory") << e.dump();
      ASSERT_TRUE(e.contains("pid") && e["pid"].is_number_integer()) << e.dump();
      ASSERT_TRUE(e.contains("args") && e["args"].contains("bytes") && e["args"]["bytes"].is_number()) << e.dump();
      EXPECT_GE(e["args"]["bytes"].get<double>(), 0.0);
      continue;
    }
    ASSERT_EQ(ph, "X") << e.dump();
    ++complete;
    ASSERT_TRUE(e.contains("name") && e["name"].is_string()) << e.dump();
    ASSERT_TRUE(e.contains("cat") && e["cat"].is_string()) << e.dump();
    ASSERT_TRUE(e.contains("ts") && e["ts"].is_number()) << e.dump();
    ASSERT_TRUE(e.contains("dur") && e["dur"].is_number()) << e.dump();
    ASSERT_TRUE(e.contains("pid") && e["pid"].is_number_integer()) << e.dump();
    ASSERT_TRUE(e.contains("tid") && e["tid"].is_number_integer()) << e.dump();
    const int64_t pid = e["pid"];
    const int64_t tid = e["tid"];
    EXPECT_GE(pid, 0);
    EXPECT_LT(pid, world);
    EXPECT_GE(tid, 0);
    EXPECT_LT(tid, kTraceStreamCount);
    EXPECT_GE(e["dur"].get<double>(), 0) << e.dump();
    ASSERT_TRUE(e.contains("args") && e["args"].is_object()) << e.dump();
    ASSERT_TRUE(e["args"].contains("start_ns") && e["args"]["start_ns"].is_number_integer()) << e.dump();
    ASSERT_TRUE(e["args"].contains("duration_ns") && e["args"]["duration_ns"].is_number_integer()) << e.dump();
    const int64_t start = e["args"]["start_ns"];
    const int64_t duration = e["args"]["duration_ns"];
    EXPECT_GE(duration, 0) << e.dump();
    // ts and dur are the same times in microseconds.
    EXPECT_EQ(std::llround(e["ts"].get<double>() * 1000.0), start) << e.dump();
    EXPECT_EQ(std::llround(e["dur"].get<double>() * 1000.0), duration) << e.dump();
    intervals[{pid, tid}].emplace_back(start, start + duration);
  }
  EXPECT_GT(complete, 0u);
  for (auto& [key, list] : intervals) {
    EXPECT_TRUE(process_named[key.first]) << "pid " << key.first << " has no process_name";
    EXPECT_TRUE((thread_named[key])) << "pid " << key.first << " tid " << key.second << " has no thread_name";
    std::stable_sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i)
      EXPECT_GE(list[i].first, list[i - 1].second)
          << "pid " << key.first << " tid " << key.second << ": event at " << list[i].first
          << " ns starts before the previous one ends at " << list[i - 1].second << " ns";
  }
}

// The checker itself catches what it looks for.
TEST(StepTrace, CheckerRejectsOverlapsAndStrayRanks) {
  Trace t;
  t.source = "simulated";
  t.ranks = 2;
  t.events.push_back({"a", "compute", 0, 100, 0, TraceStream::kCompute, 0, 0});
  t.events.push_back({"b", "compute", 99, 10, 0, TraceStream::kCompute, 0, 0});
  const Json overlapping = parse_json_text(to_json(t).dump(), "overlapping");
  EXPECT_NONFATAL_FAILURE(expect_trace_structure(overlapping, 2), "starts before the previous one ends");
  t.events[1].start_ns = 100;  // back to back is fine
  const Json touching = parse_json_text(to_json(t).dump(), "touching");
  expect_trace_structure(touching, 2);
  t.events[1].rank = 2;  // a rank beyond the world
  t.ranks = 3;
  const Json stray = parse_json_text(to_json(t).dump(), "stray");
  EXPECT_NONFATAL_FAILURE(expect_trace_structure(stray, 2), "(pid) < (world)");
  Json unnamed = parse_json_text(to_json(t).dump(), "unnamed");
  unnamed["traceEvents"].erase(0);  // rank 0's process_name
  EXPECT_NONFATAL_FAILURE(expect_trace_structure(unnamed, 3), "has no process_name");
}

TEST(StepTrace, StructureAndRoundTrip) {
  // Every stream in use: experts across nodes (ESR), sharding, offloading.
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "ESR", Checkpointing::kFull, 1, 2);
  c.parallel.activation_offloading = true;
  for (bool all_ranks : {false, true}) {
    const StepSimulation s = simulate_step(c.config(), {.all_ranks = all_ranks});
    const Trace trace = step_trace(s);
    const std::string text = to_json(trace).dump();
    const Json parsed = parse_json_text(text, "trace");
    expect_trace_structure(parsed, c.parallel.world_size);
    std::array<bool, kTraceStreamCount> used{};
    for (const TraceEvent& e : trace.events) used[static_cast<size_t>(e.stream)] = true;
    for (int stream = 0; stream < kTraceStreamCount; ++stream) EXPECT_TRUE(used[static_cast<size_t>(stream)]) << stream;
    // Compute ops are drawn as their kernels, which fill each op's interval exactly: the busy
    // time of every (rank, stream) is the graph's; other ops are drawn whole.
    EXPECT_GT(trace.events.size(), s.graph.ops().size());
    std::map<std::pair<int64_t, int>, int64_t> busy_graph, busy_trace;
    for (size_t i = 0; i < s.graph.ops().size(); ++i) {
      const Op& op = s.graph.ops()[i];
      busy_graph[{s.ranks[static_cast<size_t>(op.rank)], static_cast<int>(op.stream)}] +=
          (s.times.end[i] - s.times.start[i]).count();
    }
    bool kernel_seen = false;
    for (const TraceEvent& e : trace.events) {
      busy_trace[{e.rank, static_cast<int>(e.stream)}] += e.duration_ns;
      kernel_seen |= e.name == "mb0.L0.qkv.attn_fwd";
    }
    EXPECT_EQ(busy_trace, busy_graph);
    EXPECT_TRUE(kernel_seen);
    EXPECT_EQ(trace_from_json(parsed, "trace"), trace);
  }
}

// The memory curve: the resident bytes, plus each block's kept activations from the end of its
// forward to the end of its backward (on the host while offloaded).
TEST(StepTrace, MemoryCurveHoldsEachBlocksActivationsUntilItsBackward) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "ESR", Checkpointing::kFull, 1, 2);
  constexpr double kResident = 5e9;
  const auto curve_of = [&](bool offload) {
    c.parallel.activation_offloading = offload;
    const StepSimulation s = simulate_step(c.config());
    EXPECT_GT(s.block_activation_bytes, 0);
    const Trace t = step_trace(s, kResident);
    std::map<int64_t, std::vector<MemorySample>> by_rank;
    for (const MemorySample& m : t.memory) by_rank[m.rank].push_back(m);
    EXPECT_EQ(by_rank.size(), s.ranks.size());
    double peak = 0;
    for (const auto& [rank, samples] : by_rank) {
      EXPECT_DOUBLE_EQ(samples.front().bytes, kResident) << rank;
      EXPECT_NEAR(samples.back().bytes, kResident, 1.0) << rank;  // every block's backward has run
      for (size_t i = 1; i < samples.size(); ++i) EXPECT_LT(samples[i - 1].time_ns, samples[i].time_ns);
      for (const MemorySample& m : samples) peak = std::max(peak, m.bytes);
    }
    return std::make_pair(peak, s.block_activation_bytes);
  };
  // Without offloading, micro-batches one after the other: every block of one micro-batch at
  // the end of its forward.
  const auto [kept, block] = curve_of(false);
  EXPECT_NEAR(kept, kResident + static_cast<double>(c.model.num_layers) * block, 1.0);
  // Offloaded, the device holds a few blocks at a time.
  const auto [offloaded, block2] = curve_of(true);
  EXPECT_LT(offloaded, kResident + 0.5 * static_cast<double>(c.model.num_layers) * block2);
  EXPECT_GE(offloaded, kResident + block2 - 1.0);
}

// A fresh folder for the real command line; the tests remove it unless they fail (its logs).
std::filesystem::path command_dir() {
  std::string dir_template = (std::filesystem::temp_directory_path() / "moeplan_step_test_XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + dir_template);
  return dir_template;
}

// `moeplan <args>` run in `dir`, its output in `log` there; its exit status.
int run_moeplan_in(const std::filesystem::path& dir, const std::string& args, const std::string& log) {
  const std::string cd = "cd '" + dir.string() + "' && '" + MOEPLAN_BINARY + "'";
  return std::system((cd + " " + args + " > " + log + " 2>&1").c_str());
}

// The trace file of the real command line, from a plan the real search wrote.
TEST(StepTrace, CommandLineWritesTheSameStructure) {
  ASSERT_TRUE(std::filesystem::exists(MOEPLAN_BINARY)) << MOEPLAN_BINARY << " is not built";
  const std::filesystem::path dir = command_dir();
  ASSERT_EQ(run_moeplan_in(dir, "search --gpus 16 --profiles '" MOEPLAN_PROFILE_DIR "' --out plan.json", "search.log"), 0)
      << "see " << dir / "search.log";
  ASSERT_EQ(run_moeplan_in(dir, "simulate plan.json --trace sim.json", "simulate.log"), 0) << "see " << dir / "simulate.log";
  const Json j = parse_json_text(test::read_text(dir / "sim.json"), (dir / "sim.json").string());
  expect_trace_structure(j, 16);
  EXPECT_EQ(j["otherData"]["source"], "simulated");
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

// `moeplan simulate` of a DeepSeek-V3 plan on 256 H100 (InfiniBand, DeepEP's dispatch) splits a
// micro-batch by operation: latent attention's projections, the shared expert, the token
// permutation and the exchanges by kind, and says which dispatcher the plan uses.
TEST(StepTrace, SimulateSplitsAMicroBatchByOperation) {
  ASSERT_TRUE(std::filesystem::exists(MOEPLAN_BINARY)) << MOEPLAN_BINARY << " is not built";
  const std::filesystem::path dir = command_dir();
  ASSERT_EQ(run_moeplan_in(dir,
                           "search --model deepseek-v3 --instance dgx-h100 --gpus 256 --target megatron --seq-len 4096"
                           " --dispatcher deepep --expert-parallel-degree 16 --tensor-parallel-degree 2"
                           " --expert-tensor-parallel-degree 1 --context-parallel-degree 2 --pipeline-parallel-degree 16"
                           " --profiles '" MOEPLAN_PROFILE_DIR "' --out plan.json",
                           "search.log"),
            0)
      << "see " << dir / "search.log";
  ASSERT_EQ(run_moeplan_in(dir, "simulate plan.json", "simulate.log"), 0) << "see " << dir / "simulate.log";
  const std::string out = test::read_text(dir / "simulate.log");
  for (const char* op : {"token exchange: deepep over the 16 ranks", "one micro-batch on rank 0 by operation", "q_up",
                         "kv_up", "shared_expert.fc1", "permute", "dispatch (all_to_all)", "combine_bwd (all_to_all)"})
    EXPECT_NE(out.find(op), std::string::npos) << op << " missing from\n" << out;
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

// Determinism: the same configuration simulates to the same times and the same trace text,
// also with another simulation run in between (no state survives a run).
TEST(StepDeterminism, SameConfigurationSameResult) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 32, 8, 2, "ESR", Checkpointing::kFull, 1, 3);
  c.parallel.activation_offloading = true;
  const Scenario other = make_scenario("mixtral-tiny", "p5.48xlarge", 16, 4, 4, "SER", Checkpointing::kSelective, 2, 2);
  for (bool all_ranks : {false, true}) {
    const StepSimulation first = simulate_step(c.config(), {.all_ranks = all_ranks});
    simulate_step(other.config());
    const StepSimulation second = simulate_step(c.config(), {.all_ranks = all_ranks});
    EXPECT_EQ(first.times.end, second.times.end);
    EXPECT_EQ(first.times.start, second.times.start);
    EXPECT_EQ(first.times.makespan, second.times.makespan);
    EXPECT_EQ(first.times.events, second.times.events);
    EXPECT_EQ(first.times.nic_busy, second.times.nic_busy);
    EXPECT_EQ(to_json(step_trace(first)).dump(), to_json(step_trace(second)).dump());
  }
}

}  // namespace
}  // namespace moeplan::sim

// ---------------------------------------------------------------------------------------------
// A calibrated CPU profile: measured op times, collectives in the compute stream.

namespace moeplan::sim {
namespace {

Scenario calibrated_cpu(int64_t e, int64_t s, Checkpointing ckpt, int64_t micro_batch) {
  Scenario c = make_scenario("mixtral-tiny", "local-cpu", 2, e, s, "RSE", ckpt, micro_batch, 4, 256);
  c.training.precision = Precision::kFp32;
  c.training.global_batch_tokens = 2 * micro_batch * 4 * 256;
  OpTimes& t = c.cluster.op_times;
  t = OpTimes{};
  t.hidden_size = 128;
  t.intermediate_size = 256;
  t.num_attention_heads = 4;
  t.num_key_value_heads = 2;
  t.head_dim = 32;
  t.num_experts = 8;
  t.experts_per_token = 2;
  t.vocab_size = 4096;
  t.seq_len = 256;
  t.precision = "fp32";
  t.num_layers = c.model.num_layers;
  t.attention_forward = {{256, 0.002}, {1024, 0.008}};
  t.attention_backward = {{256, 0.005}, {1024, 0.020}};
  t.router_forward = {{256, 0.0005}, {1024, 0.002}};
  t.router_backward = {{256, 0.0005}, {1024, 0.002}};
  t.expert_forward = {{16, 0.0001}, {4096, 0.0256}};
  t.expert_backward = {{16, 0.0002}, {4096, 0.0512}};
  t.head = {{256, 0.04}, {1024, 0.16}};
  t.optimizer = {{1e5, 0.001}, {1e7, 0.1}};
  return c;
}

// Under each checkpointing, the analytic estimate is within 10% of the simulated step and its
// bound stays below it.
void expect_analytic_near_the_simulation(Scenario c) {
  for (const Checkpointing ckpt : {Checkpointing::kNone, Checkpointing::kFull, Checkpointing::kSelective}) {
    c.parallel.activation_checkpointing = ckpt;
    const StepEstimate analytic = estimate_step(c.config(), layout_shapes(c.cluster, c.parallel));
    const double simulated = simulate_step(c.config(), {}).estimate.step_time_s;
    EXPECT_LE(analytic.lower_bound_s, simulated * (1 + 1e-6)) << name_of(kCheckpointingNames, ckpt);
    EXPECT_NEAR(analytic.step_time_s, simulated, 0.1 * simulated) << name_of(kCheckpointingNames, ckpt);
  }
}

TEST(CalibratedProfile, MeasuredOpTimesReplaceTheFlopModel) {
  const Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  ASSERT_TRUE(op_times_apply(c.config()));
  const OpCosts o = op_costs(c.config());
  EXPECT_TRUE(o.measured);
  EXPECT_DOUBLE_EQ(o.attention_forward_s, 0.004);  // 512 tokens, between the two points
  EXPECT_DOUBLE_EQ(o.attention_backward_s, 0.010);
  EXPECT_DOUBLE_EQ(o.head_s, 0.08);
  // Router at 512 tokens plus 8 local experts on 2 x 512 / 8 = 128 rows each, at load 1.
  EXPECT_NEAR(moe_forward_seconds(c.config(), 1.0), 0.001 + 8 * 0.0008, 1e-12);
  EXPECT_NEAR(moe_backward_seconds(c.config(), 1.0), 0.001 + 8 * 0.0016, 1e-12);
  // Other shapes (or precision) fall back to FLOPs.
  Scenario other = c;
  other.training.seq_len = 512;
  EXPECT_FALSE(op_times_apply(other.config()));
  other = c;
  other.training.precision = Precision::kBf16;
  EXPECT_FALSE(op_times_apply(other.config()));
  EXPECT_FALSE(op_costs(other.config()).measured);
  // Attention with q/k norms (Qwen3-MoE's) is another operation: times measured with them apply
  // to such a model only, and times measured without them not to it.
  other = c;
  other.model.qk_norm = true;
  EXPECT_FALSE(op_times_apply(other.config()));
  other.cluster.op_times.blocks.qk_norm = true;
  EXPECT_TRUE(op_times_apply(other.config()));
  EXPECT_DOUBLE_EQ(op_costs(other.config()).attention_forward_s, 0.004);
  other.model.qk_norm = false;
  EXPECT_FALSE(op_times_apply(other.config()));
}

// The operations of calibrated_cpu measured at T = 2: attention and the head at about half
// their time, each expert at 0.6 of it.
TensorSplitTimes split_in_two() {
  TensorSplitTimes split;
  split.tensor_parallel_degree = 2;
  split.attention_forward = {{256, 0.0012}, {1024, 0.0048}};
  split.attention_backward = {{256, 0.003}, {1024, 0.012}};
  split.expert_forward = {{16, 0.00006}, {4096, 0.01536}};
  split.expert_backward = {{16, 0.00012}, {4096, 0.03072}};
  split.head = {{256, 0.024}, {1024, 0.096}};
  return split;
}

TEST(CalibratedProfile, TensorSplitsUseTheTimesMeasuredAtThatSplit) {
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  c.parallel.expert_parallel_degree = 1;
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  EXPECT_FALSE(op_times_apply(c.config())) << "no times measured at T = 2: the FLOP model";
  c.cluster.op_times.tensor_splits = {split_in_two()};
  ASSERT_TRUE(op_times_apply(c.config()));
  const OpCosts o = op_costs(c.config());
  EXPECT_TRUE(o.measured);
  EXPECT_DOUBLE_EQ(o.attention_forward_s, 0.0024);  // the split's curve at the whole 512 tokens
  EXPECT_DOUBLE_EQ(o.head_s, 0.048);
  // The whole micro-batch's router (not split), and each of the 8 experts at its part of the
  // width on 2 x 512 / 8 = 128 rows.
  EXPECT_NEAR(moe_forward_seconds(c.config(), 1.0), 0.001 + 8 * 0.00048, 1e-12);
  // Folded (ETP = 1, the expert group of 2 over the two tensor ranks): each rank routes its own
  // 256 tokens to its 4 whole experts, 2 x 256 / 4 = 128 rows each, at the unsplit times; the
  // attention and head are split as before.
  Scenario folded = c;
  folded.parallel.expert_parallel_degree = 2;
  folded.parallel.expert_tensor_parallel_degree = 1;
  ASSERT_TRUE(op_times_apply(folded.config()));
  EXPECT_NEAR(moe_forward_seconds(folded.config(), 1.0), 0.0005 + 4 * 0.0008, 1e-12);
  EXPECT_DOUBLE_EQ(op_costs(folded.config()).attention_forward_s, 0.0024);
  c.parallel.tensor_parallel_degree = 4;
  EXPECT_FALSE(op_times_apply(c.config())) << "measured at T = 2 only";
}

// A split's whole micro-batch, measured with its collectives: what its compute took beyond the
// split operations goes to every block, and each tensor-parallel region costs what the
// collectives took there (two regions per block), with no after-compute extra on top.
TEST(CalibratedProfile, ASplitsWholeMicroBatchPricesItsBlocksAndItsRegions) {
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  TensorSplitTimes split = split_in_two();
  const double layers = static_cast<double>(c.model.num_layers);
  // The split operations at 512 tokens: attention, the whole router, 8 experts on 128 rows of
  // half width, the head's thirds.
  const double forward = layers * (0.0024 + 0.001 + 8 * 0.00048) + 0.048 / 3;
  const double backward = layers * (0.006 + 0.001 + 8 * 0.00096) + 0.048 * 2 / 3;
  split.micro_batch_forward = {{512, forward + layers * 0.001}};
  split.micro_batch_backward = {{512, backward + layers * 0.002}};
  split.collectives_forward = {{512, layers * 2 * 0.0005}};
  split.collectives_backward = {{512, layers * 2 * 0.0007}};
  c.cluster.op_times.tensor_splits = {split};
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(o.framework_forward_s, 0.001, 1e-12);
  EXPECT_NEAR(o.framework_backward_s, 0.002, 1e-12);
  EXPECT_NEAR(o.tensor_region_forward_s, 0.0005, 1e-12);
  EXPECT_NEAR(o.tensor_region_backward_s, 0.0007, 1e-12);
  c.cluster.after_compute = {{{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}};
  const StepSimulation sim = simulate_step(c.config(), {false, true});
  double regions = 0, waited = 0;
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.rank != 0 || (op.kind != OpKind::kTensorForward && op.kind != OpKind::kTensorBackward)) continue;
    regions += to_seconds(sim.times.end[i] - sim.times.start[i]);
    waited += to_seconds(sim.times.collective_wait[static_cast<size_t>(op.collective)]);
  }
  const double micro_batches = static_cast<double>(c.parallel.gradient_accumulation_steps);
  EXPECT_NEAR(regions, micro_batches * layers * 2 * (0.0005 + 0.0007), 1e-6);
  EXPECT_EQ(waited, 0);
  // The analytic estimate prices the regions alike, and its bound stays below the simulation,
  // with recomputed regions too.
  expect_analytic_near_the_simulation(c);
  // Without sequence parallelism (all-reduces, not what was measured) the cost model prices them.
  c.parallel.sequence_parallel = false;
  EXPECT_EQ(op_costs(c.config()).tensor_region_forward_s, 0);
}

TEST(CalibratedProfile, WholeMicroBatchAddsWhatTheOperationsLeaveOut) {
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  const double layers = static_cast<double>(c.model.num_layers);
  const StepSimulation before = simulate_step(c.config(), {false, true});
  // The operations of a micro-batch of 512 tokens: per block attention, router and 8 experts
  // on 128 rows each; the head's forward third and backward two thirds.
  const double forward = layers * (0.004 + 0.001 + 8 * 0.0008) + 0.08 / 3;
  const double backward = layers * (0.010 + 0.001 + 8 * 0.0016) + 0.08 * 2 / 3;
  c.cluster.op_times.micro_batch_forward = {{512, forward + layers * 0.002}};
  c.cluster.op_times.micro_batch_backward = {{512, backward - 0.01}};  // less than the operations: nothing
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(o.framework_forward_s, 0.002, 1e-12);
  EXPECT_DOUBLE_EQ(o.framework_backward_s, 0);
  EXPECT_NEAR(o.attention_forward_s, 0.006, 1e-12);
  EXPECT_DOUBLE_EQ(o.attention_backward_s, 0.010);
  // Every block of every micro-batch runs it.
  const StepSimulation after = simulate_step(c.config(), {false, true});
  const double added = static_cast<double>(c.parallel.gradient_accumulation_steps) * layers * 0.002;
  EXPECT_NEAR(after.estimate.step_time_s - before.estimate.step_time_s, added, 1e-6);
  // A profile without the whole micro-batch adds nothing.
  c.cluster.op_times.micro_batch_forward.clear();
  EXPECT_DOUBLE_EQ(op_costs(c.config()).attention_forward_s, 0.004);
}

TEST(CalibratedProfile, SharedExpertsDenseBlocksAndPredictionModulesFromTheMeasuredExpert) {
  // DeepSeek's blocks: a shared expert of the routed width, a first dense block twice as wide,
  // one multi-token prediction module (a block and a head more).
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  c.model.shared_expert_intermediate_size = 256;
  c.model.first_dense_layers = 1;
  c.model.dense_intermediate_size = 512;
  c.model.mtp_layers = 1;
  EXPECT_FALSE(op_times_apply(c.config())) << "times measured on Mixtral's blocks";
  c.cluster.op_times.blocks = OpTimesBlocks::of(c.model);
  ASSERT_TRUE(op_times_apply(c.config()));
  // The expert's curve: 0.0001 s at 16 rows to 0.0256 at 4,096 (backward twice). The shared
  // expert on the 512 tokens, the dense layer on 2 x 512 rows of the routed width.
  const double shared = 0.0001 + (512 - 16) * 0.0255 / 4080;
  EXPECT_NEAR(moe_forward_seconds(c.config(), 1.0), 0.001 + 8 * 0.0008 + shared, 1e-12);
  OpCosts o = op_costs(c.config());
  const double dense = 0.0001 + (1024 - 16) * 0.0255 / 4080;
  EXPECT_NEAR(o.dense_forward_s, dense, 1e-12);
  EXPECT_NEAR(o.dense_backward_s, 0.0002 + (1024 - 16) * 0.0510 / 4080, 1e-12);
  EXPECT_NEAR(o.head_s, 2 * 0.08, 1e-12);
  // The whole micro-batch ran 5 blocks (4 with experts, the prediction module's among them),
  // one dense, and two heads: what it took beyond them is spread over the 5.
  const double forward = 5 * 0.004 + 4 * (0.001 + 8 * 0.0008 + shared) + dense + 0.16 / 3;
  c.cluster.op_times.micro_batch_forward = {{512, forward + 5 * 0.002}};
  c.cluster.op_times.micro_batch_backward = {{512, 1.0}};
  o = op_costs(c.config());
  EXPECT_NEAR(o.framework_forward_s, 0.002, 1e-12);
  // The shared expert is whole on every expert rank: E = 2 halves the routed experts only.
  Scenario e2 = c;
  e2.parallel.expert_parallel_degree = 2;
  Scenario e2_routed = e2;
  e2_routed.model.shared_expert_intermediate_size = 0;
  e2_routed.cluster.op_times.blocks = OpTimesBlocks::of(e2_routed.model);
  EXPECT_NEAR(moe_forward_seconds(e2.config(), 1.0) - moe_forward_seconds(e2_routed.config(), 1.0), shared, 1e-12);
}

// The whole micro-batch measured with the experts over E = 2 ranks: an E = 2 plan takes what it
// added beyond the operations of 4 local experts on twice the rows; other E keep the one-rank's.
TEST(CalibratedProfile, AnExpertSplitsWholeMicroBatchPricesItsBlocks) {
  Scenario c = calibrated_cpu(2, 1, Checkpointing::kNone, 2);
  const double layers = static_cast<double>(c.model.num_layers);
  // The one rank's: 8 experts on 128 rows; at E = 2, 4 experts on 256 rows each.
  const double forward = layers * (0.004 + 0.001 + 8 * 0.0008) + 0.08 / 3;
  const double backward = layers * (0.010 + 0.001 + 8 * 0.0016) + 0.08 * 2 / 3;
  c.cluster.op_times.micro_batch_forward = {{512, forward + layers * 0.002}};
  c.cluster.op_times.micro_batch_backward = {{512, backward + layers * 0.003}};
  const double row256 = 0.0001 + (256 - 16) * 0.0255 / 4080;
  ExpertSplitTimes split;
  split.expert_parallel_degree = 2;
  split.micro_batch_forward = {{512, layers * (0.004 + 0.001 + 4 * row256 + 0.005) + 0.08 / 3}};
  split.micro_batch_backward = {{512, layers * (0.010 + 0.001 + 4 * 2 * row256 + 0.007) + 0.08 * 2 / 3}};
  split.exchange_forward = split.exchange_backward = {{512, 0.001}};
  const OpCosts before = op_costs(c.config());
  EXPECT_NEAR(before.framework_forward_s, 0.002, 1e-12);
  c.cluster.op_times.expert_splits = {split};
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(o.framework_forward_s, 0.005, 1e-12);
  EXPECT_NEAR(o.framework_backward_s, 0.007, 1e-12);
  Scenario e1 = calibrated_cpu(1, 2, Checkpointing::kNone, 2);
  e1.cluster.op_times = c.cluster.op_times;
  EXPECT_NEAR(op_costs(e1.config()).framework_forward_s, 0.002, 1e-12);
}

// The whole micro-batch measured with the states sharded over S = 2 ranks: an S = 2 plan's
// gathers carry what it took beyond the one-rank micro-batch, each block's forward and backward
// gathers their block's share, the reduce-scatters nothing of their own and no after-compute
// extra; the analytic estimate prices it alike. Other layouts keep the cost model's.
TEST(CalibratedProfile, AShardSplitsWholeMicroBatchPricesTheGathers) {
  Scenario c = calibrated_cpu(1, 2, Checkpointing::kNone, 2);
  ASSERT_TRUE(c.parallel.shards_states());
  const double layers = static_cast<double>(c.model.num_layers);
  c.cluster.op_times.micro_batch_forward = {{512, 0.1}};
  c.cluster.op_times.micro_batch_backward = {{512, 0.2}};
  c.cluster.after_compute = {{{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}};
  const OpCosts before = op_costs(c.config());
  ShardSplitTimes split;
  split.hybrid_shard_degree = 2;
  split.micro_batch_forward = {{512, 0.1 + layers * 0.003}};
  split.micro_batch_backward = {{512, 0.2 + layers * 0.005}};
  c.cluster.op_times.shard_splits = {split};
  const OpCosts o = op_costs(c.config());
  EXPECT_TRUE(o.shard_measured);
  EXPECT_NEAR(o.shard_forward_s, 0.003, 1e-12);
  EXPECT_NEAR(o.shard_backward_s, 0.005, 1e-12);
  EXPECT_NEAR(o.framework_forward_s, before.framework_forward_s, 1e-12);  // the one rank's, unchanged
  const StepSimulation sim = simulate_step(c.config(), {false, true});
  double forward = 0, backward = 0, scattered = 0, waited = 0;
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.rank != 0 || op.collective < 0 || op.layer < 0) continue;
    const double seconds = to_seconds(sim.times.end[i] - sim.times.start[i]);
    if (op.kind == OpKind::kGatherForward) forward += seconds;
    else if (op.kind == OpKind::kGatherBackward) backward += seconds;
    else if (op.kind == OpKind::kReduceScatter) scattered += seconds;
    else continue;
    waited += to_seconds(sim.times.collective_wait[static_cast<size_t>(op.collective)]);
  }
  const double micro_batches = static_cast<double>(c.parallel.gradient_accumulation_steps);
  EXPECT_NEAR(forward, micro_batches * layers * 0.003, 1e-6);
  EXPECT_NEAR(backward, micro_batches * layers * 0.005, 1e-6);
  EXPECT_NEAR(scattered, 0, 1e-9);
  EXPECT_EQ(waited, 0);
  expect_analytic_near_the_simulation(c);
  // Measured over 4 ranks, it prices no S = 2 plan.
  c.cluster.op_times.shard_splits[0].hybrid_shard_degree = 4;
  EXPECT_FALSE(op_costs(c.config()).shard_measured);
}

// The whole micro-batch measured with every block recomputed: a fully recomputed plan's blocks
// take the forward's difference in forward (they run without autograd), and recompute what the
// backward took beyond the other's; the analytic estimate prices it alike. Other checkpointing,
// and a profile without those two curves, price a recompute as the forward.
TEST(CalibratedProfile, AFullyRecomputedBlockIsPricedFromItsWholeMicroBatches) {
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kFull, 2);
  const double layers = static_cast<double>(c.model.num_layers);
  OpTimes& t = c.cluster.op_times;
  t.micro_batch_forward = {{512, 0.1}};
  t.micro_batch_backward = {{512, 0.2}};
  const OpCosts before = op_costs(c.config());
  EXPECT_EQ(before.recompute_beyond_forward_s, 0);
  // Without autograd the forward takes 1 ms a block less; the backward 0.05 s more in all.
  t.recomputed_micro_batch_forward = {{512, 0.1 - layers * 0.001}};
  t.recomputed_micro_batch_backward = {{512, 0.2 + 0.05}};
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(o.attention_forward_s, before.attention_forward_s - 0.001, 1e-12);
  const double blocks_forward = (0.1 - 0.08 / 3) / layers;  // the head at 512 tokens: 0.08 s
  EXPECT_NEAR(o.recompute_beyond_forward_s, 0.05 / layers - blocks_forward + 0.001, 1e-12);
  // Each micro-batch's recompute, its blocks' attention and experts, is the 0.05 s measured.
  const StepSimulation sim = simulate_step(c.config(), {false, true});
  double recomputed = 0;
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.rank == 0 && (op.kind == OpKind::kAttentionRecompute || op.kind == OpKind::kExpertRecompute))
      recomputed += to_seconds(sim.times.end[i] - sim.times.start[i]);
  }
  EXPECT_NEAR(recomputed, static_cast<double>(c.parallel.gradient_accumulation_steps) * 0.05, 1e-6);
  expect_analytic_near_the_simulation(c);
  // Selective recomputation keeps its own pricing.
  c.parallel.activation_checkpointing = Checkpointing::kSelective;
  const OpCosts selective = op_costs(c.config());
  EXPECT_EQ(selective.recompute_beyond_forward_s, 0);
  EXPECT_NEAR(selective.attention_forward_s, before.attention_forward_s, 1e-12);
}

// What the expert group's collectives took inside that micro-batch (the waits for the rank that
// came last included) prices each sync point of the exchange: three per MoE block forward (the
// counts, the dispatch, the combine), two backward, and the forward's again where a block is
// recomputed, with no after-compute extra on top.
TEST(CalibratedProfile, AnExpertSplitsExchangesCostWhatTheyTookInsideItsMicroBatch) {
  Scenario c = calibrated_cpu(2, 1, Checkpointing::kNone, 2);
  const double layers = static_cast<double>(c.model.num_layers);
  ExpertSplitTimes split;
  split.expert_parallel_degree = 2;
  split.micro_batch_forward = split.micro_batch_backward = {{512, 1.0}};
  split.exchange_forward = {{512, layers * 3 * 0.004}};
  split.exchange_backward = {{512, layers * 2 * 0.006}};
  c.cluster.after_compute = {{{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}, {{1e-3, 1e-4}, {1.0, 0.1}}};
  const double before = simulate_step(c.config(), {}).estimate.step_time_s;
  c.cluster.op_times.expert_splits = {split};
  const OpCosts o = op_costs(c.config());
  EXPECT_NEAR(o.expert_exchange_forward_s, 0.004, 1e-12);
  EXPECT_NEAR(o.expert_exchange_backward_s, 0.006, 1e-12);
  for (const Checkpointing ckpt : {Checkpointing::kNone, Checkpointing::kFull}) {
    c.parallel.activation_checkpointing = ckpt;
    const StepSimulation sim = simulate_step(c.config(), {false, true});
    double forward = 0, backward = 0, waited = 0;
    for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
      const Op& op = sim.graph.ops()[i];
      if (op.rank != 0 || op.collective < 0) continue;
      const double seconds = to_seconds(sim.times.end[i] - sim.times.start[i]);
      switch (op.kind) {
        case OpKind::kDispatchCounts: case OpKind::kDispatch: case OpKind::kCombine:
        case OpKind::kDispatchRecompute: case OpKind::kCombineRecompute: forward += seconds; break;
        case OpKind::kDispatchBackward: case OpKind::kCombineBackward: backward += seconds; break;
        default: continue;
      }
      waited += to_seconds(sim.times.collective_wait[static_cast<size_t>(op.collective)]);
    }
    const double micro_batches = static_cast<double>(c.parallel.gradient_accumulation_steps);
    const double recomputed = ckpt == Checkpointing::kFull ? 2.0 : 1.0;
    EXPECT_NEAR(forward, recomputed * micro_batches * layers * 3 * 0.004, 1e-6) << name_of(kCheckpointingNames, ckpt);
    EXPECT_NEAR(backward, micro_batches * layers * 2 * 0.006, 1e-6) << name_of(kCheckpointingNames, ckpt);
    EXPECT_EQ(waited, 0);
  }
  // The analytic estimate prices them alike, and its bound stays below the simulation.
  expect_analytic_near_the_simulation(c);
  EXPECT_GT(simulate_step(c.config(), {}).estimate.step_time_s, before);
  // The all-gather dispatcher's exchange is not what was measured: the cost model prices it.
  c.moe.dispatcher = Dispatcher::kAllGather;
  EXPECT_EQ(op_costs(c.config()).expert_exchange_forward_s, 0);
}

TEST(CalibratedProfile, APipelineStageAddsWhatTheWholeModelLeftOutPerBlock) {
  // The whole micro-batch ran every block of the model; a stage of P = 2 runs half of them,
  // and each of its blocks gets the same share of what the operations left out.
  Scenario c = calibrated_cpu(1, 1, Checkpointing::kNone, 2);
  const double layers = static_cast<double>(c.model.num_layers);
  const double forward = layers * (0.004 + 0.001 + 8 * 0.0008) + 0.08 / 3;
  const double backward = layers * (0.010 + 0.001 + 8 * 0.0016) + 0.08 * 2 / 3;
  c.cluster.op_times.micro_batch_forward = {{512, forward + layers * 0.002}};
  c.cluster.op_times.micro_batch_backward = {{512, backward + layers * 0.003}};
  Scenario stage = c;
  stage.model.num_layers = c.model.num_layers / 2;
  const OpCosts o = op_costs(stage.config());
  EXPECT_NEAR(o.framework_forward_s, 0.002, 1e-12);
  EXPECT_NEAR(o.framework_backward_s, 0.003, 1e-12);
}

TEST(CalibratedProfile, SerialStreamsAddCommunicationToCompute) {
  for (const auto& [e, s] : {std::pair<int64_t, int64_t>{1, 2}, {2, 1}}) {
    Scenario overlapped = calibrated_cpu(e, s, Checkpointing::kNone, 1);
    Scenario serial = overlapped;
    serial.cluster.comm_overlaps_compute = false;
    const StepSimulation a = simulate_step(overlapped.config(), {false, true});
    const StepSimulation b = simulate_step(serial.config(), {false, true});
    double comm = 0;
    for (const auto& [name, seconds] : phase_seconds(b, 0))
      if (name != "forward" && name != "backward" && name != "optimizer") comm += seconds;
    ASSERT_GT(comm, 0) << e << s;
    // In series every collective's time lies on the rank's own chain. Sharded, the gathers
    // that were prefetched beside compute now wait in line; with experts alone the exchanges
    // were on the chain already, and the gradient all-reduce ahead of the optimizer too.
    if (s > 1)
      EXPECT_GT(b.estimate.step_time_s, a.estimate.step_time_s) << e << s;
    else
      EXPECT_GE(b.estimate.step_time_s, a.estimate.step_time_s) << e << s;
    EXPECT_GE(b.estimate.step_time_s + 1e-9, b.estimate.compute_s + b.estimate.optimizer_s + comm) << e << s;
  }
}

// A framework that syncs gradients only once the last micro-batch's backward is done
// (Megatron-LM through 2022) starts no gradient all-reduce before a rank's backward ends, and
// its step is longer by what the overlapped sync had hidden; in the analytic estimate too.
TEST(StepProperties, GradientSyncWaitsForTheBackwardWhereTheFrameworkDoes) {
  const Scenario overlapped = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 2, 1, "ERS");
  Scenario waiting = overlapped;
  waiting.cluster.overlap_gradient_sync = false;
  auto first_sync_after_backward = [](const StepSimulation& sim) {
    std::map<int32_t, SimTime> backward_end, sync_start;
    const std::vector<Op>& ops = sim.graph.ops();
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      if (op.stream == TraceStream::kCompute && op.kind != OpKind::kOptimizer)
        backward_end[op.rank] = std::max(backward_end[op.rank], sim.times.end[i]);
      if (op.kind == OpKind::kGradAllReduce)
        sync_start[op.rank] = sync_start.contains(op.rank) ? std::min(sync_start[op.rank], sim.times.start[i])
                                                           : sim.times.start[i];
    }
    bool after = !sync_start.empty();
    for (const auto& [rank, start] : sync_start) after = after && start >= backward_end[rank];
    return after;
  };
  const StepSimulation a = simulate_step(overlapped.config(), {});
  const StepSimulation b = simulate_step(waiting.config(), {});
  EXPECT_FALSE(first_sync_after_backward(a));
  EXPECT_TRUE(first_sync_after_backward(b));
  EXPECT_GT(b.estimate.step_time_s, a.estimate.step_time_s);
  const LayoutShapes shapes = layout_shapes(overlapped.cluster, overlapped.parallel);
  const StepEstimate ea = estimate_step(overlapped.config(), shapes);
  const StepEstimate eb = estimate_step(waiting.config(), shapes);
  EXPECT_GT(eb.grad_sync_s, ea.grad_sync_s);
  EXPECT_GT(eb.step_time_s, ea.step_time_s);
}

// When every collective after compute takes a share d of that compute more, every stretch of
// compute on a rank is followed by a collective that costs d times it: the step grows by d
// times its compute, whatever the layout (data parallel, whose micro-batches between the
// simulated ones have no collective of their own, sharded, or expert parallel).
TEST(CalibratedProfile, CollectivesAfterComputeAddAShareOfIt) {
  for (const auto& [e, s] : {std::pair<int64_t, int64_t>{1, 1}, {1, 2}, {2, 1}}) {
    Scenario c = calibrated_cpu(e, s, Checkpointing::kNone, 1);
    c.cluster.comm_overlaps_compute = false;
    c.training.global_batch_tokens *= 4;  // 8 micro-batches: 5 of them repeated
    const Scenario a = c;
    const CurvePoints share{{1e-3, 1e-4}, {1.0, 0.1}};
    c.cluster.after_compute = {share, share, share};
    const StepSimulation before = simulate_step(a.config(), {});
    const StepSimulation after = simulate_step(c.config(), {});
    ASSERT_GT(c.parallel.gradient_accumulation_steps, 3) << e << s;
    EXPECT_NEAR(after.estimate.step_time_s - before.estimate.step_time_s, 0.1 * before.estimate.compute_s,
                0.02 * 0.1 * before.estimate.compute_s)
        << e << s;
    double waited = 0;
    for (SimTime w : after.times.collective_wait) waited += to_seconds(w);
    EXPECT_GT(waited, 0) << e << s;
  }
}

// Before each dispatch, forward and recomputed, the expert group all-gathers its tokens per
// expert (as the executor does to size the exchange); backward reuses the sizes.
TEST(CalibratedProfile, DispatchIsSizedByAnAllGatherOfTokensPerExpert) {
  const Scenario c = calibrated_cpu(2, 1, Checkpointing::kFull, 1);
  const StepSimulation sim = simulate_step(c.config(), {false, true});
  int counts = 0, dispatches = 0;
  for (const Op& op : sim.graph.ops()) {
    if (op.rank != 0) continue;
    if (op.kind == OpKind::kDispatchCounts) {
      ++counts;
      EXPECT_EQ(op.bytes, 2 * 8 * 8);  // 2 ranks x 8 experts x int64
      EXPECT_EQ(op_category(op.kind), "all_gather");
    }
    if (op.kind == OpKind::kDispatch || op.kind == OpKind::kDispatchRecompute) ++dispatches;
  }
  EXPECT_EQ(counts, dispatches);
  EXPECT_EQ(counts, static_cast<int>(2 * c.model.num_layers * c.parallel.gradient_accumulation_steps));
}

// A dense model's feed-forward layer has no router; GPT-3's GELU layer two matrices where
// SwiGLU has three: per micro-batch of 2,048 tokens, 2 x 2048 x 2 x 12288 x 49152 FLOPs.
TEST(DenseModel, FeedForwardFlopsFollowItsMatrices) {
  Scenario c = make_scenario("gpt3-175b", "p4d.24xlarge", 64, 1, 64, "RSE", Checkpointing::kFull, 1, 4, 2048);
  const OpCosts gelu = op_costs(c.config());
  EXPECT_DOUBLE_EQ(gelu.moe_flops, 2.0 * 2048 * 2 * 12288 * 49152.0);
  c.model.mlp = Mlp::kSwiGlu;
  EXPECT_DOUBLE_EQ(op_costs(c.config()).moe_flops, 1.5 * gelu.moe_flops);
  c.model.mlp = Mlp::kGelu;
  const StepSimulation sim = simulate_step(c.config(), {});
  EXPECT_GT(sim.estimate.step_time_s, 0);
  for (const Op& op : sim.graph.ops()) EXPECT_NE(op_category(op.kind), "all_to_all") << "no experts to exchange";
}

// Shared experts take every token through a feed-forward layer of their width beside the
// routed experts: per micro-batch of 2,048 tokens their forward adds 2 x 2048 x 3 x 4096 x W
// FLOPs (split over the tensor-parallel ranks), and the step takes longer. q/k norms add no
// GEMM but time in attention. A profile's measured Mixtral blocks do not price either.
TEST(SharedExperts, EveryTokenPassesThroughThemBesideTheRoutedOnes) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "RSE", Checkpointing::kFull);
  const OpCosts routed = op_costs(c.config());
  const double before = simulate_step(c.config(), {}).estimate.step_time_s;
  c.model.shared_expert_intermediate_size = 14336;
  const OpCosts shared = op_costs(c.config());
  EXPECT_DOUBLE_EQ(shared.moe_flops - routed.moe_flops, 2.0 * 2048 * 3 * 4096 * 14336.0);
  EXPECT_EQ(shared.attention_flops, routed.attention_flops);
  EXPECT_GT(simulate_step(c.config(), {}).estimate.step_time_s, before);
  // The gate: one hidden -> 1 GEMM more.
  c.model.shared_expert_gate = true;
  EXPECT_DOUBLE_EQ(op_costs(c.config()).moe_flops - shared.moe_flops, 2.0 * 2048 * 4096);
  c.model.qk_norm = true;
  const OpCosts normed = op_costs(c.config());
  EXPECT_EQ(normed.attention_flops, routed.attention_flops);
  EXPECT_GT(normed.attention_forward_s, shared.attention_forward_s);

  // Under tensor parallelism each rank computes 1/T of the shared experts' columns, and their
  // output is reduced over the tokens with the routed experts'.
  Scenario t = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 4, 2, "RSE", Checkpointing::kFull);
  t.parallel.tensor_parallel_degree = 2;
  t.parallel.sequence_parallel = true;
  const OpCosts split = op_costs(t.config());
  t.model.shared_expert_intermediate_size = 14336;
  const OpCosts split_shared = op_costs(t.config());
  EXPECT_DOUBLE_EQ(split_shared.moe_flops - split.moe_flops, 2.0 * 2048 * 3 * 4096 * 14336.0 / 2);
  EXPECT_DOUBLE_EQ(split_shared.tensor_moe_bytes - split.tensor_moe_bytes, 2048.0 * 4096 * 2);
}

// With a model's many experts on few ranks, eager kernels run one GEMM per expert: each priced
// once and counted per expert (128 experts on one rank).
TEST(SharedExperts, EagerKernelsCountEveryExpertsGemm) {
  Scenario c = make_scenario("qwen3-30b-a3b", "p4d.24xlarge", 8, 1, 8, "RSE", Checkpointing::kFull);
  c.cluster.kernels = Kernels::kEager;
  const OpCosts eager = op_costs(c.config());
  c.cluster.kernels = Kernels::kFused;
  const OpCosts fused = op_costs(c.config());
  EXPECT_NEAR(eager.moe_flops, fused.moe_flops, 1e-9 * fused.moe_flops);
  // 8 of 2,048 tokens x 8 slots per expert: 2 x 128 x 128 x 3 x 2048 x 768 + the router.
  EXPECT_DOUBLE_EQ(fused.moe_flops, 2.0 * 128 * 128 * 3 * 2048 * 768 + 2.0 * 2048 * 128 * 2048);
}

// Latent attention's kernels: the down and up projections and o_proj do 2 FLOPs per weight and
// token, the core scores over a head's query width and sums over its value width.
TEST(LatentAttention, KernelsFollowItsProjectionsAndHeadWidths) {
  Scenario c = make_scenario("deepseek-v3", "p5.48xlarge", 8, 8, 1, "RSE", Checkpointing::kFull, 1, 2, 4096);
  const OpCosts o = op_costs(c.config());
  const double tokens = 4096;
  const ParamCounts p = count_parameters(c.model);
  EXPECT_DOUBLE_EQ(o.attention_flops,
                   2.0 * tokens * static_cast<double>(p.attention_per_layer) + 2.0 * tokens * 2048 * 128 * (192 + 128));
  // Under T = 2 the up projections and o_proj split by heads; the down projections are whole.
  c.parallel.tensor_parallel_degree = 2;
  c.parallel.sequence_parallel = true;
  c.parallel.expert_parallel_degree = 4;
  c.training.global_batch_tokens = 4 * 2 * 4096;
  const double down = 7168.0 * 1536 + 7168.0 * 576;
  EXPECT_DOUBLE_EQ(op_costs(c.config()).attention_flops,
                   2.0 * tokens * (down + (static_cast<double>(p.attention_per_layer) - down) / 2) +
                       2.0 * tokens * 2048 * 64 * (192 + 128));
}

// latent_up checkpointing remakes every block's heads' q, k and v before its attention backward:
// q_up (4,096 x 1,536 -> 128 x 192) and kv_up (512 -> 128 x (128 + 128)) forward, and the rotary
// embedding; the simulated step recomputes that per block and micro-batch, nothing else.
TEST(LatentAttention, UpProjectionCheckpointingRecomputesTheUpProjections) {
  Scenario c = make_scenario("deepseek-v3", "p5.48xlarge", 8, 8, 1, "RSE", Checkpointing::kLatentUpProjections, 1, 2, 4096);
  ASSERT_TRUE(validate(c.config()).empty()) << c.describe();
  const OpCosts o = op_costs(c.config());
  EXPECT_DOUBLE_EQ(o.latent_up_flops, 2.0 * 4096 * (1536.0 * 128 * 192 + 512.0 * 128 * 256));
  EXPECT_GT(o.latent_up_forward_s, 0);
  EXPECT_LT(o.latent_up_forward_s, 0.2 * o.attention_forward_s);
  const StepSimulation sim = simulate_step(c.config(), {.all_ranks = true, .all_micro_batches = true});
  double recomputed = 0;
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.rank == 0 && op.kind == OpKind::kAttentionRecompute) recomputed += to_seconds(sim.times.end[i] - sim.times.start[i]);
  }
  EXPECT_NEAR(recomputed, 2.0 * static_cast<double>(c.model.blocks()) * o.latent_up_forward_s, 1e-6);
  EXPECT_EQ(op_costs(make_scenario("mixtral-8x7b", "p5.48xlarge", 8, 8, 1, "RSE", Checkpointing::kNone, 1, 2).config())
                .latent_up_forward_s,
            0);
  // Without a query latent (DeepSeek-V2-Lite) the query is projected from the block input again.
  const Scenario lite =
      make_scenario("deepseek-v2-lite", "p5.48xlarge", 8, 8, 1, "RSE", Checkpointing::kLatentUpProjections, 1, 2, 4096);
  EXPECT_DOUBLE_EQ(op_costs(lite.config()).latent_up_flops, 2.0 * 4096 * (2048.0 * 16 * 192 + 512.0 * 16 * 256));
}

// Windowed and full attention (GPT-OSS-20B: 24 blocks, every second one full): the attention
// core of the simulated block sees the blocks' average context, (12 x 128 + 12 x 2048) / 24 of
// the 2,048 keys a query sees without windows at sequence 4,096.
TEST(WindowedAttention, TheCoreSeesTheBlocksAverageContext) {
  Scenario c = make_scenario("gpt-oss-20b", "p5.48xlarge", 8, 8, 1, "RSE", Checkpointing::kFull, 1, 2, 4096);
  ASSERT_TRUE(validate(c.config()).empty());
  const OpCosts windowed = op_costs(c.config());
  c.model.sliding_window.reset();
  c.model.full_attention_step = 0;
  const OpCosts full = op_costs(c.config());
  EXPECT_NEAR(windowed.core_flops / full.core_flops, (12 * 128 + 12 * 2048) / 24.0 / 2048.0, 1e-12);
  EXPECT_LT(windowed.attention_forward_s, full.attention_forward_s);
}

// Token exchanges of rank 0's first micro-batch: one per MoE block.
int dispatches(const StepSimulation& sim) {
  int n = 0;
  for (const Op& op : sim.graph.ops()) n += op.rank == 0 && op.micro_batch == 0 && op.kind == OpKind::kDispatch ? 1 : 0;
  return n;
}

// Dense blocks among MoE blocks (DeepSeek's first blocks): no token exchange and their own
// feed-forward layer over every token. At twice the expert width they do a top-2 block's work
// without its router.
TEST(DenseBlocks, ExchangeNothingAndRunTheirOwnFeedForward) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "RSE", Checkpointing::kFull);
  const StepSimulation all = simulate_step(c.config(), {});
  EXPECT_EQ(dispatches(all), 32);
  c.model.first_dense_layers = 4;
  c.model.dense_intermediate_size = 2 * 14336;
  const OpCosts o = op_costs(c.config());
  const double tokens = static_cast<double>(c.parallel.micro_batch_size * c.training.seq_len);
  EXPECT_DOUBLE_EQ(o.dense_flops, 2.0 * tokens * 3 * 4096 * 28672);
  EXPECT_GT(o.dense_forward_s, 0);
  EXPECT_GT(o.dense_backward_s, o.dense_forward_s);
  const StepSimulation mixed = simulate_step(c.config(), {});
  EXPECT_EQ(dispatches(mixed), 28);
  // The trace draws a dense block's feed-forward layer with its own kernels: no router.
  bool dense_router = false, moe_router = false, dense_fc1 = false;
  for (const TraceEvent& e : step_trace(mixed).events) {
    dense_router |= e.name.rfind("mb0.L0.router", 0) == 0;
    dense_fc1 |= e.name.rfind("mb0.L0.fc1", 0) == 0;
    moe_router |= e.name.rfind("mb0.L4.router", 0) == 0;
  }
  EXPECT_FALSE(dense_router);
  EXPECT_TRUE(dense_fc1);
  EXPECT_TRUE(moe_router);
  EXPECT_NEAR(mixed.estimate.compute_s, all.estimate.compute_s, 0.05 * all.estimate.compute_s);
  // The estimate's token exchanges: those of 28 blocks of 32.
  const LayoutShapes shapes = layout_shapes(c.cluster, c.parallel);
  const double exchanges = estimate_step(c.config(), shapes).expert_comm_s;
  const Scenario plain = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "RSE", Checkpointing::kFull);
  EXPECT_NEAR(exchanges, estimate_step(plain.config(), shapes).expert_comm_s * 28 / 32, 1e-9);
  // A dense block is not split over the expert ranks: each rank gathers its whole feed-forward
  // layer (S = 2 across the two nodes), twice an MoE block's parameters on a rank at E = 8, so
  // the step here is longer.
  EXPECT_DOUBLE_EQ(o.dense_block_unit_bytes, (41'943'040.0 + 8'192 + 3.0 * 4096 * 28672) * 2);
  EXPECT_GT(o.dense_block_unit_bytes, o.dense_unit_bytes + o.expert_unit_bytes);
}

// On a pipeline the stage of dense blocks is lighter than the others, and the simulated stage
// (the last) is scaled to it by compute, not by its number of blocks.
TEST(DenseBlocks, PipelineStagesScaleByTheirBlocksCompute) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 2, 1, "RSE", Checkpointing::kFull, 1, 32);
  c.parallel.pipeline_parallel_degree = 4;
  c.training.global_batch_tokens = 16 / 4 * 32 * c.training.seq_len;
  ASSERT_TRUE(validate(c.config()).empty()) << validate(c.config()).size();
  const OpCosts last = op_costs({stage_model(c.config()), c.cluster, c.parallel, c.moe, c.training});
  const double all_moe = simulate_step(c.config(), {}).estimate.step_time_s;
  c.model.first_dense_layers = 8;
  c.model.dense_intermediate_size = 1024;  // far lighter than two experts of 14,336
  ASSERT_TRUE(validate(c.config()).empty()) << validate(c.config()).size();
  const ModelSpec stage = stage_model(c.config());
  EXPECT_EQ(stage.first_dense_layers, 0);  // the last stage holds MoE blocks only
  const OpCosts o = op_costs({stage, c.cluster, c.parallel, c.moe, c.training});
  EXPECT_DOUBLE_EQ(o.moe_forward_busiest_s, last.moe_forward_busiest_s);
  // The last stage has no dense block, but prices one for the first stage's.
  EXPECT_GT(o.dense_forward_s, 0);
  EXPECT_GT(o.dense_backward_s, o.dense_forward_s);
  const double dense_stage = stage_weight(o, c.parallel, stage_block_counts(c.model, c.parallel, 0));
  const double moe_stage = stage_weight(o, c.parallel, stage_block_counts(c.model, c.parallel, 3));
  EXPECT_LT(dense_stage, 0.7 * moe_stage);
  EXPECT_GT(dense_stage, 0);
  // The stages of MoE blocks set the pace either way; a lighter first stage shortens only the
  // pipeline's fill and drain.
  const double mixed = simulate_step(c.config(), {}).estimate.step_time_s;
  EXPECT_LT(mixed, all_moe);
  EXPECT_GT(mixed, 0.9 * all_moe);
}

// Multi-token prediction: its block is one more MoE block (one more token exchange per
// micro-batch); its projection (2h -> h) and its second pass through the lm head run with the
// head. Under a pipeline they weigh on the last stage only, which then sets the pace.
TEST(MultiTokenPrediction, OneMoreBlockAndLossOnTheLastStage) {
  Scenario c = make_scenario("mixtral-8x7b", "p4d.24xlarge", 16, 8, 2, "RSE", Checkpointing::kFull);
  const OpCosts before = op_costs(c.config());
  const StepSimulation plain = simulate_step(c.config(), {});
  c.model.mtp_layers = 1;
  ASSERT_TRUE(validate(c.config()).empty());
  const OpCosts o = op_costs(c.config());
  const double tokens = static_cast<double>(c.parallel.micro_batch_size * c.training.seq_len);
  const double added = 2.0 * tokens * 4096 * 8192 + 2.0 * tokens * 32000 * 4096;
  EXPECT_NEAR(o.head_flops - before.head_flops, added, 1e-9 * added);
  EXPECT_GT(o.head_s, 1.9 * before.head_s);
  const KernelList head = micro_batch_kernels(c.config()).head_forward;
  int projections = 0;
  for (const Kernel& k : head.kernels()) projections += k.name == "mtp.eh_proj" ? 1 : 0;
  EXPECT_EQ(projections, 1);
  const StepSimulation mtp = simulate_step(c.config(), {});
  EXPECT_EQ(dispatches(mtp), dispatches(plain) + 1);
  EXPECT_GT(mtp.estimate.step_time_s, plain.estimate.step_time_s);
  EXPECT_GT(mtp.estimate.model_flops_per_step, plain.estimate.model_flops_per_step);

  // Four stages of 8 blocks: the last runs 9 and two losses.
  c.parallel.pipeline_parallel_degree = 4;
  c.parallel.expert_parallel_degree = 2;
  c.parallel.hybrid_shard_degree = 1;
  c.training.global_batch_tokens = 16 / 4 * c.parallel.micro_batch_size * 32 * c.training.seq_len;
  c.parallel.gradient_accumulation_steps = 32;
  ASSERT_TRUE(validate(c.config()).empty()) << validate(c.config())[0].to_string();
  const OpCosts last = op_costs({stage_model(c.config()), c.cluster, c.parallel, c.moe, c.training});
  EXPECT_GT(stage_weight(last, c.parallel, stage_block_counts(c.model, c.parallel, 3)),
            stage_weight(last, c.parallel, stage_block_counts(c.model, c.parallel, 2)) * 1.1);
  const double piped = simulate_step(c.config(), {}).estimate.step_time_s;
  c.model.mtp_layers = 0;
  EXPECT_GT(piped, simulate_step(c.config(), {}).estimate.step_time_s);
}

TEST(CalibratedProfile, CollectivesUseTheirOwnFitAndMeasuredSizes) {
  Scenario c = calibrated_cpu(1, 2, Checkpointing::kNone, 1);
  const CostModel plain(c.cluster);
  const GroupShape g = group_shape(c.cluster, c.parallel, MeshDim::kShard);
  const double bytes = 3145728;
  EXPECT_NEAR(plain.all_gather_seconds(bytes, g),
              c.cluster.intra_node_latency_s + 0.5 * bytes / c.cluster.intra_node_bandwidth_bytes_per_s, 1e-12);
  c.cluster.all_gather_fit = {1e-3, 1e9, {{bytes, 0.015}}};
  const CostModel calibrated(c.cluster);
  EXPECT_DOUBLE_EQ(calibrated.all_gather_seconds(bytes, g), 0.015);                     // measured here
  EXPECT_NEAR(calibrated.all_gather_seconds(2 * bytes, g), 1e-3 + bytes / 1e9, 1e-12);  // the line elsewhere
  // The reduce-scatter has no fit of its own: it falls back to the all-gather's.
  EXPECT_DOUBLE_EQ(calibrated.reduce_scatter_seconds(bytes, g), 0.015);
  // Per-unit gathers: a sharded step gathers the embedding, each block's dense part and its
  // experts, and the head (forward and backward).
  const StepSimulation sim = simulate_step(c.config(), {false, true});
  int gathers = 0;
  for (const Op& op : sim.graph.ops())
    if (op.rank == 0 && (op.kind == OpKind::kGatherForward || op.kind == OpKind::kGatherBackward)) ++gathers;
  const int64_t layers = c.model.num_layers;
  EXPECT_EQ(gathers, static_cast<int>(c.parallel.gradient_accumulation_steps * (1 + 2 * layers + 2 + 2 * layers)));
}

}  // namespace
}  // namespace moeplan::sim
