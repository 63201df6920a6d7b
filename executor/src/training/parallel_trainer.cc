#include "moeplan/executor/training/parallel_trainer.h"

#include "moeplan/executor/model/expert_bias.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/phases.h"
#include "moeplan/core/pipeline_schedule.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/routing.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/nonfinite.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

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
    : plan_(plan), mesh_(mesh), model_(plan, mesh), marks_(mesh.device()), offload_(offload) {
  optimizer_ = std::make_unique<AdamW>(AdamW::with_decay_runs(
      model_.shards(), model_.decay_runs(),
      AdamWSettings{plan.training.adam_beta1, plan.training.adam_beta2, 1e-8, plan.training.weight_decay}));
  if (offload) {
    model_.set_offload(offload, plan.parallel.activation_loading_horizon);
    offload->set_observer([this](const char* op, int64_t bytes, PhaseClock::Clock::time_point start,
                                 PhaseClock::Clock::time_point end) {
      clock_.add(op, "copy", TraceStream::kCopy, start, end, static_cast<double>(bytes));
    });
  }
  clock_.set_rank(mesh.rank());
  clock_.set_device(mesh.device());
  auto observe = [this](Communicator& comm, const std::string& group, TraceStream stream) {
    const int64_t first = comm.size() > 1 ? comm.first_rank() : -1;
    comm.set_observer([this, group, stream, first](const char* op, int64_t bytes, PhaseClock::Clock::time_point start,
                                                   PhaseClock::Clock::time_point end) {
      clock_.add(group + "." + category_of(op), category_of(op), stream, start, end, static_cast<double>(bytes), first);
    });
  };
  observe(mesh.expert, "expert", TraceStream::kExpertComm);
  observe(mesh.shard, "shard", TraceStream::kShardGather);
  // How much of each shard all-gather and reduce-scatter the rank waited for (the rest ran while
  // it computed), on the same lane: "shard.all_gather_wait".
  mesh.shard.set_wait_observer(
      [this](const char* op, int64_t, PhaseClock::Clock::time_point start, PhaseClock::Clock::time_point end) {
        const std::string category = category_of(op) + "_wait";
        clock_.add("shard." + category, category, TraceStream::kShardGather, start, end);
      });
  observe(mesh.dense_replicas, "dense_replicas", TraceStream::kGradComm);
  observe(mesh.expert_replicas, "expert_replicas", TraceStream::kGradComm);
  observe(mesh.world, "world", TraceStream::kGradComm);
  // The tensor-parallel collectives sit on the compute chain between a block's parts; the
  // measured trace shows them beside the expert group's.
  observe(mesh.tensor, "tensor", TraceStream::kExpertComm);
  // So do the context ranks' key-value blocks, which travel beside attention.
  observe(mesh.context, "context", TraceStream::kExpertComm);
  // Activations and gradients between pipeline stages, from the start of a transfer to its end.
  observe(mesh.pipeline, "pipeline", TraceStream::kCopy);
}

void ShardedTrainer::rehearse(const std::string& record_dir, RehearsalFault fault) {
  recorder_ = std::make_unique<RoutingRecorder>(record_dir, mesh_.rank());
  model_.record_routing(recorder_.get());
  model_.plant(fault);
  fault_ = fault;
}

