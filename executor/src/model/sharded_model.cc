#include "moeplan/executor/model/sharded_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cassert>
#include <optional>

#include "moeplan/executor/model/autograd_ops.h"
#include "moeplan/executor/model/expert_bias.h"
#include "moeplan/executor/model/kernels.h"
#include "moeplan/executor/model/routing.h"

namespace moeplan::executor {

torch::ScalarType master_type(Precision p) { return p == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat; }
torch::ScalarType compute_type(Precision p) { return p == Precision::kFp32 ? torch::kFloat : torch::kBFloat16; }

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The values of a small integer tensor (counts of rows), read on the host.
std::vector<int64_t> host_longs(const torch::Tensor& t) {
  const torch::Tensor h = t.to(torch::kCPU, torch::kLong).contiguous();
  return {h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel()};
}
}  // namespace

std::vector<FlatUnit> flat_units(const ModelSpec& spec, const std::vector<ParamInfo>& infos, int64_t expert_degree,
                                 int64_t expert_rank, int64_t shard_degree) {
  const int64_t per_rank = spec.num_experts / expert_degree;
  const int64_t first = expert_rank * per_rank;
  std::vector<FlatUnit> units;
  auto add = [&](std::string name, int64_t block, bool experts, auto&& take) {
    FlatUnit u{std::move(name), block, experts, {}, {}, 0, 0};
    for (size_t i = 0; i < infos.size(); ++i)
      if (infos[i].block == block && take(infos[i])) {
        u.params.push_back(static_cast<int64_t>(i));
        u.offsets.push_back(u.numel);
        u.numel += infos[i].numel();
      }
    u.shard_numel = ceil_div(u.numel, shard_degree);
    units.push_back(std::move(u));
  };
  add("embed", 0, false, [](const ParamInfo&) { return true; });
  for (int64_t l = 0; l < spec.blocks(); ++l) {
    const std::string prefix = "layers." + std::to_string(l);
    add(prefix + ".dense", l + 1, false, [](const ParamInfo& p) { return p.expert < 0; });
    add(prefix + ".experts", l + 1, true,
        [&](const ParamInfo& p) { return p.expert >= first && p.expert < first + per_rank; });
  }
  add("head", spec.blocks() + 1, false, [](const ParamInfo&) { return true; });
  return units;
}

ShardedModel::ShardedModel(const Plan& plan, DeviceMesh& mesh)
    : plan_(plan), mesh_(mesh), master_type_(master_type(plan.training.precision)),
      compute_type_(compute_type(plan.training.precision)), device_(mesh.device()), local_spec_(plan.model),
      tp_(plan.parallel.tensor_parallel_degree), tp_rank_(mesh.coords().t) {
  const ParallelConfig& p = plan.parallel;
  scatters_in_flight_ = device_.is_cuda() ? 1 : 0;
  expert_bias_ = initial_expert_bias(plan.model, device_);
  experts_per_rank_ = plan.model.num_experts / p.expert_parallel_degree;
  const int64_t expert_index = mesh.layout().expert_index(mesh.rank());
  first_expert_ = expert_index * experts_per_rank_;
  cp_ = p.context_parallel_degree;
  local_spec_.num_attention_heads /= tp_;
  local_spec_.num_key_value_heads /= tp_;
  pp_ = p.pipeline_parallel_degree;
  pp_rank_ = mesh.coords().p;
  chunks_ = p.virtual_pipeline_degree;
  shared_embedding_ = plan.model.mtp_layers > 0 && pp_ > 1;
  layers_per_chunk_ = plan.model.num_layers / (pp_ * chunks_);
  const std::vector<ParamInfo> whole = mixtral_parameters(plan.model);
  folded_ = p.expert_tensor_fold() > 1;
  for (const ParamInfo& info : whole) {
    // Folded (ETP = 1), each routed expert is whole on its rank of the larger expert group.
    const bool whole_expert = folded_ && info.expert >= 0;
    infos_.push_back(tensor_part_info(info, whole_expert ? 1 : tp_));
    splits_.push_back(whole_expert ? TensorSplit::kWhole : tensor_split(info));
  }
  units_ = flat_units(plan.model, infos_, p.expert_parallel_degree, expert_index, p.hybrid_shard_degree);

  // Shapes only until here: the whole model exists on the meta device, no memory is used.
  const ParameterSet meta = ParameterSet::on_meta(infos_);
  const auto seed = static_cast<uint64_t>(plan.training.seed);
  torch::NoGradGuard no_grad;
  for (const FlatUnit& u : units_) {
    // The stage of a unit: virtual stage v (of P x V) is chunk v / P of pipeline rank v % P.
    // A dense block's experts unit is empty: held by no rank, like another stage's units.
    const int64_t layer = std::clamp<int64_t>(u.block - 1, 0, plan.model.num_layers - 1);
    const bool embedding_copy = u.block == 0 && shared_embedding_ && pp_rank_ == pp_ - 1;
    held_.push_back(u.numel > 0 && (layer / layers_per_chunk_ % pp_ == pp_rank_ || embedding_copy));
    if (!held_.back()) {
      shards_.push_back(
          torch::zeros({0}, torch::TensorOptions().dtype(master_type_).device(device_)).requires_grad_(true));
      decay_runs_.emplace_back();
      whole_runs_.emplace_back();
      continue;
    }
    const int64_t begin = shard_begin(u), end = begin + u.shard_numel;
    torch::Tensor shard = torch::zeros({u.shard_numel}, torch::TensorOptions().dtype(master_type_));
    ElementRuns decay, whole_runs;
    for (size_t j = 0; j < u.params.size(); ++j) {
      const auto param = static_cast<size_t>(u.params[j]);
      const ParamInfo& info = infos_[param];
      const int64_t a = std::max(begin, u.offsets[j]), b = std::min(end, u.offsets[j] + info.numel());
      if (a >= b) continue;  // the parameter lies in other ranks' shards: not drawn here
      // A parameter's values come from one seeded stream, so they are drawn whole and this
      // rank's part of them kept.
      torch::Tensor values = torch::empty(whole[param].shape, torch::TensorOptions().dtype(master_type_));
      initialize_parameter(values, whole[param], seed);
      const torch::Tensor part = tensor_part(values, splits_[param], tp_rank_, tp_).contiguous().flatten();
      shard.narrow(0, a - begin, b - a).copy_(part.narrow(0, a - u.offsets[j], b - a));
      if (info.weight_decay) add_run(decay, a - begin, b - a);
      if (tp_ > 1 && alike_on_tensor_ranks(u.params[j])) add_run(whole_runs, a - begin, b - a);
    }
    // Drawn on the host (one seeded stream, whatever the device), kept on the rank's device.
    shards_.push_back(shard.to(device_).requires_grad_(true));
    decay_runs_.push_back(std::move(decay));
    whole_runs_.push_back(std::move(whole_runs));
  }
  for (const torch::Tensor& s : shards_)
    if (s.is_meta()) throw std::logic_error("a parameter shard is still on the meta device");
  (void)meta;
}

