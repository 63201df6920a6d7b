#include "moeplan/executor/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "moeplan/core/fit.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/offload.h"
#include "moeplan/executor/optimizer.h"
#include "moeplan/executor/routing.h"
#include "moeplan/executor/run_report.h"
#include "moeplan/executor/runtime.h"
#include "moeplan/executor/sharded_model.h"

namespace moeplan::executor {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Short operations are repeated more, so that each measurement spans about 0.1 s.
int repeats_for(int reps, double one_call_s) {
  const double wanted = 0.1 / std::max(one_call_s, 1e-6);
  return std::clamp(static_cast<int>(wanted), reps, 60);
}

// Times of the calls after one warm-up call; the median. Collectives pass `adapt` false: every
// rank must make the same number of calls.
template <class F>
double time_median(int reps, F&& f, bool adapt = true) {
  const auto warm = Clock::now();
  f();
  if (adapt) reps = repeats_for(reps, seconds_since(warm));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    f();
    t.push_back(seconds_since(start));
  }
  return median(t);
}

// The mean time of `calls` calls after one warm-up call, every rank making as many. For
// collectives: their times have a long tail here (a tenth of the calls take 3 to 6 ms where
// the median takes 0.2), and what a step pays for many of them is their mean.
template <class F>
double time_mean(int calls, F&& f) {
  f();
  const auto start = Clock::now();
  for (int i = 0; i < calls; ++i) f();
  return seconds_since(start) / calls;
}

// A forward and its backward, timed apart; medians over `reps` after a warm-up.
template <class Forward>
std::pair<double, double> time_forward_backward(int reps, Forward&& forward) {
  std::vector<double> fwd, bwd;
  for (int i = 0; i <= reps; ++i) {
    auto start = Clock::now();
    const torch::Tensor y = forward();
    const double f = seconds_since(start);
    start = Clock::now();
    y.backward(torch::ones_like(y));
    const double b = seconds_since(start);
    if (i == 0) {  // warm-up
      reps = repeats_for(reps, f + b);
      continue;
    }
    fwd.push_back(f);
    bwd.push_back(b);
  }
  return {median(fwd), median(bwd)};
}

torch::Tensor weight(std::vector<int64_t> shape, torch::ScalarType type, double scale = 0.02) {
  return (torch::randn(shape) * scale).to(type).requires_grad_(true);
}

// Progress lines on rank 0.
class Progress {
 public:
  Progress(std::ostream* out, bool leader) : out_(leader ? out : nullptr), start_(Clock::now()) {}
  void say(const std::string& what) {
    if (out_ == nullptr) return;
    char line[256];
    std::snprintf(line, sizeof line, "calibrate [%5.1f s] %s", seconds_since(start_), what.c_str());
    *out_ << line << std::endl;
  }

 private:
  std::ostream* out_;
  Clock::time_point start_;
};

// The largest resident set beyond live tensors seen at the sample points.
class OverheadProbe {
 public:
  void sample() {
    if (!stopped_) most_ = std::max(most_, current_rss_bytes() - tensor_bytes().live);
  }
  void stop() { stopped_ = true; }
  int64_t most() const { return most_; }

 private:
  int64_t most_ = 0;
  bool stopped_ = false;
};

std::vector<int64_t> micro_batches(int64_t max_micro_batch) {
  std::vector<int64_t> m;
  for (int64_t b = 1; b <= max_micro_batch; b *= 2) m.push_back(b);
  return m;
}

// Per column of [passes, values], the lower quartile of the passes (the smaller of two, the
// second smallest of five); with `higher_is_better`, the upper quartile.
torch::Tensor undisturbed_quartile(const torch::Tensor& per_pass, bool higher_is_better) {
  const torch::Tensor sorted = std::get<0>(per_pass.sort(0, higher_is_better));
  return sorted[(per_pass.size(0) - 1) / 4].contiguous();
}

}  // namespace

CollectiveFit fit_collective(const CollectiveSweep& sweep, int64_t ranks) {
  // The cost model (simulator/cost_model.cc) on one node of n ranks:
  //   all-gather, reduce-scatter: (n-1) latency + (n-1)/n bytes / bandwidth
  //   all-reduce: 2 (n-1) latency + 2 (n-1)/n bytes / bandwidth
  //   all-to-all: (n-1) latency + (n-1)/n bytes / bandwidth
  const double n = static_cast<double>(ranks);
  double steps = n - 1, share = (n - 1) / n;
  if (sweep.name == "all_reduce") {
    steps *= 2;
    share *= 2;
  }
  std::vector<double> x;
  for (double b : sweep.bytes) x.push_back(share * b);
  // Relative residuals, and sizes far off the line left out (a transport may handle some
  // sizes much worse than its neighbours; the model's own sizes are measured apart).
  const LineFit f = fit_line_relative(x, sweep.seconds);
  CollectiveFit c;
  if (f.slope > 0) {
    c.latency_s = std::max(0.0, f.intercept) / std::max(1.0, steps);
    c.bandwidth_bytes_per_s = 1.0 / f.slope;
    return c;
  }
  // Times that do not rise with the size (a short sweep whose middle sizes the transport
  // handles worse than its largest): the smallest message's time as the latency, the largest
  // message's rate as the bandwidth.
  if (x.empty()) return c;
  const size_t small = static_cast<size_t>(std::min_element(x.begin(), x.end()) - x.begin());
  const size_t large = static_cast<size_t>(std::max_element(x.begin(), x.end()) - x.begin());
  c.latency_s = sweep.seconds[small] / std::max(1.0, steps);
  c.bandwidth_bytes_per_s = sweep.seconds[large] > 0 ? x[large] / sweep.seconds[large] : 0.0;
  return c;
}

