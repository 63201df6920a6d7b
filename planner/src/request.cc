#include "moeplan/planner/request.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "moeplan/core/errors.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::planner {

namespace {

// What the sizes and the time and cost inputs need: a range for a deadline or an objective
// other than time, a whole node in a range, and a price for the dollars.
void check_sizes(const PreparedSearch& s, const ClusterSpec& instance) {
  const std::string objective(name_of(kObjectiveNames, s.goal.objective));
  if (!s.gpus.is_range() && s.goal.deadline_days > 0)
    throw InputError("--deadline-days", {{"", "picks among the sizes of a --gpus range (A:B)"}});
  if (!s.gpus.is_range() && s.goal.objective != Objective::kTime)
    throw InputError("--objective", {{"", "= " + objective + " ranks the sizes of a --gpus range (A:B)"}});
  if (s.sizes.empty())
    throw InputError("--gpus", {{"", "= " + s.gpus.text + " holds no whole number of " + instance.name + " instances (" +
                                         std::to_string(instance.gpus_per_node) + " GPUs each)"}});
  if (s.goal.objective != Objective::kTime && instance.instance_price_per_hour <= 0)
    throw InputError("--objective", {{"", "= " + objective + " needs the instance's price: " + instance.name +
                                              " has no cost.instance_price_per_hour"}});
}

// The training and MoE settings: the target's defaults where the request leaves them open, the
// model's auxiliary-loss coefficient, and the checks that need the model or the sizes.
void decide_training(const SearchRequest& r, const ModelSpec& model, const ClusterSpec& cluster, int64_t batch_gpus,
                     SearchOptions& o) {
  if (o.training.min_learning_rate > o.training.learning_rate)
    throw InputError("--min-learning-rate", {{"", "must not exceed --learning-rate"}});
  if (o.training.global_batch_tokens == 0)
    o.training.global_batch_tokens = default_global_batch_tokens(batch_gpus, o.training.seq_len);
  const FrameworkDefaults& defaults = framework(o.target).defaults;
  o.training.precision = r.precision.value_or(defaults.precision);
  o.training.fp32_gradients = r.fp32_gradients.value_or(defaults.fp32_gradients);
  o.moe.load_balancing = r.load_balancing.value_or(defaults.load_balancing);
  // Sinkhorn and balanced routing rebalance a softmax router's probabilities; a sigmoid router
  // balances by its bias, beside the auxiliary loss (DeepSeek-V3's, with the model's small
  // coefficient), unless the request says otherwise.
  const bool softmax_only = o.moe.load_balancing == LoadBalancing::kSinkhorn || o.moe.load_balancing == LoadBalancing::kBalanced;
  if (!r.load_balancing && model.router_scoring == RouterScoring::kSigmoid && softmax_only)
    o.moe.load_balancing = LoadBalancing::kAuxLoss;
  if (!o.moe.tokens_per_expert.empty()) {
    const RunConfig probe{model, cluster, ParallelConfig{}, o.moe, o.training};
    for (const Violation& v : validate(probe))
      if (v.rule == Rule::kTokenCountsMatchExperts) throw InputError("--tokens-per-expert", {{"", v.message}});
  }
  o.moe.aux_loss_coef = model.router_aux_loss_coef;
  const std::string& data = o.training.data;
  if (!data.empty() && !std::filesystem::exists(data + "/manifest.json"))
    throw InputError("--data", {{"", data + " has no manifest.json; prepare it with `moeplan data prepare`"}});
}

// The pins the planner cannot check itself, and the batch made of whole sequences.
void check_layout(const SearchOptions& o) {
  if (const std::optional<std::string>& placement = o.pins.placement; placement && !Placement::parse(*placement))
    throw InputError("--placement", {{"", "= \"" + placement->substr(0, 16) +
                                              "\": expected R, S and E once each and P and T at most once, "
                                              "outermost first (e.g. RSE or PRSET), or SMP's cluster, spread "
                                              "or a string of D, P and T"}});
  // Whole sequences; whether they split over a layout's data-parallel replicas (W / (T x P)
  // readers) is the global-batch rule's to say, layout by layout.
  if (o.training.global_batch_tokens % o.training.seq_len != 0)
    throw InputError("--global-batch-tokens",
                     {{"", "= " + std::to_string(o.training.global_batch_tokens) +
                               " is not a multiple of seq-len = " + std::to_string(o.training.seq_len) +
                               " (the batch is made of whole sequences)"}});
}

}  // namespace