StepRecord ShardedTrainer::step(const std::vector<torch::Tensor>& host_batches) {
  using Clock = PhaseClock::Clock;
  marks_.restart();
  if (offload_ && mesh_.device().is_cuda()) offload_->device_idle(mesh_.device());
  model_.finish_gradient_scatters();  // none, unless a failed step left some: its gradients go
  for (torch::Tensor& shard : model_.shards()) shard.mutable_grad() = torch::Tensor();
  const auto start = Clock::now();
  clock_.start_step();
  // The token ids on the rank's device; the step's counts and sums stay on the host.
  std::vector<torch::Tensor> micro_batches;
  for (const torch::Tensor& b : host_batches) micro_batches.push_back(to_device(b, mesh_.device()));
  const ModelSpec& spec = plan_.model;
  const int64_t ga = static_cast<int64_t>(micro_batches.size());
  // The data readers: the ranks of a tensor-parallel group and of a context group train on the
  // same micro-batches. The first tensor-parallel rank counts its tokens' routing (the context
  // ranks' tokens are their own), and the first of both reports the losses (every rank of them
  // has the micro-batch's).
  const double readers = static_cast<double>(plan_.parallel.data_parallel_degree());
  // Folded tensor ranks route their own tokens: each counts them.
  const bool counts_data = mesh_.coords().t == 0 || model_.folded();
  const bool reports = mesh_.coords().t == 0 && mesh_.coords().c == 0;
  // The ranks that compute the router's losses from the same tokens (unfolded T ranks).
  const double tp = model_.folded() ? 1.0 : static_cast<double>(mesh_.tensor.size());
  StepRecord r;
  r.step = ++step_;
  r.learning_rate = learning_rate(plan_.training, step_);
  // Token-expert slots by [expert group][micro-batch][block with experts][expert], each rank adding its
  // tokens' routing to its own group's micro-batch; summed over the world after the step.
  const int64_t groups = plan_.parallel.replica_degree() * plan_.parallel.hybrid_shard_degree;
  torch::Tensor counts = torch::zeros({groups, ga, spec.moe_blocks(), spec.num_experts}, torch::kLong);
  torch::Tensor mine = counts[mesh_.coords().r * mesh_.shard.size() + mesh_.coords().s];
  torch::Tensor sums = torch::zeros({5}, torch::kDouble);  // lm, aux, z, total, tokens
  nonfinite_layers_ = torch::zeros({spec.blocks()}, torch::kLong);
  dropped_slots_ = torch::zeros({spec.moe_blocks()}, torch::kLong);
  if (mesh_.pipeline.size() > 1) run_pipeline(micro_batches, mine, sums);
  for (int64_t m = 0; m < ga && mesh_.pipeline.size() == 1; ++m) {
    const torch::Tensor& ids = micro_batches[static_cast<size_t>(m)];
    const size_t f0 = marks_.mark();
    model_.set_micro_batch(mesh_.layout().reader(mesh_.rank()) * ga + m);
    ForwardResult out = model_.forward(ids, shuffle_seed(plan_.training.seed, step_, m));
    const LossTerms terms = model_.loss(out, ids);
    out.logits = torch::Tensor();  // the graph keeps what backward needs; the logits go now
    out.mtp_logits.clear();
    const size_t f1 = marks_.mark();
    // Every unfolded T rank computes the router's losses from the same logits, and the router's
    // gradient is summed over them: each takes 1/T of those terms, so they count once.
    const torch::Tensor router_terms = terms.total - terms.prediction;
    ((terms.prediction + router_terms / tp) / static_cast<double>(ga)).backward();
    const size_t f2 = marks_.mark();
    clock_.add_marked(phase::kForward, marks_, f0, f1);
    clock_.add_marked(phase::kBackward, marks_, f1, f2);
    nonfinite_layers_ += out.nonfinite_layers.to(torch::kCPU);
    if (!counts_data) continue;
    mine[m] += out.tokens_per_expert.to(torch::kCPU);
    dropped_slots_ += out.dropped_slots.to(torch::kCPU);
    if (!reports) continue;
    sums[0] += terms.lm.item<double>();
    sums[1] += terms.aux.item<double>();
    sums[2] += terms.z.item<double>();
    sums[3] += terms.total.item<double>();
    sums[4] += static_cast<double>(ids.numel());
  }

  // Gradients: reduce-scattered over the shard group during backward; now summed over the
  // tensor-parallel group (the parameters its ranks hold whole) and the replicas, and averaged
  // over every reader's tokens.
  model_.finish_gradient_scatters();  // the last ones left in flight (GPU ranks)
  const auto o0 = Clock::now();
  std::vector<torch::Tensor> grads;
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < model_.units().size(); ++u) {
    torch::Tensor& shard = model_.shards()[u];
    torch::Tensor g = shard.grad().defined() ? shard.grad() : torch::zeros_like(shard);
    grads.push_back(g);
    if (!model_.holds(u)) continue;  // on another pipeline stage
    model_.sum_whole_parameter_grads(u, g);
    // The planted fault leaves the first block's dense gradient unreduced in one replica group:
    // the one whose ranks are at shard and tensor coordinate 0 on the first stage (every rank of
    // that group skips alike, so no collective waits).
    const bool unreduced = fault_ == RehearsalFault::kUnreducedGradient && u == 1 && mesh_.coords().s == 0 &&
                           mesh_.coords().t == 0;
    if (!unreduced) model_.replica_group(model_.units()[u]).all_reduce_sum(g);
    g.div_(readers);
  }
  // The embedding's copy on the last stage (multi-token prediction): both copies get the sum.
  model_.sum_shared_embedding_grads(grads[0]);
  // Global norm: each element counted on exactly one rank (what T ranks hold whole, on the first).
  torch::Tensor square = torch::zeros({1}, torch::dtype(torch::kFloat).device(mesh_.device()));
  for (size_t u = 0; u < grads.size(); ++u) {
    if (!model_.owns(model_.units()[u])) continue;
    square += model_.counted_once(u, grads[u]).to(torch::kFloat).square().sum();
  }
  mesh_.world.all_reduce_sum(square);
  r.grad_norm = std::sqrt(square.item<double>());
  // The loss of the whole world decides, with the norm, whether the update is applied: every
  // rank sees the same two numbers.
  mesh_.world.all_reduce_sum(sums);
  if (std::isfinite(r.grad_norm) && std::isfinite(sums[3].item<double>())) {
    const double coef = plan_.training.max_grad_norm / (r.grad_norm + 1e-6);
    if (coef < 1)
      for (torch::Tensor& g : grads) g.mul_(coef);
    optimizer_->step(grads, r.learning_rate);
  } else {
    r.skipped = true;
    torch::Tensor blocks = nonfinite_blocks(spec.blocks());
    note_nonfinite_outputs(blocks, nonfinite_layers_);
    for (size_t u = 0; u < grads.size(); ++u)
      if (model_.owns(model_.units()[u]))
        note_nonfinite_tensors(blocks, model_.units()[u].block, model_.shards()[u], grads[u]);
    mesh_.world.all_reduce_sum(blocks);
    r.nonfinite = describe_nonfinite(blocks);
  }
  for (torch::Tensor& shard : model_.shards()) shard.mutable_grad() = torch::Tensor();
  clock_.add(std::string(phase::kOptimizer), "compute", TraceStream::kCompute, o0, Clock::now());
  if (recorder_) recorder_->write(step_);

  record_routing(r, counts);
  // Every rank has every layer's slots over the world now, so the biases move alike everywhere.
  if (model_.expert_bias().defined() && !r.skipped)
    update_expert_bias(model_.expert_bias(), counts.sum(at::IntArrayRef{0, 1}).to(mesh_.device()),
                       spec.router_bias_update_rate);
  const double n = readers * static_cast<double>(ga);
  r.loss = sums[0].item<double>() / n;
  r.aux_loss = sums[1].item<double>() / n;
  r.z_loss = sums[2].item<double>() / n;
  r.total_loss = sums[3].item<double>() / n;
  r.tokens = static_cast<int64_t>(sums[4].item<double>());
  wait_for(mesh_.device());  // the step's device work done: the host clock times it
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  clock_.add_marked_spans(marks_);
  if (offload_) offload_->report_copies();  // a GPU rank's copies, timed on its copy stream
  return r;
}