void ShardedModel::sum_whole_parameter_grads(size_t unit, torch::Tensor& grad) {
  const ElementRuns& runs = whole_runs_[unit];
  if (runs.empty()) return;
  std::vector<torch::Tensor> parts;
  for (const ElementRun& r : runs) parts.push_back(grad.narrow(0, r.begin, r.length));
  torch::Tensor joined = torch::cat(parts);
  mesh_.tensor.all_reduce_sum(joined);
  int64_t at = 0;
  for (const ElementRun& r : runs) {
    grad.narrow(0, r.begin, r.length).copy_(joined.narrow(0, at, r.length));
    at += r.length;
  }
}

void ShardedModel::sum_shared_embedding_grads(torch::Tensor& grad) {
  if (!shared_embedding_) return;
  if (held_[0]) {
    mesh_.pipeline.all_reduce_sum(grad);
    return;
  }
  torch::Tensor zeros = torch::zeros({units_[0].shard_numel}, grad.options());
  mesh_.pipeline.all_reduce_sum(zeros);
}

torch::Tensor ShardedModel::counted_once(size_t unit, const torch::Tensor& g) const {
  const ElementRuns& runs = whole_runs_[unit];
  if (runs.empty() || tp_rank_ == 0) return g;  // the first T rank counts what all hold
  torch::Tensor out = g.clone();
  for (const ElementRun& r : runs) out.narrow(0, r.begin, r.length).zero_();
  return out;
}

Communicator& ShardedModel::replica_group(const FlatUnit& unit) {
  return unit.experts ? mesh_.expert_replicas : mesh_.dense_replicas;
}

bool ShardedModel::owns(const FlatUnit& unit) const {
  const MeshCoords& c = mesh_.coords();
  const size_t index = static_cast<size_t>(&unit - units_.data());
  if (!held_[index]) return false;
  if (index == 0 && pp_rank_ != 0) return false;  // the last stage's copy of the embedding
  // Experts are replicated over R (and C where E = 1), the dense units over R, E and C.
  if (unit.experts) return c.r == 0 && (plan_.parallel.expert_parallel_degree > 1 || c.c == 0);
  return c.r == 0 && c.e == 0 && c.c == 0;
}

// ---------------------------------------------------------------------------------------------
// Gathering and freeing flat parameters.

ShardedModel::Gathered ShardedModel::gather(size_t index) {
  const FlatUnit& u = units_[index];
  Gathered g;
  g.unit = index;
  torch::Tensor& shard = shards_[index];
  if (mesh_.shard.size() == 1 && compute_type_ == master_type_) {
    g.flat = shard;  // nothing to gather or convert: compute on the master itself
  } else {
    Communicator& comm = mesh_.shard;
    std::vector<torch::Tensor> out;
    if (auto it = prefetched_.find(index); it != prefetched_.end()) {
      out.push_back(comm.finish_all_gather(it->second));
      prefetched_.erase(it);
    } else {
      out.push_back(comm.all_gather(shard.detach().to(compute_type_)));
    }
    attach_backward({shard}, out, "GatherUnitBackward", [this, index, n = out[0].numel()](std::vector<torch::Tensor>&& grads) {
      const torch::Tensor grad =
          grads[0].defined() ? grads[0] : torch::zeros({n}, torch::TensorOptions().dtype(compute_type_).device(device_));
      if (scatters_in_flight_ == 0) return std::vector<torch::Tensor>{mesh_.shard.reduce_scatter_sum(grad).to(master_type_)};
      start_scatter(index, grad);
      return std::vector<torch::Tensor>{torch::Tensor()};  // the shard's gradient comes with finish_scatters
    });
    g.flat = out[0];
    g.releasable = true;
  }
  std::vector<int64_t> sizes;
  for (const int64_t p : u.params) sizes.push_back(infos_[static_cast<size_t>(p)].numel());
  sizes.push_back(g.flat.numel() - u.numel);  // padding
  if (!g.releasable) {
    // The master shard itself: each parameter a leaf over its part of it, whose gradient is
    // its part of the shard's, added in place as autograd computes it (as Megatron-Core's
    // main_grad and FSDP2's per-parameter gradients are). Views of the shard with autograd
    // through them would hold every parameter's gradient of the unit until the last one came,
    // then a unit-sized gradient beside them: twice the unit's gradients at once.
    torch::Tensor& grad = shard.mutable_grad();
    if (!grad.defined()) grad = torch::zeros_like(shard);
    const std::vector<torch::Tensor> values = shard.detach().split_with_sizes(sizes);
    const std::vector<torch::Tensor> grads = grad.split_with_sizes(sizes);
    for (size_t j = 0; j < u.params.size(); ++j) {
      const c10::IntArrayRef shape = infos_[static_cast<size_t>(u.params[j])].shape;
      torch::Tensor param = values[j].view(shape).requires_grad_(true);
      param.mutable_grad() = grads[j].view(shape);
      g.params.push_back(std::move(param));
    }
    return g;
  }
  const std::vector<torch::Tensor> pieces = g.flat.split_with_sizes(sizes);
  for (size_t j = 0; j < u.params.size(); ++j)
    g.params.push_back(pieces[j].view(infos_[static_cast<size_t>(u.params[j])].shape));
  return g;
}

void ShardedModel::start_scatter(size_t unit, const torch::Tensor& grad) {
  scattering_.emplace_back(unit, mesh_.shard.start_reduce_scatter_sum(grad));
  finish_scatters(static_cast<size_t>(scatters_in_flight_));
}

