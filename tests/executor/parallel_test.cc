// Multi-rank training through the real binary, on real gloo process groups between local
// processes: every layout of 4 ranks (tensor-parallel ones included) trains the same model to
// the same losses as one rank with the same global batch, and checkpoints move between layouts.

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "moeplan/core/step_record.h"
#include "moeplan/core/trace.h"
#include "run_fixture.h"

namespace moeplan::test {
namespace {

struct Layout {
  std::string name;
  int64_t e, s;
  std::string checkpointing;
  bool offload;
  std::string dispatcher = "alltoall";
  int64_t t = 1;  // tensor-parallel degree, with sequence parallelism
  int64_t p = 1, v = 1;  // pipeline stages, and chunks of each
  int64_t c = 1;         // context-parallel degree (E, when over 1, counts the C ranks)
  std::string exchange = "p2p";
  int64_t etp = 0;       // 1: the T ranks folded into the expert group (E counts them too)
  // The ranks an expert group has beyond the mesh's E dimension, and the readers it spans.
  int64_t fold() const { return (etp == 1 && t > 1 ? t : 1) * (e > 1 ? c : 1); }
  int64_t expert_readers() const { return e / fold(); }
};

std::string layout_name(const ::testing::TestParamInfo<Layout>& info) { return info.param.name; }

using SlotTable = std::vector<std::vector<int64_t>>;  // [layer][expert]

// Whether every table of `seen` is the sum of `per` tables of `reference`, no reference table
// used twice and every one used: an expert group's micro-batch carries the routing of its E
// readers' micro-batches, which one rank computed one by one.
bool sums_of_reference(const std::vector<SlotTable>& seen, size_t next, const std::vector<SlotTable>& reference,
                       std::vector<bool>& used, size_t per) {
  if (next == seen.size()) return std::all_of(used.begin(), used.end(), [](bool u) { return u; });
  // Choose `per` unused reference tables (in increasing order) whose sum is seen[next].
  std::vector<size_t> pick;
  const std::function<bool(size_t)> choose = [&](size_t from) -> bool {
    if (pick.size() == per) {
      SlotTable sum = reference[pick[0]];
      for (size_t i = 1; i < pick.size(); ++i)
        for (size_t l = 0; l < sum.size(); ++l)
          for (size_t e = 0; e < sum[l].size(); ++e) sum[l][e] += reference[pick[i]][l][e];
      if (sum != seen[next]) return false;
      for (size_t i : pick) used[i] = true;
      if (sums_of_reference(seen, next + 1, reference, used, per)) return true;
      for (size_t i : pick) used[i] = false;
      return false;
    }
    for (size_t i = from; i < reference.size(); ++i) {
      if (used[i]) continue;
      pick.push_back(i);
      if (choose(i + 1)) return true;
      pick.pop_back();
    }
    return false;
  };
  return choose(0);
}
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class Parallel : public ::testing::TestWithParam<Layout> {
 protected:
  // Steps of the reference and of each layout: the checkpoint moves resume to step 12 against
  // the reference. A layout that computes something else parts from the one rank's losses and
  // routing at its first step; more steps add time, not checks.
  static constexpr int64_t kSteps = 12;
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
    if (files.empty()) return;
    const Command r = prepare_data(files, dir_->file("data"), 512, 64);
    ASSERT_EQ(r.exit_code, 0) << show(r);
    model_ = write_small_model(*dir_, 512);
    // One rank, 4 micro-batches of one sequence: what 4 ranks of one sequence each train on.
    reference_plan_ = dir_->file("plan-1.json");
    const Command made = make_plan(model_, reference_plan_, 64, 256, "fp32", 1);
    ASSERT_EQ(made.exit_code, 0) << show(made);
    const Command run = run_moeplan("run " + reference_plan_ + " --data " + dir_->file("data") + " --out " +
                                    dir_->file("reference") + " --steps " + std::to_string(kSteps));
    ASSERT_EQ(run.exit_code, 0) << show(run);
    reference_ = read_metrics(dir_->file("reference"));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (model_.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
    ASSERT_EQ(reference_.size(), static_cast<size_t>(kSteps));
  }

  // The reference plan (or another one-rank plan) spread over 4 ranks with the layout's degrees.
  static std::string plan_for(const Layout& l, const std::string& one_rank = reference_plan_) {
    Json plan = read_json_file(one_rank);
    Json& p = plan["parallel"];
    p["world_size"] = 4;
    p["expert_parallel_degree"] = l.e;
    p["hybrid_shard_degree"] = l.s;
    p["tensor_parallel_degree"] = l.t;
    p["sequence_parallel"] = l.t > 1;
    p["pipeline_parallel_degree"] = l.p;
    p["virtual_pipeline_degree"] = l.v;
    p["context_parallel_degree"] = l.c;
    p["context_exchange"] = l.exchange;
    p["expert_tensor_parallel_degree"] = l.etp;
    p["replica_degree"] = 4 / (l.expert_readers() * l.s * l.c * l.t * l.p);
    p["micro_batch_size"] = 1;
    // The T ranks of a tensor-parallel group, the C ranks of a context group and the P stages of
    // a pipeline read the same micro-batches: 4 / (T C P) readers.
    p["gradient_accumulation_steps"] = l.t * l.p * l.c;
    p["activation_checkpointing"] = l.checkpointing;
    p["activation_offloading"] = l.offload;
    plan["moe"]["dispatcher"] = l.dispatcher;
    // Four ranks on this 2-vCPU machine: oversubscribed, which changes the speed, not the result.
    plan["cluster"]["num_nodes"] = 2;
    plan["alternatives"] = Json::array();
    return dir_->write("plan-" + std::string(plan["model"]["name"].get<std::string>()) + "-" + l.name + ".json", plan);
  }

  // `model` (a model file) trained by one rank and by each layout of 4 ranks, 10 steps: the same
  // losses and routing.
  static void expect_one_ranks_losses(const std::string& model, const std::string& name,
                                      const std::vector<Layout>& layouts) {
    const std::string one_rank = dir_->file(name + "-plan-1.json");
    const Command made = make_plan(model, one_rank, 64, 256, "fp32", 1);
    ASSERT_EQ(made.exit_code, 0) << show(made);
    constexpr int64_t kSteps = 10;
    auto train = [&](const std::string& plan, const std::string& out) {
      const Command r = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + out +
                                    " --steps " + std::to_string(kSteps) + " --timeout 60");
      EXPECT_EQ(r.exit_code, 0) << show(r);
      return read_metrics(out);
    };
    const std::vector<Json> reference = train(one_rank, dir_->file(name + "-reference"));
    ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps));
    for (const Layout& l : layouts) {
      const std::vector<Json> m = train(plan_for(l, one_rank), dir_->file(name + "-run-" + l.name));
      ASSERT_EQ(m.size(), static_cast<size_t>(kSteps)) << l.name;
      for (size_t i = 0; i < m.size(); ++i) {
        const double a = reference[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
        EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a)) << l.name << " step " << i + 1 << ": one rank " << a << ", " << b;
        EXPECT_EQ(m[i]["tokens_per_expert"], reference[i]["tokens_per_expert"]) << l.name << " step " << i + 1;
      }
    }
  }

  static TempDir* dir_;
  static std::string model_, reference_plan_;
  static std::vector<Json> reference_;
};

