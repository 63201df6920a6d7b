// The compute calibration measures: matrix multiplies, the executor's operations one rank alone
// and under tensor splits, the optimizer, and the executor's whole micro-batch.
#include <fstream>
#include <numeric>

#include "measure.h"
#include "moeplan/core/phases.h"
#include "moeplan/executor/model/routing.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/optimizer.h"
#include "moeplan/executor/training/parallel_trainer.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor::calibration {

namespace {

// The attention sub-block (norm, attention of spec's heads, residual) on `in`, forward and
// backward.
ForwardBackward time_attention(const Workload& x, const ModelSpec& spec, const LayerWeights& w,
                               const torch::Tensor& in) {
  return time_forward_backward(x.device, x.reps, [&] {
    return in + attention(spec, w, rms_norm(in, w.input_norm, x.m.rms_norm_eps), x.rope, x.mask);
  });
}

// The MoE sub-block without its experts on `in`: norm, router, routing, dispatch to rows grouped
// by expert and the weighted combine back, residual; forward and backward.
ForwardBackward time_router(const Workload& x, const torch::Tensor& in) {
  const ModelSpec& m = x.m;
  return time_forward_backward(x.device, x.reps, [&] {
    const torch::Tensor tokens = in.reshape({-1, x.h});
    const torch::Tensor xn = rms_norm(tokens, x.w.post_attention_norm, m.rms_norm_eps);
    const torch::Tensor logits = torch::matmul(xn, x.w.router.t());
    const Routing r = route(logits, m.experts_per_token, x.o.load_balancing);
    const torch::Tensor slots = r.experts.flatten();
    (void)torch::bincount(slots, {}, m.num_experts);
    const torch::Tensor order = std::get<1>(torch::sort(slots, c10::optional<bool>(true), 0));
    const torch::Tensor token_of = torch::div(order, m.experts_per_token, "floor");
    const torch::Tensor sorted = xn.index_select(0, token_of);
    const torch::Tensor slot_weights = r.weights.to(x.type).flatten().index_select(0, order).unsqueeze(-1);
    return tokens + torch::zeros_like(xn).index_add(0, token_of, sorted * slot_weights);
  });
}

// The head on `in` (embedding, final norm, lm head over embed's rows of the vocabulary, the loss
// with the router losses of every layer), forward and backward together.
double time_head(const Workload& x, const torch::Tensor& embed, const torch::Tensor& lm_head, const torch::Tensor& in) {
  const ModelSpec& m = x.m;
  ModelSpec spec = m;
  spec.vocab_size = embed.size(0);
  const int64_t b = in.size(0);
  const torch::Tensor ids = torch::randint(spec.vocab_size, {b, x.t}, torch::kLong).to(x.device);
  std::vector<torch::Tensor> router_logits;
  for (int64_t l = 0; l < m.num_layers; ++l)
    router_logits.push_back(torch::randn({b * x.t, m.num_experts}).to(x.device, x.type).requires_grad_(true));
  return time_median(x.device, x.reps, [&] {
    ForwardResult out;
    out.logits = torch::matmul(rms_norm(in + torch::embedding(embed, ids), x.norm, m.rms_norm_eps), lm_head.t())
                     .to(torch::kFloat);
    out.router_logits = router_logits;
    // On CPU ranks the loss of the sharded model that runs train; on a GPU the one-rank trainer's.
    (x.whole ? x.whole->loss(out, ids) : mixtral_loss(spec, x.moe, out, ids)).total.backward();
  });
}

// On a GPU: optimizer steps of the one-rank trainer over one micro-batch, as `moeplan run`
// makes them; the medians of its forward span and of its backward span (which includes adding
// the gradients to the fp32 accumulators in mixed precision) after a warm-up step.
ForwardBackward time_trainer_step(int reps, ModelTrainer& trainer, const torch::Tensor& ids) {
  auto spans = [&trainer] {
    ForwardBackward s;
    for (const TraceEvent& e : trainer.clock().events()) {
      if (e.name == phase::kForward) s.forward += 1e-9 * static_cast<double>(e.duration_ns);
      if (e.name == phase::kBackward) s.backward += 1e-9 * static_cast<double>(e.duration_ns);
    }
    return s;
  };
  trainer.step({ids});
  const ForwardBackward first = spans();
  reps = repeats_for(reps, first.forward + first.backward);
  std::vector<double> fwd, bwd;
  for (int i = 0; i < reps; ++i) {
    trainer.step({ids});
    const ForwardBackward s = spans();
    fwd.push_back(s.forward);
    bwd.push_back(s.backward);
  }
  return {median(fwd), median(bwd)};
}

// The whole micro-batch of `ids` on a split's mesh, `reps` times after a warm-up, every rank
// alike: its compute by the median (the time inside the tensor group's collectives left out),
// the whole by the mean, the collectives' tail included (what a step pays for many of them, as
// in measure_collectives). The collectives' share is read back as the slowest rank's whole less
// the slowest rank's compute: the rank that computes less waits longer inside, and the two
// ranks' longest of each would count that twice.
SplitMicroBatchFigures time_split_micro_batch(int reps, SplitModel& s, const torch::Tensor& ids) {
  std::vector<double> forward, backward, forward_whole, backward_whole;
  for (int i = 0; i <= reps; ++i) {
    s.inside_s = 0;
    auto start = Clock::now();
    const torch::Tensor loss = s.model->loss(s.model->forward(ids, 1), ids).total;
    const double fwd = seconds_since(start), fwd_inside = s.inside_s;
    s.inside_s = 0;
    start = Clock::now();
    loss.backward();
    const double bwd = seconds_since(start), bwd_inside = s.inside_s;
    if (i == 0) continue;  // warm-up
    forward.push_back(fwd - fwd_inside);
    backward.push_back(bwd - bwd_inside);
    forward_whole.push_back(fwd);
    backward_whole.push_back(bwd);
  }
  auto mean = [](const std::vector<double>& v) {
    return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  };
  SplitMicroBatchFigures figures;
  figures.compute = {median(forward), median(backward)};
  figures.whole = {mean(forward_whole), mean(backward_whole)};
  return figures;
}

}  // namespace