// The step's routing, summed over the world: the slots per expert group, micro-batch, layer and
// expert, the slots dropped at capacity per layer, and each rank's time inside its expert
// group's exchanges (dispatch and combine, forward and backward: the transfers and the wait for
// the group's busiest rank).
void ShardedTrainer::record_routing(StepRecord& r, torch::Tensor& counts) {
  mesh_.world.all_reduce_sum(counts);
  r.tokens_per_expert = slot_table(counts.sum(at::IntArrayRef{0, 1}));
  for (int64_t g = 0; g < counts.size(0); ++g) {
    std::vector<std::vector<std::vector<int64_t>>>& group = r.exchange_slots.emplace_back();
    for (int64_t m = 0; m < counts.size(1); ++m) group.push_back(slot_table(counts[g][m]));
  }
  if (plan_.moe.capacity_factor > 0) {
    mesh_.world.all_reduce_sum(dropped_slots_);
    const int64_t* d = dropped_slots_.data_ptr<int64_t>();
    r.dropped_slots.assign(d, d + dropped_slots_.numel());
  }
  if (mesh_.expert.size() <= 1) return;
  torch::Tensor inside = torch::zeros({mesh_.layout().world_size()}, torch::kDouble);
  for (const TraceEvent& e : clock_.events())
    if (e.name.rfind("expert.", 0) == 0) inside[mesh_.rank()] += 1e-9 * static_cast<double>(e.duration_ns);
  mesh_.world.all_reduce_sum(inside);
  r.exchange_seconds.assign(inside.data_ptr<double>(), inside.data_ptr<double>() + inside.numel());
}