Calibration calibrate(const CalibrateOptions& o, Communicator& world) {
  const auto started = Clock::now();
  const bool leader = world.rank() == 0;
  Progress progress(o.progress, leader);
  torch::manual_seed(1234 + static_cast<uint64_t>(world.rank()));
  torch::NoGradGuard outer_no_grad;  // enabled again where a backward is timed
  const ModelSpec& m = o.model;
  const torch::ScalarType type = compute_type(o.precision);
  const int64_t h = m.hidden_size, t = o.seq_len;
  const int reps = o.quick ? 3 : 7;
  const int passes = o.passes > 0 ? o.passes : (o.quick ? 1 : 5);
  OverheadProbe overhead;
  Calibration cal;
  cal.ranks = world.size();
  cal.passes = passes;
  cal.baseline_rss_bytes = current_rss_bytes();

  // -- What is measured: the shapes and sizes, the same on every rank.
  const std::vector<int64_t> mbs = micro_batches(o.max_micro_batch);
  std::vector<int64_t> expert_rows;
  for (int64_t r = 16; r <= m.experts_per_token * t * o.max_micro_batch; r *= o.quick ? 4 : 2) expert_rows.push_back(r);
  struct Gemm {
    int64_t rows, inner, cols;
  };
  std::vector<Gemm> gemms;
  for (int64_t b : mbs) {
    gemms.push_back({b * t, h, m.num_attention_heads * m.head_dim});  // q projection
    gemms.push_back({b * t, h, m.vocab_size});                        // lm head
  }
  for (int64_t r : expert_rows) {
    gemms.push_back({r, h, m.intermediate_size});  // w1, w3
    gemms.push_back({r, m.intermediate_size, h});  // w2
  }
  // The optimizer's shards of the model's flat units: the whole model, then halves, quarters,
  // ... as sharding leaves them.
  const ParamCounts params = count_parameters(m);
  std::vector<int64_t> units{params.embedding, params.final_norm + params.lm_head};
  for (int64_t l = 0; l < m.num_layers; ++l) {
    units.push_back(params.dense_per_layer());
    units.push_back(m.num_experts * params.expert);
  }
  const std::vector<int64_t> divisors = o.quick ? std::vector<int64_t>{2, 1} : std::vector<int64_t>{8, 4, 2, 1};
  std::vector<int64_t> shard_sizes;
  for (int64_t d : divisors) {
    int64_t total = 0;
    for (int64_t numel : units) total += (numel + d - 1) / d;
    shard_sizes.push_back(total);
  }
  const torch::ScalarType master = o.precision == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat;
  // Collectives: a sweep of sizes, and the model's flat units as the executor moves them:
  // gathered and reduce-scattered over a shard group of every rank (padded to a multiple of
  // it), all-reduced whole over a replica group of every rank.
  const std::vector<std::string> kinds{"all_gather", "all_to_all", "all_reduce", "reduce_scatter"};
  std::vector<int64_t> sizes;
  for (int64_t b = int64_t{16} << 10; b <= (o.quick ? int64_t{4} << 20 : int64_t{16} << 20); b *= 2) {
    sizes.push_back(b);
    if (b >= (int64_t{1} << 20) && !o.quick) sizes.push_back(b * 3 / 2);
  }
  const int64_t n = world.size();
  const int64_t a = o.precision == Precision::kFp32 ? 4 : 2;
  auto padded = [&](int64_t numel, int64_t s) { return (numel + s - 1) / s * s * a; };
  std::map<std::string, std::vector<int64_t>> unit_sizes;
  for (const int64_t numel : {params.dense_per_layer(), m.num_experts * params.expert, params.embedding,
                              params.final_norm + params.lm_head}) {
    for (const char* kind : {"all_gather", "reduce_scatter"}) unit_sizes[kind].push_back(padded(numel, n));
    unit_sizes["all_reduce"].push_back(padded(numel, 1));
  }
  for (auto& [kind, list] : unit_sizes) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
  }

  // The weights and inputs of the executor's operations.
  const Rope rope = rope_tables(m, t, type);
  const torch::Tensor mask = attention_mask_bias(m, t, type);
  LayerWeights w;
  w.input_norm = torch::ones({h}).to(type).requires_grad_(true);
  w.post_attention_norm = torch::ones({h}).to(type).requires_grad_(true);
  w.q_proj = weight({m.num_attention_heads * m.head_dim, h}, type);
  w.k_proj = weight({m.num_key_value_heads * m.head_dim, h}, type);
  w.v_proj = weight({m.num_key_value_heads * m.head_dim, h}, type);
  w.o_proj = weight({h, m.num_attention_heads * m.head_dim}, type);
  w.router = weight({m.num_experts, h}, type);
  const torch::Tensor w1 = weight({m.intermediate_size, h}, type), w2 = weight({h, m.intermediate_size}, type),
                      w3 = weight({m.intermediate_size, h}, type);
  const torch::Tensor embed = weight({m.vocab_size, h}, type), norm = torch::ones({h}).to(type).requires_grad_(true),
                      lm_head = weight({m.vocab_size, h}, type);
  MoeConfig moe;
  moe.load_balancing = o.load_balancing;
  // The executor's own model, one rank alone on it (E = S = 1).
  Plan whole_plan;
  whole_plan.model = m;
  whole_plan.training.seq_len = t;
  whole_plan.training.precision = o.precision;
  whole_plan.moe = moe;
  DeviceMesh alone(whole_plan.parallel);
  ShardedModel whole(whole_plan, alone);
  // Collectives after compute: each kind as the executor uses it, small (a one-element
  // all-reduce, the tokens-per-expert all-gather before a dispatch, a dispatch of one
  // sequence), after stretches from a router's forward to a whole micro-batch's forward and
  // backward; as many lockstep calls on every rank.
  torch::Tensor token = torch::zeros({1});
  const torch::Tensor expert_counts = torch::zeros({1, m.num_experts}, torch::kLong);
  const int64_t dispatch_rows = m.experts_per_token * t / n * n;
  const torch::Tensor dispatch = torch::randn({dispatch_rows, h}).to(a == 4 ? torch::kFloat : torch::kBFloat16);
  const std::vector<int64_t> dispatch_split(static_cast<size_t>(n), dispatch_rows / n);
  const std::vector<std::pair<std::string, std::function<void()>>> after_collectives{
      {"all_reduce", [&] { world.all_reduce_sum(token); }},
      {"all_gather", [&] { (void)world.all_gather(expert_counts); }},
      {"all_to_all", [&] { (void)world.all_to_all(dispatch, dispatch_split, dispatch_split); }}};
  struct Stretch {
    std::function<void()> work;
    int calls;
  };
  const torch::Tensor stretch_x = torch::randn({1, t, h}).to(type);
  const torch::Tensor stretch_ids = torch::randint(m.vocab_size, {1, t}, torch::kLong);
  const int few = o.quick ? 2 : 1;  // quick: half the calls
  const std::vector<Stretch> stretches{
      {[&] { (void)torch::matmul(stretch_x, w.router.t()).softmax(-1).topk(m.experts_per_token); }, 80 / few},
      {[&] { (void)attention(m, w, rms_norm(stretch_x, w.input_norm, m.rms_norm_eps), rope, mask); }, 40 / few},
      {[&] { (void)mixtral_loss(m, moe, whole.forward(stretch_ids, 1), stretch_ids).total; }, 24 / few},
      {[&] { mixtral_loss(m, moe, whole.forward(stretch_ids, 1), stretch_ids).total.backward(); }, 16 / few}};
  const std::string dir = o.scratch_dir.empty() ? std::filesystem::temp_directory_path().string() : o.scratch_dir;
  ActivationStore store(dir + "/.calibrate-offload-rank-" + std::to_string(world.rank()));

  // Every figure is measured once per pass, in the same order on every rank. A shared machine
  // has spells in which a core runs far slower (another tenant on it); the passes spread the
  // measurements over time and each figure keeps its lower quartile over them (below).
  std::vector<std::vector<double>> pass_values;
  for (int pass = 1; pass <= passes; ++pass) {
    const std::string of = passes > 1 ? " (pass " + std::to_string(pass) + " of " + std::to_string(passes) + ")" : "";
    std::vector<double> values;

    // -- Matrix multiplies at the model's shapes.
    progress.say("matrix multiplies at the shapes of " + m.name + of);
    world.barrier();
    for (const Gemm& g : gemms) {
      const torch::Tensor a = torch::randn({g.rows, g.inner}).to(type), b = torch::randn({g.inner, g.cols}).to(type);
      values.push_back(time_median(reps, [&] { (void)torch::mm(a, b); }));
      overhead.sample();
    }

    // -- The executor's operations, forward and backward.
    progress.say("attention, router and experts, head and loss, forward and backward" + of);
    torch::autograd::GradMode::set_enabled(true);
    world.barrier();
    for (int64_t b : mbs) {
      const torch::Tensor x = torch::randn({b, t, h}).to(type).requires_grad_(true);
      // Attention sub-block: norm, attention, residual.
      auto [af, ab] = time_forward_backward(reps, [&] {
        return x + attention(m, w, rms_norm(x, w.input_norm, m.rms_norm_eps), rope, mask);
      });
      overhead.sample();
      // MoE sub-block without its experts: norm, router, routing, dispatch to rows grouped by
      // expert and the weighted combine back, residual.
      auto [rf, rb] = time_forward_backward(reps, [&] {
        const torch::Tensor tokens = x.reshape({-1, h});
        const torch::Tensor xn = rms_norm(tokens, w.post_attention_norm, m.rms_norm_eps);
        const torch::Tensor logits = torch::matmul(xn, w.router.t());
        const Routing r = route(logits, m.experts_per_token, o.load_balancing);
        const torch::Tensor slots = r.experts.flatten();
        (void)torch::bincount(slots, {}, m.num_experts);
        const torch::Tensor order = std::get<1>(torch::sort(slots, c10::optional<bool>(true), 0));
        const torch::Tensor token_of = torch::div(order, m.experts_per_token, "floor");
        const torch::Tensor sorted = xn.index_select(0, token_of);
        const torch::Tensor slot_weights = r.weights.to(type).flatten().index_select(0, order).unsqueeze(-1);
        return tokens + torch::zeros_like(xn).index_add(0, token_of, sorted * slot_weights);
      });
      overhead.sample();
      // Head: embedding, final norm, lm head, loss (with the router losses of every layer).
      const torch::Tensor ids = torch::randint(m.vocab_size, {b, t}, torch::kLong);
      std::vector<torch::Tensor> router_logits;
      for (int64_t l = 0; l < m.num_layers; ++l)
        router_logits.push_back(torch::randn({b * t, m.num_experts}).to(type).requires_grad_(true));
      const double head = time_median(reps, [&] {
        ForwardResult out;
        const torch::Tensor e = torch::embedding(embed, ids);
        out.logits = torch::matmul(rms_norm(x + e, norm, m.rms_norm_eps), lm_head.t()).to(torch::kFloat);
        out.router_logits = router_logits;
        mixtral_loss(m, moe, out, ids).total.backward();
      });
      overhead.sample();
      values.insert(values.end(), {af, ab, rf, rb, head});
    }
    for (int64_t r : expert_rows) {
      const torch::Tensor rows = torch::randn({r, h}).to(type).requires_grad_(true);
      auto [ef, eb] = time_forward_backward(reps, [&] { return expert_ffn(rows, w1, w2, w3); });
      values.insert(values.end(), {ef, eb});
      overhead.sample();
    }
    // -- Optimizer: gradient clipping and AdamW on the shards of the model's flat units.
    progress.say("optimizer" + of);
    torch::autograd::GradMode::set_enabled(false);
    world.barrier();
    for (int64_t d : divisors) {
      std::vector<torch::Tensor> shards, grads, masks;
      for (int64_t numel : units) {
        const int64_t k = (numel + d - 1) / d;
        shards.push_back(torch::randn({k}).to(master));
        grads.push_back((torch::randn({k}) * 1e-3).to(type));
        masks.push_back(torch::ones({k}, torch::kBool));
      }
      AdamW adam = AdamW::with_decay_masks(shards, masks, AdamWSettings{});
      values.push_back(time_median(reps, [&] {
        clip_grad_norm(grads, 1.0);
        adam.step(grads, 1e-4);
      }));
      overhead.sample();
    }

    // -- Memory copy and the offload file.
    progress.say("memory copy and offload file" + of);
    {
      const int64_t n = int64_t{16} << 20;  // 64 MiB of fp32
      const torch::Tensor a = torch::randn({n}), b = torch::empty({n});
      const double copy = time_median(reps, [&] { b.copy_(a); });
      values.push_back(2.0 * static_cast<double>(n) * 4 / copy);  // read and written
      overhead.sample();
      const int64_t block = o.max_micro_batch * t * h;  // one block input of the largest micro-batch
      const torch::Tensor act = torch::randn({block}).to(type);
      const int64_t blocks = m.num_layers;
      double write = 0, read = 0;
      for (int i = 0; i <= reps; ++i) {
        auto start = Clock::now();
        for (int64_t k = 0; k < blocks; ++k) store.put(k, act);
        const double w_s = seconds_since(start);
        start = Clock::now();
        for (int64_t k = blocks - 1; k >= 0; --k) (void)store.take(k);
        const double r_s = seconds_since(start);
        store.clear();
        if (i == 0) continue;
        write += w_s;
        read += r_s;
      }
      const double bytes = static_cast<double>(blocks * act.nbytes()) * reps;
      values.push_back(bytes / write);
      values.push_back(bytes / read);
    }

    // -- Collectives.
    if (n > 1) {
      for (const std::string& kind : kinds) {
        std::vector<int64_t> all = sizes;
        all.insert(all.end(), unit_sizes[kind].begin(), unit_sizes[kind].end());
        progress.say("gloo " + kind + ", " + std::to_string(all.size()) + " sizes" + of);
        for (int64_t bytes : all) {
          const int64_t elems = bytes / a / n * n;  // a multiple of the ranks
          const torch::Tensor full = torch::randn({elems}).to(a == 4 ? torch::kFloat : torch::kBFloat16);
          const torch::Tensor shard = torch::randn({elems / n}).to(full.scalar_type());
          const std::vector<int64_t> rows(static_cast<size_t>(n), elems / n);
          // Many calls: the mean has to see the tail.
          const int r = bytes <= (1 << 20) ? 60 / (o.quick ? 2 : 1) : 15 / (o.quick ? 2 : 1);
          world.barrier();
          double s = 0;
          if (kind == "all_gather") s = time_mean(r, [&] { (void)world.all_gather(shard); });
          if (kind == "all_to_all")
            s = time_mean(r, [&] { (void)world.all_to_all(full.view({elems, 1}), rows, rows); });
          if (kind == "all_reduce") {
            torch::Tensor buffer = full.clone();
            s = time_mean(r, [&] { world.all_reduce_sum(buffer); });
          }
          if (kind == "reduce_scatter") s = time_mean(r, [&] { (void)world.reduce_scatter_sum(full); });
          values.push_back(s);
        }
      }
    }
    overhead.sample();

    // -- The executor's whole micro-batch: forward with the loss, then backward, through its
    // own model; what the operations above leave out shows here.
    progress.say("whole micro-batches of the executor's model" + of);
    torch::AutoGradMode with_grad(true);
    world.barrier();
    for (int64_t b : mbs) {
      const torch::Tensor ids = torch::randint(m.vocab_size, {b, t}, torch::kLong);
      auto [mf, mb] =
          time_forward_backward(reps, [&] { return mixtral_loss(m, moe, whole.forward(ids, 1), ids).total; });
      values.insert(values.end(), {mf, mb});
    }
    // The heap keeps what the whole model's backward freed; the overhead is what a rank holds
    // beyond its tensors before that.
    overhead.stop();

    // -- Collectives after compute: each kind back to back, then after stretches of compute of
    // a few lengths in lockstep. What the pair takes beyond the stretch alone and the
    // collective alone is what a collective costs in a step for following compute: a longer
    // tail (its threads have to be woken), and the wait for the rank that fell behind.
    if (n > 1) {
      progress.say("collectives after compute" + of);
      for (const auto& [kind, collective] : after_collectives) {
        world.barrier();
        const double alone = time_mean(60 / few, collective);
        for (const Stretch& stretch : stretches) {
          // Each call's stretch and collective timed apart on every rank, then gathered. A
          // step pays, beyond the stretch's own time and the collective back to back, how far
          // the slowest rank's stretch runs past it (the median over the calls) and how far
          // the collective on the rank that came last (it waited for nobody) runs past its
          // back-to-back time (the mean: the tail counts).
          std::vector<double> times(static_cast<size_t>(2 * stretch.calls + 1));
          world.barrier();
          for (int i = 0; i <= stretch.calls; ++i) {
            auto start = Clock::now();
            stretch.work();
            const double work_s = seconds_since(start);
            start = Clock::now();
            collective();
            if (i == 0) continue;  // warm-up
            times[static_cast<size_t>(i - 1)] = work_s;
            times[static_cast<size_t>(stretch.calls + i - 1)] = seconds_since(start);
          }
          times.back() = alone;
          const torch::Tensor all = world.all_gather(torch::tensor(times, torch::kDouble).unsqueeze(0));
          const int64_t calls = stretch.calls;
          const torch::Tensor work = all.narrow(1, 0, calls), after = all.narrow(1, calls, calls);
          const double own = std::get<0>(work.median(1)).max().item<double>();
          const double behind = std::get<0>(work.max(0)).median().item<double>() - own;
          const double longer = std::get<0>(after.min(0)).mean().item<double>() - all.select(1, 2 * calls).max().item<double>();
          values.insert(values.end(), {own, behind + longer});
        }
      }
    }
    pass_values.push_back(std::move(values));
  }
  for (std::vector<double>& values : pass_values) {
    values.push_back(static_cast<double>(overhead.most()));
    values.push_back(static_cast<double>(cal.baseline_rss_bytes));
  }

  // -- Over the ranks: in each pass the slowest rank's time (it sets the pace of a step) and
  // the lowest bandwidth. Over the passes: the lower quartile of the times (the upper of the
  // bandwidths), the machine as it runs when no other tenant slows it: a shared machine only
  // ever adds to a time, and the validation keeps each configuration's least disturbed run
  // just as well. The quartile, not the fastest pass, so that no single lucky measurement
  // decides. The overheads: the largest anywhere.
  const int64_t count = static_cast<int64_t>(pass_values.front().size());
  torch::Tensor mine = torch::empty({1, passes, count}, torch::kDouble);
  for (int p = 0; p < passes; ++p)
    mine[0][p].copy_(torch::tensor(pass_values[static_cast<size_t>(p)], torch::kDouble));
  const torch::Tensor all = world.all_gather(mine).to(torch::kDouble);  // [ranks, passes, values]
  const torch::Tensor slowest_rank = std::get<0>(all.max(0));           // [passes, values]
  const torch::Tensor fastest_rank = std::get<0>(all.min(0));
  const torch::Tensor largest = std::get<0>(slowest_rank.max(0)).contiguous();
  const torch::Tensor slowest = undisturbed_quartile(slowest_rank, false);
  const torch::Tensor least = undisturbed_quartile(fastest_rank, true);
  // How much slower each pass ran than the figures kept: the median over the compute times.
  const int64_t compute = static_cast<int64_t>(gemms.size() + 5 * mbs.size() + 2 * expert_rows.size());
  for (int p = 0; p < passes; ++p)
    cal.pass_slowdown.push_back(
        (slowest_rank[p].narrow(0, 0, compute) / slowest.narrow(0, 0, compute)).median().item<double>());
  const auto* v = slowest.data_ptr<double>();
  const auto* low = least.data_ptr<double>();
  size_t at = 0;
  for (const Gemm& g : gemms) {
    const double flops = 2.0 * static_cast<double>(g.rows * g.inner * g.cols);
    cal.gemm.emplace_back(flops, flops / v[at++]);
  }
  OpTimes& times = cal.op_times;
  times.hidden_size = h;
  times.intermediate_size = m.intermediate_size;
  times.num_attention_heads = m.num_attention_heads;
  times.num_key_value_heads = m.num_key_value_heads;
  times.head_dim = m.head_dim;
  times.num_experts = m.num_experts;
  times.experts_per_token = m.experts_per_token;
  times.vocab_size = m.vocab_size;
  times.seq_len = t;
  times.precision = std::string(name_of(kPrecisionNames, o.precision));
  for (int64_t b : mbs) {
    const double tokens = static_cast<double>(b * t);
    times.attention_forward.emplace_back(tokens, v[at++]);
    times.attention_backward.emplace_back(tokens, v[at++]);
    times.router_forward.emplace_back(tokens, v[at++]);
    times.router_backward.emplace_back(tokens, v[at++]);
    times.head.emplace_back(tokens, v[at++]);
  }
  for (int64_t r : expert_rows) {
    times.expert_forward.emplace_back(static_cast<double>(r), v[at++]);
    times.expert_backward.emplace_back(static_cast<double>(r), v[at++]);
  }
  for (int64_t s : shard_sizes) times.optimizer.emplace_back(static_cast<double>(s), v[at++]);
  cal.copy_bandwidth_bytes_per_s = low[at++];
  cal.offload_write_bytes_per_s = low[at++];
  cal.offload_read_bytes_per_s = low[at++];
  if (n > 1) {
    for (const std::string& kind : kinds) {
      CollectiveSweep sweep;
      sweep.name = kind;
      for (int64_t bytes : sizes) {
        sweep.bytes.push_back(static_cast<double>(bytes / a / n * n * a));
        sweep.seconds.push_back(v[at++]);
      }
      for (int64_t bytes : unit_sizes[kind]) {
        sweep.unit_bytes.push_back(static_cast<double>(bytes / a / n * n * a));
        sweep.unit_seconds.push_back(v[at++]);
      }
      sweep.r_squared = fit_line_relative(sweep.bytes, sweep.seconds).r_squared;
      cal.collectives.push_back(std::move(sweep));
    }
  }
  for (int64_t b : mbs) {
    const double tokens = static_cast<double>(b * t);
    times.micro_batch_forward.emplace_back(tokens, v[at++]);
    times.micro_batch_backward.emplace_back(tokens, v[at++]);
  }
  if (n > 1) {
    // Per pass: what a collective took after a stretch beyond the two alone; over the passes
    // the lower quartile, like every time here, at the stretch's own time (its lower quartile).
    const auto kinds_n = static_cast<int64_t>(after_collectives.size()), stretches_n = static_cast<int64_t>(stretches.size());
    const torch::Tensor pairs =
        slowest_rank.narrow(1, static_cast<int64_t>(at), 2 * kinds_n * stretches_n).reshape({passes, kinds_n, stretches_n, 2});
    const torch::Tensor own = pairs.select(3, 0), extra = pairs.select(3, 1);  // [passes, kinds, stretches]
    const torch::Tensor kept = undisturbed_quartile(extra.reshape({passes, -1}), false).reshape({kinds_n, stretches_n});
    const torch::Tensor own_kept = undisturbed_quartile(own.reshape({passes, -1}), false).reshape({kinds_n, stretches_n});
    for (int64_t k = 0; k < kinds_n; ++k) {
      const std::string& kind = after_collectives[static_cast<size_t>(k)].first;
      CurvePoints& curve = kind == "all_reduce"   ? cal.after_compute.all_reduce
                           : kind == "all_gather" ? cal.after_compute.all_gather
                                                  : cal.after_compute.all_to_all;
      for (int64_t i = 0; i < stretches_n; ++i) {
        const double x = own_kept[k][i].item<double>();
        if (curve.empty() || x > curve.back().first) curve.emplace_back(x, std::max(0.0, kept[k][i].item<double>()));
      }
    }
    for (int p = 0; p < passes; ++p) {
      const torch::Tensor row = extra[p].reshape({-1}).contiguous();
      cal.after_compute_per_pass.emplace_back(row.data_ptr<double>(), row.data_ptr<double>() + row.numel());
    }
    at += static_cast<size_t>(2 * kinds_n * stretches_n);
  }
  cal.overhead_bytes = static_cast<int64_t>(largest.data_ptr<double>()[at++]);
  cal.baseline_rss_bytes = static_cast<int64_t>(largest.data_ptr<double>()[at++]);
  // How far apart the ranks were: the slowest over the fastest, the median over the compute
  // times of every pass.
  cal.rank_spread = (slowest_rank.narrow(1, 0, compute) / fastest_rank.narrow(1, 0, compute)).median().item<double>();

  // Peak: the fastest multiply seen; the efficiency curve: each size's rate against it, one
  // point per distinct size (the median where sizes repeat).
  for (const auto& [flops, rate] : cal.gemm) cal.peak_flops = std::max(cal.peak_flops, rate);
  std::map<double, std::vector<double>> by_size;
  for (const auto& [flops, rate] : cal.gemm) by_size[flops].push_back(rate / cal.peak_flops);
  for (const auto& [flops, eff] : by_size)
    if (cal.efficiency.size() < 64) cal.efficiency.push_back({flops, std::clamp(median(eff), 1e-6, 1.0)});
  cal.seconds = seconds_since(started);
  progress.say("done");
  return cal;
}

