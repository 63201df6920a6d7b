#include "moeplan/executor/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "moeplan/core/errors.h"
#include "moeplan/core/phases.h"
#include "moeplan/core/rules.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/hf_checkpoint.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/optimizer.h"
#include "moeplan/executor/runtime.h"
#include "moeplan/executor/tokens.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

std::string to_json_line(const StepRecord& r) {
  Json j;
  j["step"] = r.step;
  j["loss"] = r.loss;
  j["aux_loss"] = r.aux_loss;
  j["z_loss"] = r.z_loss;
  j["total_loss"] = r.total_loss;
  j["lr"] = r.learning_rate;
  j["grad_norm"] = r.grad_norm;
  j["tokens"] = r.tokens;
  j["step_s"] = r.seconds;
  j["tokens_per_s"] = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0;
  j["tokens_per_expert"] = r.tokens_per_expert;
  return j.dump();
}

void check_run_inputs(const Plan& plan, const TokenDataset& data, const RunOptions& o, Diagnostics& d) {
  // Every rule of the plan, the executor's own (what it trains) among them: the same rules the
  // search applies for `--target moeplan`, so that it never writes a plan this refuses.
  RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
  config.executor_mode = true;
  for (const Violation& v : validate(config)) d.error(v.field, v.message);
  if (data.vocab_size() != plan.model.vocab_size)
    d.error("model.vocab_size", std::to_string(plan.model.vocab_size) + " does not match the tokenizer of " +
                                    data.dir() + " (" + std::to_string(data.vocab_size()) + " pieces)");
  if (data.block_size() != plan.training.seq_len)
    d.error("training.seq_len", std::to_string(plan.training.seq_len) + " does not match the block size of " +
                                    data.dir() + " (" + std::to_string(data.block_size()) + ")");
  if (plan.training.seq_len > plan.model.max_position_embeddings)
    d.error("training.seq_len", "exceeds model.max_position_embeddings");
  if (o.stop_after_step < 0 || o.stop_after_step > plan.training.steps)
    d.error("--steps", std::to_string(o.stop_after_step) + " is outside 1.." + std::to_string(plan.training.steps) +
                           " (training.steps of the plan)");
  if (o.checkpoint_every < 0) d.error("--checkpoint-every", "must not be negative");
}

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

std::vector<Json> read_metrics(const std::string& run_dir) {
  std::vector<Json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(Json::parse(line));
  return lines;
}

void truncate_metrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::parse_error&) {
      break;  // a line cut by a crash ends the usable part
    }
    if (!j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() > last_step) break;
    kept += line + '\n';
  }
  write_file_atomic(path, kept);
}

void check_checkpoint_state(const Plan& plan, const Json& s, Diagnostics& d) {
  if (!s.is_object() || !s.contains("model") || s["model"] != to_json(plan.model))
    d.error("state.model", "the checkpoint's model differs from the plan's model");
  if (!s.contains("precision") || s["precision"] != name_of(kPrecisionNames, plan.training.precision))
    d.error("state.precision", "the checkpoint was saved with another precision");
  if (!s.contains("samples_consumed") || !s["samples_consumed"].is_number_integer())
    d.error("state.samples_consumed", "missing");
  if (!s.contains("optimizer_step") || !s["optimizer_step"].is_number_integer())
    d.error("state.optimizer_step", "missing");
}

namespace {

}  // namespace