// The micro-batches of a step through this rank's pipeline stage in the schedule's order
// (core/pipeline_schedule.h: 1F1B, or the interleaved schedule with V chunks). A chunk's input
// comes from the previous pipeline rank and its output goes to the next one; gradients go the
// other way. Sends are started and never waited for inside the schedule (a gloo send waits for
// its receiver, so no rank blocks on a peer that waits on it); their buffers are let go of as
// soon as a message from the peer proves that the peer has received them (the peer's schedule
// says which of ours it has taken before it sends each message), so that they do not pile up
// over the step's micro-batches. Receives wait. Each stage adds up the router-loss sums of its
// layers per micro-batch (routing.h), and after the schedule they are summed over the stages
// (and the micro-batch's other parts), so that the last stage reports the load-balancing and
// z-losses of all the layers, as Megatron-LM's tracker reduces them over the pipeline when it
// logs; those losses are not in the objective here (the executor refuses such plans). Only the
// activations and their gradients travel between the stages: a second message per micro-batch
// would wait for the sender again, as busy with its next chunk.
void ShardedTrainer::run_pipeline(const std::vector<torch::Tensor>& micro_batches, torch::Tensor& counts,
                                  torch::Tensor& sums) {
  const ModelSpec& spec = plan_.model;
  Communicator& pipe = mesh_.pipeline;
  const int64_t ranks = pipe.size(), me = pipe.rank(), chunks = plan_.parallel.virtual_pipeline_degree;
  const int64_t stages = ranks * chunks, ga = static_cast<int64_t>(micro_batches.size());
  const int64_t prev = (me + ranks - 1) % ranks, next = (me + 1) % ranks;
  const bool counts_data = mesh_.coords().t == 0 || model_.folded();
  const int64_t k = spec.experts_per_token, experts = spec.num_experts, sum_size = k * experts + experts + 2;
  const torch::Tensor& first = micro_batches.front();
  const std::vector<int64_t> hidden_shape{first.size(0), first.size(1) / (mesh_.tensor.size() * mesh_.context.size()),
                                          spec.hidden_size};
  const torch::ScalarType hidden_type = compute_type(plan_.training.precision);
  enum Kind : int64_t { kActivation, kGradient };
  // A transfer's tag names its micro-batch, the virtual stage it goes to and what it carries.
  auto tag = [&](int64_t micro, int64_t stage, Kind kind) { return (micro * stages + stage) * 2 + kind; };
  // [micro-batch][router-loss sums] of this stage's layers, summed over the stages at the end.
  torch::Tensor router = torch::zeros({ga, sum_size}, torch::kDouble);
  struct InFlight {
    torch::Tensor input;   // the received activation (a leaf whose gradient goes back)
    torch::Tensor output;  // the chunk's output, or the loss of the last stage
  };
  std::map<std::pair<int64_t, int64_t>, InFlight> live;  // by (micro-batch, chunk)
  // Our sends, by tag, and for each peer the tags of ours it receives in the order it does,
  // with, for each message it sends us, how many of those it has received by then.
  std::map<int64_t, Communicator::PendingTransfer> sends;
  struct Peer {
    std::vector<int64_t> takes;               // our tags, in the order the peer receives them
    std::map<int64_t, size_t> taken_before;   // its message's tag -> takes received by then
    size_t settled = 0;                       // takes already let go of
  };
  std::map<int64_t, Peer> peers;
  for (const int64_t q : {prev, next}) {
    if (peers.count(q) != 0) continue;
    Peer& peer = peers[q];
    const bool after_me = (q + ranks - 1) % ranks == me, before_me = (q + 1) % ranks == me;
    for (const PipelineAction& b : pipeline_schedule(ranks, q, ga, chunks)) {
      const int64_t sq = b.chunk * ranks + q;
      if (b.forward) {
        if (sq > 0 && after_me) peer.takes.push_back(tag(b.micro_batch, sq, kActivation));
        if (sq + 1 < stages && before_me) peer.taken_before[tag(b.micro_batch, sq + 1, kActivation)] = peer.takes.size();
      } else {
        if (sq + 1 < stages && before_me) peer.takes.push_back(tag(b.micro_batch, sq, kGradient));
        if (sq > 0 && after_me) peer.taken_before[tag(b.micro_batch, sq - 1, kGradient)] = peer.takes.size();
      }
    }
  }
  auto send = [&](const torch::Tensor& t, int64_t to, int64_t tag_of) {
    sends.emplace(tag_of, pipe.start_send(t, to, tag_of));
  };
  auto receive = [&](c10::IntArrayRef shape, torch::ScalarType type, int64_t from, int64_t tag_of) {
    torch::Tensor t = pipe.recv(shape, type, from, tag_of);
    Peer& peer = peers.at(from);
    for (const size_t taken = peer.taken_before.at(tag_of); peer.settled < taken; ++peer.settled)
      if (const auto it = sends.find(peer.takes[peer.settled]); it != sends.end()) {
        pipe.finish_transfer(it->second);  // received by the peer: done at once
        sends.erase(it);
      }
    return t;
  };
  for (const PipelineAction& a : pipeline_schedule(ranks, me, ga, chunks)) {
    const int64_t stage = a.chunk * ranks + me;
    const torch::Tensor& ids = micro_batches[static_cast<size_t>(a.micro_batch)];
    if (a.forward) {
      InFlight f;
      if (stage > 0)
        f.input = receive(hidden_shape, hidden_type, prev, tag(a.micro_batch, stage, kActivation)).requires_grad_(true);
      const size_t t0 = marks_.mark();  // the compute, after the wait for the input
      model_.set_micro_batch(mesh_.layout().reader(mesh_.rank()) * ga + a.micro_batch);
      ForwardResult out =
          model_.forward_chunk(a.chunk, ids, f.input, shuffle_seed(plan_.training.seed, step_, a.micro_batch));
      router[a.micro_batch] += router_loss_sums(out.router_logits, k, experts, spec.router_scoring);
      if (counts_data) {
        counts[a.micro_batch] += out.tokens_per_expert.to(torch::kCPU);
        dropped_slots_ += out.dropped_slots.to(torch::kCPU);
      }
      nonfinite_layers_ += out.nonfinite_layers.to(torch::kCPU);
      if (stage + 1 < stages) {
        f.output = out.hidden;
        send(out.hidden.detach(), next, tag(a.micro_batch, stage + 1, kActivation));
      } else {
        // What backward starts from: the predictions' loss (the next token's and the multi-token
        // prediction modules'); the router's losses are not trained through the stages.
        const LossTerms terms = model_.loss(out, ids);
        f.output = terms.prediction / static_cast<double>(ga);
        if (mesh_.coords().t == 0 && mesh_.coords().c == 0) {
          sums[0] += terms.lm.item<double>();
          sums[3] += terms.prediction.item<double>();
          sums[4] += static_cast<double>(ids.numel());
        }
      }
      live.emplace(std::make_pair(a.micro_batch, a.chunk), std::move(f));
      clock_.add_marked(phase::kForward, marks_, t0, marks_.mark());
    } else {
      const auto at = live.find({a.micro_batch, a.chunk});
      if (at == live.end()) throw std::logic_error("a pipeline backward before its forward");
      InFlight f = std::move(at->second);
      live.erase(at);
      torch::Tensor grad;
      if (stage + 1 < stages) grad = receive(hidden_shape, hidden_type, next, tag(a.micro_batch, stage, kGradient));
      const size_t t0 = marks_.mark();
      if (grad.defined())
        torch::autograd::backward({f.output}, {grad});
      else
        f.output.backward();
      if (stage > 0)
        send(f.input.grad().defined() ? f.input.grad() : torch::zeros_like(f.input), prev,
             tag(a.micro_batch, stage - 1, kGradient));
      clock_.add_marked(phase::kBackward, marks_, t0, marks_.mark());
    }
  }
  for (auto& [tag_of, transfer] : sends) pipe.finish_transfer(transfer);
  // The router's sums of every stage, and of the micro-batch's other parts (context ranks,
  // folded tensor ranks).
  pipe.all_reduce_sum(router);
  if (mesh_.routing.size() > 1) mesh_.routing.all_reduce_sum(router);
  if (me + 1 == ranks && mesh_.coords().t == 0 && mesh_.coords().c == 0)
    for (int64_t m = 0; m < ga; ++m) {
      const auto [aux, z] = router_losses_of_sums(router[m], k, experts);
      sums[1] += aux;
      sums[2] += z;
    }
}