TempDir* Parallel::dir_ = nullptr;
std::string Parallel::model_, Parallel::reference_plan_;
std::vector<Json> Parallel::reference_;

TEST_P(Parallel, MatchesTheOneRankLossCurve) {
  const Layout& l = GetParam();
  const std::string out = dir_->file("run-" + l.name);
  const Command r = run_moeplan("run " + plan_for(l) + " --data " + dir_->file("data") + " --out " + out +
                                " --steps " + std::to_string(kSteps) + " --timeout 60");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const std::vector<Json> m = read_metrics(out);
  ASSERT_EQ(m.size(), static_cast<size_t>(kSteps)) << show(r);
  for (size_t i = 0; i < m.size(); ++i) {
    const double a = reference_[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
    EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a)) << "step " << i + 1 << ": one rank " << a << ", " << l.name << " " << b;
    // The router's load-balancing and z-losses, reported over every layer: summed over the
    // pipeline's stages, the context and the tensor ranks.
    for (const char* key : {"aux_loss", "z_loss"}) {
      const double ra = reference_[i][key].get<double>(), rb = m[i][key].get<double>();
      EXPECT_LE(std::abs(rb - ra), 1e-4 * std::abs(ra)) << "step " << i + 1 << " " << key << ": one rank " << ra << ", "
                                                        << l.name << " " << rb;
    }
    // Routing decisions are discrete: the same tokens reach the same experts.
    EXPECT_EQ(m[i]["tokens_per_expert"], reference_[i]["tokens_per_expert"]) << "step " << i + 1;
    EXPECT_EQ(m[i]["tokens"], reference_[i]["tokens"]);
    // Each expert group's micro-batches: R S groups of T C P micro-batches, each the routing of
    // the group's readers' sequences (the one rank's micro-batches, E / C at a time where the
    // expert group spans the C ranks of each).
    const StepRecord one = step_record_from_json(reference_[i], "reference"), here = step_record_from_json(m[i], l.name);
    const int64_t readers_per_group = l.expert_readers();
    ASSERT_EQ(here.exchange_slots.size(), static_cast<size_t>(4 / (readers_per_group * l.c * l.t * l.p)))
        << "step " << i + 1;
    std::vector<SlotTable> seen;
    for (const auto& group : here.exchange_slots) {
      ASSERT_EQ(group.size(), static_cast<size_t>(l.t * l.p * l.c)) << "step " << i + 1;
      seen.insert(seen.end(), group.begin(), group.end());
    }
    // Every rank's time inside its expert group's exchanges, where there is a group to exchange in.
    EXPECT_EQ(here.exchange_seconds.size(), l.e > 1 ? 4u : 0u) << "step " << i + 1;
    for (double seconds : here.exchange_seconds) EXPECT_GT(seconds, 0.0) << "step " << i + 1;
    ASSERT_EQ(one.exchange_slots.size(), 1u);
    std::vector<bool> used(one.exchange_slots[0].size(), false);
    EXPECT_TRUE(sums_of_reference(seen, 0, one.exchange_slots[0], used, static_cast<size_t>(readers_per_group)))
        << "step " << i + 1 << ": the groups' micro-batches are not the one rank's, " << readers_per_group
        << " at a time";
  }
  // The run leaves its measured trace (every rank's phases) and report, and prints the comparison.
  const Trace trace = trace_from_json(read_json_file(out + "/trace.json"), "trace.json");
  EXPECT_EQ(trace.source, "measured");
  ASSERT_EQ(trace.ranks, 4);
  for (int64_t rank = 0; rank < 4; ++rank)
    for (const char* phase : {"forward", "backward", "optimizer"})
      EXPECT_TRUE(std::any_of(trace.events.begin(), trace.events.end(),
                              [&](const TraceEvent& e) { return e.rank == rank && e.name == phase; }))
          << "rank " << rank << " " << phase;
  // Tensor-parallel ranks move the sequence between a block's parts.
  if (l.t > 1) {
    for (int64_t rank = 0; rank < 4; ++rank) {
      EXPECT_TRUE(std::any_of(trace.events.begin(), trace.events.end(),
                              [&](const TraceEvent& e) {
                                return e.rank == rank && e.name.rfind("tensor.", 0) == 0 && e.bytes > 0;
                              }))
          << "rank " << rank << ": no tensor-parallel collective";
    }
  }
  // Context ranks pass key-value blocks around their ring.
  if (l.c > 1 && l.exchange == "p2p") {
    for (int64_t rank = 0; rank < 4; ++rank)
      EXPECT_TRUE(std::any_of(trace.events.begin(), trace.events.end(),
                              [&](const TraceEvent& e) { return e.rank == rank && e.name == "context.send" && e.bytes > 0; }))
          << "rank " << rank << ": no context.send";
  }
  // Pipeline stages pass activations and gradients to each other.
  if (l.p > 1) {
    for (int64_t rank = 0; rank < 4; ++rank) {
      for (const char* op : {"pipeline.send", "pipeline.recv"}) {
        EXPECT_TRUE(std::any_of(trace.events.begin(), trace.events.end(),
                                [&](const TraceEvent& e) { return e.rank == rank && e.name == op && e.bytes > 0; }))
            << "rank " << rank << ": no " << op;
      }
    }
  }
  // Offloaded block inputs are timed going out and coming back.
  if (l.offload) {
    for (int64_t rank = 0; rank < 4; ++rank)
      for (const char* op : {"offload", "reload"}) {
        EXPECT_TRUE(std::any_of(trace.events.begin(), trace.events.end(),
                                [&](const TraceEvent& e) {
                                  return e.rank == rank && e.name == op && e.category == "copy" && e.bytes > 0;
                                }))
            << "rank " << rank << " " << op;
      }
  }
  // With S > 1 the next block's units are all-gathered while a block computes: in forward and in
  // backward, a gather is in flight while the rank starts other collectives (the next gather,
  // the block's reduce-scatters). Without prefetch every collective waits for the one before.
  // (A pipeline chunk of one of mixtral-tiny's 4 blocks has no next block of its own to fetch.)
  if (l.s > 1 && 4 / (l.p * l.v) > 1)
    for (int64_t rank = 0; rank < 4; ++rank)
      for (const char* phase : {"forward", "backward"}) {
        std::vector<const TraceEvent*> spans, comms;
        for (const TraceEvent& e : trace.events)
          if (e.rank == rank && e.name == phase) spans.push_back(&e);
        auto within = [&](const TraceEvent& e) {
          return std::any_of(spans.begin(), spans.end(), [&](const TraceEvent* p) {
            return e.start_ns >= p->start_ns && e.start_ns < p->start_ns + p->duration_ns;
          });
        };
        for (const TraceEvent& e : trace.events)
          if (e.rank == rank && (e.category == "all_gather" || e.category == "reduce_scatter") && within(e))
            comms.push_back(&e);
        const bool overlap = std::any_of(comms.begin(), comms.end(), [&](const TraceEvent* a) {
          return a->category == "all_gather" && std::any_of(comms.begin(), comms.end(), [&](const TraceEvent* b) {
                   return a != b && b->start_ns > a->start_ns && b->start_ns < a->start_ns + a->duration_ns;
                 });
        });
        EXPECT_TRUE(overlap) << "rank " << rank << ": no collective started during " << phase
                             << " while an all-gather was in flight";
      }
  const Json report = read_json_file(out + "/report.json");
  EXPECT_EQ(report["measured"]["steps"], kSteps);
  ASSERT_EQ(report["measured"]["peak_rss_bytes_per_rank"].size(), 4u);
  for (const Json& peak : report["measured"]["peak_rss_bytes_per_rank"]) EXPECT_GT(peak.get<int64_t>(), 0);
  EXPECT_NE(r.out.find("peak memory per rank"), std::string::npos) << show(r);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Parallel,
    ::testing::Values(Layout{"E1S1R4", 1, 1, "none", false}, Layout{"E2S2R1", 2, 2, "none", false},
                      Layout{"E4S1R1", 4, 1, "none", false}, Layout{"E2S1R2", 2, 1, "none", false},
                      Layout{"E1S1R4_full", 1, 1, "full", false}, Layout{"E2S2R1_full", 2, 2, "full", false},
                      Layout{"E4S1R1_selective", 4, 1, "selective", false},
                      Layout{"E2S1R2_selective", 2, 1, "selective", false},
                      Layout{"E1S1R4_full_offload", 1, 1, "full", true},
                      Layout{"E2S2R1_full_offload", 2, 2, "full", true},
                      Layout{"E4S1R1_selective_offload", 4, 1, "selective", true},
                      Layout{"E2S1R2_full_offload", 2, 1, "full", true},
                      Layout{"E4S1R1_allgather", 4, 1, "none", false, "allgather"},
                      Layout{"E2S1T2", 2, 1, "none", false, "alltoall", 2},
                      Layout{"E1S2T2_selective", 1, 2, "selective", false, "alltoall", 2},
                      Layout{"E1S1T2R2_full_offload", 1, 1, "full", true, "alltoall", 2},
                      Layout{"E2S1T2_allgather", 2, 1, "none", false, "allgather", 2},
                      Layout{"E2S1P2", 2, 1, "none", false, "alltoall", 1, 2},
                      Layout{"E1S2P2V2_full", 1, 2, "full", false, "alltoall", 1, 2, 2},
                      Layout{"E1S1T2P2_selective", 1, 1, "selective", false, "alltoall", 2, 2},
                      Layout{"E1S1T2P2V2", 1, 1, "none", false, "alltoall", 2, 2, 2},
                      // Context parallelism: each sequence in two ranks' halves (E counts the C ranks).
                      Layout{"E1S1R2C2", 1, 1, "none", false, "alltoall", 1, 1, 1, 2},
                      Layout{"E2S1T2C2_selective", 2, 1, "selective", false, "alltoall", 2, 1, 1, 2},
                      Layout{"E1S1C2P2", 1, 1, "none", false, "alltoall", 1, 2, 1, 2},
                      // Parallel folding: the T ranks join the expert group, each expert whole on its rank.
                      Layout{"E4S1T2C2_folded_full", 4, 1, "full", false, "alltoall", 2, 1, 1, 2, "p2p", 1},
                      Layout{"E2S1T2P2_folded", 2, 1, "none", false, "alltoall", 2, 2, 1, 1, "p2p", 1}),
    layout_name);