GpuRange parse_gpu_range(const std::string& text) {
  const size_t colon = text.find(':');
  auto count = [&](const std::string& part) -> int64_t {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || errno == ERANGE || v < 1 || v > (1 << 20))
      throw InputError("--gpus", {{"", "= \"" + text.substr(0, 32) + "\": expected a GPU count in [1, 1048576] or a range A:B"}});
    return v;
  };
  if (colon == std::string::npos) {
    const int64_t n = count(text);
    return {n, n, text};
  }
  const GpuRange range{count(text.substr(0, colon)), count(text.substr(colon + 1)), text};
  if (range.min > range.max) throw InputError("--gpus", {{"", "= \"" + text + "\": the range's first size exceeds its last"}});
  return range;
}

PreparedSearch prepare_search(const SearchRequest& r) {
  if (r.goal.deadline_days > 0 && r.goal.tokens <= 0)
    throw InputError("--deadline-days", {{"", "needs --train-tokens (the tokens to train within it)"}});
  const GpuRange gpus = parse_gpu_range(r.gpus);
  const std::string dir = profile_dir(r.profiles);
  PreparedSearch s{load_model(r.model, dir), {}, gpus, {}, r.options, r.goal};
  const ClusterSpec instance = load_hardware(r.instance, dir);
  s.sizes = gpus.is_range() ? cluster_sizes(gpus.min, gpus.max, instance.gpus_per_node) : std::vector<int64_t>{gpus.max};
  s.cluster = size_cluster(instance, gpus.max);
  check_sizes(s, instance);
  if (r.kernels) {
    s.cluster.kernels = *r.kernels;
    s.cluster.attention = *r.kernels == Kernels::kFused ? AttentionKernel::kFlash : AttentionKernel::kUnfused;
  }
  if (r.attention) s.cluster.attention = *r.attention;
  s.options.gpus = gpus.max;
  s.options.keep = static_cast<size_t>(std::max<int64_t>(r.top, 5));
  if (r.capacity_factors.size() == 1) s.options.moe.capacity_factor = r.capacity_factors.front();
  if (r.capacity_factors.size() > 1 && gpus.is_range())
    throw InputError("--capacity-factor",
                     {{"", "a list of factors is chosen among at one cluster size, not over a --gpus range"}});
  decide_training(r, s.model, s.cluster, s.sizes.back(), s.options);
  check_layout(s.options);
  return s;
}

SearchOutcome plan_search(const SearchRequest& request, const std::string& command, const SearchProgress& progress) {
  SearchOutcome found{prepare_search(request), {}, {}, std::nullopt, {}};
  const PreparedSearch& s = found.search;
  if (progress.prepared) progress.prepared(s);
  if (s.gpus.is_range()) {
    found.sweep = sweep_cluster_sizes(s.model, s.cluster, s.options, s.sizes, s.goal, progress.size_searched);
    if (found.sweep.chosen) {
      const SizeResult& chosen = found.sweep.sizes[*found.sweep.chosen];
      found.plan = make_plan(s.model, chosen.cluster, chosen.options, chosen.result, command);
    }
  } else if (request.capacity_factors.size() > 1) {
    found.capacity = choose_capacity_factor(s.model, s.cluster, s.options, request.capacity_factors,
                                            request.max_dropped_fraction);
    if (found.capacity.chosen) {
      const CapacityChoice& chosen = found.capacity.factors[*found.capacity.chosen];
      found.search.options = chosen.options;
      found.result = chosen.result;
      found.plan = make_plan(s.model, s.cluster, chosen.options, chosen.result, command);
    }
  } else {
    found.result = search(s.model, s.cluster, s.options);
    if (!found.result.ranked.empty()) found.plan = make_plan(s.model, s.cluster, s.options, found.result, command);
  }
  return found;
}

}  // namespace moeplan::planner