std::vector<double> measure_gemms(Workload& x, OverheadProbe& overhead) {
  std::vector<double> seconds;
  for (const Gemm& g : x.gemms) {
    const torch::Tensor a = torch::randn({g.rows, g.inner}).to(x.device, x.type);
    const torch::Tensor b = torch::randn({g.inner, g.cols}).to(x.device, x.type);
    seconds.push_back(time_median(x.device, x.reps, [&] { (void)torch::mm(a, b); }));
    overhead.sample();
  }
  return seconds;
}

std::vector<ForwardBackward> measure_experts(const Workload& x, const torch::Tensor& w1, const torch::Tensor& w2,
                                             const torch::Tensor& w3, OverheadProbe& overhead) {
  std::vector<ForwardBackward> experts;
  for (int64_t r : x.expert_rows) {
    const torch::Tensor rows = torch::randn({r, x.h}).to(x.device, x.type).requires_grad_(true);
    experts.push_back(time_forward_backward(x.device, x.reps, [&] { return expert_ffn(rows, w1, w2, w3); }));
    overhead.sample();
  }
  return experts;
}

// Attention, router and dispatch, head and loss per micro-batch size.
std::vector<OpFigures> measure_ops(Workload& x, OverheadProbe& overhead) {
  std::vector<OpFigures> ops;
  for (int64_t b : x.mbs) {
    const torch::Tensor in = torch::randn({b, x.t, x.h}).to(x.device, x.type).requires_grad_(true);
    OpFigures figures;
    figures.attention = time_attention(x, x.m, x.w, in);
    overhead.sample();
    figures.router = time_router(x, in);
    overhead.sample();
    figures.head = time_head(x, x.embed, x.lm_head, in);
    overhead.sample();
    ops.push_back(figures);
  }
  return ops;
}

// The operations one rank runs under a tensor split, as the executor splits them: attention
// with its part of the heads over the whole sequence, the head with its part of the vocabulary
// (the loss over that part), each expert with its part of the width. The collectives between
// them are measured with the others.
std::vector<SplitFigures> measure_splits(Workload& x, OverheadProbe& overhead) {
  const ModelSpec& m = x.m;
  const int64_t h = x.h, t = x.t;
  std::vector<SplitFigures> splits;
  for (int64_t split : x.splits) {
    ModelSpec local = m;
    local.num_attention_heads /= split;
    local.num_key_value_heads /= split;
    LayerWeights w = x.w;
    x.set_attention_weights(w, local);
    const int64_t vocab = m.vocab_size / split, width = m.intermediate_size / split;
    const torch::Tensor embed = x.weight({vocab, h}), lm_head = x.weight({vocab, h});
    SplitFigures figures;
    for (int64_t b : x.mbs) {
      const torch::Tensor in = torch::randn({b, t, h}).to(x.device, x.type).requires_grad_(true);
      SplitFigures::Ops ops;
      ops.attention = time_attention(x, local, w, in);
      overhead.sample();
      ops.head = time_head(x, embed, lm_head, in);
      overhead.sample();
      figures.ops.push_back(ops);
    }
    const torch::Tensor w1 = x.weight({width, h}), w2 = x.weight({h, width}), w3 = x.weight({width, h});
    figures.experts = measure_experts(x, w1, w2, w3, overhead);
    splits.push_back(std::move(figures));
  }
  return splits;
}