namespace {

// A parameter's part of this rank's shard of a flat unit: elements [first, last) of the
// parameter's flattened values, stored from element `at` of the unit's shard.
struct HeldSlice {
  size_t unit;
  int64_t param;
  const ParamInfo* info;  // this rank's part of the parameter
  int64_t first, last, at;
};

// Every such part, unit by unit (the replicated units included).
template <class F>
void for_each_held_slice(ShardedModel& model, F&& f) {
  for (size_t u = 0; u < model.units().size(); ++u) {
    if (!model.holds(u)) continue;  // on another pipeline stage
    const FlatUnit& unit = model.units()[u];
    const int64_t begin = model.shard_begin(unit), end = begin + unit.shard_numel;
    for (size_t j = 0; j < unit.params.size(); ++j) {
      const ParamInfo& info = model.infos()[static_cast<size_t>(unit.params[j])];
      const int64_t a = std::max(begin, unit.offsets[j]), b = std::min(end, unit.offsets[j] + info.numel());
      if (a < b) f(HeldSlice{u, unit.params[j], &info, a - unit.offsets[j], b - unit.offsets[j], a - begin});
    }
  }
}

// Where a held slice lies in the checkpoint's naming of the whole parameter: "<name>@<first>"
// for a range of its flattened values, or, for a part split by columns over the T ranks,
// "<name>#cols<c0>:<c1>of<C>@<first>", a range of the flattened columns [c0, c1) of C.
std::string slice_name(const HeldSlice& h, TensorSplit split, int64_t tp_rank, int64_t tp) {
  switch (tp == 1 ? TensorSplit::kWhole : split) {
    case TensorSplit::kWhole: return h.info->name + "@" + std::to_string(h.first);
    case TensorSplit::kRows: return h.info->name + "@" + std::to_string(tp_rank * h.info->numel() + h.first);
    case TensorSplit::kColumns: {
      const int64_t columns = h.info->shape[1], c0 = tp_rank * columns;
      return h.info->name + "#cols" + std::to_string(c0) + ":" + std::to_string(c0 + columns) + "of" +
             std::to_string(columns * tp) + "@" + std::to_string(h.first);
    }
  }
  return h.info->name;
}

// The values of a held slice from a checkpoint of any layout.
torch::Tensor held_values(const SlicedState& state, const std::string& key, const HeldSlice& h, TensorSplit split,
                          int64_t tp_rank, int64_t tp, Diagnostics& d) {
  switch (tp == 1 ? TensorSplit::kWhole : split) {
    case TensorSplit::kWhole: return state.range(key, h.first, h.last, d);
    case TensorSplit::kRows: {
      const int64_t at = tp_rank * h.info->numel();
      return state.range(key, at + h.first, at + h.last, d);
    }
    case TensorSplit::kColumns: {
      std::vector<int64_t> shape = h.info->shape;
      shape[1] *= tp;
      const torch::Tensor whole = state.whole(key, shape, d);
      if (!whole.defined()) return whole;
      return tensor_part(whole, split, tp_rank, tp).contiguous().flatten().narrow(0, h.first, h.last - h.first);
    }
  }
  return {};
}

}  // namespace

