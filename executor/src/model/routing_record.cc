#include "moeplan/executor/model/routing_record.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/tensor_file.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

std::string step_dir(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return dir + "/" + name;
}

std::string key(int64_t micro_batch, int64_t layer, const char* what) {
  return "m" + std::to_string(micro_batch) + "/l" + std::to_string(layer) + "/" + what;
}

// Slots of `a` [tokens, k] whose expert is not among the same token's experts in `b`: a token's
// k experts are a set (the order of its slots only orders two additions, which commute).
int64_t slots_unlike(const torch::Tensor& a, const torch::Tensor& b, int64_t experts) {
  const torch::Tensor in_a = torch::one_hot(a, experts).sum(1).clamp_max(1);
  const torch::Tensor in_b = torch::one_hot(b, experts).sum(1).clamp_max(1);
  return a.numel() - (in_a * in_b).sum().item<int64_t>();
}

}  // namespace

void RoutingRecorder::add(int64_t micro_batch, int64_t layer, const torch::Tensor& logits,
                          const torch::Tensor& experts, const torch::Tensor& kept, const torch::Tensor& rows) {
  torch::NoGradGuard no_grad;
  Entry e;
  e.micro_batch = micro_batch;
  e.layer = layer;
  e.tokens = logits.size(0);
  e.experts = logits.size(1);
  e.k = experts.size(1);
  const torch::Tensor values = logits.detach().to(torch::kCPU, torch::kFloat).contiguous();
  e.logits.assign(values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
  const torch::Tensor chosen = experts.to(torch::kCPU, torch::kLong).contiguous();
  const int64_t* c = chosen.data_ptr<int64_t>();
  for (int64_t i = 0; i < chosen.numel(); ++i) e.chosen.push_back(static_cast<uint8_t>(c[i]));
  if (kept.defined()) {
    const torch::Tensor k = kept.to(torch::kCPU, torch::kByte).contiguous();
    e.kept.assign(k.data_ptr<uint8_t>(), k.data_ptr<uint8_t>() + k.numel());
  }
  if (rows.defined()) {
    const torch::Tensor r = rows.to(torch::kCPU, torch::kLong).contiguous();
    e.rows.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  }
  entries_.push_back(std::move(e));
}

void RoutingRecorder::write(int64_t step) {
  const std::string dir = step_dir(dir_, step);
  std::error_code ec;
  fs::create_directories(dir, ec);  // every rank of the layout makes it; one succeeds
  NamedTensors tensors;
  for (Entry& e : entries_) {
    tensors.emplace_back(key(e.micro_batch, e.layer, "logits"),
                         torch::from_blob(e.logits.data(), {e.tokens, e.experts}, torch::kFloat));
    tensors.emplace_back(key(e.micro_batch, e.layer, "experts"),
                         torch::from_blob(e.chosen.data(), {e.tokens, e.k}, torch::kByte));
    if (!e.kept.empty())
      tensors.emplace_back(key(e.micro_batch, e.layer, "kept"),
                           torch::from_blob(e.kept.data(), {e.tokens, e.k}, torch::kByte));
    if (!e.rows.empty())
      tensors.emplace_back(key(e.micro_batch, e.layer, "rows"), torch::from_blob(e.rows.data(), {e.tokens}, torch::kLong));
  }
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05lld.safetensors", static_cast<long long>(rank_));
  const std::string path = dir + "/" + name;
  write_tensor_file(path + ".tmp", tensors, {{"step", std::to_string(step)}, {"rank", std::to_string(rank_)}});
  fs::rename(path + ".tmp", path);
  entries_.clear();
}

Json ReplayedStep::to_json() const {
  return {{"step", step},
          {"slots", slots},
          {"unrecorded", unrecorded},
          {"unlike_route", unlike_route},
          {"near_ties", near_ties},
          {"logit_difference", logit_difference},
          {"logit_difference_micro_batch", logit_difference_micro_batch}};
}

void RoutingReplay::start_step(int64_t step) {
  const std::string dir = step_dir(dir_, step);
  if (!fs::is_directory(dir))
    throw InputError(dir, {{"", "no routing record of step " + std::to_string(step) + " (the layout's run writes it)"}});
  record_.clear();
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  // Each rank's part of a (micro-batch, layer), put together in the order of their rows.
  std::map<std::pair<int64_t, int64_t>, std::vector<Recorded>> parts;
  for (const std::string& file : files) {
    std::map<std::pair<int64_t, int64_t>, Recorded> mine;
    for (auto& [name, tensor] : read_tensor_file(file).tensors) {
      // "m<micro-batch>/l<layer>/<what>"
      long long micro = -1, layer = -1;
      char what[16] = {};
      if (std::sscanf(name.c_str(), "m%lld/l%lld/%15s", &micro, &layer, what) != 3)
        throw InputError(file, {{name, "is not a routing record's tensor (m<micro-batch>/l<layer>/logits, experts, "
                                       "kept or rows)"}});
      Recorded& slot = mine[{micro, layer}];
      const std::string kind = what;
      (kind == "logits" ? slot.logits : kind == "experts" ? slot.experts : kind == "rows" ? slot.rows : slot.kept) =
          tensor;
    }
    for (auto& [at, part] : mine) parts[at].push_back(std::move(part));
  }
  for (auto& [at, list] : parts) {
    if (list.size() == 1 || !list[0].rows.defined()) {
      record_[at] = list.back();
      continue;
    }
    std::vector<torch::Tensor> logits, experts, kept, rows;
    for (const Recorded& r : list) {
      if (!r.rows.defined() || !r.logits.defined() || !r.experts.defined())
        throw InputError(dir, {{"m" + std::to_string(at.first) + "/l" + std::to_string(at.second),
                                "a part of the micro-batch's routing lacks its rows, logits or experts"}});
      logits.push_back(r.logits);
      experts.push_back(r.experts);
      rows.push_back(r.rows);
      if (r.kept.defined()) kept.push_back(r.kept);
    }
    const torch::Tensor order = torch::argsort(torch::cat(rows));
    Recorded whole;
    whole.logits = torch::cat(logits).index_select(0, order);
    whole.experts = torch::cat(experts).index_select(0, order);
    if (kept.size() == list.size()) whole.kept = torch::cat(kept).index_select(0, order);
    whole.parts = static_cast<int64_t>(list.size());
    record_[at] = whole;
  }
  current_ = ReplayedStep{};
  current_.step = step;
  current_.logit_difference.assign(static_cast<size_t>(spec_.blocks()), 0.0);
  current_.logit_difference_micro_batch.assign(static_cast<size_t>(spec_.blocks()), -1);
}

RouteOverride RoutingReplay::micro_batch(int64_t micro_batch) {
  return [this, micro_batch](int64_t layer, const torch::Tensor& logits) { return replay(micro_batch, layer, logits); };
}

Routing RoutingReplay::own_route(int64_t layer, const torch::Tensor& logits) const {
  const torch::Tensor bias =
      bias_.defined() && spec_.moe_layer(layer) ? bias_[spec_.moe_row(layer)].to(logits.device()) : torch::Tensor();
  return route(logits, RouterShape::of(spec_), method_, bias);
}

ChosenExperts RoutingReplay::replay(int64_t micro_batch, int64_t layer, const torch::Tensor& logits) {
  torch::NoGradGuard no_grad;
  const int64_t k = spec_.experts_per_token, experts = spec_.num_experts;
  // The load-balancing loss counts the k largest of the balancing probabilities (softmax, or the
  // normalised sigmoid scores), whatever chose the experts.
  auto counted = [&](const torch::Tensor& of) {
    return std::get<1>(torch::topk(balancing_probs(of, spec_.router_scoring), k, -1));
  };
  const torch::Tensor own = own_route(layer, logits).experts;
  current_.slots += own.numel();
  const auto it = record_.find({micro_batch, layer});
  if (it == record_.end() || !it->second.logits.defined() || !it->second.experts.defined() ||
      it->second.logits.sizes() != logits.sizes() || it->second.experts.size(0) != logits.size(0) ||
      it->second.experts.size(1) != k ||
      (it->second.kept.defined() && it->second.kept.sizes() != it->second.experts.sizes())) {
    ++current_.unrecorded;
    return {own, counted(logits), {}};
  }
  const torch::Tensor recorded_logits = it->second.logits.to(logits.scalar_type());
  const torch::Tensor chosen = it->second.experts.to(torch::kLong);
  const torch::Tensor kept = it->second.kept.defined() ? (it->second.kept != 0).to(logits.device()) : torch::Tensor();
  // The layout routes as the plan says: its choice is route() of its own logits, exactly. Sinkhorn
  // over several ranks' parts sums its column scalings over them, in another order than one rank
  // does, and stops at 1e-4 of their change: where two experts' balanced scores lie within 1e-3
  // of each other that rounding may decide, and such a slot is a near tie, not a wrong route.
  const torch::Tensor expected = own_route(layer, recorded_logits).experts;
  torch::Tensor unlike = torch::one_hot(expected, experts).sum(1).gather(1, chosen) == 0;  // [tokens, k]
  if (method_ == LoadBalancing::kSinkhorn && it->second.parts > 1 && unlike.any().item<bool>()) {
    const torch::Tensor balanced = sinkhorn(recorded_logits.to(torch::kFloat));
    const torch::Tensor kth = std::get<0>(torch::topk(balanced, k, -1)).select(1, k - 1).unsqueeze(1);
    const torch::Tensor close = balanced.gather(1, chosen) >= kth * (1 - 1e-3);
    unlike = unlike & close.logical_not();
  }
  current_.unlike_route += unlike.sum().item<int64_t>();
  current_.near_ties += slots_unlike(chosen, own, experts);
  const double difference = (logits.to(torch::kDouble) - recorded_logits.to(torch::kDouble)).norm().item<double>() /
                            std::sqrt(static_cast<double>(logits.size(0)));
  double& worst = current_.logit_difference[static_cast<size_t>(layer)];
  if (!(difference <= worst)) {  // a NaN stays
    worst = difference;
    current_.logit_difference_micro_batch[static_cast<size_t>(layer)] = micro_batch;
  }
  // The load-balancing loss counts the layout's logits' top-k, as the layout's own loss did.
  return {chosen, counted(recorded_logits), kept};
}

void RoutingReplay::finish_step() {
  done_.push_back(current_);
  Json steps = Json::array();
  for (const ReplayedStep& s : done_) steps.push_back(s.to_json());
  write_file_atomic(findings_path_, Json{{"steps", steps}}.dump(2) + "\n");
}

std::vector<ReplayedStep> read_replayed_steps(const std::string& path) {
  const Json doc = read_json_file(path);
  Diagnostics d;
  ObjectReader top(doc, "", d);
  std::vector<ReplayedStep> steps;
  const Json* list = top.child("steps");
  if (list != nullptr && !list->is_array()) d.error("steps", "expected an array, got " + describe_json(*list));
  if (list != nullptr && list->is_array())
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string at = "steps[" + std::to_string(i) + "]";
      ObjectReader o((*list)[i], at, d);
      if (!o.ok()) continue;
      ReplayedStep s;
      constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
      s.step = o.integer("step", 1, kMax);
      s.slots = o.integer("slots", 0, kMax);
      s.unrecorded = o.integer("unrecorded", 0, kMax);
      s.unlike_route = o.integer("unlike_route", 0, kMax);
      s.near_ties = o.integer("near_ties", 0, kMax);
      for (const char* field : {"logit_difference", "logit_difference_micro_batch"}) {
        const Json* values = o.child(field);
        if (values == nullptr) continue;
        if (!values->is_array()) {
          d.error(o.path_of(field), "expected an array, got " + describe_json(*values));
          continue;
        }
        for (size_t j = 0; j < values->size(); ++j) {
          const Json& v = (*values)[j];
          // A logit difference that was not finite is written as null.
          if (std::string(field) == "logit_difference") {
            if (!v.is_number() && !v.is_null())
              d.error(o.path_of(field) + "[" + std::to_string(j) + "]", "expected a number, got " + describe_json(v));
            s.logit_difference.push_back(v.is_number() ? v.get<double>() : std::nan(""));
          } else {
            if (!v.is_number_integer())
              d.error(o.path_of(field) + "[" + std::to_string(j) + "]", "expected an integer, got " + describe_json(v));
            s.logit_difference_micro_batch.push_back(v.is_number_integer() ? v.get<int64_t>() : -1);
          }
        }
      }
      o.finish();
      steps.push_back(std::move(s));
    }
  top.finish();
  d.throw_if_any(path);
  return steps;
}

}  // namespace moeplan::executor
