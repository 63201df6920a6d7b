#include "moeplan/executor/parallel_trainer.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/runtime.h"
#include "moeplan/executor/tokens.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Checkpoint slices.

void SlicedState::add(const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) {
    const auto at = name.rfind('@');
    int64_t begin = 0;
    std::string key = name;
    if (at != std::string::npos) {
      key = name.substr(0, at);
      try {
        begin = std::stoll(name.substr(at + 1));
      } catch (const std::exception&) {
        throw InputError(name, {{"", "is not <name>@<first element>"}});
      }
    }
    slices_[key][begin] = t.flatten();
  }
}

torch::Tensor SlicedState::range(const std::string& key, int64_t begin, int64_t end, Diagnostics& d) const {
  const auto it = slices_.find(key);
  if (it == slices_.end()) {
    d.error(key, "missing from the checkpoint");
    return {};
  }
  const auto& parts = it->second;
  std::vector<torch::Tensor> pieces;
  int64_t at = begin;
  auto p = parts.upper_bound(begin);
  if (p != parts.begin()) --p;
  for (; p != parts.end() && at < end; ++p) {
    const int64_t first = p->first, last = first + p->second.numel();
    if (last <= at) continue;
    if (first > at) break;  // a gap
    if (!pieces.empty() && p->second.scalar_type() != pieces.front().scalar_type()) {
      d.error(key, "has slices of different types");
      return {};
    }
    const int64_t take_end = std::min(end, last);
    pieces.push_back(p->second.narrow(0, at - first, take_end - at));
    at = take_end;
  }
  if (at != end) {
    d.error(key, "elements " + std::to_string(at) + ".." + std::to_string(end) + " are in no slice of the checkpoint");
    return {};
  }
  return pieces.size() == 1 ? pieces.front() : torch::cat(pieces);
}

torch::Tensor SlicedState::whole(const std::string& key, const std::vector<int64_t>& shape, Diagnostics& d) const {
  int64_t n = 1;
  for (const int64_t s : shape) n *= s;
  const auto it = slices_.find(key);
  if (it != slices_.end() && !it->second.empty()) {
    const auto& last = *it->second.rbegin();
    if (last.first + last.second.numel() != n) {
      d.error(key, "has " + std::to_string(last.first + last.second.numel()) + " elements, expected " +
                       std::to_string(n) + " " + c10::str(c10::IntArrayRef(shape)));
      return {};
    }
  }
  const torch::Tensor flat = range(key, 0, n, d);
  return flat.defined() ? flat.view(shape) : flat;
}

// ---------------------------------------------------------------------------------------------
// The trainer.

namespace {

std::string category_of(const char* op) {
  std::string c = op;
  std::replace(c.begin(), c.end(), '-', '_');
  return c;
}

uint64_t shuffle_seed(int64_t seed, int64_t step, int64_t micro) {
  uint64_t x = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(step) << 20 ^
               static_cast<uint64_t>(micro);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  return x ^ (x >> 31);
}

}  // namespace

ShardedTrainer::ShardedTrainer(const Plan& plan, DeviceMesh& mesh, ActivationStore* offload)
    : plan_(plan), mesh_(mesh), model_(plan, mesh) {
  optimizer_ = std::make_unique<AdamW>(AdamW::with_decay_masks(
      model_.shards(), model_.decay_masks(),
      AdamWSettings{plan.training.adam_beta1, plan.training.adam_beta2, 1e-8, plan.training.weight_decay}));
  if (offload) {
    model_.set_offload(offload, plan.parallel.activation_loading_horizon);
    offload->set_observer([this](const char* op, int64_t bytes, PhaseClock::Clock::time_point start,
                                 PhaseClock::Clock::time_point end) {
      clock_.add(op, "copy", TraceStream::kCopy, start, end, static_cast<double>(bytes));
    });
  }
  clock_.set_rank(mesh.rank());
  auto observe = [this](Communicator& comm, const std::string& group, TraceStream stream) {
    comm.set_observer([this, group, stream](const char* op, int64_t bytes, PhaseClock::Clock::time_point start,
                                            PhaseClock::Clock::time_point end) {
      clock_.add(group + "." + category_of(op), category_of(op), stream, start, end, static_cast<double>(bytes));
    });
  };
  observe(mesh.expert, "expert", TraceStream::kExpertComm);
  observe(mesh.shard, "shard", TraceStream::kShardGather);
  observe(mesh.dense_replicas, "dense_replicas", TraceStream::kGradComm);
  observe(mesh.expert_replicas, "expert_replicas", TraceStream::kGradComm);
  observe(mesh.world, "world", TraceStream::kGradComm);
}

