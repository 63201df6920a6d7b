// `moeplan run plan.json --rehearse`: the plan's layout on local CPU ranks with the model shrunk,
// checked against one rank that trains the same global batch, and a verdict.
//
// Three child runs of this program, each logged in the rehearsal folder:
//   layout/     the shrunk plan on its world size, steps 1..N-1, a checkpoint at N-1;
//   layout/     resumed from that checkpoint for step N;
//   reference/  one rank with the whole global batch, steps 1..N, a checkpoint at N-1.
// Losses and per-expert token counts must agree step by step, the two checkpoints must hold the
// same parameters, and per-rank memory is set against the memory model's figure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "commands.h"
#include "matrix.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/launch.h"
#include "moeplan/executor/mesh.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/parallel_trainer.h"
#include "moeplan/executor/tokens.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/rehearsal.h"

namespace moeplan::cli {
namespace fs = std::filesystem;

namespace {

// Losses of one rank and of the layout agree to this (fp32; sums in another order).
constexpr double kLossTolerance = 1e-4;
// Parameters after the checkpointed step: |layout - reference| / |reference|, per tensor. Adam's
// first steps move an element by about the learning rate whatever its gradient's size, so an
// element whose gradient is rounding noise may move either way.
constexpr double kParameterTolerance = 1e-3;
// Measured live tensors per rank over the memory model's figure for the same shrunk layout.
constexpr double kMemoryTolerance = 0.15;

std::vector<Json> read_metrics(const std::string& run_dir) {
  std::vector<Json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(Json::parse(line));
  return lines;
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

struct Check {
  std::string name;
  bool ok = false;
  std::string detail;
};

// The groups a rank of this layout joins, counted, and whether each kind stays inside a node.
std::string describe_groups(const ParallelConfig& p, int64_t gpus_per_node) {
  const executor::MeshLayout layout(p);
  struct Kind {
    const char* name;
    std::vector<MeshDim> varying;
  };
  const Kind kinds[] = {{"shard", {MeshDim::kShard}},
                        {"expert", {MeshDim::kExpert}},
                        {"dense replica", {MeshDim::kReplica, MeshDim::kExpert}},
                        {"expert replica", {MeshDim::kReplica}}};
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

// The largest relative difference between the two checkpoints' parameters, and where.
std::pair<double, std::string> parameter_difference(const std::string& a_dir, const std::string& b_dir,
                                                    const ModelSpec& model) {
  auto load = [](const std::string& dir) {
    const executor::LoadedCheckpoint c = executor::open_checkpoint(dir);
    executor::SlicedState s;
    for (const executor::CheckpointFile& f : c.files) s.add(executor::read_checkpoint_shard(c, f.name).tensors);
    return s;
  };
  const executor::SlicedState a = load(a_dir), b = load(b_dir);
  double worst = 0;
  std::string where;
  for (const executor::ParamInfo& info : executor::mixtral_parameters(model)) {
    Diagnostics d;
    const torch::Tensor x = a.whole("param/" + info.name, info.shape, d);
    const torch::Tensor y = b.whole("param/" + info.name, info.shape, d);
    d.throw_if_any(a_dir);
    const double norm = y.to(torch::kDouble).norm().item<double>();
    const double diff = (x.to(torch::kDouble) - y.to(torch::kDouble)).norm().item<double>() / std::max(norm, 1e-30);
    if (diff >= worst) {
      worst = diff;
      where = info.name;
    }
  }
  return {worst, where};
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

int run_rehearse(const RunArgs& args) {
  const Plan plan = read_plan_file(args.plan);  // the rules of the cluster layout, against the cluster
  {
    Diagnostics d;
    // The executor's mesh is [R, S, E]; what it cannot run, it cannot rehearse.
    if (plan.parallel.tensor_parallel_degree != 1)
      d.error("parallel.tensor_parallel_degree",
              "= " + std::to_string(plan.parallel.tensor_parallel_degree) +
                  ": the executor runs without tensor parallelism, so such plans cannot be rehearsed yet (search "
                  "with --tensor-parallel-degree 1 for a plan it runs)");
    if (plan.parallel.pipeline_parallel_degree != 1)
      d.error("parallel.pipeline_parallel_degree",
              "= " + std::to_string(plan.parallel.pipeline_parallel_degree) +
                  ": the executor runs without pipeline stages, so such plans cannot be rehearsed yet (search with "
                  "--pipeline-parallel-degree 1 for a plan it runs)");
    if (args.steps == 1) d.error("--steps", "= 1: a rehearsal needs 2 steps or more (a checkpoint and a resumed step)");
    if (args.resume || !args.init_from.empty() || args.checkpoint_every > 0)
      d.error("--rehearse", "takes none of --resume, --init-from and --checkpoint-every");
    if (executor::rank_env_from_environment())
      d.error("--rehearse", "starts its own local ranks: run it without a launcher");
    if (fs::exists(args.out) && !fs::is_empty(args.out))
      d.error("--out", args.out + " is not empty; a rehearsal writes a folder of its own");
    d.throw_if_any("rehearse");
  }
  const executor::TokenDataset data = executor::TokenDataset::open(args.data);
  const int64_t steps = args.steps > 0 ? args.steps : 2;
  const planner::Shrink shrink{args.shrink_width, args.shrink_layers};
  const Plan small = planner::rehearsal_plan(plan, shrink, data.vocab_size(), data.block_size(), steps);
  const Plan reference = planner::reference_plan(small);

  fs::create_directories(args.out);
  const std::string out = fs::absolute(args.out).string();
  write_file_atomic(out + "/plan.json", plan_to_text(small));
  write_file_atomic(out + "/reference-plan.json", plan_to_text(reference));

  const ModelSpec& m = small.model;
  const ParallelConfig& p = small.parallel;
  std::printf("rehearsing %s (%s on %s x %lld GPUs) on %lld local CPU ranks\n", args.plan.c_str(),
              plan.model.name.c_str(), plan.cluster.name.c_str(), static_cast<long long>(plan.parallel.world_size),
              static_cast<long long>(p.world_size));
  std::printf("  layout  %s\n", describe(p).c_str());
  std::printf("  model   hidden %lld -> %lld, intermediate %lld -> %lld, heads %lld/%lld x %lld -> %lld/%lld x %lld, "
              "layers %lld -> %lld, vocabulary %lld -> %lld; %lld experts, top-%lld kept\n",
              static_cast<long long>(plan.model.hidden_size), static_cast<long long>(m.hidden_size),
              static_cast<long long>(plan.model.intermediate_size), static_cast<long long>(m.intermediate_size),
              static_cast<long long>(plan.model.num_attention_heads), static_cast<long long>(plan.model.num_key_value_heads),
              static_cast<long long>(plan.model.head_dim), static_cast<long long>(m.num_attention_heads),
              static_cast<long long>(m.num_key_value_heads), static_cast<long long>(m.head_dim),
              static_cast<long long>(plan.model.num_layers), static_cast<long long>(m.num_layers),
              static_cast<long long>(plan.model.vocab_size), static_cast<long long>(m.vocab_size),
              static_cast<long long>(m.num_experts), static_cast<long long>(m.experts_per_token));
  std::printf("  batch   %lld sequences of %lld tokens a step (was %lld), fp32, %lld steps\n",
              static_cast<long long>(small.training.global_batch_tokens / small.training.seq_len),
              static_cast<long long>(small.training.seq_len), static_cast<long long>(plan.training.seq_len),
              static_cast<long long>(steps));
  std::fflush(stdout);

  const std::string self = self_path();
  auto child = [&](const std::string& plan_file, const std::string& run, int64_t last, bool resume, int64_t every,
                   const std::string& log) {
    std::vector<std::string> argv{self, "run", plan_file, "--data", args.data, "--out", out + "/" + run, "--steps",
                                  std::to_string(last), "--timeout", std::to_string(args.timeout_seconds)};
    if (resume) argv.push_back("--resume");
    if (every > 0) argv.insert(argv.end(), {"--checkpoint-every", std::to_string(every)});
    if (args.threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(args.threads)});
    const auto start = std::chrono::steady_clock::now();
    const int code = run_logged(argv, out + "/" + log);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("  %-44s %s in %.0f s (%s)\n",
                (run + (resume ? " resumed to step " : " steps 1-") + std::to_string(last)).c_str(),
                code == 0 ? "done" : "FAILED", seconds, log.c_str());
    if (code != 0) std::fputs(tail(out + "/" + log, 8).c_str(), stdout);
    std::fflush(stdout);
    return code == 0;
  };

  std::vector<Check> checks;
  const int64_t saved = steps - 1;
  const bool trained = child(out + "/plan.json", "layout", saved, false, saved, "layout.log");
  const bool resumed = trained && child(out + "/plan.json", "layout", steps, true, 0, "resume.log");
  const bool referenced = child(out + "/reference-plan.json", "reference", steps, false, saved, "reference.log");

  checks.push_back({"process groups form and train", trained,
                    std::to_string(p.world_size) + " ranks: " + describe_groups(p, plan.cluster.gpus_per_node)});
  OrderedJson record;
  record["plan"] = args.plan;
  record["layout"] = describe(p);
  record["model"] = to_json(m);
  record["steps"] = steps;
  if (trained && resumed && referenced) {
    const std::vector<Json> layout = read_metrics(out + "/layout"), one = read_metrics(out + "/reference");
    double worst = 0;
    bool same_routing = layout.size() == one.size() && layout.size() == static_cast<size_t>(steps);
    OrderedJson losses = OrderedJson::array();
    for (size_t i = 0; i < std::min(layout.size(), one.size()); ++i) {
      const double a = one[i]["loss"].get<double>(), b = layout[i]["loss"].get<double>();
      worst = std::max(worst, std::abs(b - a) / std::abs(a));
      same_routing = same_routing && layout[i]["tokens_per_expert"] == one[i]["tokens_per_expert"];
      losses.push_back({{"step", i + 1}, {"layout", b}, {"one_rank", a}});
    }
    record["losses"] = losses;
    checks.push_back({"tokens reach their experts", same_routing && worst <= kLossTolerance,
                      format("every step's tokens per expert equal to one rank's; losses within %.1e of one rank's "
                             "(bound %.0e)",
                             worst, kLossTolerance)});
    const auto [diff, where] = parameter_difference(executor::step_folder(out + "/layout/checkpoints", saved),
                                                    executor::step_folder(out + "/reference/checkpoints", saved), m);
    record["parameter_difference"] = diff;
    const double last_a = one.back()["loss"].get<double>(), last_b = layout.back()["loss"].get<double>();
    const double resumed_error = std::abs(last_b - last_a) / std::abs(last_a);
    checks.push_back({"shards line up, checkpoint saves and loads",
                      diff <= kParameterTolerance && resumed_error <= kLossTolerance,
                      format("the shards saved at step %.0f put together are one rank's parameters to %.1e (bound %.0e, ",
                             static_cast<double>(saved), diff, kParameterTolerance) +
                          where + format("); the step resumed from them has one rank's loss to %.1e", resumed_error)});
    // Memory: the busiest rank's live tensors against the memory model for the same shrunk layout.
    const Json report = read_json_file(out + "/layout/report.json");
    int64_t measured = 0;
    for (const Json& b : report["measured"]["peak_step_tensor_bytes_per_rank"]) measured = std::max(measured, b.get<int64_t>());
    // The memory model with the expert load this run measured: the most rows one rank's experts
    // computed in a layer of a micro-batch, over the mean (a random router is uneven, and the
    // busiest expert rank holds the most activations).
    int64_t rows = 0;
    for (const Json& r : report["measured"]["busiest_expert_rows_per_rank"]) rows = std::max(rows, r.get<int64_t>());
    const double load = static_cast<double>(rows) /
                        static_cast<double>(m.experts_per_token * p.micro_batch_size * small.training.seq_len);
    const Plan loaded = planner::with_measured_load(small, load);
    const int64_t predicted = planner::predicted_cpu_tensor_bytes(loaded);
    const double ratio = static_cast<double>(measured) / static_cast<double>(predicted);
    record["memory"] = {{"measured_peak_tensor_bytes", measured},
                        {"predicted_tensor_bytes", predicted},
                        {"busiest_expert_rank_load", load},
                        {"measured_over_predicted", ratio},
                        {"plan_device_bytes", plan.prediction.memory.device_total_bytes},
                        {"plan_device_limit_bytes", plan.prediction.memory.device_limit_bytes}};
    const double full = static_cast<double>(plan.prediction.memory.device_total_bytes);
    checks.push_back({"memory per rank as the memory model says", ratio <= 1 + kMemoryTolerance,
                      "busiest rank " + mib(static_cast<double>(measured)) + " of live tensors, memory model " +
                          mib(static_cast<double>(predicted)) + format(" (x %.2f, bound %.2f); ", ratio,
                                                                         1 + kMemoryTolerance) +
                          "on the cluster the model says " + gib(full) + " of " +
                          gib(static_cast<double>(plan.prediction.memory.device_limit_bytes)) +
                          (ratio > 1 ? ", " + gib(full * ratio) + " at this rehearsal's ratio" : "")});
  } else if (!trained || !resumed) {
    checks.push_back({"checkpoint saves and loads", false, "the layout's run failed; see its log"});
  } else {
    checks.push_back({"one-rank reference", false, "the reference run failed; see reference.log"});
  }

  bool ready = true;
  OrderedJson listed = OrderedJson::array();
  std::printf("\n");
  for (const Check& c : checks) {
    std::printf("  %-4s %-44s %s\n", c.ok ? "ok" : "FAIL", c.name.c_str(), c.detail.c_str());
    listed.push_back({{"check", c.name}, {"ok", c.ok}, {"detail", c.detail}});
    ready = ready && c.ok;
  }
  record["checks"] = listed;
  record["ready"] = ready;
  write_file_atomic(out + "/rehearsal.json", record.dump(2) + "\n");
  std::printf("\nverdict: %s\n", ready ? "the layout works; ready for the cluster"
                                         : "NOT READY: fix what failed above before booking the cluster");
  std::printf("wrote %s/rehearsal.json\n", out.c_str());
  return ready ? kExitOk : 1;
}

}  // namespace moeplan::cli