Json to_json(const Calibration& c) {
  Json j;
  j["ranks"] = c.ranks;
  j["passes"] = c.passes;
  j["pass_slowdown"] = c.pass_slowdown;
  j["seconds"] = c.seconds;
  j["rank_spread"] = c.rank_spread;
  Json gemm = Json::array();
  for (const auto& [flops, rate] : c.gemm) gemm.push_back({{"flops", flops}, {"flops_per_s", rate}});
  j["matrix_multiplies"] = gemm;
  Json sweeps = Json::array();
  for (const CollectiveSweep& s : c.collectives) {
    const CollectiveFit f = fit_collective(s, c.ranks);
    sweeps.push_back({{"name", s.name},
                      {"bytes", s.bytes},
                      {"seconds", s.seconds},
                      {"latency_s", f.latency_s},
                      {"bandwidth_bytes_per_s", f.bandwidth_bytes_per_s},
                      {"r_squared", s.r_squared},
                      {"unit_bytes", s.unit_bytes},
                      {"unit_seconds", s.unit_seconds}});
  }
  j["collectives"] = sweeps;
  j["copy_bandwidth_bytes_per_s"] = c.copy_bandwidth_bytes_per_s;
  j["offload_write_bytes_per_s"] = c.offload_write_bytes_per_s;
  j["offload_read_bytes_per_s"] = c.offload_read_bytes_per_s;
  Json after;
  for (std::string_view kind : kAfterComputeKinds) {
    Json points = Json::array();
    for (const auto& [seconds, extra] : *c.after_compute.of(kind)) points.push_back({seconds, extra});
    after[std::string(kind)] = points;
  }
  j["collective_after_compute"] = after;
  j["collective_after_compute_per_pass"] = c.after_compute_per_pass;
  j["overhead_bytes"] = c.overhead_bytes;
  j["baseline_rss_bytes"] = c.baseline_rss_bytes;
  return j;
}