StepRecord ShardedTrainer::step(const std::vector<torch::Tensor>& micro_batches) {
  using Clock = PhaseClock::Clock;
  const auto start = Clock::now();
  clock_.start_step();
  const ModelSpec& spec = plan_.model;
  const int64_t ga = static_cast<int64_t>(micro_batches.size());
  const double world = static_cast<double>(mesh_.world.size());
  StepRecord r;
  r.step = ++step_;
  r.learning_rate = learning_rate(plan_.training, step_);
  torch::Tensor counts = torch::zeros({spec.num_layers, spec.num_experts}, torch::kLong);
  torch::Tensor sums = torch::zeros({5}, torch::kDouble);  // lm, aux, z, total, tokens
  for (int64_t m = 0; m < ga; ++m) {
    const torch::Tensor& ids = micro_batches[static_cast<size_t>(m)];
    const auto f0 = Clock::now();
    ForwardResult out = model_.forward(ids, shuffle_seed(plan_.training.seed, step_, m));
    const LossTerms terms = mixtral_loss(spec, plan_.moe, out, ids);
    out.logits = torch::Tensor();  // the graph keeps what backward needs; the logits go now
    const auto f1 = Clock::now();
    (terms.total / static_cast<double>(ga)).backward();
    const auto f2 = Clock::now();
    clock_.add("forward", "compute", TraceStream::kCompute, f0, f1);
    clock_.add("backward", "compute", TraceStream::kCompute, f1, f2);
    counts += out.tokens_per_expert;
    sums[0] += terms.lm.item<double>();
    sums[1] += terms.aux.item<double>();
    sums[2] += terms.z.item<double>();
    sums[3] += terms.total.item<double>();
    sums[4] += static_cast<double>(ids.numel());
  }

  // Gradients: reduce-scattered over the shard group during backward; now summed over the
  // replicas and averaged over every rank's tokens.
  const auto o0 = Clock::now();
  std::vector<torch::Tensor> grads;
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < model_.units().size(); ++u) {
    torch::Tensor& shard = model_.shards()[u];
    torch::Tensor g = shard.grad().defined() ? shard.grad() : torch::zeros_like(shard);
    model_.replica_group(model_.units()[u]).all_reduce_sum(g);
    g.div_(world);
    grads.push_back(g);
  }
  // Global norm: each element counted on exactly one rank.
  torch::Tensor square = torch::zeros({1}, torch::kFloat);
  for (size_t u = 0; u < grads.size(); ++u)
    if (model_.owns(model_.units()[u])) square += grads[u].to(torch::kFloat).square().sum();
  mesh_.world.all_reduce_sum(square);
  r.grad_norm = std::sqrt(square.item<double>());
  const double coef = plan_.training.max_grad_norm / (r.grad_norm + 1e-6);
  if (coef < 1)
    for (torch::Tensor& g : grads) g.mul_(coef);
  optimizer_->step(grads, r.learning_rate);
  for (torch::Tensor& shard : model_.shards()) shard.mutable_grad() = torch::Tensor();
  clock_.add("optimizer", "compute", TraceStream::kCompute, o0, Clock::now());

  mesh_.world.all_reduce_sum(sums);
  mesh_.world.all_reduce_sum(counts);
  const double n = world * static_cast<double>(ga);
  r.loss = sums[0].item<double>() / n;
  r.aux_loss = sums[1].item<double>() / n;
  r.z_loss = sums[2].item<double>() / n;
  r.total_loss = sums[3].item<double>() / n;
  r.tokens = static_cast<int64_t>(sums[4].item<double>());
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    std::vector<int64_t> row;
    for (int64_t e = 0; e < spec.num_experts; ++e) row.push_back(counts[l][e].item<int64_t>());
    r.tokens_per_expert.push_back(std::move(row));
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