void ShardedModel::finish_scatters(size_t keep) {
  torch::NoGradGuard no_grad;
  while (scattering_.size() > keep) {
    auto [unit, pending] = std::move(scattering_.front());
    scattering_.pop_front();
    const torch::Tensor part = mesh_.shard.finish_reduce_scatter(pending).to(master_type_);
    // As autograd accumulates a leaf's gradient: the first taken as it is, the next added.
    torch::Tensor& grad = shards_[unit].mutable_grad();
    if (grad.defined())
      grad.add_(part);
    else
      grad = part;
  }
}

void ShardedModel::prefetch(size_t index) {
  // Nothing to move, or a unit of another pipeline stage.
  if (mesh_.shard.size() == 1 || !held_[index] || prefetched_.count(index) != 0) return;
  prefetched_.emplace(index, mesh_.shard.start_all_gather(shards_[index].detach().to(compute_type_)));
}

void ShardedModel::prefetch_block(int64_t layer) {
  if (layer < 0) return;  // the embedding needs no weights in backward
  if (layer >= plan_.model.blocks()) {
    prefetch(units_.size() - 1);  // the final norm and lm head
    return;
  }
  prefetch(static_cast<size_t>(1 + 2 * layer));  // dense
  prefetch(static_cast<size_t>(2 + 2 * layer));  // experts
}

// Frees the gathered copy's memory. The views that autograd saved keep pointing at the same
// storage, which regather_in_backward fills again before they are read.
void ShardedModel::release(const Gathered& g) {
  if (!g.releasable) return;
  c10::StorageImpl* storage = g.flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, g.flat.device()));
  storage->set_nbytes(0);
}

torch::Tensor ShardedModel::regather_in_backward(const torch::Tensor& y, const std::vector<Gathered>& units) {
  std::vector<Gathered> again;
  for (const Gathered& g : units)
    if (g.releasable) again.push_back(g);
  if (again.empty()) return y;
  std::vector<torch::Tensor> out{y};
  attach_backward({y}, out, "RegatherBackward", [this, again](std::vector<torch::Tensor>&& grads) {
    torch::NoGradGuard no_grad;
    for (const Gathered& g : again) {
      torch::Tensor values;
      if (auto it = prefetched_.find(g.unit); it != prefetched_.end()) {
        values = mesh_.shard.finish_all_gather(it->second);
        prefetched_.erase(it);
      } else {
        values = mesh_.shard.all_gather(shards_[g.unit].detach().to(compute_type_));
      }
      // Written below autograd (no version bump): the saved views see the same values as in
      // forward. The gathered memory itself moves into the unit's storage when it is all of it.
      // (A copy of its own first where it is part of a larger one; on the values' device.)
      const size_t bytes = values.nbytes();
      const torch::Tensor whole =
          values.storage_offset() == 0 && values.storage().nbytes() == bytes ? values : values.clone();
      c10::StorageImpl* storage = g.flat.storage().unsafeGetStorageImpl();
      c10::StorageImpl* gathered = whole.storage().unsafeGetStorageImpl();
      storage->set_data_ptr_noswap(gathered->set_data_ptr(at::DataPtr(nullptr, whole.device())));
      gathered->set_nbytes(0);
      storage->set_nbytes(bytes);
    }
    // The block before this one runs backward next: its units move while this one computes.
    // Before the head's (and the multi-token prediction blocks'), the decoder's last block: which
    // of the head's two uses runs backward first is autograd's choice, and a gather started for a
    // block whose backward has run would be left to the next step.
    prefetch_block(std::min(units_[again.front().unit].block - 2, plan_.model.num_layers - 1));
    return std::vector<torch::Tensor>{grads[0]};
  });
  return out[0];
}

// ---------------------------------------------------------------------------------------------
// Activation checkpointing: fn runs without autograd in forward and again, with it, in backward.
// Input 0 (the activation) may be offloaded; other inputs are parameter views kept as they are.

std::vector<torch::Tensor> ShardedModel::checkpoint(BlockFn fn, const std::vector<torch::Tensor>& inputs,
                                                    int64_t layer) {
  std::vector<torch::Tensor> outputs;
  {
    torch::NoGradGuard no_grad;
    outputs = fn(inputs, false);
  }
  if (!torch::GradMode::is_enabled()) return outputs;
  std::vector<torch::Tensor> saved;
  for (const torch::Tensor& t : inputs) saved.push_back(t.detach());
  const bool offloaded = offload_ != nullptr;
  if (offloaded) {
    offload_->put(layer, saved[0]);
    saved[0] = torch::Tensor();
  }
  std::vector<bool> needs_grad;
  for (const torch::Tensor& t : inputs) needs_grad.push_back(t.requires_grad());
  attach_backward(inputs, outputs, "CheckpointBackward",
                  [this, fn, saved, offloaded, layer, needs_grad](std::vector<torch::Tensor>&& grads) {
                    std::vector<torch::Tensor> in;
                    for (size_t i = 0; i < saved.size(); ++i) {
                      torch::Tensor t = i == 0 && offloaded ? offload_->take(layer) : saved[i];
                      in.push_back(t.detach().requires_grad_(needs_grad[i]));
                    }
                    if (offloaded)
                      for (int64_t k = 1; k <= horizon_; ++k) offload_->prefetch(layer - k);
                    prefetch_block(layer - 1);  // the next block to run backward
                    std::vector<torch::Tensor> again;
                    {
                      torch::AutoGradMode enable(true);
                      again = fn(in, true);
                    }
                    std::vector<torch::Tensor> roots, root_grads;
                    for (size_t j = 0; j < again.size(); ++j)
                      if (grads[j].defined() && again[j].requires_grad()) {
                        roots.push_back(again[j]);
                        root_grads.push_back(grads[j]);
                      }
                    torch::autograd::backward(roots, root_grads);
                    std::vector<torch::Tensor> result;
                    for (const torch::Tensor& t : in) result.push_back(t.grad());
                    return result;
                  });
  return outputs;
}

// ---------------------------------------------------------------------------------------------
// The forward pass.

namespace {

// The routed experts' output plus the shared experts' on the same normed input, where the model
// has them. Under tensor parallelism each T rank's shared experts are its part of their width,
// so their output is a partial sum like the routed experts', reduce-scattered with it.
torch::Tensor with_shared(const torch::Tensor& routed, const LayerWeights& w, const torch::Tensor& normed) {
  return w.shared_w1.defined() ? routed + shared_experts(w, normed) : routed;
}

}  // namespace