NamedTensors ShardedTrainer::state() const {
  NamedTensors tensors;
  auto& model = const_cast<ShardedModel&>(model_);
  const int64_t t = mesh_.coords().t;
  for_each_held_slice(model, [&](const HeldSlice& h) {
    if (!model.owns(model.units()[h.unit])) return;  // one replica saves
    const TensorSplit split = model.split_of(h.param);
    if (model.alike_on_tensor_ranks(h.param) && t != 0) return;  // the first T rank saves what all hold
    const std::string suffix = slice_name(h, split, t, mesh_.tensor.size());
    const int64_t n = h.last - h.first;
    // The planted fault: rank 0 writes its slices one element off.
    const bool off_by_one = fault_ == RehearsalFault::kShardOffByOne && mesh_.rank() == 0;
    auto slice = [&](const torch::Tensor& of) {
      const torch::Tensor part = of.detach().narrow(0, h.at, n);
      return off_by_one ? torch::roll(part, 1) : part;
    };
    tensors.emplace_back("param/" + suffix, slice(model.shards()[h.unit]));
    tensors.emplace_back("exp_avg/" + suffix, slice(optimizer_->exp_avg()[h.unit]));
    tensors.emplace_back("exp_avg_sq/" + suffix, slice(optimizer_->exp_avg_sq()[h.unit]));
  });
  if (mesh_.rank() == 0) add_expert_bias(tensors, plan_.model, model.expert_bias());  // equal on every rank
  return tensors;
}