// Gradient clipping and AdamW on the shards of the model's flat units.
std::vector<double> measure_optimizer(Workload& x, OverheadProbe& overhead) {
  std::vector<double> seconds;
  for (int64_t d : x.divisors) {
    std::vector<torch::Tensor> shards, grads;
    std::vector<ElementRuns> runs;
    for (int64_t numel : x.units) {
      const int64_t k = (numel + d - 1) / d;
      // Drawn where they are used: a GPU draws a large model's shards in milliseconds.
      const auto where = torch::TensorOptions().device(x.device);
      shards.push_back(torch::randn({k}, where).to(x.master));
      grads.push_back((torch::randn({k}, where) * 1e-3).to(x.type));
      runs.push_back({{0, k}});
    }
    AdamW adam = AdamW::with_decay_runs(shards, runs, AdamWSettings{});
    seconds.push_back(time_median(x.device, x.reps, [&] {
      clip_grad_norm(grads, 1.0);
      adam.step(grads, 1e-4);
    }));
    overhead.sample();
  }
  return seconds;
}

// The executor's whole micro-batch: forward with the loss, then backward, through its own
// model; what the operations above leave out shows here.
std::vector<ForwardBackward> measure_micro_batches(Workload& x, bool recompute) {
  std::vector<ForwardBackward> micro_batches;
  if (recompute && !x.recomputed) return micro_batches;
  for (int64_t b : x.mbs) {
    const torch::Tensor ids = torch::randint(x.m.vocab_size, {b, x.t}, torch::kLong);
    if (x.trainer && !recompute) {
      micro_batches.push_back(time_trainer_step(x.reps, *x.trainer, ids));
      continue;
    }
    micro_batches.push_back(
        time_forward_backward(x.device, x.reps, [&] { return x.micro_batch_loss(ids, recompute); }));
  }
  return micro_batches;
}

int64_t measure_step_overhead(const CalibrateOptions& o, Communicator& world, const MeshMaker& mesh_of) {
  // The data-parallel layout of the calibration's ranks (on one rank, the rank alone), at the
  // middle of the micro-batch sizes measured, two micro-batches a step.
  Plan plan = alone_plan(o);
  const std::vector<int64_t> sizes = micro_batches(o.max_micro_batch);
  plan.parallel.world_size = world.size();
  plan.parallel.micro_batch_size = sizes[sizes.size() / 2];
  plan.parallel.gradient_accumulation_steps = 2;
  std::unique_ptr<DeviceMesh> mesh =
      world.size() > 1 ? mesh_of(plan.parallel) : std::make_unique<DeviceMesh>(plan.parallel);
  // The peak resident set from here on (Linux: writing 5 to clear_refs resets VmHWM) and the
  // peak of live tensors.
  std::ofstream("/proc/self/clear_refs") << "5";
  reset_peak_tensor_bytes();
  {
    torch::AutoGradMode with_grad(true);
    ShardedTrainer trainer(plan, *mesh, nullptr);
    for (int step = 0; step < 3; ++step) {
      std::vector<torch::Tensor> batch;
      for (int64_t m = 0; m < plan.parallel.gradient_accumulation_steps; ++m)
        batch.push_back(torch::randint(o.model.vocab_size, {plan.parallel.micro_batch_size, o.seq_len}, torch::kLong));
      (void)trainer.step(batch);
    }
  }
  return peak_rss_bytes() - tensor_bytes().peak;
}

// The executor's whole micro-batch under each tensor split, on its mesh with its collectives
// (the same tokens on every rank). Every rank makes the same calls. The meshes are formed at
// the first call.
std::vector<std::vector<SplitMicroBatchFigures>> measure_split_micro_batches(Workload& x) {
  if (x.split_models.empty() && x.mesh_of) x.form_split_models();
  std::vector<std::vector<SplitMicroBatchFigures>> per_split;
  for (const std::unique_ptr<SplitModel>& s : x.split_models) {
    std::vector<SplitMicroBatchFigures> figures;
    for (int64_t b : x.mbs) {
      torch::Tensor ids = torch::randint(x.m.vocab_size, {b, x.t}, torch::kLong);
      x.world.broadcast(ids, 0);
      x.world.barrier();
      figures.push_back(time_split_micro_batch(x.reps, *s, ids));
    }
    per_split.push_back(std::move(figures));
  }
  return per_split;
}

}  // namespace moeplan::executor::calibration
