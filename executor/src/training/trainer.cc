#include "moeplan/executor/training/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string_view>
#include <vector>

#include "moeplan/core/errors.h"
#include "moeplan/core/phases.h"
#include "moeplan/core/rules.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/model/expert_bias.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/nonfinite.h"
#include "moeplan/executor/training/optimizer.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

struct Precisions {
  torch::ScalarType master, compute;
};

Precisions precisions(Precision p) {
  switch (p) {
    case Precision::kFp32: return {torch::kFloat, torch::kFloat};
    case Precision::kMixed: return {torch::kFloat, torch::kBFloat16};
    case Precision::kBf16: return {torch::kBFloat16, torch::kBFloat16};
  }
  return {torch::kFloat, torch::kFloat};
}

void check_plan(const Plan& plan, const TokenDataset& data, const RunOptions& o) {
  Diagnostics d;
  if (plan.parallel.world_size != 1)
    d.error("parallel.world_size", std::to_string(plan.parallel.world_size) +
                                       " ranks: this executor trains on one rank; plan with --gpus 1");
  check_run_inputs(plan, data, o, d);
  d.throw_if_any("run");
}

}  // namespace

ModelTrainer::ModelTrainer(const Plan& plan, torch::Device device, ExpertKernel kernel)
    : plan_(plan), device_(device), master_type_(precisions(plan.training.precision).master),
      compute_type_(precisions(plan.training.precision).compute),
      expert_kernel_(resolve_expert_kernel(kernel, plan.model, device, master_type_, compute_type_)),
      params_(ParameterSet::on_meta(mixtral_parameters(plan.model))),
      expert_bias_(initial_expert_bias(plan.model, device)), marks_(device) {
  clock_.set_device(device_);
  params_.materialize(static_cast<uint64_t>(plan.training.seed), master_type_);
  params_.check_materialized();
  params_.move_to(device_);
  std::vector<bool> decay;
  for (const ParamInfo& info : params_.infos()) decay.push_back(info.weight_decay);
  for (torch::Tensor& t : params_.tensors()) t.requires_grad_(true);
  optimizer_ = std::make_unique<AdamW>(
      params_.tensors(), decay,
      AdamWSettings{plan.training.adam_beta1, plan.training.adam_beta2, 1e-8, plan.training.weight_decay});
}

NamedTensors ModelTrainer::state() const {
  NamedTensors tensors;
  const auto& infos = params_.infos();
  // On the host (the tensors themselves on the CPU; copies of a device's).
  for (size_t i = 0; i < infos.size(); ++i) tensors.emplace_back("param/" + infos[i].name, params_.tensors()[i].cpu());
  for (size_t i = 0; i < infos.size(); ++i)
    tensors.emplace_back("exp_avg/" + infos[i].name, optimizer_->exp_avg()[i].cpu());
  for (size_t i = 0; i < infos.size(); ++i)
    tensors.emplace_back("exp_avg_sq/" + infos[i].name, optimizer_->exp_avg_sq()[i].cpu());
  add_expert_bias(tensors, plan_.model, expert_bias_);
  tensors.emplace_back("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
  return tensors;
}

void ModelTrainer::load_state(const NamedTensors& tensors, int64_t step, int64_t optimizer_step, Diagnostics& d) {
  std::map<std::string, const torch::Tensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  auto take = [&](const std::string& name, torch::Tensor& into) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) {
      d.error(name, "missing from the checkpoint");
      return;
    }
    const torch::Tensor& t = *it->second;
    if (t.sizes() != into.sizes() || t.scalar_type() != into.scalar_type()) {
      d.error(name, "is " + std::string(c10::toString(t.scalar_type())) + " " + c10::str(t.sizes()) + ", expected " +
                        c10::toString(into.scalar_type()) + " " + c10::str(into.sizes()));
      return;
    }
    torch::NoGradGuard no_grad;
    into.copy_(t);
  };
  for (size_t i = 0; i < params_.infos().size(); ++i) {
    const std::string& name = params_.infos()[i].name;
    take("param/" + name, params_.tensors()[i]);
    take("exp_avg/" + name, optimizer_->exp_avg()[i]);
    take("exp_avg_sq/" + name, optimizer_->exp_avg_sq()[i]);
  }
  // A sharded run's checkpoint has no generator state (training draws no random numbers).
  torch::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
  const bool has_rng = by_name.count("rng/cpu") != 0;
  if (has_rng) take("rng/cpu", rng);
  if (!d.empty()) return;
  if (has_rng) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(rng);
  }
  step_ = step;
  optimizer_->set_step_count(optimizer_step);
}

