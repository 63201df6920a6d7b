// The rehearsal of a cluster plan on local CPU ranks (rehearsal.h).
//
// Child runs of this program, each logged in the rehearsal folder:
//   layout/               the shrunk plan on its world size, steps 1..N-1, a checkpoint after
//                         every step, its routing recorded (layout/routing/);
//   layout/               resumed from step N-1's checkpoint for step N, a checkpoint at N;
//   reference/step-<s>/   one rank with the whole global batch for step s alone, replaying the
//                         layout's routing of that step, from the layout's checkpoint of step
//                         s - 1 (step 1: from the initial values).
// So the layout and one rank take every step from the same state, compute the same function
// and differ by rounding only; rehearsal_bounds.h bounds that, and any more is the layout's.
#include "moeplan/executor/rehearsal/rehearsal.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/rules.h"
#include "moeplan/core/run_report.h"
#include "moeplan/core/units.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/model/routing_record.h"
#include "moeplan/executor/ranks/mesh.h"
#include "moeplan/executor/ranks/rank_start.h"
#include "moeplan/executor/rehearsal/rehearsal_bounds.h"
#include "moeplan/executor/training/optimizer.h"
#include "moeplan/executor/training/parallel_trainer.h"
#include "moeplan/executor/training/trainer.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

// The rounding bounds hold for every comparison of a rehearsal at once except with this
// probability (rehearsal_bounds.h): a false alarm once in a million rehearsals.
constexpr double kFalseAlarm = 1e-6;
// Measured live tensors per rank over the memory model's figure for the same shrunk layout: a
// model's tolerance, not rounding (the eager CPU kernels and autograd keep temporaries the model
// does not list; docs/executor.md, "Rehearsal", has the measurements it rests on).
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

std::string format(const char* f, double a, double b = 0, double c = 0) {
  char s[256];
  std::snprintf(s, sizeof s, f, a, b, c);
  return s;
}