LayerWeights ShardedModel::dense_weights(const Gathered& dense) const {
  LayerWeights w;
  const FlatUnit& u = units_[dense.unit];
  const std::string prefix = "model.layers." + std::to_string(u.block - 1) + ".";
  for (size_t j = 0; j < u.params.size(); ++j)
    w.bind(std::string_view(infos_[static_cast<size_t>(u.params[j])].name).substr(prefix.size()), dense.params[j]);
  return w;
}

ForwardResult ShardedModel::forward(const torch::Tensor& input_ids, uint64_t shuffle_seed) {
  return forward_chunk(0, input_ids, torch::Tensor(), shuffle_seed);
}

ForwardResult ShardedModel::forward_chunk(int64_t chunk, const torch::Tensor& input_ids, const torch::Tensor& hidden,
                                          uint64_t shuffle_seed) {
  const ModelSpec& spec = plan_.model;
  const int64_t t = input_ids.size(1);
  if (seq_len_ != t) {
    seq_len_ = t;
    rope_ = rope_tables(spec, t, compute_type_, device_);
    // Blocks within the window (or every block, without one) and, where the model has both, the
    // blocks over the whole sequence.
    const bool both = spec.sliding_window && spec.full_attention_step > 0;
    if (cp_ > 1) {
      context_ = std::make_unique<ContextAttention>(mesh_.context, plan_.parallel.context_exchange, t,
                                                    spec.sliding_window);
      context_full_ = both ? std::make_unique<ContextAttention>(mesh_.context, plan_.parallel.context_exchange, t,
                                                                std::nullopt)
                           : nullptr;
      const torch::Tensor positions = context_->positions().to(device_);
      rope_ = {rope_.cos.index_select(0, positions), rope_.sin.index_select(0, positions)};
      core_ = [this](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        return context_->attend(q, k, v);
      };
      full_core_ = [this](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        return context_full_->attend(q, k, v);
      };
    } else {
      mask_ = attention_mask_bias(spec, t, compute_type_, device_);
      core_ = [this](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        return flash_attention(q, k, v, mask_);
      };
      full_core_ = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        return flash_attention(q, k, v, torch::Tensor());
      };
    }
    if (!both) full_core_ = core_;
    // The positions this rank routes: its context part, and of that its sequence-parallel
    // slice where the tensor ranks are folded (unfolded ones route the gathered whole).
    routed_positions_ = torch::Tensor();
    if (cp_ > 1 || folded_) {
      torch::Tensor positions = (context_ ? context_->positions() : torch::arange(t, torch::kLong)).to(device_);
      if (folded_) {
        const int64_t n = positions.size(0) / tp_;
        positions = positions.narrow(0, tp_rank_ * n, n);
      }
      routed_positions_ = positions;
    }
  }
  const int64_t stage = chunk * pp_ + pp_rank_, stages = pp_ * chunks_;
  const int64_t first = stage * layers_per_chunk_, last = first + layers_per_chunk_;
  ForwardResult out;
  const torch::TensorOptions counts = torch::dtype(torch::kLong).device(device_);
  out.tokens_per_expert = torch::zeros({spec.moe_blocks(), spec.num_experts}, counts);
  out.dropped_slots = torch::zeros({spec.moe_blocks()}, counts);
  out.nonfinite_layers = torch::zeros({spec.blocks()}, counts);
  torch::Tensor x;
  // Gathers started by a forward that failed half-way, or by a backward of the pipeline's
  // schedule, are finished before new ones start.
  for (auto& [unit, pending] : prefetched_) mesh_.shard.finish_all_gather(pending);
  prefetched_.clear();
  if (stage == 0) {
    prefetch(0);
    prefetch_block(first);  // moves while the embedding is looked up
    const Gathered embed = gather(0);
    x = this->embed(embed.params[0], local_tokens(input_ids));  // its backward needs only the ids
    release(embed);
  } else {
    prefetch_block(first);
    x = hidden;
  }
  for (int64_t l = first; l < last; ++l) {
    x = block(l, x, out, shuffle_seed);
    note_nonfinite(out, l, x);
  }
  if (stage + 1 < stages) {
    out.hidden = x;
    return out;
  }
  // The head's logits of the blocks' output (through the final norm, or a multi-token prediction
  // block's own), [B, T, this rank's part of the vocabulary].
  auto logits_of = [&](const torch::Tensor& h, std::optional<size_t> norm_unit) {
    const Gathered head = gather(units_.size() - 1);
    std::vector<Gathered> used{head};
    torch::Tensor norm = head.params[0];
    if (norm_unit) {
      used.push_back(gather(*norm_unit));
      norm = dense_weights(used.back()).mtp_head_norm;
    }
    const torch::Tensor logits =
        torch::matmul(gather_sequence(rms_norm(h, norm, spec.rms_norm_eps)), head.params[1].t()).to(torch::kFloat);
    for (const Gathered& g : used) release(g);
    return regather_in_backward(logits, used);
  };
  out.logits = logits_of(x, std::nullopt);
  // Multi-token prediction, on the last stage, which holds the embedding too (shares_embedding).
  for (int64_t k = 1; k <= spec.mtp_layers; ++k) {
    const int64_t l = spec.num_layers + k - 1;
    const size_t dense_unit = static_cast<size_t>(1 + 2 * l);
    const Gathered table = gather(0);
    const torch::Tensor ahead = this->embed(table.params[0], local_tokens(mtp_input_ids(input_ids, k)));
    release(table);  // the lookup's backward needs only the ids
    const Gathered dense = gather(dense_unit);
    const LayerWeights w = dense_weights(dense);
    torch::Tensor joined = torch::matmul(
        torch::cat({rms_norm(ahead, w.mtp_enorm, spec.rms_norm_eps), rms_norm(x, w.mtp_hnorm, spec.rms_norm_eps)}, -1),
        w.mtp_eh_proj.t());
    release(dense);
    x = block(l, regather_in_backward(joined, {dense}), out, shuffle_seed);
    note_nonfinite(out, l, x);
    out.mtp_logits.push_back(logits_of(x, dense_unit));
  }
  if (offload_)  // the last blocks are the first ones backward needs
    for (int64_t k = 1; k <= horizon_; ++k) offload_->prefetch(spec.blocks() - k);
  return out;
}

