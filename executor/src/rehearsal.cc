// The rehearsal of a cluster plan on local CPU ranks (rehearsal.h).
//
// Three child runs of this program, each logged in the rehearsal folder:
//   layout/     the shrunk plan on its world size, steps 1..N-1, a checkpoint at N-1;
//   layout/     resumed from that checkpoint for step N, a checkpoint at N;
//   reference/  one rank with the whole global batch, steps 1..N, checkpoints at N-1 and N.
#include "moeplan/executor/rehearsal.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/rules.h"
#include "moeplan/core/run_report.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/launch.h"
#include "moeplan/executor/mesh.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/parallel_trainer.h"
#include "moeplan/executor/trainer.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

// Losses of one rank and of the layout agree to this (fp32; sums in another order).
constexpr double kLossTolerance = 1e-4;
// Parameters and AdamW moments of a checkpoint: |layout - reference| / |reference|, per tensor.
// Adam's first steps move an element by about the learning rate whatever its gradient's size,
// so an element whose gradient is rounding noise may move either way.
constexpr double kParameterTolerance = 1e-3;
// Under tensor parallelism a block's output is a sum of the T ranks' parts, added in another
// order than one rank's matrix product: a router logit differs by rounding, so a near tie may go
// to another expert from the first step on. At most this share of step 1's slots may. A slot
// routed elsewhere moves the gradients of the router and of two experts by that token's share,
// so when any was, the AdamW moments (a step's gradients themselves) are held to
// kMovedMomentTolerance and the parameters to kParameterTolerance; state lost or misplaced by a
// save and load differs by far more than either.
constexpr double kTensorParallelFirstStepMoved = 1e-4;
constexpr double kMovedMomentTolerance = 1e-2;
// Measured live tensors per rank over the memory model's figure for the same shrunk layout.
constexpr double kMemoryTolerance = 0.15;
// Resident memory of one rank's process before any tensor (LibTorch, gloo), with room.
constexpr int64_t kBytesPerRank = int64_t{256} << 20;

int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::string mib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f MiB", bytes / (1 << 20));
  return s;
}

std::string gib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f GiB", bytes / (1 << 30));
  return s;
}

std::string format(const char* f, double a, double b = 0, double c = 0) {
  char s[256];
  std::snprintf(s, sizeof s, f, a, b, c);
  return s;
}

// The groups a rank of this layout joins, counted, and whether each kind stays inside a node.
std::string describe_groups(const ParallelConfig& p, int64_t gpus_per_node) {
  const MeshLayout layout(p);
  struct Kind {
    const char* name;
    std::vector<MeshDim> varying;
  };
  const Kind kinds[] = {{"shard", {MeshDim::kShard}},
                        {"expert", {MeshDim::kExpert}},
                        {"dense replica", {MeshDim::kReplica, MeshDim::kExpert}},
                        {"expert replica", {MeshDim::kReplica}},
                        {"tensor", {MeshDim::kTensor}},
                        {"pipeline", {MeshDim::kPipeline}}};
  std::string out;
  for (const Kind& k : kinds) {
    std::set<std::vector<int64_t>> groups;
    for (int64_t rank = 0; rank < p.world_size; ++rank) groups.insert(layout.group(rank, k.varying));
    const int64_t size = static_cast<int64_t>(groups.begin()->size());
    if (size == 1) continue;
    const bool in_node = std::all_of(groups.begin(), groups.end(), [&](const std::vector<int64_t>& g) {
      return g.front() / gpus_per_node == g.back() / gpus_per_node;
    });
    out += (out.empty() ? "" : ", ") + std::to_string(groups.size()) + " " + k.name + " group" +
           (groups.size() > 1 ? "s" : "") + " of " + std::to_string(size) + (in_node ? " (in a node)" : " (across nodes)");
  }
  return out.empty() ? "no groups (every degree is 1)" : out;
}