// Qwen3-MoE's blocks (qwen3-tiny: q/k norms, 32 fine-grained experts, top-8, query heads twice
// the hidden width): sharded, recomputed, split over tensor-parallel ranks (each holding the q/k
// norms whole for its heads) and over pipeline stages, each trains the one rank's losses and
// routing.
TEST_F(Parallel, Qwen3BlocksTrainTheOneRanksLosses) {
  expect_one_ranks_losses(write_small_model(*dir_, 512, "qwen3-tiny"), "qwen3",
                          {Layout{"E2S2R1_full", 2, 2, "full", false}, Layout{"E2S1T2", 2, 1, "none", false, "alltoall", 2},
                           Layout{"E1S1T2P2_selective", 1, 1, "selective", false, "alltoall", 2, 2}});
}

// GPT-OSS's pattern of attention on mixtral-tiny's blocks: a window of 16 tokens on blocks 0
// and 2, the whole 64-token sequence on blocks 1 and 3; over context ranks (the window and the
// causal mask each split around the ring) and over pipeline stages (each stage with blocks of
// both kinds), each trains the one rank's losses and routing.
TEST_F(Parallel, WindowOnSomeBlocksTrainsTheOneRanksLosses) {
  Json model = read_json_file(write_small_model(*dir_, 512));
  model["name"] = "mixtral-tiny-window-pattern";
  model["sliding_window"] = 16;
  model["full_attention_step"] = 2;
  expect_one_ranks_losses(dir_->write("window-pattern.json", model), "window-pattern",
                          {Layout{"E1S1R2C2", 1, 1, "none", false, "alltoall", 1, 1, 1, 2},
                           Layout{"E2S1P2", 2, 1, "none", false, "alltoall", 1, 2}});
}