torch::Tensor ShardedModel::block(int64_t l, const torch::Tensor& x, ForwardResult& out, uint64_t shuffle_seed) {
  const ModelSpec& spec = plan_.model;
  const size_t dense_unit = static_cast<size_t>(1 + 2 * l), expert_unit = dense_unit + 1;
  // This block's units were started by the one before; the next block's move while it computes.
  prefetch_block(l + 1);
  if (!spec.moe_layer(l)) return dense_block(l, x);
  const int64_t m = spec.moe_row(l);
  torch::Tensor counts = out.tokens_per_expert[m], dropped = out.dropped_slots[m];
  switch (plan_.parallel.activation_checkpointing) {
    case Checkpointing::kNone: {
      const Gathered dense = gather(dense_unit), experts = gather(expert_unit);
      const LayerWeights w = dense_weights(dense);
      const torch::Tensor h = x + scatter_sequence(attention(
                                      local_spec_, w, gather_sequence(rms_norm(x, w.input_norm, spec.rms_norm_eps)),
                                      rope_, core(l)));
      torch::Tensor router_logits;
      const torch::Tensor y =
          moe_sublayer(l, h, w.post_attention_norm, w.router, w, experts, true, router_logits, shuffle_seed);
      out.router_logits.push_back(router_logits);
      counts.copy_(tokens_per_expert_);
      dropped.fill_(dropped_slots_);
      release(dense);
      release(experts);
      return regather_in_backward(y, {dense, experts});
    }
    case Checkpointing::kSelective: {
      // Attention keeps its activations; the MoE sub-block is recomputed in backward.
      const Gathered dense = gather(dense_unit);
      const LayerWeights w = dense_weights(dense);
      const torch::Tensor h = x + scatter_sequence(attention(
                                      local_spec_, w, gather_sequence(rms_norm(x, w.input_norm, spec.rms_norm_eps)),
                                      rope_, core(l)));
      // The shared experts' weights are inputs too, after the router's: their gradients come back.
      BlockFn fn = [this, l, expert_unit, counts, dropped, shuffle_seed](const std::vector<torch::Tensor>& in,
                                                                         bool recompute) {
        const Gathered experts = gather(expert_unit);
        torch::Tensor router_logits;
        LayerWeights shared;
        if (in.size() > 3) {
          shared.shared_w1 = in[3];
          shared.shared_w2 = in[4];
          shared.shared_w3 = in[5];
          if (in.size() > 6) shared.shared_gate = in[6];
        }
        const torch::Tensor y =
            moe_sublayer(l, in[0], in[1], in[2], shared, experts, !recompute, router_logits, shuffle_seed);
        if (!recompute) {
          counts.copy_(tokens_per_expert_);
          dropped.fill_(dropped_slots_);
        }
        return std::vector<torch::Tensor>{y, router_logits};
      };
      std::vector<torch::Tensor> inputs{h, w.post_attention_norm, w.router};
      for (const torch::Tensor& t : {w.shared_w1, w.shared_w2, w.shared_w3, w.shared_gate})
        if (t.defined()) inputs.push_back(t);
      const std::vector<torch::Tensor> outs = checkpoint(fn, inputs, l);
      out.router_logits.push_back(outs[1]);
      release(dense);
      return regather_in_backward(outs[0], {dense});
    }
    case Checkpointing::kFull: {
      BlockFn fn = [this, l, dense_unit, expert_unit, counts, dropped,
                    shuffle_seed](const std::vector<torch::Tensor>& in, bool recompute) {
        const ModelSpec& spec = plan_.model;
        const Gathered dense = gather(dense_unit), experts = gather(expert_unit);
        const LayerWeights w = dense_weights(dense);
        const torch::Tensor h = in[0] + scatter_sequence(attention(
                                            local_spec_, w,
                                            gather_sequence(rms_norm(in[0], w.input_norm, spec.rms_norm_eps)), rope_,
                                            core(l)));
        torch::Tensor router_logits;
        const torch::Tensor y =
            moe_sublayer(l, h, w.post_attention_norm, w.router, w, experts, !recompute, router_logits, shuffle_seed);
        if (!recompute) {
          counts.copy_(tokens_per_expert_);
          dropped.fill_(dropped_slots_);
        }
        return std::vector<torch::Tensor>{y, router_logits};
      };
      const std::vector<torch::Tensor> outs = checkpoint(fn, {x}, l);
      out.router_logits.push_back(outs[1]);
      return outs[0];
    }
    case Checkpointing::kAttentionCore:
    case Checkpointing::kLatentUpProjections:
      break;  // refused by check_run_inputs
  }
  assert(false && "attention_core or latent_up checkpointing reached the executor");
  return x;
}

// The MoE sub-block with its residual: h plus the routed (and shared) experts' output of h normed.
// Unfolded, every T rank routes the whole gathered sequence and the experts' partial sums are
// reduce-scattered with the shared experts'. Folded (ETP = 1, Megatron-Core's parallel folding),
// each rank routes its own part of the sequence to whole experts over the larger expert group,
// and only the shared experts (split over T like a dense block's layer) go through the
// gather and the reduce-scatter.
torch::Tensor ShardedModel::moe_sublayer(int64_t l, const torch::Tensor& h, const torch::Tensor& norm,
                                         const torch::Tensor& router, const LayerWeights& shared,
                                         const Gathered& experts, bool count, torch::Tensor& router_logits,
                                         uint64_t shuffle_seed) {
  const torch::Tensor normed = rms_norm(h, norm, plan_.model.rms_norm_eps);
  if (!folded_) {
    const torch::Tensor whole = gather_sequence(normed);
    return h + scatter_sequence(
                   with_shared(moe(l, whole, router, experts, count, router_logits, shuffle_seed), shared, whole));
  }
  const torch::Tensor y = h + moe(l, normed, router, experts, count, router_logits, shuffle_seed);
  if (!shared.shared_w1.defined()) return y;
  return y + scatter_sequence(shared_experts(shared, gather_sequence(normed)));
}