ModelTrainer::ModelTrainer(const Plan& plan)
    : plan_(plan), master_type_(precisions(plan.training.precision).master),
      compute_type_(precisions(plan.training.precision).compute),
      params_(ParameterSet::on_meta(mixtral_parameters(plan.model))) {
  params_.materialize(static_cast<uint64_t>(plan.training.seed), master_type_);
  params_.check_materialized();
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
  for (size_t i = 0; i < infos.size(); ++i) tensors.emplace_back("param/" + infos[i].name, params_.tensors()[i]);
  for (size_t i = 0; i < infos.size(); ++i) tensors.emplace_back("exp_avg/" + infos[i].name, optimizer_->exp_avg()[i]);
  for (size_t i = 0; i < infos.size(); ++i)
    tensors.emplace_back("exp_avg_sq/" + infos[i].name, optimizer_->exp_avg_sq()[i]);
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
  const auto start = Clock::now();
  clock_.start_step();
  const int64_t ga = static_cast<int64_t>(micro_batches.size());
  const ModelSpec& spec = plan_.model;
  StepRecord r;
  r.step = ++step_;
  r.learning_rate = learning_rate(plan_.training, step_);
  torch::Tensor counts = torch::zeros({spec.num_layers, spec.num_experts}, torch::kLong);
  const bool mixed = compute_type_ != master_type_;
  std::vector<torch::Tensor> master_grads;
  if (mixed)
    for (const torch::Tensor& t : params_.tensors()) master_grads.push_back(torch::zeros_like(t));
  double loss = 0, aux = 0, z = 0, total = 0;
  for (const torch::Tensor& ids : micro_batches) {
    std::vector<torch::Tensor> compute;
    if (mixed) {
      // bf16 copies of the fp32 master weights for this micro-batch; their gradients are added
      // to fp32 accumulators.
      for (const torch::Tensor& t : params_.tensors()) compute.push_back(t.detach().to(compute_type_).requires_grad_(true));
    } else {
      compute = params_.tensors();
    }
    const auto f0 = Clock::now();
    ForwardResult out = mixtral_forward(spec, MixtralWeights::bind(spec, compute), ids, plan_.moe.load_balancing);
    const LossTerms terms = mixtral_loss(spec, plan_.moe, out, ids);
    out.logits = torch::Tensor();  // the graph keeps what backward needs; the logits go now
    const auto f1 = Clock::now();
    (terms.total / static_cast<double>(ga)).backward();
    clock_.add(std::string(phase::kForward), "compute", TraceStream::kCompute, f0, f1);
    clock_.add(std::string(phase::kBackward), "compute", TraceStream::kCompute, f1, Clock::now());
    if (mixed)
      for (size_t i = 0; i < compute.size(); ++i)
        if (compute[i].grad().defined()) master_grads[i].add_(compute[i].grad().to(master_type_));
    counts += out.tokens_per_expert;
    loss += terms.lm.item<double>();
    aux += terms.aux.item<double>();
    z += terms.z.item<double>();
    total += terms.total.item<double>();
    r.tokens += ids.numel();
  }
  const auto o0 = Clock::now();
  std::vector<torch::Tensor> grads;
  if (mixed) {
    grads = master_grads;
  } else {
    for (torch::Tensor& t : params_.tensors()) grads.push_back(t.grad().defined() ? t.grad() : torch::zeros_like(t));
  }
  r.grad_norm = clip_grad_norm(grads, plan_.training.max_grad_norm);
  optimizer_->step(grads, r.learning_rate);
  for (torch::Tensor& t : params_.tensors()) t.mutable_grad() = torch::Tensor();
  clock_.add(std::string(phase::kOptimizer), "compute", TraceStream::kCompute, o0, Clock::now());
  const double n = static_cast<double>(ga);
  r.loss = loss / n;
  r.aux_loss = aux / n;
  r.z_loss = z / n;
  r.total_loss = total / n;
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    std::vector<int64_t> row;
    for (int64_t e = 0; e < spec.num_experts; ++e) row.push_back(counts[l][e].item<int64_t>());
    r.tokens_per_expert.push_back(std::move(row));
  }
  return r;
}

namespace {

// The data order, the checkpoint files and the model trainer of one run.
class Run {
 public:
  Run(const Plan& plan, const RunOptions& o, TokenDataset data)
      : plan_(plan), o_(o), data_(std::move(data)), model_(plan),
        order_(data_.num_blocks(), static_cast<uint64_t>(plan.training.seed)) {}

  void resume(const std::string& step_dir) {
    const LoadedCheckpoint c = open_checkpoint(step_dir);
    Diagnostics d;
    const Json& s = c.state;
    check_checkpoint_state(plan_, s, d);
    if (c.files.empty()) d.error("files", "the checkpoint lists no shard");
    d.throw_if_any(step_dir + "/manifest.json");
    // Shards of any layout: whole tensors of a one-rank run or slices of a sharded one.
    SlicedState sliced;
    for (const CheckpointFile& f : c.files) sliced.add(read_checkpoint_shard(c, f.name).tensors);
    NamedTensors tensors;
    const std::string rng = "rng/cpu";
    for (const ParamInfo& info : model_.parameters().infos())
      for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"}) {
        const torch::Tensor t = sliced.whole(prefix + info.name, info.shape, d);
        if (t.defined()) tensors.emplace_back(prefix + info.name, t);
      }
    if (sliced.contains(rng)) tensors.emplace_back(rng, sliced.whole(rng, {at::detail::getDefaultCPUGenerator().get_state().numel()}, d));
    d.throw_if_any(step_dir);
    model_.load_state(tensors, c.step, s["optimizer_step"].get<int64_t>(), d);
    d.throw_if_any(step_dir);
    samples_ = s["samples_consumed"].get<int64_t>();
  }