// The largest relative difference between two checkpoints' tensors (parameters and AdamW
// moments), and which one. Not finite when a tensor is not.
struct StateDifference {
  double worst = 0;  // the largest relative difference, and where
  std::string where;
  double moments = 0;  // the same over the AdamW moments alone, when they are kept apart
  std::string moments_where;
};
StateDifference state_difference(const std::string& a_dir, const std::string& b_dir, const ModelSpec& model,
                                 bool moments_apart) {
  auto load = [](const std::string& dir) {
    const LoadedCheckpoint c = open_checkpoint(dir);
    SlicedState s;
    for (const CheckpointFile& f : c.files) s.add(read_checkpoint_shard(c, f.name).tensors);
    return s;
  };
  const SlicedState a = load(a_dir), b = load(b_dir);
  StateDifference out;
  for (const ParamInfo& info : mixtral_parameters(model))
    for (const char* kind : {"param/", "exp_avg/", "exp_avg_sq/"}) {
      Diagnostics d;
      const std::string key = kind + info.name;
      const torch::Tensor x = a.whole(key, info.shape, d);
      d.throw_if_any(a_dir);
      const torch::Tensor y = b.whole(key, info.shape, d);
      d.throw_if_any(b_dir);
      const double norm = y.to(torch::kDouble).norm().item<double>();
      const double diff = (x.to(torch::kDouble) - y.to(torch::kDouble)).norm().item<double>() / std::max(norm, 1e-30);
      const bool moment = moments_apart && std::string(kind) != "param/";
      double& worst = moment ? out.moments : out.worst;
      if (std::isnan(diff) || diff > worst) {  // a NaN stays
        worst = diff;
        (moment ? out.moments_where : out.where) = key;
      }
    }
  return out;
}

// |a - b| / |b|, NaN when either is not finite.
double relative(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return std::nan("");
  return std::abs(a - b) / std::max(std::abs(b), 1e-30);
}

std::string tail(const std::string& log, size_t lines) {
  std::ifstream in(log);
  std::vector<std::string> all;
  std::string line;
  while (std::getline(in, line)) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "    " + all[i] + "\n";
  return out;
}

}  // namespace

void check_rehearsal(const Plan& plan, const RehearsalOptions& o) {
  Diagnostics d;
  if (o.steps < 2)
    d.error("--steps", "= " + std::to_string(o.steps) +
                           ": a rehearsal needs 2 steps or more (a checkpoint and a resumed step)");
  if (rank_env_from_environment()) d.error("--rehearse", "starts its own local ranks: run it without a launcher");
  if (fs::exists(o.out_dir) && !fs::is_empty(o.out_dir))
    d.error("--out", o.out_dir + " is not empty; a rehearsal writes a folder of its own");
  // One rank cannot reproduce routing over tokens shuffled across the expert group.
  if (plan.moe.global_token_shuffle)
    d.error("moe.global_token_shuffle", "= true: the one-rank reference routes other token sets, so the losses "
                                        "could not be compared");
  // Every rank is a LibTorch process of its own (about 200 MiB before any tensor).
  const int64_t available = available_memory_bytes();
  if (available > 0 && plan.parallel.world_size * kBytesPerRank > available)
    d.error("parallel.world_size", "= " + std::to_string(plan.parallel.world_size) + " processes need about " +
                                       gib(static_cast<double>(plan.parallel.world_size * kBytesPerRank)) +
                                       " here; this machine has " + gib(static_cast<double>(available)) + " available");
  d.throw_if_any("rehearse");
}

void check_rehearsal_plans(const Plan& small, const Plan& reference, const TokenDataset& data,
                           const RehearsalOptions& o) {
  // What the child runs would refuse, refused before any rank starts.
  Diagnostics d;
  RunOptions run;
  run.stop_after_step = o.steps;
  const std::pair<const Plan*, const char*> plans[] = {{&small, " (in the shrunk plan)"},
                                                       {&reference, " (in the one-rank reference plan)"}};
  for (const auto& [each, which] : plans) {
    Diagnostics found;
    check_run_inputs(*each, data, run, found);
    for (const Diagnostic& item : found.items()) d.error(item.path, item.message + which);
  }
  d.throw_if_any("rehearse");
}