StepRecord ModelTrainer::step(const std::vector<torch::Tensor>& micro_batches) {
  using Clock = PhaseClock::Clock;
  marks_.restart();  // the device idle: the step's phases are timed by marks in its queue
  const auto start = Clock::now();
  clock_.start_step();
  const int64_t ga = static_cast<int64_t>(micro_batches.size());
  const ModelSpec& spec = plan_.model;
  StepRecord r;
  r.step = ++step_;
  r.learning_rate = learning_rate(plan_.training, step_);
  if (replay_) {
    replay_->start_step(step_);
    replay_->set_expert_bias(expert_bias_);  // the biases of the step's start, as the layout's
  }
  const bool mixed = compute_type_ != master_type_;
  std::vector<torch::Tensor> master_grads;
  if (mixed)
    for (const torch::Tensor& t : params_.tensors()) master_grads.push_back(torch::zeros_like(t));
  // Stacked for the grouped expert kernel (copies in the compute type, made once for the step's
  // micro-batches, as the mixed-precision copies are); their gradients go back to each expert's.
  std::optional<ExpertStacks> stacks;
  if (expert_kernel_ == ExpertKernel::kGrouped) stacks.emplace(spec, params_.tensors(), compute_type_);
  std::vector<torch::Tensor> stacked_grads(params_.tensors().size());
  // The losses stay on the device until the step ends and are read once, rather than copied to
  // the host one micro-batch at a time.
  std::vector<torch::Tensor> sums;
  torch::Tensor nonfinite_layers = torch::zeros({spec.blocks()}, torch::dtype(torch::kLong).device(device_));
  // In mixed precision, bf16 copies of the fp32 master weights, made once for the step's
  // micro-batches; after each backward their gradients are added to fp32 accumulators.
  std::vector<torch::Tensor> compute;
  if (mixed) {
    for (size_t i = 0; i < params_.tensors().size(); ++i) {
      const torch::Tensor& t = params_.tensors()[i];
      compute.push_back(stacks && stacks->stacked(i) ? t : t.detach().to(compute_type_).requires_grad_(true));
    }
  } else {
    compute = params_.tensors();
  }
  MixtralWeights weights = MixtralWeights::bind(spec, compute, expert_bias_);
  if (stacks) stacks->bind(weights);
  int64_t micro_batch = 0;
  std::vector<torch::Tensor> per_micro_batch;  // tokens_per_expert of each, read once at the end
  torch::Tensor dropped = torch::zeros({spec.moe_blocks()}, torch::dtype(torch::kLong).device(device_));
  for (const torch::Tensor& batch : micro_batches) {
    const torch::Tensor ids = to_device(batch, device_);
    const size_t f0 = marks_.mark();
    ForwardResult out =
        mixtral_forward(spec, weights, ids, plan_.moe, replay_ ? replay_->micro_batch(micro_batch++) : RouteOverride{});
    const LossTerms terms = mixtral_loss(spec, plan_.moe, out, ids);
    out.logits = torch::Tensor();  // the graph keeps what backward needs; the logits go now
    out.mtp_logits.clear();
    const size_t f1 = marks_.mark();
    (terms.total / static_cast<double>(ga)).backward();
    if (mixed) {
      for (size_t i = 0; i < compute.size(); ++i) {
        if (stacks && stacks->stacked(i)) continue;
        torch::Tensor& grad = compute[i].mutable_grad();
        if (!grad.defined()) continue;
        master_grads[i].add_(grad);  // widened inside the addition, exactly as a copy to fp32 would be
        grad = torch::Tensor();
      }
      if (stacks) stacks->add_gradients(master_grads);
    } else if (stacks) {
      stacks->add_gradients(stacked_grads);
    }
    const size_t f2 = marks_.mark();
    clock_.add_marked(phase::kForward, marks_, f0, f1);
    clock_.add_marked(phase::kBackward, marks_, f1, f2);
    per_micro_batch.push_back(out.tokens_per_expert);
    dropped += out.dropped_slots;
    nonfinite_layers += out.nonfinite_layers;
    sums.push_back(torch::stack({terms.lm, terms.aux, terms.z, terms.total}).detach().to(torch::kDouble));
    r.tokens += ids.numel();
  }
  const torch::Tensor mean_losses = torch::stack(sums).mean(0).cpu();
  const auto o0 = Clock::now();
  std::vector<torch::Tensor> grads;
  if (mixed) {
    grads = master_grads;
  } else {
    for (size_t i = 0; i < params_.tensors().size(); ++i) {
      const torch::Tensor& t = params_.tensors()[i];
      const torch::Tensor& g = stacks && stacks->stacked(i) ? stacked_grads[i] : t.grad();
      grads.push_back(g.defined() ? g : torch::zeros_like(t));
    }
  }
  r.grad_norm = clip_grad_norm(grads, plan_.training.max_grad_norm);
  if (std::isfinite(r.grad_norm) && std::isfinite(mean_losses[3].item<double>())) {
    optimizer_->step(grads, r.learning_rate);
  } else {
    r.skipped = true;
    torch::Tensor blocks = nonfinite_blocks(spec.blocks());
    note_nonfinite_outputs(blocks, nonfinite_layers);
    for (size_t i = 0; i < grads.size(); ++i)
      note_nonfinite_tensors(blocks, params_.infos()[i].block, params_.tensors()[i], grads[i]);
    r.nonfinite = describe_nonfinite(blocks);
  }
  for (torch::Tensor& t : params_.tensors()) t.mutable_grad() = torch::Tensor();
  wait_for(device_);
  clock_.add_marked_spans(marks_);
  clock_.add(std::string(phase::kOptimizer), "compute", TraceStream::kCompute, o0, Clock::now());
  if (replay_) replay_->finish_step();
  r.loss = mean_losses[0].item<double>();
  r.aux_loss = mean_losses[1].item<double>();
  r.z_loss = mean_losses[2].item<double>();
  r.total_loss = mean_losses[3].item<double>();
  // One rank is one expert group; the step's counts are its micro-batches' together.
  const torch::Tensor all = torch::stack(per_micro_batch).cpu();
  if (expert_bias_.defined() && !r.skipped) update_expert_bias(expert_bias_, all.sum(0), spec.router_bias_update_rate);
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.tokens_per_expert = slot_table(all.sum(0));
  std::vector<std::vector<std::vector<int64_t>>>& group = r.exchange_slots.emplace_back();
  for (int64_t m = 0; m < all.size(0); ++m) group.push_back(slot_table(all[m]));
  if (plan_.moe.capacity_factor > 0) {
    const torch::Tensor host = dropped.cpu();
    r.dropped_slots.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }
  return r;
}