  // Parameters from a Hugging Face folder, fresh optimizer state, step 0.
  void init_from(const std::string& dir) {
    const torch::ScalarType dtype = model_.parameters().tensors().front().scalar_type();
    const SlicedState sliced = read_hf_parameters(dir, plan_.model, dtype);
    Diagnostics d;
    NamedTensors tensors;
    for (const ParamInfo& info : model_.parameters().infos())
      for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"}) {
        const torch::Tensor t = sliced.whole(prefix + info.name, info.shape, d);
        if (t.defined()) tensors.emplace_back(prefix + info.name, t);
      }
    d.throw_if_any(dir);
    model_.load_state(tensors, 0, 0, d);
    d.throw_if_any(dir);
  }

  std::string save() {
    const std::string dir = begin_checkpoint(o_.out_dir + "/checkpoints", model_.step_count());
    const CheckpointFile shard = write_checkpoint_shard(dir, 0, model_.state());
    Json state;
    state["samples_consumed"] = samples_;
    state["optimizer_step"] = model_.step_count();
    state["precision"] = name_of(kPrecisionNames, plan_.training.precision);
    state["seed"] = plan_.training.seed;
    state["model"] = to_json(plan_.model);
    state["parallel"] = to_json(plan_.parallel);
    state["data"] = {{"dir", data_.dir()}, {"blocks", data_.num_blocks()}, {"block_size", data_.block_size()}};
    commit_checkpoint(dir, model_.step_count(), state, {shard});
    return dir;
  }

  StepRecord train_step() {
    std::vector<torch::Tensor> micro_batches;
    for (int64_t m = 0; m < plan_.parallel.gradient_accumulation_steps; ++m) {
      std::vector<int64_t> blocks;
      for (int64_t i = 0; i < plan_.parallel.micro_batch_size; ++i) blocks.push_back(order_.block_of(samples_++));
      micro_batches.push_back(data_.blocks(blocks));
    }
    return model_.step(micro_batches);
  }

  int64_t step() const { return model_.step_count(); }
  const PhaseClock& clock() const { return model_.clock(); }

 private:
  const Plan& plan_;
  const RunOptions& o_;
  TokenDataset data_;
  ModelTrainer model_;
  BlockOrder order_;
  int64_t samples_ = 0;
};

std::string format_progress(const StepRecord& r, int64_t last_step) {
  char line[200];
  std::snprintf(line, sizeof line, "step %lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  %.3f s",
                static_cast<long long>(r.step), static_cast<long long>(last_step), r.loss, r.learning_rate,
                r.grad_norm, r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0, r.seconds);
  return line;
}

}  // namespace

RunResult run_training(const Plan& plan, const RunOptions& o) {
  TokenDataset data = TokenDataset::open(o.data_dir);
  check_plan(plan, data, o);
  set_compute_threads(o.threads > 0 ? o.threads : 1);
  keep_freed_memory();
  install_tensor_allocator();
  ignore_broken_pipes();

  fs::create_directories(o.out_dir);
  const std::string metrics_path = o.out_dir + "/metrics.jsonl";
  const std::string checkpoints = o.out_dir + "/checkpoints";
  std::string resume_from;
  if (o.resume) {
    resume_from = latest_checkpoint(checkpoints);
    if (resume_from.empty())
      throw InputError("--resume", {{"", "no complete checkpoint in " + checkpoints}});
  } else if (fs::exists(metrics_path) || !latest_checkpoint(checkpoints).empty()) {
    throw InputError("--out", {{"", o.out_dir + " already holds a run; pass --resume to continue it or choose another folder"}});
  }

  const int64_t baseline_rss = current_rss_bytes();
  Run trainer(plan, o, std::move(data));
  if (!resume_from.empty()) {
    trainer.resume(resume_from);
    truncate_metrics(metrics_path, trainer.step());
    if (o.progress) *o.progress << "resumed from " << resume_from << " at step " << trainer.step() << "\n";
  } else if (!o.init_from.empty()) {
    trainer.init_from(o.init_from);
    if (o.progress) *o.progress << "started from the Hugging Face model in " << o.init_from << "\n";
  }
  const int64_t last_step = o.stop_after_step > 0 ? o.stop_after_step : plan.training.steps;
  RunResult result;
  result.first_step = trainer.step() + 1;
  std::ofstream metrics(metrics_path, std::ios::app);
  if (!metrics) throw InputError(metrics_path, {{"", "cannot write"}});
  StepPeaks peaks;
  while (trainer.step() < last_step) {
    peaks.begin_step();
    StepRecord r = trainer.train_step();
    peaks.end_step();
    metrics << to_json_line(r) << '\n' << std::flush;
    if (o.progress) *o.progress << format_progress(r, last_step) << std::endl;
    if (o.checkpoint_every > 0 && (r.step % o.checkpoint_every == 0 || r.step == last_step)) {
      result.last_checkpoint = trainer.save();
      if (o.progress) *o.progress << "saved " << result.last_checkpoint << std::endl;
    }
    result.steps.push_back(std::move(r));
  }
  result.last_step = trainer.step();
  result.peak_rss_bytes = peak_rss_bytes();
  if (!result.steps.empty()) {
    RankMeasurement m;
    m.peak_rss_bytes = result.peak_rss_bytes;
    m.baseline_rss_bytes = baseline_rss;
    m.peak_tensor_bytes = peaks.whole_run();
    m.peak_step_tensor_bytes = peaks.steps();
    m.events = trainer.clock().events();
    m.memory = trainer.clock().memory();
    result.report = write_run_outputs(plan, o.out_dir, result.steps, {m}, "CPU rank");
  }
  return result;
}

}  // namespace moeplan::executor