namespace {

// What the checks of a rehearsal look at: the cluster plan, its shrunk layout, the rehearsal's
// folder (layout/ and reference/ runs in it) and the steps run.
struct Rehearsing {
  const Plan& plan;
  const Plan& small;
  const std::string& out;
  int64_t steps;
};

// Losses, router losses, gradient norms and tokens per expert of the layout's run against one
// rank's; `routed_elsewhere`: the slots the layout sent to other experts than one rank did.
RehearsalCheck check_routing(const Rehearsing& c, Json& record, int64_t& routed_elsewhere) {
  const std::string& out = c.out;
  const int64_t steps = c.steps;
  const ParallelConfig& p = c.small.parallel;
  const std::vector<Json> layout = read_metrics(out + "/layout"), one = read_metrics(out + "/reference");
  // Losses, the router's auxiliary losses and the gradient norm (which sees a gradient
  // summed over the wrong group or scaled wrongly, where Adam's first update would not).
  double worst = 0;
  int64_t first_moved = 0, first_total = 0;  // step 1's routing is exactly one rank's (but see
                                             // kTensorParallelFirstStepMoved)
  int64_t moved = 0, total = 0;  // later, slots that went elsewhere: the weights equal one
                                 // rank's only to rounding, so a near tie may go the other way
  Json losses = Json::array();
  bool complete = layout.size() == one.size() && layout.size() == static_cast<size_t>(steps);
  for (size_t i = 0; complete && i < layout.size(); ++i) {
    for (const char* key : {"loss", "aux_loss", "z_loss", "grad_norm"}) {
      const double e = relative(layout[i].at(key).get<double>(), one[i].at(key).get<double>());
      if (std::isnan(e) || e > worst) worst = e;  // a NaN stays
    }
    const auto a = layout[i].at("tokens_per_expert").get<std::vector<std::vector<int64_t>>>();
    const auto b = one[i].at("tokens_per_expert").get<std::vector<std::vector<int64_t>>>();
    complete = a.size() == b.size();
    for (size_t l = 0; complete && l < a.size(); ++l)
      for (size_t e = 0; e < std::min(a[l].size(), b[l].size()); ++e) {
        // A slot that went elsewhere is one too few at one expert and one too many at
        // another: half the differences are slots.
        if (i == 0) {
          first_moved += std::abs(a[l][e] - b[l][e]);
          first_total += b[l][e];
        }
        moved += std::abs(a[l][e] - b[l][e]);
        total += b[l][e];
      }
    losses.push_back({{"step", i + 1}, {"layout", layout[i].at("loss")}, {"one_rank", one[i].at("loss")}});
  }
  record["losses"] = losses;
  first_moved /= 2;
  moved /= 2;
  routed_elsewhere = moved;
  const bool first_step_ok =
      first_moved == 0 || (p.tensor_parallel_degree > 1 &&
                           static_cast<double>(first_moved) <= kTensorParallelFirstStepMoved * first_total);
  const bool ok = complete && first_step_ok && worst <= kLossTolerance && moved * 1000 <= total;
  const std::string first_step =
      first_moved == 0 ? "step 1's tokens per expert are one rank's"
      : first_step_ok  ? format("step 1's tokens per expert are one rank's but for %.0f of %.0f slots (tensor-parallel "
                                "sums round otherwise; bound %.0e)",
                                static_cast<double>(first_moved), static_cast<double>(first_total),
                                kTensorParallelFirstStepMoved)
                       : "step 1's tokens per expert DIFFER from one rank's";
  return RehearsalCheck{"tokens reach their experts", ok,
               !complete ? "the runs did not record every step"
                         : first_step +
                               format(" (%.0f of %.0f slots elsewhere over all steps); loss, auxiliary losses and "
                                      "gradient norm within %.1e",
                                      static_cast<double>(moved), static_cast<double>(total), worst) +
                               format(" (bound %.0e)", kLossTolerance)};
}

// The layout's checkpoint shards put together against one rank's, before and after the resume.
RehearsalCheck check_shards(const Rehearsing& c, Json& record, int64_t routed_elsewhere) {
  const std::string& out = c.out;
  const int64_t steps = c.steps, saved = steps - 1;
  const ModelSpec& m = c.small.model;
  // Step N-1's shards and step N's, after the resume, against one rank's: parameters and
  // AdamW moments, so that moments lost or misplaced by the save and load show too.
  // When tokens went to other experts, the moments are held to their own bound.
  const bool moments_apart = routed_elsewhere > 0;
  StateDifference worst;
  for (const int64_t step : {saved, steps}) {
    const StateDifference diff = state_difference(step_folder(out + "/layout/checkpoints", step),
                                                  step_folder(out + "/reference/checkpoints", step), m,
                                                  moments_apart);
    const std::string at = " at step " + std::to_string(step);
    if (std::isnan(diff.worst) || diff.worst > worst.worst) {
      worst.worst = diff.worst;
      worst.where = diff.where + at;
    }
    if (std::isnan(diff.moments) || diff.moments > worst.moments) {
      worst.moments = diff.moments;
      worst.moments_where = diff.moments_where + at;
    }
  }
  record["state_difference"] = std::isfinite(worst.worst) ? Json(worst.worst) : Json("not finite");
  const bool ok = worst.worst <= kParameterTolerance && worst.moments <= kMovedMomentTolerance;
  std::string moments;
  if (moments_apart) {
    record["moment_difference"] =
        std::isfinite(worst.moments) ? Json(worst.moments) : Json("not finite");
    moments = format("; with %.0f slots routed elsewhere, the moments to %.1e",
                     static_cast<double>(routed_elsewhere), worst.moments) +
              format(" (bound %.0e, ", kMovedMomentTolerance) + worst.moments_where + ")";
  }
  return RehearsalCheck{"shards line up, checkpoint saves and loads", ok,
               format("the layout's shards of steps %.0f and %.0f (after the resume) put together are one "
                      "rank's ",
                      static_cast<double>(saved), static_cast<double>(steps)) +
                   (moments_apart ? "parameters" : "parameters and moments") + format(" to %.1e", worst.worst) +
                   format(" (bound %.0e, ", kParameterTolerance) + worst.where + ")" + moments};
}

// The busiest rank's live tensors against the memory model, and what that says of the plan.
RehearsalCheck check_memory(const Rehearsing& c, Json& record, const PredictTensorBytes& predict,
                            int64_t plan_tensor_bytes) {
  const Plan& plan = c.plan;
  const Plan& small = c.small;
  const std::string& out = c.out;
  const ModelSpec& m = small.model;
  const ParallelConfig& p = small.parallel;
  // The busiest rank's live tensors inside a step against the memory model for the same
  // shrunk layout, with the expert load this run measured: the most rows one rank's experts
  // computed in a layer of a micro-batch, over the mean (a random router is uneven, and the
  // busiest expert rank holds the most activations).
  const RunReport report = read_run_report(out + "/layout/report.json");
  const int64_t measured = report.peak_step_tensor_bytes();
  const int64_t rows = report.busiest_expert_rows();
  const double load = static_cast<double>(rows) /
                      static_cast<double>(m.experts_per_token * p.micro_batch_size * small.training.seq_len);
  const int64_t predicted = predict(load);
  const double ratio = static_cast<double>(measured) / static_cast<double>(std::max<int64_t>(1, predicted));
  // On the cluster: the plan's tensor bytes scaled by this ratio, its framework and
  // fragmentation as they are.
  const double full = static_cast<double>(plan.prediction.memory.device_total_bytes);
  const double full_tensors = static_cast<double>(plan_tensor_bytes);
  const double scaled = full - full_tensors + full_tensors * ratio;
  const double limit = static_cast<double>(plan.prediction.memory.device_limit_bytes);
  record["memory"] = {{"measured_peak_tensor_bytes", measured},
                      {"predicted_tensor_bytes", predicted},
                      {"measured_over_predicted", ratio},
                      {"busiest_expert_rank_load", load},
                      {"plan_device_bytes", plan.prediction.memory.device_total_bytes},
                      {"plan_device_bytes_at_this_ratio", static_cast<int64_t>(scaled)},
                      {"plan_device_limit_bytes", plan.prediction.memory.device_limit_bytes}};
  return RehearsalCheck{"memory per rank as the memory model says", ratio <= 1 + kMemoryTolerance,
               "busiest rank " + mib(static_cast<double>(measured)) + " of live tensors, memory model " +
                   mib(static_cast<double>(predicted)) +
                   format(" (x %.2f, bound %.2f); ", ratio, 1 + kMemoryTolerance) + "on the cluster the plan says " +
                   gib(full) + " of " + gib(limit) + ", " + gib(scaled) + " at this rehearsal's ratio" +
                   (scaled > limit ? " (above its limit, if this error carried over to the GPUs)" : "")};
}

}  // namespace