namespace {

// The reference trainer as the run's loop drives it: every tensor whole on this one rank.
class OneRankTrainer final : public StepTrainer {
 public:
  OneRankTrainer(const Plan& plan, torch::Device device) : plan_(plan), model_(plan, device) {}

  StepRecord step(const std::vector<torch::Tensor>& micro_batches) override { return model_.step(micro_batches); }
  void replay_routing(RoutingReplay* replay) { model_.replay_routing(replay); }
  ExpertKernel expert_kernel() const { return model_.expert_kernel(); }
  int64_t step_count() const override { return model_.step_count(); }
  NamedTensors state() const override { return model_.state(); }
  const PhaseClock& clock() const override { return model_.clock(); }

  // Shards of any layout: whole tensors of a one-rank run or slices of a sharded one.
  void load_state(const SlicedState& sliced, int64_t step, int64_t optimizer_step, Diagnostics& d) override {
    NamedTensors tensors = whole_parameters(sliced, d);
    const std::string rng = "rng/cpu";
    if (sliced.contains(rng))
      tensors.emplace_back(rng, sliced.whole(rng, {at::detail::getDefaultCPUGenerator().get_state().numel()}, d));
    read_expert_bias(sliced, plan_.model, model_.expert_bias(), /*required=*/true, d);
    if (!d.empty()) return;
    model_.load_state(tensors, step, optimizer_step, d);
  }

  void load_hugging_face(const std::string& dir) override {
    const torch::ScalarType dtype = model_.parameters().tensors().front().scalar_type();
    Diagnostics d;
    const SlicedState sliced = read_hf_parameters(dir, plan_.model, dtype);
    const NamedTensors tensors = whole_parameters(sliced, d);
    read_expert_bias(sliced, plan_.model, model_.expert_bias(), /*required=*/false, d);
    d.throw_if_any(dir);
    model_.load_state(tensors, 0, 0, d);
    d.throw_if_any(dir);
  }

 private:
  NamedTensors whole_parameters(const SlicedState& sliced, Diagnostics& d) const {
    NamedTensors tensors;
    for (const ParamInfo& info : model_.parameters().infos())
      for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"}) {
        const torch::Tensor t = sliced.whole(prefix + info.name, info.shape, d);
        if (t.defined()) tensors.emplace_back(prefix + info.name, t);
      }
    return tensors;
  }

  const Plan& plan_;
  ModelTrainer model_;
};

}  // namespace

RunResult run_training(const Plan& plan, const RunOptions& o) {
  TokenDataset data = TokenDataset::open(o.data_dir);
  check_plan(plan, data, o);
  set_compute_threads(o.threads > 0 ? o.threads : 1);
  keep_freed_memory();
  install_tensor_allocator();
  ignore_broken_pipes();
  const std::string resume_from = prepare_run_folder(o);
  const ComputeDevice device = choose_device(plan.cluster, 0);
  if (!device.note.empty() && o.progress)
    *o.progress << gpu_plan_but(plan.cluster) << device.note << ": training on the CPU\n";
  RunRank me;
  me.device = device.device;
  me.where = device.is_cuda() ? "GPU " + device.name : "CPU rank";
  me.baseline_device_bytes = device_memory(device.device).used;
  const int64_t baseline_rss = current_rss_bytes();
  OneRankTrainer trainer(plan, device.device);
  if (device.is_cuda())
    me.where += trainer.expert_kernel() == ExpertKernel::kGrouped ? ", experts as grouped GEMMs" : ", experts one by one";
  std::unique_ptr<RoutingReplay> replay;
  if (!o.replay_routing.empty()) {
    replay = std::make_unique<RoutingReplay>(o.replay_routing, o.out_dir + "/routing-replay.json", plan.model,
                                             plan.moe.load_balancing);
    trainer.replay_routing(replay.get());
  }
  return run_steps(plan, o, data, trainer, me, resume_from, baseline_rss);
}

}  // namespace moeplan::executor