std::set<std::string> ShardedTrainer::held_parameters() const {
  // As load_state reads: every unit this rank keeps a shard of, and the balancing biases (every
  // rank keeps all of them).
  std::set<std::string> names;
  for_each_held_slice(const_cast<ShardedModel&>(model_), [&](const HeldSlice& h) { names.insert(h.info->name); });
  if (const_cast<ShardedModel&>(model_).expert_bias().defined())
    for (const std::string& name : expert_bias_names(plan_.model)) names.insert(name);
  return names;
}

void ShardedTrainer::load_state(const SlicedState& state, int64_t step, int64_t optimizer_step, Diagnostics& d) {
  load_held_slices(state, d);
  read_expert_bias(state, plan_.model, model_.expert_bias(), /*required=*/true, d);
  step_ = step;
  optimizer_->set_step_count(optimizer_step);
}

void ShardedTrainer::load_held_slices(const SlicedState& state, Diagnostics& d) {
  torch::NoGradGuard no_grad;
  for_each_held_slice(model_, [&](const HeldSlice& h) {
    const std::pair<const char*, torch::Tensor> targets[] = {{"param/", model_.shards()[h.unit]},
                                                              {"exp_avg/", optimizer_->exp_avg()[h.unit]},
                                                              {"exp_avg_sq/", optimizer_->exp_avg_sq()[h.unit]}};
    for (const auto& [prefix, into] : targets) {
      const std::string key = prefix + h.info->name;
      const torch::Tensor values =
          held_values(state, key, h, model_.split_of(h.param), mesh_.coords().t, mesh_.tensor.size(), d);
      if (!values.defined()) continue;
      if (values.scalar_type() != into.scalar_type()) {
        d.error(key, std::string("is ") + c10::toString(values.scalar_type()) + ", this run keeps " +
                         c10::toString(into.scalar_type()));
        continue;
      }
      into.narrow(0, h.at, h.last - h.first).copy_(values);
    }
  });
}

void ShardedTrainer::load_hugging_face(const std::string& dir) {
  const std::set<std::string> held = held_parameters();
  const torch::ScalarType dtype = plan_.training.precision == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat;
  const SlicedState sliced = read_hf_parameters(dir, plan_.model, dtype, &held);
  Diagnostics d;
  load_held_slices(sliced, d);
  read_expert_bias(sliced, plan_.model, model_.expert_bias(), /*required=*/false, d);  // a folder may have none
  d.throw_if_any(dir);
  step_ = 0;
  optimizer_->set_step_count(0);
}

}  // namespace moeplan::executor