// DeepSeek-V3's blocks on mixtral-tiny's sizes: latent attention (a query latent of 48, a
// key-value latent of 64, heads of 24 + 8 rotary, values of 16), the first block dense (its
// feed-forward layer split over T like a shared expert, its empty experts unit held by no
// rank), a shared expert beside the routed ones (gated as Qwen2-MoE gates it, so that the gate's
// split is trained too: whole on every T rank, its gradient summed), the sigmoid router (top-2 from the best 2 of 4
// groups of 2 experts, the weights scaled by 2.5, the balancing bias moved after every step by
// the slots counted over the world, at 0.01 a step so that it changes choices within the run)
// and a multi-token prediction block after the decoder, its loss weighted 0.3. Each layout
// trains the one rank's losses and routing step by step, which holds only while every rank
// moves the same bias; the multi-token prediction block lies on the last stage with the
// embedding, so these layouts have one stage.
std::string deepseek_blocks_model(const TempDir& dir) {
  Json model = read_json_file(write_small_model(dir, 512));
  model["name"] = "mixtral-tiny-deepseek-blocks";
  model["num_key_value_heads"] = 4;
  model["head_dim"] = 32;
  model["qk_rope_head_dim"] = 8;
  model["v_head_dim"] = 16;
  model["kv_lora_rank"] = 64;
  model["q_lora_rank"] = 48;
  model["first_dense_layers"] = 1;
  model["dense_intermediate_size"] = 512;
  model["shared_expert_intermediate_size"] = 128;
  model["shared_expert_gate"] = true;
  model["router_scoring"] = "sigmoid";
  model["router_groups"] = 4;
  model["router_group_topk"] = 2;
  model["routed_scaling_factor"] = 2.5;
  model["router_bias_update_rate"] = 0.01;
  model["mtp_layers"] = 1;
  model["mtp_loss_weight"] = 0.3;
  return dir.write("deepseek-blocks.json", model);
}