// A dense block (no router, no experts): attention, then one feed-forward layer split over the
// tensor-parallel ranks like a shared expert (w1 and w3 by rows, w2 by columns), recomputed as
// the plan says (selective: the feed-forward sub-block; full: the whole block).
torch::Tensor ShardedModel::dense_block(int64_t l, const torch::Tensor& x) {
  const size_t dense_unit = static_cast<size_t>(1 + 2 * l);
  const Checkpointing recompute = plan_.parallel.activation_checkpointing;
  auto attention_part = [this, l](const torch::Tensor& in, const LayerWeights& w) {
    const ModelSpec& spec = plan_.model;
    return in + scatter_sequence(attention(
                    local_spec_, w, gather_sequence(rms_norm(in, w.input_norm, spec.rms_norm_eps)), rope_, core(l)));
  };
  // in: the block's input (full) or the attention's output (selective), then the
  // post-attention norm and the three matrices.
  auto feed_forward = [this](const torch::Tensor& h, const torch::Tensor& norm, const torch::Tensor& w1,
                             const torch::Tensor& w2, const torch::Tensor& w3) {
    const torch::Tensor normed = gather_sequence(rms_norm(h, norm, plan_.model.rms_norm_eps));
    return h + scatter_sequence(expert_ffn(normed, w1, w2, w3));
  };
  if (recompute == Checkpointing::kFull) {
    BlockFn fn = [this, dense_unit, attention_part, feed_forward](const std::vector<torch::Tensor>& in, bool) {
      const Gathered dense = gather(dense_unit);
      const LayerWeights w = dense_weights(dense);
      return std::vector<torch::Tensor>{
          feed_forward(attention_part(in[0], w), w.post_attention_norm, w.dense_w1, w.dense_w2, w.dense_w3)};
    };
    return checkpoint(fn, {x}, l)[0];
  }
  const Gathered dense = gather(dense_unit);
  const LayerWeights w = dense_weights(dense);
  const torch::Tensor h = attention_part(x, w);
  torch::Tensor y;
  if (recompute == Checkpointing::kSelective) {
    BlockFn fn = [feed_forward](const std::vector<torch::Tensor>& in, bool) {
      return std::vector<torch::Tensor>{feed_forward(in[0], in[1], in[2], in[3], in[4])};
    };
    y = checkpoint(fn, {h, w.post_attention_norm, w.dense_w1, w.dense_w2, w.dense_w3}, l)[0];
  } else {
    y = feed_forward(h, w.post_attention_norm, w.dense_w1, w.dense_w2, w.dense_w3);
  }
  release(dense);
  return regather_in_backward(y, {dense});
}

// ---------------------------------------------------------------------------------------------
// Tensor and sequence parallelism.