namespace {

// A parameter's part of this rank's shard of a flat unit: elements [first, last) of the
// parameter's flattened values, stored from element `at` of the unit's shard.
struct HeldSlice {
  size_t unit;
  const ParamInfo* info;
  int64_t first, last, at;
};

// Every such part, unit by unit (the replicated units included).
template <class F>
void for_each_held_slice(ShardedModel& model, F&& f) {
  for (size_t u = 0; u < model.units().size(); ++u) {
    const FlatUnit& unit = model.units()[u];
    const int64_t begin = model.shard_begin(unit), end = begin + unit.shard_numel;
    for (size_t j = 0; j < unit.params.size(); ++j) {
      const ParamInfo& info = model.infos()[static_cast<size_t>(unit.params[j])];
      const int64_t a = std::max(begin, unit.offsets[j]), b = std::min(end, unit.offsets[j] + info.numel());
      if (a < b) f(HeldSlice{u, &info, a - unit.offsets[j], b - unit.offsets[j], a - begin});
    }
  }
}

}  // namespace

NamedTensors ShardedTrainer::state() const {
  NamedTensors tensors;
  auto& model = const_cast<ShardedModel&>(model_);
  for_each_held_slice(model, [&](const HeldSlice& h) {
    if (!model.owns(model.units()[h.unit])) return;  // one replica saves
    const std::string suffix = h.info->name + "@" + std::to_string(h.first);
    const int64_t n = h.last - h.first;
    tensors.emplace_back("param/" + suffix, model.shards()[h.unit].detach().narrow(0, h.at, n));
    tensors.emplace_back("exp_avg/" + suffix, optimizer_->exp_avg()[h.unit].narrow(0, h.at, n));
    tensors.emplace_back("exp_avg_sq/" + suffix, optimizer_->exp_avg_sq()[h.unit].narrow(0, h.at, n));
  });
  return tensors;
}

std::set<std::string> ShardedTrainer::held_parameters() const {
  // As load_state reads: every unit this rank keeps a shard of.
  std::set<std::string> names;
  for_each_held_slice(const_cast<ShardedModel&>(model_), [&](const HeldSlice& h) { names.insert(h.info->name); });
  return names;
}

void ShardedTrainer::load_state(const SlicedState& state, int64_t step, Diagnostics& d) {
  torch::NoGradGuard no_grad;
  for_each_held_slice(model_, [&](const HeldSlice& h) {
    const std::pair<const char*, torch::Tensor> targets[] = {{"param/", model_.shards()[h.unit]},
                                                              {"exp_avg/", optimizer_->exp_avg()[h.unit]},
                                                              {"exp_avg_sq/", optimizer_->exp_avg_sq()[h.unit]}};
    for (const auto& [prefix, into] : targets) {
      const std::string key = prefix + h.info->name;
      const torch::Tensor values = state.range(key, h.first, h.last, d);
      if (!values.defined()) continue;
      if (values.scalar_type() != into.scalar_type()) {
        d.error(key, std::string("is ") + c10::toString(values.scalar_type()) + ", this run keeps " +
                         c10::toString(into.scalar_type()));
        continue;
      }
      into.narrow(0, h.at, h.last - h.first).copy_(values);
    }
  });
  step_ = step;
  optimizer_->set_step_count(step);
}

}  // namespace moeplan::executor