Rehearsal rehearse(const Plan& plan, const Plan& small, const Plan& reference, const RehearsalOptions& o,
                   const RunProgram& run, const PredictTensorBytes& predict, int64_t plan_tensor_bytes) {
  const int64_t steps = o.steps;
  // Progress and verdict lines, when someone reads them.
  auto say = [&](const char* f, auto... values) {
    if (!o.progress) return;
    char line[1024];
    std::snprintf(line, sizeof line, f, values...);
    *o.progress << line << std::flush;
  };
  fs::create_directories(o.out_dir);
  const std::string out = fs::absolute(o.out_dir).string();
  write_file_atomic(out + "/plan.json", plan_to_text(small));
  write_file_atomic(out + "/reference-plan.json", plan_to_text(reference));

  const Rehearsing ctx{plan, small, out, steps};
  Rehearsal result;
  const ModelSpec& m = small.model;
  const ParallelConfig& p = small.parallel;
  say("rehearsing %s (%s on %s x %lld GPUs) on %lld local CPU ranks\n", o.plan_path.c_str(),
      plan.model.name.c_str(), plan.cluster.name.c_str(), static_cast<long long>(plan.parallel.world_size),
      static_cast<long long>(p.world_size));
  say("  layout  %s\n", describe(p).c_str());
  say("  model   hidden %lld -> %lld, intermediate %lld -> %lld, heads %lld/%lld x %lld -> %lld/%lld x %lld, "
      "layers %lld -> %lld, vocabulary %lld -> %lld; %lld experts, top-%lld kept\n",
      static_cast<long long>(plan.model.hidden_size), static_cast<long long>(m.hidden_size),
      static_cast<long long>(plan.model.intermediate_size), static_cast<long long>(m.intermediate_size),
      static_cast<long long>(plan.model.num_attention_heads), static_cast<long long>(plan.model.num_key_value_heads),
      static_cast<long long>(plan.model.head_dim), static_cast<long long>(m.num_attention_heads),
      static_cast<long long>(m.num_key_value_heads), static_cast<long long>(m.head_dim),
      static_cast<long long>(plan.model.num_layers), static_cast<long long>(m.num_layers),
      static_cast<long long>(plan.model.vocab_size), static_cast<long long>(m.vocab_size),
      static_cast<long long>(m.num_experts), static_cast<long long>(m.experts_per_token));
  say("  batch   %lld sequences of %lld tokens a step (was %lld), %lld micro-batches of %lld a reader (the plan: "
      "%lld), fp32, %lld steps\n",
      static_cast<long long>(small.training.global_batch_tokens / small.training.seq_len),
      static_cast<long long>(small.training.seq_len), static_cast<long long>(plan.training.seq_len),
      static_cast<long long>(small.parallel.gradient_accumulation_steps),
      static_cast<long long>(small.parallel.micro_batch_size),
      static_cast<long long>(plan.parallel.gradient_accumulation_steps), static_cast<long long>(steps));

  auto child = [&](const std::string& plan_file, const std::string& folder, int64_t last, bool resume, int64_t every,
                   const std::string& log) {
    std::vector<std::string> argv{"run", plan_file, "--data", o.data_dir, "--out", out + "/" + folder, "--steps",
                                  std::to_string(last), "--timeout", std::to_string(o.timeout_seconds)};
    if (resume) argv.push_back("--resume");
    if (every > 0) argv.insert(argv.end(), {"--checkpoint-every", std::to_string(every)});
    if (o.threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(o.threads)});
    const auto start = std::chrono::steady_clock::now();
    const int code = run(argv, out + "/" + log);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    say("  %-44s %s in %.0f s (%s)\n",
        (folder + (resume ? " resumed to step " : " steps 1-") + std::to_string(last)).c_str(),
        code == 0 ? "done" : "FAILED", seconds, log.c_str());
    if (code != 0 && o.progress) *o.progress << tail(out + "/" + log, 8) << std::flush;
    return code == 0;
  };

  std::vector<RehearsalCheck>& checks = result.checks;
  const int64_t saved = steps - 1;
  const bool trained = child(out + "/plan.json", "layout", saved, false, saved, "layout.log");
  const bool resumed = trained && child(out + "/plan.json", "layout", steps, true, steps, "resume.log");
  const bool referenced = child(out + "/reference-plan.json", "reference", steps, false, saved, "reference.log");

  checks.push_back({"process groups form and train", trained,
                    std::to_string(p.world_size) + " ranks: " + describe_groups(p, plan.cluster.gpus_per_node)});
  Json record;
  record["plan"] = o.plan_path;
  record["layout"] = describe(p);
  record["model"] = to_json(m);
  record["steps"] = steps;
  if (!trained || !resumed) {
    checks.push_back({"checkpoint saves and loads", false,
                      std::string("the layout's run failed; see ") + (trained ? "resume.log" : "layout.log")});
  } else if (!referenced) {
    checks.push_back({"one-rank reference", false, "the reference run failed; see reference.log"});
  } else {
    // A file the runs should have left and did not, or a damaged one, fails the check it feeds.
    auto guarded = [&](const char* name, const std::function<RehearsalCheck()>& body) {
      try {
        checks.push_back(body());
      } catch (const InputError& e) {
        checks.push_back({name, false, e.lines().empty() ? "unreadable output" : e.lines().front()});
      } catch (const std::exception& e) {
        checks.push_back({name, false, e.what()});
      }
    };
    int64_t routed_elsewhere = 0;  // slots the layout sent to other experts than one rank did
    guarded("tokens reach their experts", [&] { return check_routing(ctx, record, routed_elsewhere); });
    guarded("shards line up, checkpoint saves and loads", [&] { return check_shards(ctx, record, routed_elsewhere); });
    guarded("memory per rank as the memory model says",
            [&] { return check_memory(ctx, record, predict, plan_tensor_bytes); });
  }

  bool ready = true;
  Json listed = Json::array();
  say("%s", "\n");
  for (const RehearsalCheck& c : checks) {
    say("  %-4s %-44s %s\n", c.ok ? "ok" : "FAIL", c.name.c_str(), c.detail.c_str());
    listed.push_back({{"check", c.name}, {"ok", c.ok}, {"detail", c.detail}});
    ready = ready && c.ok;
  }
  record["checks"] = listed;
  record["ready"] = ready;
  write_file_atomic(out + "/rehearsal.json", record.dump(2) + "\n");
  say("\nverdict: %s\n",
      ready ? "the layout works; ready for the cluster" : "NOT READY: fix what failed above before booking the cluster");
  say("wrote %s/rehearsal.json\n", out.c_str());
  result.ready = ready;
  return result;
}

}  // namespace moeplan::executor