torch::Tensor ShardedModel::gather_sequence(const torch::Tensor& x) {
  if (tp_ == 1) return x;
  // The collectives work along dimension 0: the sequence goes first for the move.
  // Contiguous again, so that the matrix products that read it share one saved copy.
  return all_gather_autograd(mesh_.tensor, x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous();
}

torch::Tensor ShardedModel::scatter_sequence(const torch::Tensor& partial) {
  if (tp_ == 1) return partial;
  return reduce_scatter_autograd(mesh_.tensor, partial.transpose(0, 1).contiguous()).transpose(0, 1);
}

// A vocabulary-parallel lookup: each T rank holds rows [t V / T, (t + 1) V / T) of the table and
// gives zeros for the other tokens; the reduce-scatter sums the parts and splits the sequence.
torch::Tensor ShardedModel::embed(const torch::Tensor& table, const torch::Tensor& input_ids) {
  if (tp_ == 1) return torch::embedding(table, input_ids);
  const int64_t rows = table.size(0);
  const torch::Tensor local = input_ids - tp_rank_ * rows;
  const torch::Tensor inside = ((local >= 0) & (local < rows)).unsqueeze(-1).to(table.scalar_type());
  return scatter_sequence(torch::embedding(table, local.clamp(0, rows - 1)) * inside);
}

RankSum ShardedModel::routing_sum() {
  if (mesh_.routing.size() == 1) return {};
  return [this](const torch::Tensor& t) { return all_reduce_autograd(mesh_.routing, t); };
}

torch::Tensor ShardedModel::sequence_mean(const torch::Tensor& sum, const torch::Tensor& counted) {
  if (cp_ == 1) return sum / counted;
  torch::Tensor total = counted.detach().reshape({1}).clone();
  mesh_.context.all_reduce_sum(total);
  return (all_reduce_autograd(mesh_.context, sum.reshape({1})) / total).squeeze(0);
}

namespace {

// Megatron-LM's vocabulary-parallel cross entropy as one autograd node: the sum over the counted
// tokens of log-sum-exp minus the label's logit, for logits [tokens, part] of which this rank
// holds vocabulary rows [rank x part, (rank + 1) x part). The maximum, the sum of exponentials
// and the label's logit are each combined over the tensor group (a group of one: this rank's
// whole vocabulary), so every rank gets the loss of the whole vocabulary. Forward keeps one
// [tokens, part] fp32 tensor, the softmax (the exponentials normalised in place); backward is
// (softmax - one-hot of the label where this rank holds it) times the token's gradient, with no
// collective.
torch::Tensor vocab_parallel_cross_entropy(Communicator& group, const torch::Tensor& split_logits,
                                           const torch::Tensor& label_ids, const torch::Tensor& counted) {
  const int64_t part = split_logits.size(-1);
  const torch::Tensor logits = split_logits.reshape({-1, part});
  const torch::Tensor labels = label_ids.reshape({-1});
  torch::Tensor softmax, local, mine, sum;
  {
    torch::NoGradGuard no_grad;
    torch::Tensor max = std::get<0>(logits.max(-1));
    if (group.size() > 1) max = std::get<0>(group.all_gather(max.unsqueeze(0)).max(0));
    softmax = (logits - max.unsqueeze(-1)).exp_();
    torch::Tensor sum_exp = softmax.sum(-1);
    if (group.size() > 1) group.all_reduce_sum(sum_exp);
    local = labels - group.rank() * part;
    mine = (local >= 0) & (local < part);
    local = local.clamp(0, part - 1);
    torch::Tensor label_logit = (logits.gather(1, local.unsqueeze(-1)).squeeze(-1) - max) * mine;
    if (group.size() > 1) group.all_reduce_sum(label_logit);
    sum = ((sum_exp.log() - label_logit) * counted).sum();
    softmax.div_(sum_exp.unsqueeze(-1));
  }
  TensorList out{sum};
  attach_backward({split_logits}, out, "VocabParallelCrossEntropyBackward",
                  [softmax, local, mine, counted, shape = split_logits.sizes().vec(),
                   type = split_logits.scalar_type()](TensorList&& g) {
                    const torch::Tensor scale = g[0].defined() ? g[0] * counted : counted * 0;
                    torch::Tensor grad = softmax * scale.unsqueeze(-1);
                    grad.scatter_add_(1, local.unsqueeze(-1), (-scale * mine).unsqueeze(-1));
                    return TensorList{grad.to(type).view(shape)};
                  });
  return out[0];
}

}  // namespace

LossTerms ShardedModel::loss(const ForwardResult& out, const torch::Tensor& input_ids) {
  // Cross entropy over this rank's tokens (with T > 1 over this rank's part of the vocabulary,
  // the embedding's and the head's split), made the micro-batch's mean (sequence_mean). At
  // T = 1 too: it keeps one fp32 tensor of the logits' size where LibTorch's log-softmax and
  // negative log-likelihood keep their output and, in backward, hold it beside two gradients.
  auto cross_entropy = [this](const torch::Tensor& split_logits, const torch::Tensor& label_ids) {
    const torch::Tensor counted = (label_ids.reshape({-1}) != kIgnoreLabel).to(torch::kFloat);
    return sequence_mean(vocab_parallel_cross_entropy(mesh_.tensor, split_logits, label_ids, counted), counted.sum());
  };
  std::vector<torch::Tensor> mtp;
  for (size_t k = 0; k < out.mtp_logits.size(); ++k)
    mtp.push_back(
        cross_entropy(out.mtp_logits[k], local_tokens(mtp_labels(input_ids, static_cast<int64_t>(k) + 1))));
  return mixtral_loss_from_lm(plan_.model, plan_.moe, out,
                              cross_entropy(out.logits, local_tokens(next_token_labels(input_ids))), mtp,
                              routing_sum());
}

namespace {

// The global token shuffle of an expert group: a random permutation of the group's tokens
// (the same on every member), of which each rank takes an equal consecutive part.
struct TokenShuffle {
  std::vector<int64_t> send_rows, recv_rows;
  torch::Tensor send_order;    // this rank's tokens in the order they leave
  torch::Tensor arrival;       // arrival index -> local shuffled position
  torch::Tensor arrival_inv;   // local shuffled position -> arrival index
  torch::Tensor send_inv;      // leaving index -> original token
};

TokenShuffle make_shuffle(int64_t ranks, int64_t me, int64_t n, uint64_t seed, const torch::Device& device) {
  const int64_t total = ranks * n;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor perm = torch::randperm(total, generator, torch::kLong);  // position -> token
  const torch::Tensor position = torch::argsort(perm);                         // token -> position
  TokenShuffle s;
  const torch::Tensor mine = position.narrow(0, me * n, n);  // positions of my tokens
  s.send_order = std::get<1>(torch::sort(mine, c10::optional<bool>(true), 0));
  s.send_inv = torch::argsort(s.send_order);
  const torch::Tensor dest = torch::div(mine, n, "floor");
  const torch::Tensor my_positions = torch::arange(me * n, me * n + n, torch::kLong);
  const torch::Tensor src = torch::div(perm.narrow(0, me * n, n), n, "floor");
  const torch::Tensor send_counts = torch::bincount(dest, {}, ranks), recv_counts = torch::bincount(src, {}, ranks);
  for (int64_t r = 0; r < ranks; ++r) {
    s.send_rows.push_back(send_counts[r].item<int64_t>());
    s.recv_rows.push_back(recv_counts[r].item<int64_t>());
  }
  // Rows arrive grouped by source rank, each group in position order.
  s.arrival = std::get<1>(torch::sort(src * total + my_positions, c10::optional<bool>(true), 0));
  s.arrival_inv = torch::argsort(s.arrival);
  // Drawn on the host (one seeded stream on every rank), used where the tokens are.
  for (torch::Tensor* t : {&s.send_order, &s.arrival, &s.arrival_inv, &s.send_inv}) *t = t->to(device);
  return s;
}

uint64_t mix_seed(uint64_t seed, int64_t layer) {
  uint64_t x = seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(layer + 1);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

torch::Tensor ShardedModel::moe(int64_t layer, const torch::Tensor& x, const torch::Tensor& router,
                                const Gathered& experts, bool count, torch::Tensor& router_logits,
                                uint64_t shuffle_seed) {
  const ModelSpec& spec = plan_.model;
  const MoeConfig& moe = plan_.moe;
  Communicator& group = mesh_.expert;
  torch::Tensor tokens = x.reshape({-1, x.size(-1)});
  const bool shuffle = moe.global_token_shuffle && group.size() > 1;
  TokenShuffle s;
  if (shuffle) {
    s = make_shuffle(group.size(), group.rank(), tokens.size(0), mix_seed(shuffle_seed, layer), device_);
    tokens = all_to_all_autograd(group, tokens.index_select(0, s.send_order), s.send_rows, s.recv_rows)
                 .index_select(0, s.arrival_inv);
  }
  router_logits = torch::matmul(tokens, router.t());
  const Routing r = route(router_logits, RouterShape::of(spec), moe.load_balancing,
                          expert_bias_.defined() ? expert_bias_[spec.moe_row(layer)] : torch::Tensor(), routing_sum());
  // Each rank drops at its own tokens' capacity, before the exchange (Megatron-Core's).
  SlotList slots = slot_list(r, spec.num_experts, moe);
  if (count) {
    tokens_per_expert_ = torch::bincount(r.experts.flatten(), {}, spec.num_experts);
    dropped_slots_ = slots.dropped;
  }
  if (count && recorder_ && (tp_rank_ == 0 || folded_)) {
    // Part of the micro-batch: the rows of its [B x T] tokens that this rank routed.
    const torch::Tensor rows =
        routed_positions_.defined()
            ? ((torch::arange(x.size(0), routed_positions_.options()) * seq_len_).unsqueeze(1) +
               routed_positions_.unsqueeze(0))
                  .flatten()
            : torch::Tensor();
    recorder_->add(micro_batch_, layer, router_logits, r.experts, slots.kept, rows);
  }
  torch::Tensor sent_to = r.experts;
  if (fault_ == RehearsalFault::kExpertOnWrongRank && experts_per_rank_ < spec.num_experts) {
    // The planted fault: expert 0 and the second expert rank's first expert trade places.
    const int64_t other = experts_per_rank_;
    auto swapped = [other](const torch::Tensor& e) { return e.masked_fill(e == 0, other).masked_fill_(e == other, 0); };
    sent_to = swapped(r.experts);
    slots.expert = swapped(slots.expert);
  }
  // The all-gather dispatcher sends every slot's expert; a dropped one goes to none (-1).
  if (slots.kept.defined()) sent_to = sent_to.masked_fill(slots.kept.logical_not(), -1);
  torch::Tensor out = moe.dispatcher == Dispatcher::kAllGather
                          ? dispatch_all_gather(tokens, sent_to, r.weights.to(tokens.scalar_type()), experts)
                          : dispatch_all_to_all(tokens, slots, experts);
  if (shuffle)
    out = all_to_all_autograd(group, out.index_select(0, s.arrival), s.recv_rows, s.send_rows).index_select(0, s.send_inv);
  return out.view(x.sizes());
}

torch::Tensor ShardedModel::local_experts(const torch::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                                          const Gathered& local) {
  busiest_expert_rows_ = std::max(busiest_expert_rows_, rows.size(0));
  const auto& p = local.params;  // w1, w2, w3 of each local expert
  return grouped_experts(rows, rows_per_expert, [&p](int64_t j) {
    return ExpertWeights{p[static_cast<size_t>(3 * j)], p[static_cast<size_t>(3 * j + 1)], p[static_cast<size_t>(3 * j + 2)]};
  });
}

torch::Tensor ShardedModel::dispatch_all_to_all(const torch::Tensor& tokens, const SlotList& slots,
                                                const Gathered& local) {
  const int64_t num_experts = plan_.model.num_experts;
  const torch::Tensor order = std::get<1>(torch::sort(slots.expert, c10::optional<bool>(true), 0));
  const torch::Tensor token_of = slots.token.index_select(0, order);
  const torch::Tensor load = torch::bincount(slots.expert, {}, num_experts);  // slots per expert, from this rank
  torch::Tensor sorted = tokens.index_select(0, token_of);  // grouped by expert
  const torch::Tensor slot_weights = slots.weight.to(tokens.scalar_type()).index_select(0, order).unsqueeze(-1);
  Communicator& group = mesh_.expert;
  const int64_t ranks = group.size(), n = experts_per_rank_, first = first_expert_;
  torch::Tensor y;
  if (ranks == 1) {
    y = local_experts(sorted, host_longs(load), local);
  } else {
    const std::vector<int64_t> a = host_longs(group.all_gather(load.unsqueeze(0)));  // [ranks, experts]
    std::vector<int64_t> send(static_cast<size_t>(ranks), 0), recv(static_cast<size_t>(ranks), 0),
        per_expert(static_cast<size_t>(n), 0);
    for (int64_t r = 0; r < ranks; ++r)
      for (int64_t j = 0; j < n; ++j) {
        send[static_cast<size_t>(r)] += a[group.rank() * num_experts + r * n + j];
        recv[static_cast<size_t>(r)] += a[r * num_experts + first + j];
        per_expert[static_cast<size_t>(j)] += a[r * num_experts + first + j];
      }
    // Each copy of the slots is let go of as soon as the next is made (what backward needs,
    // autograd keeps): a rank holds about two copies at a time, as the memory model counts.
    torch::Tensor received = all_to_all_autograd(group, sorted, send, recv);  // by source, then expert
    sorted = torch::Tensor();
    // Regroup by expert, then source, so that each local expert reads one slice.
    std::vector<int64_t> index;
    index.reserve(static_cast<size_t>(received.size(0)));
    for (int64_t j = 0; j < n; ++j) {
      int64_t source_begin = 0;
      for (int64_t r = 0; r < ranks; ++r) {
        int64_t start = source_begin;
        for (int64_t i = 0; i < j; ++i) start += a[r * num_experts + first + i];
        for (int64_t i = 0; i < a[r * num_experts + first + j]; ++i) index.push_back(start + i);
        source_begin += recv[static_cast<size_t>(r)];
      }
    }
    const torch::Tensor by_expert = torch::tensor(index, torch::kLong).to(device_);
    torch::Tensor rows = received.index_select(0, by_expert);
    received = torch::Tensor();
    torch::Tensor computed = local_experts(rows, per_expert, local);
    rows = torch::Tensor();
    torch::Tensor back = computed.index_select(0, torch::argsort(by_expert));
    computed = torch::Tensor();
    y = all_to_all_autograd(group, back, recv, send);  // this rank's slots, in the order they left
  }
  return torch::zeros_like(tokens).index_add(0, token_of, y * slot_weights);
}

torch::Tensor ShardedModel::dispatch_all_gather(const torch::Tensor& tokens, const torch::Tensor& experts,
                                                const torch::Tensor& weights, const Gathered& local) {
  const int64_t k = plan_.model.experts_per_token;
  Communicator& group = mesh_.expert;
  const torch::Tensor all_tokens = all_gather_autograd(group, tokens);  // [ranks * N, hidden]
  const torch::Tensor all_weights = all_gather_autograd(group, weights);
  const torch::Tensor all_experts = group.all_gather(experts).flatten();
  const torch::Tensor mine =
      torch::nonzero((all_experts >= first_expert_) & (all_experts < first_expert_ + experts_per_rank_)).flatten();
  const torch::Tensor local_expert = all_experts.index_select(0, mine) - first_expert_;
  const torch::Tensor order = std::get<1>(torch::sort(local_expert, c10::optional<bool>(true), 0));
  const torch::Tensor slot = mine.index_select(0, order);
  const torch::Tensor token_of = torch::div(slot, k, "floor");
  const torch::Tensor counts = torch::bincount(local_expert, {}, experts_per_rank_);
  const torch::Tensor y = local_experts(all_tokens.index_select(0, token_of), host_longs(counts), local);
  const torch::Tensor partial = torch::zeros_like(all_tokens)
                                    .index_add(0, token_of, y * all_weights.flatten().index_select(0, slot).unsqueeze(-1));
  return reduce_scatter_autograd(group, partial);  // this rank's tokens, summed over the experts of the group
}

}  // namespace moeplan::executor