// 1234567 -> "1,234,567"
std::string count(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// The groups a rank of this layout joins, counted, and whether each kind stays inside a node.
std::string describe_groups(const ParallelConfig& p, int64_t gpus_per_node) {
  const MeshLayout layout(p);
  struct Kind {
    const char* name;
    std::vector<MeshDim> varying;
  };
  const Kind kinds[] = {{"shard", {MeshDim::kShard}},
                        {"expert", layout.expert_dims()},
                        {"dense replica", {MeshDim::kReplica, MeshDim::kExpert, MeshDim::kContext}},
                        {"expert replica", layout.expert_replica_dims()},
                        {"context", {MeshDim::kContext}},
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
  if (plan.parallel.world_size < 2)
    d.error("parallel.world_size", "= 1: a one-rank plan has no layout to rehearse; train it with `moeplan run`");
  // One rank cannot reproduce routing over tokens shuffled across the expert group.
  if (plan.moe.global_token_shuffle)
    d.error("moe.global_token_shuffle", "= true: the one-rank reference routes other token sets, so the losses "
                                        "could not be compared");
  // Every rank is a LibTorch process of its own (about 200 MiB before any tensor).
  const int64_t available = available_memory_bytes();
  if (available > 0 && plan.parallel.world_size * kBytesPerRank > available)
    d.error("parallel.world_size", "= " + std::to_string(plan.parallel.world_size) + " processes need about " +
                                       gib_text(static_cast<double>(plan.parallel.world_size * kBytesPerRank)) +
                                       " here; this machine has " + gib_text(static_cast<double>(available)) + " available");
  // The test hook: a fault the layout can carry.
  const ParallelConfig& p = plan.parallel;
  switch (rehearsal_fault_from_environment()) {
    case RehearsalFault::kExpertOnWrongRank:
      if (p.expert_parallel_degree < 2)
        d.error(kRehearsalFaultVariable, "= expert-on-wrong-rank needs parallel.expert_parallel_degree > 1");
      break;
    case RehearsalFault::kUnreducedGradient:
      if (p.replica_degree() * p.expert_parallel_degree < 2)
        d.error(kRehearsalFaultVariable, "= unreduced-gradient needs a dense replica group (R x E > 1)");
      break;
    case RehearsalFault::kShardOffByOne:
    case RehearsalFault::kNone:
      break;
  }
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
// folder (layout/ and reference/ runs in it), the steps run, and the rounding bounds.
struct Rehearsing {
  const Plan& plan;
  const Plan& small;
  const std::string& out;
  int64_t steps;
  RoundingBudget budget;
  RoundingBound bound;
  // The checkpoints the checks read, each read (and its files verified) once.
  mutable std::map<std::string, std::shared_ptr<const SlicedState>> states = {};

  // A checkpoint's tensors, put together by parameter.
  const SlicedState& state(const std::string& dir) const {
    std::shared_ptr<const SlicedState>& s = states[dir];
    if (!s) {
      const LoadedCheckpoint c = open_checkpoint(dir);
      auto loaded = std::make_shared<SlicedState>();
      for (const CheckpointFile& f : c.files) loaded->add(read_checkpoint_shard(c, f.name).tensors);
      s = std::move(loaded);
    }
    return *s;
  }
};

std::string reference_dir(const std::string& out, int64_t step) {
  return out + "/reference/step-" + std::to_string(step);
}

// The state a step starts from: the initial values (step 1) or the layout's checkpoint of the
// step before, which the reference's run of the step loaded too.
class StartingState {
 public:
  StartingState(const Rehearsing& c, int64_t step) : model_(c.small.model), seed_(c.small.training.seed) {
    if (step > 1) state_ = &c.state(step_folder(c.out + "/layout/checkpoints", step - 1));
  }
  // "param/<name>" and the moments; zero moments at the start.
  torch::Tensor get(const std::string& kind, const ParamInfo& info) const {
    if (state_) {
      Diagnostics d;
      torch::Tensor t = state_->whole(kind + info.name, info.shape, d);
      d.throw_if_any("the layout's checkpoint");
      return t;
    }
    torch::Tensor t = torch::zeros(info.shape, torch::kFloat);
    if (kind == "param/") initialize_parameter(t, info, static_cast<uint64_t>(seed_));
    return t;
  }
  torch::Tensor parameter(const std::string& name) const {
    for (const ParamInfo& info : mixtral_parameters(model_))
      if (info.name == name) return get("param/", info);
    throw std::logic_error("no parameter " + name);
  }

 private:
  ModelSpec model_;
  int64_t seed_ = 0;
  const SlicedState* state_ = nullptr;  // none at step 1
};

// The worst ratio of a difference to its bound over a check, and where it was.
struct Worst {
  double ratio = 0, value = 0, bound = 0;
  std::string where;
  void add(double v, double b, const std::string& at) {
    const double r = b > 0 ? v / b : (v == 0 ? 0 : std::numeric_limits<double>::infinity());
    if (!(r <= ratio)) {  // a NaN stays
      ratio = r;
      value = v;
      bound = b;
      where = at;
    }
  }
  bool ok() const { return ratio <= 1; }
  std::string describe() const {
    return format("%.2g of its bound (%.2g against %.2g, ", ratio, value, bound) + where + ")";
  }
  Json to_json() const {
    return {{"ratio", std::isfinite(ratio) ? Json(ratio) : Json("not finite")},
            {"value", std::isfinite(value) ? Json(value) : Json("not finite")},
            {"bound", bound},
            {"where", where}};
  }
};

// Routing: the reference replayed the layout's choices; here, whether the layout made them as
// the plan says, counted them as it made them, and saw the router logits one rank sees.
RehearsalCheck check_routing(const Rehearsing& c, Json& record) {
  const ModelSpec& m = c.small.model;
  const std::vector<Json> layout = read_metrics(c.out + "/layout");
  if (layout.size() != static_cast<size_t>(c.steps))
    return {"tokens reach their experts", false, "the layout's run did not record every step"};
  Worst logits;
  int64_t slots = 0, unrecorded = 0, unlike_route = 0, near_ties = 0;
  bool counts_equal = true;
  std::string counts_differ;
  for (int64_t s = 1; s <= c.steps; ++s) {
    const std::vector<Json> one = read_metrics(reference_dir(c.out, s));
    const std::vector<ReplayedStep> replayed = read_replayed_steps(reference_dir(c.out, s) + "/routing-replay.json");
    if (one.size() != 1 || replayed.size() != 1 || replayed[0].step != s)
      return {"tokens reach their experts", false, "the reference's run of step " + std::to_string(s) + " is incomplete"};
    // Replaying the layout's choices, one rank counts what the layout counted, exactly.
    const Json& a = layout[static_cast<size_t>(s - 1)].at("tokens_per_expert");
    const Json& b = one[0].at("tokens_per_expert");
    if (a != b && counts_equal) {
      counts_equal = false;
      counts_differ = "step " + std::to_string(s);
    }
    const ReplayedStep& r = replayed[0];
    slots += r.slots;
    unrecorded += r.unrecorded;
    unlike_route += r.unlike_route;
    near_ties += r.near_ties;
    // The router logits of every layer against their rounding bound: the budget of the forward
    // pass up to that router, times the magnitude the parameters at the step's start allow.
    const LogitMagnitudes magnitudes =
        logit_magnitudes(m, [state = StartingState(c, s)](const std::string& name) { return state.parameter(name); });
    for (size_t l = 0; l < r.logit_difference.size() && l < c.budget.router.size(); ++l)
      logits.add(r.logit_difference[l], c.bound.of(c.budget.router[l]) * magnitudes.router_per_token[l],
                 "layer " + std::to_string(l) + ", micro-batch " + std::to_string(r.logit_difference_micro_batch[l]) +
                     ", step " + std::to_string(s));
  }
  record["routing"] = {{"slots", slots},
                       {"unrecorded", unrecorded},
                       {"unlike_route", unlike_route},
                       {"near_ties", near_ties},
                       {"tokens_per_expert_equal", counts_equal},
                       {"router_logits", logits.to_json()}};
  const bool ok = counts_equal && unrecorded == 0 && unlike_route == 0 && logits.ok();
  std::string detail;
  if (unrecorded > 0) detail += count(unrecorded) + " (micro-batch, layer) pairs were NOT ROUTED by the layout; ";
  if (unlike_route > 0)
    detail += count(unlike_route) + " slots went to OTHER experts than the plan's " +
              std::string(name_of(kLoadBalancingNames, c.small.moe.load_balancing)) +
              " routing of the layout's own logits; ";
  detail += counts_equal ? "every step's tokens per expert are one rank's replaying the layout's routing"
                         : "tokens per expert DIFFER from one rank's replaying the layout's routing (" + counts_differ + ")";
  detail += "; router logits " + std::string(logits.ok() ? "" : "DIFFER: ") + logits.describe();
  detail += "; " + count(near_ties) + " of " + count(slots) + " slots go elsewhere under one rank's own routing" +
            (logits.ok() ? " (near ties: the logits agree within their bound)" : "");
  return {"tokens reach their experts", ok, detail};
}

// Losses, router losses and the gradient norm of every step against one rank's, each within the
// rounding bound of its own computation (the gradient norm sees a gradient summed over the wrong
// group or scaled wrongly).
RehearsalCheck check_losses(const Rehearsing& c, Json& record) {
  const std::vector<Json> layout = read_metrics(c.out + "/layout");
  Worst worst;
  Json losses = Json::array();
  for (int64_t s = 1; s <= c.steps && static_cast<size_t>(s) <= layout.size(); ++s) {
    const std::vector<Json> one = read_metrics(reference_dir(c.out, s));
    if (one.empty()) return {"losses and gradient norm are one rank's", false, "no metrics of step " + std::to_string(s)};
    const Json& a = layout[static_cast<size_t>(s - 1)];
    const Json& b = one[0];
    if (a.contains("skipped") || b.contains("skipped"))  // a NaN or an Inf: no update, nothing to compare
      return {"losses and gradient norm are one rank's", false,
              "step " + std::to_string(s) + " was SKIPPED (a NaN or an Inf) by " +
                  (a.contains("skipped") ? "the layout" : "one rank")};
    StepMetrics reference{b.at("loss").get<double>(), b.at("aux_loss").get<double>(), b.at("z_loss").get<double>(),
                          b.at("grad_norm").get<double>()};
    const LogitMagnitudes magnitudes = logit_magnitudes(
        c.small.model, [state = StartingState(c, s)](const std::string& name) { return state.parameter(name); });
    const StepMetrics bound = metric_bounds(c.budget, c.bound, magnitudes, reference, c.small.model.num_experts);
    const std::string at = " at step " + std::to_string(s);
    worst.add(std::abs(a.at("loss").get<double>() - reference.loss), bound.loss, "loss" + at);
    worst.add(std::abs(a.at("aux_loss").get<double>() - reference.aux_loss), bound.aux_loss, "load-balancing loss" + at);
    worst.add(std::abs(a.at("z_loss").get<double>() - reference.z_loss), bound.z_loss, "z-loss" + at);
    worst.add(std::abs(a.at("grad_norm").get<double>() - reference.grad_norm), bound.grad_norm, "gradient norm" + at);
    losses.push_back({{"step", s}, {"layout", a.at("loss")}, {"one_rank", b.at("loss")}, {"bound", bound.loss}});
  }
  record["losses"] = losses;
  record["metrics"] = worst.to_json();
  return {"losses and gradient norm are one rank's", worst.ok(),
          std::string(worst.ok() ? "" : "DIFFER: ") + "loss, router losses and gradient norm at most " + worst.describe()};
}

// Every step's state, saved by the layout and put together from its shards: the gradient its
// first moment took in is one rank's to the rounding bound, and its second moment and
// parameters follow from it and from the step before by one fp32 AdamW step. Saves and loads
// that lose or misplace any slice show, and the parameters are held to AdamW's own arithmetic
// rather than to one rank's (where a gradient is rounding noise, Adam's first steps move an
// element by about the learning rate either way).
RehearsalCheck check_shards(const Rehearsing& c, Json& record) {
  const ModelSpec& m = c.small.model;
  const TrainingConfig& t = c.small.training;
  Worst gradient, moment, parameter;
  for (int64_t s = 1; s <= c.steps; ++s) {
    const StartingState before(c, s);
    const SlicedState& layout = c.state(step_folder(c.out + "/layout/checkpoints", s));
    const SlicedState& one = c.state(step_folder(reference_dir(c.out, s) + "/checkpoints", s));
    // Clipping scales every gradient when the norm passes max_grad_norm: when either run may
    // have clipped, its bound adds (rehearsal_bounds.cc).
    const std::vector<Json> metrics = read_metrics(reference_dir(c.out, s));
    const double norm = metrics.empty() ? 0 : metrics[0].at("grad_norm").get<double>();
    const double norm_bound = gradient_bound(c.budget, c.bound, false) + c.bound.of(c.budget.parameters) / 2;
    const bool clipped = norm * (1 + norm_bound) >= t.max_grad_norm;
    const double relative = gradient_bound(c.budget, c.bound, clipped);
    // eps as both trainers set it (AdamWSettings); step s is optimizer step s (no step skipped).
    AdamWStep adam{learning_rate(t, s), t.adam_beta1, t.adam_beta2, 1e-8, t.weight_decay, s, true};
    for (const ParamInfo& info : mixtral_parameters(m)) {
      Diagnostics d;
      auto whole = [&](const SlicedState& state, const char* kind, const char* whose) {
        torch::Tensor x = state.whole(kind + info.name, info.shape, d);
        d.throw_if_any(std::string(whose) + "'s checkpoint of step " + std::to_string(s));
        return x;
      };
      const std::string at = info.name + " at step " + std::to_string(s);
      const torch::Tensor m_prev = before.get("exp_avg/", info);
      const RecoveredGradient g_layout = recovered_gradient(whole(layout, "exp_avg/", "the layout"), m_prev, t.adam_beta1);
      const RecoveredGradient g_one = recovered_gradient(whole(one, "exp_avg/", "one rank"), m_prev, t.adam_beta1);
      const double difference = (g_layout.gradient - g_one.gradient).norm().item<double>();
      gradient.add(difference,
                   relative * g_one.gradient.norm().item<double>() + g_layout.error.norm().item<double>() +
                       g_one.error.norm().item<double>(),
                   at);
      const torch::Tensor v = whole(layout, "exp_avg_sq/", "the layout");
      adam.decay = info.weight_decay;
      moment.add(second_moment_mismatch(v, before.get("exp_avg_sq/", info), g_layout, adam), 1, at);
      parameter.add(parameter_mismatch(whole(layout, "param/", "the layout"), before.get("param/", info),
                                       whole(layout, "exp_avg/", "the layout"), v, adam),
                    1, at);
    }
    // Read for the last time (the layout's of this step starts the next).
    c.states.erase(step_folder(reference_dir(c.out, s) + "/checkpoints", s));
    if (s > 1) c.states.erase(step_folder(c.out + "/layout/checkpoints", s - 1));
  }
  record["state"] = {{"gradient", gradient.to_json()}, {"exp_avg_sq", moment.to_json()}, {"param", parameter.to_json()}};
  const bool ok = gradient.ok() && moment.ok() && parameter.ok();
  return {"shards line up, checkpoint saves and loads", ok,
          format("the layout's shards of steps 1 to %.0f (step %.0f after the resume) put together: the gradient "
                 "in the first moments ",
                 static_cast<double>(c.steps), static_cast<double>(c.steps)) +
              (gradient.ok() ? "is one rank's to " : "DIFFERS from one rank's: ") + gradient.describe() +
              "; second moments " + (moment.ok() ? "follow from it to " : "do NOT follow from it: ") +
              format("%.2g of AdamW's rounding (", moment.ratio) + moment.where + "); parameters " +
              (parameter.ok() ? "follow from the moments to " : "do NOT follow from the moments: ") +
              format("%.2g of AdamW's rounding (", parameter.ratio) + parameter.where + ")"};
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
  // busiest expert rank holds the most activations). The mean is k times the tokens a rank
  // routes: a micro-batch's, of which a context rank routes 1 / C and a folded tensor rank
  // 1 / T of that.
  const RunReport report = read_run_report(out + "/layout/report.json");
  const int64_t measured = report.peak_step_tensor_bytes();
  const int64_t rows = report.busiest_expert_rows();
  const int64_t routed_tokens = p.micro_batch_size * small.training.seq_len /
                                (p.context_parallel_degree * p.expert_tensor_fold());
  const double load = static_cast<double>(rows) / static_cast<double>(m.experts_per_token * routed_tokens);
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
                   gib_text(full) + " of " + gib_text(limit) + ", " + gib_text(scaled) + " at this rehearsal's ratio" +
                   (scaled > limit ? " (above its limit, if this error carried over to the GPUs)" : "")};
}

// Progress and verdict lines, printf-style, when someone reads them.
class Say {
 public:
  explicit Say(std::ostream* out) : out_(out) {}
  template <class... Values>
  void operator()(const char* f, Values... values) const {
    if (!out_) return;
    char line[1024];
    std::snprintf(line, sizeof line, f, values...);
    *out_ << line << std::flush;
  }
  std::ostream* stream() const { return out_; }

 private:
  std::ostream* out_;
};

// What is rehearsed: the plan, its layout, and how the model and the batch were shrunk.
void say_what_is_rehearsed(const Say& say, const Plan& plan, const Plan& small, const RehearsalOptions& o,
                           RehearsalFault fault) {
  const ModelSpec& m = small.model;
  const ParallelConfig& p = small.parallel;
  say("rehearsing %s (%s on %s x %lld GPUs) on %lld local CPU ranks\n", o.plan_path.c_str(),
      plan.model.name.c_str(), plan.cluster.name.c_str(), static_cast<long long>(plan.parallel.world_size),
      static_cast<long long>(p.world_size));
  if (fault != RehearsalFault::kNone)
    say("  PLANTED FAULT %s (the test hook %s): this rehearsal is not of the plan as it is\n",
        std::string(name_of(fault)).c_str(), kRehearsalFaultVariable);
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
      static_cast<long long>(plan.parallel.gradient_accumulation_steps), static_cast<long long>(o.steps));
}

// Which of the child runs finished: the layout's steps 1..N-1, its step N resumed, and the
// one-rank reference of every step.
struct ChildRuns {
  bool trained = false, resumed = false, referenced = false;
};

// The layout saves after every step and records its routing; the reference takes each step from
// the layout's state before it, replaying that routing. Each run stops the ones after it when it
// fails.
ChildRuns run_layout_and_reference(const RehearsalOptions& o, const std::string& out, const RunProgram& run,
                                   RehearsalFault fault, const Say& say) {
  auto child = [&](const std::string& plan_file, const std::string& folder, int64_t last, bool resume, int64_t every,
                   const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> argv{"run", plan_file, "--data", o.data_dir, "--out", out + "/" + folder, "--steps",
                                  std::to_string(last), "--timeout", std::to_string(o.timeout_seconds),
                                  "--checkpoint-every", std::to_string(every)};
    if (resume) argv.push_back("--resume");
    if (o.threads > 0) argv.insert(argv.end(), {"--threads", std::to_string(o.threads)});
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto start = std::chrono::steady_clock::now();
    const int code = run(argv, out + "/" + log);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    say("  %-44s %s in %.0f s (%s)\n",
        (folder + (resume ? " resumed to step " : " steps 1-") + std::to_string(last)).c_str(),
        code == 0 ? "done" : "FAILED", seconds, log.c_str());
    if (code != 0 && say.stream()) *say.stream() << tail(out + "/" + log, 8) << std::flush;
    return code == 0;
  };
  const int64_t steps = o.steps;
  const std::string record_dir = out + "/layout/routing";
  ChildRuns done;
  std::vector<std::string> record{"--record-routing", record_dir};
  if (fault != RehearsalFault::kNone) record.insert(record.end(), {"--planted-fault", std::string(name_of(fault))});
  done.trained = child(out + "/plan.json", "layout", steps - 1, false, 1, record, "layout.log");
  done.resumed = done.trained && child(out + "/plan.json", "layout", steps, true, 1, record, "resume.log");
  done.referenced = done.resumed;
  for (int64_t s = 1; s <= steps && done.referenced; ++s) {
    const std::string folder = "reference/step-" + std::to_string(s);
    if (s > 1) {
      const std::string from = step_folder(out + "/layout/checkpoints", s - 1);
      fs::create_directories(out + "/" + folder + "/checkpoints");
      fs::copy(from, step_folder(out + "/" + folder + "/checkpoints", s - 1), fs::copy_options::recursive);
    }
    done.referenced = child(out + "/reference-plan.json", folder, s, s > 1, s, {"--replay-routing", record_dir},
                            "reference-step-" + std::to_string(s) + ".log");
  }
  return done;
}

// rehearsal.json's account of what was rehearsed and the rounding bound it was held to.
Json rehearsal_record(const Rehearsing& c, const RehearsalOptions& o, RehearsalFault fault, double comparisons) {
  Json record;
  record["plan"] = o.plan_path;
  record["layout"] = describe(c.small.parallel);
  record["model"] = to_json(c.small.model);
  record["steps"] = c.steps;
  if (fault != RehearsalFault::kNone) record["planted_fault"] = std::string(name_of(fault));
  record["rounding"] = {{"unit_roundoff", kUnitRoundoff},
                        {"lambda", c.bound.lambda()},
                        {"false_alarm_probability", kFalseAlarm},
                        {"comparisons", comparisons},
                        {"gradient_bound", gradient_bound(c.budget, c.bound, false)}};
  return record;
}

// The checks of the runs' outputs, once every run finished; else which run failed.
void check_runs(const Rehearsing& c, const ChildRuns& runs, Json& record, const PredictTensorBytes& predict,
                int64_t plan_tensor_bytes, const Say& say, std::vector<RehearsalCheck>& checks) {
  if (!runs.trained || !runs.resumed) {
    checks.push_back({"checkpoint saves and loads", false,
                      std::string("the layout's run failed; see ") + (runs.trained ? "resume.log" : "layout.log")});
    return;
  }
  if (!runs.referenced) {
    checks.push_back({"one-rank reference", false, "a reference run failed; see reference-step-*.log"});
    return;
  }
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
  const auto start = std::chrono::steady_clock::now();
  guarded("tokens reach their experts", [&] { return check_routing(c, record); });
  guarded("losses and gradient norm are one rank's", [&] { return check_losses(c, record); });
  guarded("shards line up, checkpoint saves and loads", [&] { return check_shards(c, record); });
  guarded("memory per rank as the memory model says",
          [&] { return check_memory(c, record, predict, plan_tensor_bytes); });
  say("  %-44s done in %.0f s\n", "checks",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// Every check and the verdict, said and written into rehearsal.json; whether every check passed.
bool give_verdict(const std::vector<RehearsalCheck>& checks, Json& record, const std::string& out,
                  RehearsalFault fault, const Say& say) {
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
  if (fault != RehearsalFault::kNone)
    say("(with the planted fault %s of %s)\n", std::string(name_of(fault)).c_str(), kRehearsalFaultVariable);
  say("wrote %s/rehearsal.json\n", out.c_str());
  return ready;
}

}  // namespace

Rehearsal rehearse(const Plan& plan, const Plan& small, const Plan& reference, const RehearsalOptions& o,
                   const RunProgram& run, const PredictTensorBytes& predict, int64_t plan_tensor_bytes) {
  const Say say(o.progress);
  fs::create_directories(o.out_dir);
  const std::string out = fs::absolute(o.out_dir).string();
  write_file_atomic(out + "/plan.json", plan_to_text(small));
  write_file_atomic(out + "/reference-plan.json", plan_to_text(reference));

  const ModelSpec& m = small.model;
  // One rounding bound for every comparison: each step's router logits (every element), each
  // parameter's gradient (every element) and the four step metrics.
  int64_t parameters = 0;
  for (const ParamInfo& info : mixtral_parameters(m)) parameters += info.numel();
  const int64_t tokens = small.training.global_batch_tokens;
  const double comparisons = static_cast<double>(o.steps) *
                             (static_cast<double>(tokens * m.num_layers * m.num_experts + parameters) + 4);
  const Rehearsing ctx{plan, small, out, o.steps,
                       rounding_budget(m, small.training.seq_len, tokens, parameters),
                       RoundingBound(comparisons, kFalseAlarm)};
  const RehearsalFault fault = rehearsal_fault_from_environment();
  say_what_is_rehearsed(say, plan, small, o, fault);
  const ChildRuns runs = run_layout_and_reference(o, out, run, fault, say);

  Rehearsal result;
  const ParallelConfig& p = small.parallel;
  result.checks.push_back({"process groups form and train", runs.trained,
                           std::to_string(p.world_size) + " ranks: " + describe_groups(p, plan.cluster.gpus_per_node)});
  Json record = rehearsal_record(ctx, o, fault, comparisons);
  check_runs(ctx, runs, record, predict, plan_tensor_bytes, say, result.checks);
  result.ready = give_verdict(result.checks, record, out, fault, say);
  return result;
}

}  // namespace moeplan::executor