TEST_F(Parallel, DeepSeekBlocksTrainTheOneRanksLosses) {
  expect_one_ranks_losses(deepseek_blocks_model(*dir_), "deepseek",
                          {Layout{"E2S2R1_full", 2, 2, "full", false},
                           Layout{"E4S1R1_selective", 4, 1, "selective", false, "allgather"},
                           Layout{"E2S1T2_selective", 2, 1, "selective", false, "alltoall", 2},
                           Layout{"E1S1T2R2", 1, 1, "none", false, "alltoall", 2},
                           Layout{"E2S1R2C2", 2, 1, "none", false, "alltoall", 1, 1, 1, 2},
                           Layout{"E1S1T2C2_full_allgather", 1, 1, "full", false, "alltoall", 2, 1, 1, 2, "all_gather"},
                           Layout{"E2S1T2_folded_selective", 2, 1, "selective", false, "alltoall", 2, 1, 1, 1, "p2p", 1}});
}

// Token dropping at capacity factor 1: each rank drops at its own tokens' capacity before the
// exchange, as Megatron-Core does. A rank of these layouts routes one sequence per micro-batch,
// as the one rank does, so the same slots are dropped and the layouts train the one rank's
// dropping curve: padded in the all-to-all, unpadded in the all-gather.
TEST_F(Parallel, DroppedSlotsAreTheOneRanksAtCapacity) {
  constexpr int64_t kDropSteps = 8;
  auto with_capacity = [](const std::string& path, bool pad, const std::string& name) {
    Json plan = read_json_file(path);
    plan["moe"]["capacity_factor"] = 1.0;
    plan["moe"]["pad_to_capacity"] = pad;
    return dir_->write(name, plan);
  };
  auto train = [&](const std::string& plan, const std::string& name) {
    const std::string out = dir_->file(name);
    const Command r = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + out + " --steps " +
                                  std::to_string(kDropSteps) + " --timeout 60");
    EXPECT_EQ(r.exit_code, 0) << show(r);
    return read_metrics(out);
  };
  const std::vector<Json> one = train(with_capacity(reference_plan_, true, "plan-1-drop.json"), "drop-1");
  ASSERT_EQ(one.size(), static_cast<size_t>(kDropSteps));
  int64_t dropped = 0;
  for (const Json& step : one) {
    const StepRecord r = step_record_from_json(step, "one rank");
    ASSERT_EQ(r.dropped_slots.size(), r.tokens_per_expert.size());
    for (int64_t d : r.dropped_slots) dropped += d;
  }
  EXPECT_GT(dropped, 0) << "capacity factor 1 dropped nothing: the test no longer tests dropping";
  for (const auto& [layout, pad] : {std::pair{Layout{"E2S2R1", 2, 2, "none", false}, true},
                                    std::pair{Layout{"E4S1R1_allgather", 4, 1, "none", false, "allgather"}, false}}) {
    const std::vector<Json> m =
        train(with_capacity(plan_for(layout), pad, "plan-drop-" + layout.name + ".json"), "drop-" + layout.name);
    ASSERT_EQ(m.size(), one.size()) << layout.name;
    for (size_t i = 0; i < m.size(); ++i) {
      const double a = one[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
      EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a)) << layout.name << " step " << i + 1 << ": one rank " << a << ", " << b;
      EXPECT_EQ(m[i]["tokens_per_expert"], one[i]["tokens_per_expert"]) << layout.name << " step " << i + 1;
      EXPECT_EQ(m[i]["dropped_slots"], one[i]["dropped_slots"]) << layout.name << " step " << i + 1;
    }
  }
}

// Steps `from`..`to` of a run's metrics against the one-rank reference.
void expect_reference_losses(const std::vector<Json>& m, const std::vector<Json>& reference, size_t from, size_t to,
                             const std::string& what) {
  ASSERT_GE(m.size(), to) << what;
  for (size_t i = from - 1; i < to; ++i) {
    EXPECT_EQ(m[i]["step"].get<int64_t>(), static_cast<int64_t>(i + 1)) << what;
    const double a = reference[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
    EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a)) << what << " step " << i + 1 << ": one rank " << a << ", here " << b;
  }
}

// Trains the plan `saved` into `folder` for 6 steps with a checkpoint, then resumes a copy of it
// under each target plan to step 12: the losses go on as if one rank had trained straight through.
void expect_checkpoint_moves(const std::string& saved, const std::string& folder, const std::string& data,
                             const std::vector<std::pair<std::string, std::string>>& targets,
                             const std::vector<Json>& reference) {
  namespace fs = std::filesystem;
  Command r = run_moeplan("run " + saved + " --data " + data + " --out " + folder + " --steps 6 --checkpoint-every 6");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  for (const auto& [name, plan] : targets) {
    const std::string out = folder + "-to-" + name;
    fs::copy(folder, out, fs::copy_options::recursive);
    r = run_moeplan("run " + plan + " --data " + data + " --out " + out + " --steps 12 --resume");
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << show(r);
    EXPECT_NE(r.out.find("at step 6"), std::string::npos) << show(r);
    expect_reference_losses(read_metrics(out), reference, 1, 12, folder + " then " + name);
  }
}

// A checkpoint of (E2 S2) resumes under (E4 S1) and under one rank.
TEST_F(Parallel, CheckpointMovesBetweenLayouts) {
  expect_checkpoint_moves(plan_for({"reshard-E2S2R1", 2, 2, "none", false}), dir_->file("reshard-E2S2"),
                          dir_->file("data"),
                          {{"E4S1R1", plan_for({"reshard-E4S1R1", 4, 1, "none", false})}, {"one-rank", reference_plan_}},
                          reference_);
}