ClusterSpec calibrated_cluster(const ClusterSpec& base, const Calibration& c, const CalibrateOptions& o,
                               const std::string& name, const std::string& how) {
  ClusterSpec p = base;
  p.name = name;
  char text[512];
  auto say = [&](const std::string& field, const std::string& what) { p.sources[field] = what + "; " + how; };
  std::snprintf(text, sizeof text,
                "This machine as a cluster of %lld CPU ranks (one process each, gloo over loopback), calibrated "
                "by moeplan calibrate in %.0f s",
                static_cast<long long>(c.ranks), c.seconds);
  p.description = text;
  p.sources.erase("description");
  p.gpus_per_node = c.ranks;
  say("gpus_per_node", "the ranks calibrated together");
  const bool fp32 = o.precision == Precision::kFp32;
  (fp32 ? p.peak_fp32_flops : p.peak_bf16_flops) = c.peak_flops;
  if (fp32) p.peak_bf16_flops = std::max(p.peak_bf16_flops, p.peak_fp32_flops);
  std::snprintf(text, sizeof text, "measured: the fastest of %zu matrix multiplies at %s's shapes, %lld ranks busy",
                c.gemm.size(), o.model.name.c_str(), static_cast<long long>(c.ranks));
  say(fp32 ? "gpu.peak_fp32_flops" : "gpu.peak_bf16_flops", text);
  p.matmul_efficiency = c.efficiency;
  say("gpu.matmul_efficiency.points", "measured: each multiply's rate over the fastest");
  p.hbm_bandwidth_bytes_per_s = c.copy_bandwidth_bytes_per_s;
  say("gpu.memory_bandwidth_bytes_per_s", "measured: bytes read and written by a 64 MiB tensor copy");
  p.pcie_bandwidth_bytes_per_s =
      2.0 / (1.0 / c.offload_write_bytes_per_s + 1.0 / c.offload_read_bytes_per_s);
  std::snprintf(text, sizeof text,
                "measured: the activation offload file, written at %.2f GB/s and read at %.2f GB/s (the mean time "
                "per byte of the two)",
                c.offload_write_bytes_per_s / 1e9, c.offload_read_bytes_per_s / 1e9);
  say("host.pcie_bandwidth_bytes_per_s", text);
  for (const CollectiveSweep& s : c.collectives) {
    CollectiveFit f = fit_collective(s, c.ranks);
    for (size_t i = 0; i < s.unit_bytes.size(); ++i) f.points.emplace_back(s.unit_bytes[i], s.unit_seconds[i]);
    if (s.name == "all_gather") p.all_gather_fit = f;
    if (s.name == "all_to_all") p.all_to_all_fit = f;
    if (s.name == "all_reduce") p.all_reduce_fit = f;
    if (s.name == "reduce_scatter") p.reduce_scatter_fit = f;
    if (s.name == "all_gather" && f.given()) {
      p.intra_node_latency_s = f.latency_s;
      p.intra_node_bandwidth_bytes_per_s = f.bandwidth_bytes_per_s;
      say("intra_node.latency_s", "measured: the all-gather fit below");
      say("intra_node.bandwidth_bytes_per_s", "measured: the all-gather fit below");
    }
  }
  if (!c.collectives.empty()) {
    std::string fits = "measured: gloo collectives from " + std::to_string(static_cast<int64_t>(c.collectives[0].bytes.front())) +
                       " to " + std::to_string(static_cast<int64_t>(c.collectives[0].bytes.back())) +
                       " bytes (each the mean time of many calls, its tail included), latency + bytes / bandwidth "
                       "fitted by least squares, and measured at the sizes of " +
                       o.model.name + "'s flat units (points) (R^2:";
    for (const CollectiveSweep& s : c.collectives) {
      std::snprintf(text, sizeof text, " %s %.3f", s.name.c_str(), s.r_squared);
      fits += text;
    }
    say("intra_node.collectives", fits + ")");
  }
  // One process per core: gloo's threads and the compute share the cores.
  p.comm_overlaps_compute = false;
  say("framework.comm_overlaps_compute",
      "moeplan policy for CPU ranks: a collective's threads take the cores the ranks compute on (measured on 2 "
      "vCPUs: an all-gather of 3 MiB took 30-45 ms prefetched beside compute against 14 ms alone, and the step "
      "time did not change without prefetching, docs/validation.md)");
  p.after_compute = c.after_compute;
  if (!c.after_compute.empty())
    say("framework.collective_after_compute",
        "measured: a one-element all-reduce, a tokens-per-expert all-gather and a one-sequence dispatch all-to-all, "
        "each after stretches of compute (a router forward, an attention forward, a micro-batch forward, forward "
        "and backward) on every rank in lockstep: how far the slowest rank's stretch ran past its median (median "
        "over the calls) plus how far the collective on the rank that came last ran past its back-to-back mean "
        "(mean over the calls); the lower quartile of " + std::to_string(c.passes) + " passes");
  p.framework_overhead_bytes = c.overhead_bytes;
  std::snprintf(text, sizeof text,
                "measured: the largest resident set beyond live tensors while the executor's operations ran "
                "(%.0f MiB before any tensor work)",
                static_cast<double>(c.baseline_rss_bytes) / (1 << 20));
  say("framework.overhead_bytes", text);
  p.op_times = c.op_times;
  say("framework.op_times",
      "measured: medians of the executor's operations at these shapes, every rank busy at once, routing by " +
          std::string(name_of(kLoadBalancingNames, o.load_balancing)) + ", a median within each of " +
          std::to_string(c.passes) + " passes, the lower quartile of the passes kept");
  return p;
}

}  // namespace moeplan::executor