// A checkpoint of (E2 T2), whose o and w2 matrices are saved in column blocks, resumes under
// one rank and under (E1 S2 T2).
TEST_F(Parallel, TensorParallelCheckpointMovesBetweenLayouts) {
  expect_checkpoint_moves(
      plan_for({"reshard-E2S1T2", 2, 1, "none", false, "alltoall", 2}), dir_->file("reshard-E2T2"), dir_->file("data"),
      {{"one-rank", reference_plan_}, {"E1S2T2", plan_for({"reshard-E1S2T2", 1, 2, "none", false, "alltoall", 2})}},
      reference_);
}

// A checkpoint of (E2 T2 C2), whose expert group is the two context ranks of each sequence,
// resumes under one rank and under (E1 R2 C2), where every rank holds every expert.
TEST_F(Parallel, ContextParallelCheckpointMovesBetweenLayouts) {
  expect_checkpoint_moves(
      plan_for({"reshard-E2T2C2", 2, 1, "none", false, "alltoall", 2, 1, 1, 2}), dir_->file("reshard-E2T2C2"),
      dir_->file("data"),
      {{"one-rank", reference_plan_},
       {"E1R2C2", plan_for({"reshard-E1R2C2", 1, 1, "none", false, "alltoall", 1, 1, 1, 2})}},
      reference_);
}

// A checkpoint of (E2 T2, folded: each expert whole on one of the expert group's four ranks)
// resumes under one rank and under (E2 S1 T2) unfolded, whose experts are split over T.
TEST_F(Parallel, FoldedCheckpointMovesBetweenLayouts) {
  expect_checkpoint_moves(
      plan_for({"reshard-E2T2-folded", 2, 1, "none", false, "alltoall", 2, 1, 1, 1, "p2p", 1}),
      dir_->file("reshard-E2T2-folded"), dir_->file("data"),
      {{"one-rank", reference_plan_}, {"E2S1T2", plan_for({"reshard-E2S1T2-unfolded", 2, 1, "none", false, "alltoall", 2})}},
      reference_);
}

// A checkpoint of (T2 P2 V2), each stage saving its own blocks, resumes under one rank and under
// (E2 P2).
TEST_F(Parallel, PipelineCheckpointMovesBetweenLayouts) {
  expect_checkpoint_moves(
      plan_for({"reshard-T2P2V2", 1, 1, "none", false, "alltoall", 2, 2, 2}), dir_->file("reshard-T2P2V2"),
      dir_->file("data"),
      {{"one-rank", reference_plan_}, {"E2P2", plan_for({"reshard-E2P2", 2, 1, "none", false, "alltoall", 1, 2})}},
      reference_);
}

// The same blocks without a balance loss (which pipeline stages do not train) over two stages
// of two tensor ranks: the dense first block and its empty experts unit on the first stage, the
// biases of every stage's blocks moved alike, the multi-token prediction module on the last
// stage with its copy of the embedding, whose gradient it sums with the first stage's (a copy
// left to its own gradient looks the tokens up in other values from the second step on). Its
// checkpoint, the embedding saved once, resumes under one rank on the one rank's curve.
TEST_F(Parallel, DeepSeekBlocksTrainTheOneRanksLossesOverStages) {
  Json model = read_json_file(deepseek_blocks_model(*dir_));
  model["name"] = "mixtral-tiny-deepseek-blocks-staged";
  model["router_aux_loss_coef"] = 0.0;
  const std::string staged = dir_->write("deepseek-staged.json", model);
  expect_one_ranks_losses(staged, "deepseek-staged", {Layout{"E1S1T2P2", 1, 1, "none", false, "alltoall", 2, 2}});
  const std::string one_rank = dir_->file("deepseek-staged-plan-1.json");
  const std::string reference = dir_->file("deepseek-staged-reference-12");
  const Command r = run_moeplan("run " + one_rank + " --data " + dir_->file("data") + " --out " + reference + " --steps 12");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  expect_checkpoint_moves(plan_for({"deepseek-staged-T2P2", 1, 1, "none", false, "alltoall", 2, 2}, one_rank),
                          dir_->file("deepseek-staged-T2P2"), dir_->file("data"), {{"one-rank", one_rank}},
                          read_metrics(reference));
}

// DeepSeek's blocks move between layouts, the router's balancing biases with them: a checkpoint
// of (E2 S1 T2) resumes under one rank, under (E4 S1) and under (E2 R2 C2, the expert group the
// context ranks) on the one rank's curve, which a bias
// started again from zero would leave.
TEST_F(Parallel, DeepSeekCheckpointMovesBetweenLayouts) {
  const std::string one_rank = dir_->file("deepseek-ckpt-plan-1.json");
  const Command made = make_plan(deepseek_blocks_model(*dir_), one_rank, 64, 256, "fp32", 1);
  ASSERT_EQ(made.exit_code, 0) << show(made);
  const std::string reference = dir_->file("deepseek-ckpt-reference");
  const Command r = run_moeplan("run " + one_rank + " --data " + dir_->file("data") + " --out " + reference + " --steps 12");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  expect_checkpoint_moves(
      plan_for({"deepseek-E2S1T2", 2, 1, "none", false, "alltoall", 2}, one_rank), dir_->file("deepseek-E2T2"),
      dir_->file("data"),
      {{"one-rank", one_rank},
       {"E4S1", plan_for({"deepseek-E4S1", 4, 1, "none", false}, one_rank)},
       {"E2R2C2", plan_for({"deepseek-E2R2C2", 2, 1, "none", false, "alltoall", 1, 1, 1, 2}, one_rank)}},
      read_metrics(reference));
}

// With the aux-loss balancing and a z-loss in the objective, every T rank computes the router's
// losses from the same logits: each must count once in the router's gradient, so the losses, the
// load-balancing terms and the gradient norm stay those of one rank; so they do where context or
// folded tensor ranks each route a part of the sequence.
TEST_F(Parallel, TensorParallelRouterLossesCountOnce) {
  auto with_router_losses = [&](const std::string& plan_file, const std::string& name) {
    Json plan = read_json_file(plan_file);
    plan["moe"]["load_balancing"] = "aux_loss";
    plan["moe"]["aux_loss_coef"] = 0.05;
    plan["moe"]["z_loss_coef"] = 0.01;
    return dir_->write(name, plan);
  };
  const std::string data = dir_->file("data");
  const std::string one = with_router_losses(reference_plan_, "plan-aux-1.json");
  Command r = run_moeplan("run " + one + " --data " + data + " --out " + dir_->file("aux-1") + " --steps 8");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const std::vector<Json> a = read_metrics(dir_->file("aux-1"));
  ASSERT_EQ(a.size(), 8u);
  // Unfolded T ranks route the same tokens; context ranks and folded T ranks route their own part
  // of each sequence, and the losses sum the parts (each rank's gradient that of its tokens).
  for (const Layout& l : {Layout{"aux-E2S1T2", 2, 1, "none", false, "alltoall", 2},
                          Layout{"aux-E2S1R2C2", 2, 1, "none", false, "alltoall", 1, 1, 1, 2},
                          Layout{"aux-E2S1T2R2-folded", 2, 1, "none", false, "alltoall", 2, 1, 1, 1, "p2p", 1}}) {
    const std::string plan = with_router_losses(plan_for(l), "plan-" + l.name + ".json");
    r = run_moeplan("run " + plan + " --data " + data + " --out " + dir_->file(l.name) + " --steps 8");
    ASSERT_EQ(r.exit_code, 0) << show(r);
    const std::vector<Json> b = read_metrics(dir_->file(l.name));
    ASSERT_EQ(b.size(), 8u);
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* key : {"loss", "aux_loss", "z_loss", "total_loss", "grad_norm"}) {
        const double x = a[i][key].get<double>(), y = b[i][key].get<double>();
        EXPECT_LE(std::abs(y - x), 1e-4 * std::abs(x))
            << "step " << i + 1 << " " << key << ": one rank " << x << ", " << l.name << " " << y;
      }
  }
}

// SIGKILL of one rank during training: every other rank stops with an error naming it, well
// within the collective timeout; --resume then goes on from the last checkpoint with the same
// losses.
TEST_F(Parallel, AKilledRankStopsTheRunAndResumeContinues) {
  const std::string plan = plan_for({"kill-E2S2R1", 2, 2, "none", false});
  const std::string out = dir_->file("killed"), err = dir_->file("killed.err");
  constexpr int kTimeout = 30;
  const pid_t launcher =
      spawn_moeplan({"run", plan, "--data", dir_->file("data"), "--out", out, "--steps", std::to_string(kSteps),
                     "--checkpoint-every", "2", "--timeout", std::to_string(kTimeout)},
                    {}, "/dev/null", err);
  // Wait for step 3 (a checkpoint of step 2 is there), then kill rank 1.
  const auto start = std::chrono::steady_clock::now();
  while (read_metrics(out).size() < 3 && std::chrono::steady_clock::now() - start < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const size_t steps_before = read_metrics(out).size();
  ASSERT_GE(steps_before, 3u) << read_text(err);
  ASSERT_LT(steps_before, static_cast<size_t>(kSteps)) << "the run ended before the kill";
  const std::vector<pid_t> rank1 = rank_processes(launcher, 1);
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(::kill(rank1[0], SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  const int code = wait_moeplan(launcher, kTimeout + 30);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string said = read_text(err);
  EXPECT_NE(code, 0) << said;
  EXPECT_NE(code, -2) << "still running after " << seconds << " s\n" << said;
  EXPECT_LT(seconds, kTimeout) << said;
  EXPECT_NE(said.find("rank 1 was killed by signal 9"), std::string::npos) << said;
  EXPECT_NE(said.find("lost rank 1"), std::string::npos) << said;
  EXPECT_TRUE(rank_processes(launcher, 0).empty());

  const Command r = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + out +
                                " --steps " + std::to_string(kSteps) + " --resume --timeout 60");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << show(r);
  const std::vector<Json> m = read_metrics(out);
  ASSERT_EQ(m.size(), static_cast<size_t>(kSteps));
  expect_reference_losses(m, reference_, 1, kSteps, "killed and resumed");
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Four ranks started by hand as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; rank 0 hosts the store) train together.
TEST_F(Parallel, RanksStartedWithTorchrunVariablesTrainTogether) {
  const std::string plan = plan_for({"torchrun-E2S2R1", 2, 2, "none", false});
  const std::string out = dir_->file("torchrun");
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < 4; ++rank)
    ranks.push_back(spawn_moeplan({"run", plan, "--data", dir_->file("data"), "--out", out, "--steps", "10"},
                                  {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank), "WORLD_SIZE=4",
                                   "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port},
                                  dir_->file("torchrun-" + std::to_string(rank) + ".out"),
                                  dir_->file("torchrun-" + std::to_string(rank) + ".err")));
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(wait_moeplan(ranks[static_cast<size_t>(rank)], 120), 0)
        << "rank " << rank << ": " << read_text(dir_->file("torchrun-" + std::to_string(rank) + ".err"));
  expect_reference_losses(read_metrics(out), reference_, 1, 10, "torchrun variables");
  const Json report = read_json_file(out + "/report.json");
  EXPECT_NE(report["measured"]["where"].get<std::string>().find("torchrun"), std::string::npos);
  // Only rank 0 prints.
  EXPECT_NE(read_text(dir_->file("torchrun-0.out")).find("step 10/10"), std::string::npos);
  EXPECT_EQ(read_text(dir_->file("torchrun-1.out")), "");
}

// Two network namespaces joined by a veth pair, acting as two hosts; removed again at the end.
class TwoHosts {
 public:
  TwoHosts() : a_("moeplan-a-" + std::to_string(::getpid())), b_("moeplan-b-" + std::to_string(::getpid())) {
    const std::string veth = "mp" + std::to_string(::getpid() % 100000);
    ok_ = run("ip netns add " + a_) && run("ip netns add " + b_) &&
          run("ip link add " + veth + "a type veth peer name " + veth + "b") &&
          run("ip link set " + veth + "a netns " + a_) && run("ip link set " + veth + "b netns " + b_) &&
          run("ip -n " + a_ + " addr add 10.231.0.1/24 dev " + veth + "a") &&
          run("ip -n " + b_ + " addr add 10.231.0.2/24 dev " + veth + "b") &&
          run("ip -n " + a_ + " link set " + veth + "a up") && run("ip -n " + b_ + " link set " + veth + "b up") &&
          run("ip -n " + a_ + " link set lo up") && run("ip -n " + b_ + " link set lo up");
  }
  ~TwoHosts() {
    // A veth end is deleted with its namespace, and the pair with either end.
    run("ip netns delete " + a_);
    run("ip netns delete " + b_);
  }
  bool ok() const { return ok_; }
  const std::string& host(int i) const { return i == 0 ? a_ : b_; }
  static constexpr char kFirstAddress[] = "10.231.0.1";

 private:
  static bool run(const std::string& command) { return std::system((command + " 2>/dev/null").c_str()) == 0; }
  std::string a_, b_;
  bool ok_ = false;
};

// Ranks 0-1 on one "host" and 2-3 on another (network namespaces: their gloo connections cross a
// veth pair, not loopback) train together to the one-rank losses.
TEST_F(Parallel, RanksOnTwoHostsTrainTogether) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  const TwoHosts hosts;
  if (!hosts.ok()) GTEST_SKIP() << "could not create network namespaces (ip netns and veth, CAP_NET_ADMIN)";
  const std::string plan = plan_for({"hosts-E2S2R1", 2, 2, "none", false});
  const std::string out = dir_->file("two-hosts");
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < 4; ++rank)
    ranks.push_back(spawn_moeplan({"run", plan, "--data", dir_->file("data"), "--out", out, "--steps", "10"},
                                  {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank % 2),
                                   "WORLD_SIZE=4", std::string("MASTER_ADDR=") + TwoHosts::kFirstAddress,
                                   "MASTER_PORT=29500"},
                                  "/dev/null", dir_->file("hosts-" + std::to_string(rank) + ".err"),
                                  {"ip", "netns", "exec", hosts.host(rank / 2)}));
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(wait_moeplan(ranks[static_cast<size_t>(rank)], 120), 0)
        << "rank " << rank << ": " << read_text(dir_->file("hosts-" + std::to_string(rank) + ".err"));
  expect_reference_losses(read_metrics(out), reference_, 1, 10, "two hosts");
}

// The same two hosts with rank 0's store admitting the first host only (MOEPLAN_STORE_PEERS):
// the second host's ranks never get through to the store, and the run fails within the
// timeout without a step.
TEST_F(Parallel, RanksOnAHostTheStoreDoesNotAdmitCannotJoin) {
  if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  const TwoHosts hosts;
  if (!hosts.ok()) GTEST_SKIP() << "could not create network namespaces (ip netns and veth, CAP_NET_ADMIN)";
  const std::string plan = plan_for({"hosts-E2S2R1", 2, 2, "none", false});
  const std::string out = dir_->file("two-hosts-refused");
  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < 4; ++rank)
    ranks.push_back(spawn_moeplan({"run", plan, "--data", dir_->file("data"), "--out", out, "--steps", "10",
                                   "--timeout", "8"},
                                  {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank % 2),
                                   "WORLD_SIZE=4", std::string("MASTER_ADDR=") + TwoHosts::kFirstAddress,
                                   "MASTER_PORT=29501", std::string("MOEPLAN_STORE_PEERS=") + TwoHosts::kFirstAddress},
                                  "/dev/null", dir_->file("refused-" + std::to_string(rank) + ".err"),
                                  {"ip", "netns", "exec", hosts.host(rank / 2)}));
  std::string said;
  for (int rank = 0; rank < 4; ++rank) {
    const int code = wait_moeplan(ranks[static_cast<size_t>(rank)], 120);
    const std::string err = read_text(dir_->file("refused-" + std::to_string(rank) + ".err"));
    said += "rank " + std::to_string(rank) + " (exit " + std::to_string(code) + "): " + err + "\n";
    EXPECT_NE(code, 0) << "rank " << rank << " joined: " << err;
    if (rank >= 2) {
      EXPECT_NE(err.find("the rendezvous store at 10.231.0.1:29501 took no connection from this host within 8 s"),
                std::string::npos)
          << err;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(read_metrics(out).empty()) << said;
  EXPECT_LT(seconds, 90) << said;
  std::printf("%s", said.c_str());
}

}  // namespace
}  // namespace moeplan::test
