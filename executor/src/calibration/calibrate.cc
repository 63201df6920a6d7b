#include "moeplan/executor/calibration/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/phases.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/offload.h"
#include "moeplan/executor/model/routing.h"
#include "moeplan/executor/model/sharded_model.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/optimizer.h"
#include "moeplan/executor/training/run_measurement.h"
#include "moeplan/executor/training/trainer.h"

namespace moeplan::executor {

namespace {

using Clock = std::chrono::steady_clock;

// The device calibrate() measures on, set once at its start: where the helpers below put their
// tensors, and what every timer waits for before it reads the clock (a GPU runs its work
// after the call that queued it has returned).
torch::Device measured_device = torch::kCPU;

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
  wait_for(measured_device);
  const auto warm = Clock::now();
  f();
  wait_for(measured_device);
  if (adapt) reps = repeats_for(reps, seconds_since(warm));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    f();
    wait_for(measured_device);
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
  wait_for(measured_device);
  const auto start = Clock::now();
  for (int i = 0; i < calls; ++i) f();
  wait_for(measured_device);
  return seconds_since(start) / calls;
}

// The median of a tensor's values, as core's median() takes it (the mean of the two middle
// values of an even count; torch's median takes the lower one).
double median_of(const torch::Tensor& t) {
  const torch::Tensor flat = t.to(torch::kDouble).contiguous().flatten();
  return median(std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()));
}

// A forward and its backward, timed apart; medians over `reps` after a warm-up.
template <class Forward>
std::pair<double, double> time_forward_backward(int reps, Forward&& forward) {
  std::vector<double> fwd, bwd;
  for (int i = 0; i <= reps; ++i) {
    wait_for(measured_device);
    auto start = Clock::now();
    const torch::Tensor y = forward();
    wait_for(measured_device);
    const double f = seconds_since(start);
    start = Clock::now();
    y.backward(torch::ones_like(y));
    wait_for(measured_device);
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
  return (torch::randn(shape) * scale).to(measured_device, type).requires_grad_(true);
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
  // What the process holds beyond tensors: the resident set less the live tensors and the
  // mappings kept for reuse (reserved by the tensor allocator, as CUDA's caching allocator
  // reserves: they count as tensor memory, never above the live peak).
  // On a GPU: the device memory in use (as the driver counts it, every process on the device)
  // beyond what the caching allocator reserved (the CUDA context, the libraries' handles and kernels).
  void sample() {
    if (stopped_) return;
    if (measured_device.is_cuda()) {
      const DeviceMemory d = device_memory(measured_device);
      most_ = std::max(most_, d.used - d.reserved);
      return;
    }
    const TensorBytes t = tensor_bytes();
    most_ = std::max(most_, current_rss_bytes() - t.live - (t.mapped - t.mapped_live));
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

namespace {

struct Gemm {
  int64_t rows, inner, cols;
};

// Compute of some length followed by a collective, as many calls in lockstep on every rank.
struct Stretch {
  std::function<void()> work;
  int calls;
};

// The executor's model on a mesh of one tensor split of the ranks (R = n / T replicas, sequence
// parallel), and the time its tensor group has spent inside collectives (its observer adds).
struct SplitModel {
  Plan plan;
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<ShardedModel> model;
  double inside_s = 0;
};

// What calibration measures, the same on every rank: the model's GEMM shapes, expert rows and
// optimizer shards, the collectives' sizes, and the weights and inputs of the executor's
// operations. Built once, used by every pass.
struct Workload {
  Workload(const CalibrateOptions& options, Communicator& communicator, const MeshMaker& mesh_of);
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  const CalibrateOptions& o;
  Communicator& world;
  const ModelSpec& m;
  const torch::ScalarType type, master;
  const int64_t h, t, n, a;  // hidden size, sequence, ranks, bytes per element moved
  const int reps, few;       // repeats per figure; few: 2 with quick (half the calls), else 1
  std::vector<int64_t> mbs, expert_rows, units, divisors, shard_sizes, sizes;
  std::vector<int64_t> splits;  // tensor-parallel degrees the operations are measured split over
  std::vector<Gemm> gemms;
  const std::vector<std::string> kinds{"all_gather", "all_to_all", "all_reduce", "reduce_scatter"};
  std::map<std::string, std::vector<int64_t>> unit_sizes;  // per kind: the model's flat units
  MoeConfig moe;
  // The executor's operations and its own model, one rank alone on it (E = S = 1).
  Rope rope;
  torch::Tensor mask;
  LayerWeights w;
  torch::Tensor w1, w2, w3, embed, norm, lm_head;
  Plan whole_plan;
  DeviceMesh alone;
  // The executor's own model of one rank: on the CPU the sharded model (E = S = 1) that every
  // CPU layout runs; on a GPU the one-rank trainer, whose steps are timed whole.
  std::unique_ptr<ShardedModel> whole;
  std::unique_ptr<ModelTrainer> trainer;
  // Forward with the loss of the sharded model on token ids (CPU).
  torch::Tensor micro_batch_loss(const torch::Tensor& ids);
  // Collectives after compute: each kind as the executor uses it, small (a one-element
  // all-reduce, the tokens-per-expert all-gather before a dispatch, a dispatch of one
  // sequence), after stretches from a router's forward to a whole micro-batch's forward and
  // backward.
  torch::Tensor token, expert_counts, dispatch, stretch_x, stretch_ids;
  std::vector<int64_t> dispatch_split;
  std::vector<std::pair<std::string, std::function<void()>>> after_collectives;
  std::vector<Stretch> stretches;
  ActivationStore store;
  // Per tensor split that divides the ranks (when meshes can be formed): the whole model on
  // it, formed by form_split_models (every rank alike).
  MeshMaker mesh_of;
  std::vector<std::unique_ptr<SplitModel>> split_models;
  void form_split_models();
};

Plan alone_plan(const CalibrateOptions& o) {
  Plan p;
  p.model = o.model;
  p.training.seq_len = o.seq_len;
  p.training.precision = o.precision;
  p.moe.load_balancing = o.load_balancing;
  return p;
}

Workload::Workload(const CalibrateOptions& options, Communicator& communicator, const MeshMaker& meshes)
    : o(options), world(communicator), m(options.model), type(compute_type(options.precision)),
      master(options.precision == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat), h(m.hidden_size),
      t(options.seq_len), n(communicator.size()), a(options.precision == Precision::kFp32 ? 4 : 2),
      reps(options.quick ? 3 : 7), few(options.quick ? 2 : 1), mbs(micro_batches(options.max_micro_batch)),
      rope(rope_tables(m, t, type, measured_device)), mask(attention_mask_bias(m, t, type, measured_device)),
      whole_plan(alone_plan(options)), alone(whole_plan.parallel),
      store((o.scratch_dir.empty() ? std::filesystem::temp_directory_path().string() : o.scratch_dir) +
            "/.calibrate-offload-rank-" + std::to_string(communicator.rank())),
      mesh_of(meshes) {
  for (int64_t r = 16; r <= m.experts_per_token * t * o.max_micro_batch; r *= o.quick ? 4 : 2) expert_rows.push_back(r);
  // Every power-of-two split of this node's ranks the executor can run (the shapes its rule
  // executor_tensor_splits and the heads' split ask to divide).
  for (int64_t split = 2; split <= n; split *= 2)
    if (m.num_attention_heads % split == 0 && m.num_key_value_heads % split == 0 && m.intermediate_size % split == 0 &&
        m.vocab_size % split == 0 && t % split == 0)
      splits.push_back(split);
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
  units = {params.embedding, params.final_norm + params.lm_head};
  for (int64_t l = 0; l < m.num_layers; ++l) {
    units.push_back(params.dense_per_layer());
    units.push_back(m.num_experts * params.expert);
  }
  divisors = o.quick ? std::vector<int64_t>{2, 1} : std::vector<int64_t>{8, 4, 2, 1};
  for (int64_t d : divisors) {
    int64_t total = 0;
    for (int64_t numel : units) total += (numel + d - 1) / d;
    shard_sizes.push_back(total);
  }
  // Collectives: a sweep of sizes, and the model's flat units as the executor moves them:
  // gathered and reduce-scattered over a shard group of every rank (padded to a multiple of
  // it), all-reduced whole over a replica group of every rank.
  for (int64_t b = int64_t{16} << 10; b <= (o.quick ? int64_t{4} << 20 : int64_t{16} << 20); b *= 2) {
    sizes.push_back(b);
    if (b >= (int64_t{1} << 20) && !o.quick) sizes.push_back(b * 3 / 2);
  }
  auto padded = [&](int64_t numel, int64_t s) { return (numel + s - 1) / s * s * a; };
  for (const int64_t numel : {params.dense_per_layer(), m.num_experts * params.expert, params.embedding,
                              params.final_norm + params.lm_head}) {
    for (const char* kind : {"all_gather", "reduce_scatter"}) unit_sizes[kind].push_back(padded(numel, n));
    unit_sizes["all_reduce"].push_back(padded(numel, 1));
  }
  for (auto& [kind, list] : unit_sizes) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
  }
  moe.load_balancing = o.load_balancing;
  if (measured_device.is_cpu()) {
    whole = std::make_unique<ShardedModel>(whole_plan, alone);
  } else {
    trainer = std::make_unique<ModelTrainer>(whole_plan, measured_device);
  }
  w.input_norm = torch::ones({h}).to(measured_device, type).requires_grad_(true);
  w.post_attention_norm = torch::ones({h}).to(measured_device, type).requires_grad_(true);
  w.q_proj = weight({m.num_attention_heads * m.head_dim, h}, type);
  w.k_proj = weight({m.num_key_value_heads * m.head_dim, h}, type);
  w.v_proj = weight({m.num_key_value_heads * m.head_dim, h}, type);
  w.o_proj = weight({h, m.num_attention_heads * m.head_dim}, type);
  w.router = weight({m.num_experts, h}, type);
  w1 = weight({m.intermediate_size, h}, type);
  w2 = weight({h, m.intermediate_size}, type);
  w3 = weight({m.intermediate_size, h}, type);
  embed = weight({m.vocab_size, h}, type);
  norm = torch::ones({h}).to(measured_device, type).requires_grad_(true);
  lm_head = weight({m.vocab_size, h}, type);
  token = torch::zeros({1});
  expert_counts = torch::zeros({1, m.num_experts}, torch::kLong);
  const int64_t dispatch_rows = m.experts_per_token * t / n * n;
  dispatch = torch::randn({dispatch_rows, h}).to(a == 4 ? torch::kFloat : torch::kBFloat16);
  dispatch_split.assign(static_cast<size_t>(n), dispatch_rows / n);
  after_collectives = {{"all_reduce", [this] { world.all_reduce_sum(token); }},
                       {"all_gather", [this] { (void)world.all_gather(expert_counts); }},
                       {"all_to_all", [this] { (void)world.all_to_all(dispatch, dispatch_split, dispatch_split); }}};
  stretch_x = torch::randn({1, t, h}).to(type);
  stretch_ids = torch::randint(m.vocab_size, {1, t}, torch::kLong);
  stretches = {
      {[this] { (void)torch::matmul(stretch_x, w.router.t()).softmax(-1).topk(m.experts_per_token); }, 80 / few},
      {[this] { (void)attention(m, w, rms_norm(stretch_x, w.input_norm, m.rms_norm_eps), rope, mask); }, 40 / few},
      {[this] { (void)micro_batch_loss(stretch_ids); }, 24 / few},
      {[this] { micro_batch_loss(stretch_ids).backward(); }, 16 / few}};
}

torch::Tensor Workload::micro_batch_loss(const torch::Tensor& ids) {
  if (!whole) throw std::logic_error("calibration: the sharded model is measured on CPU ranks only");
  return mixtral_loss(m, moe, whole->forward(ids, 1), ids).total;
}

void Workload::form_split_models() {
  for (int64_t split : splits) {
    if (n % split != 0) continue;
    auto s = std::make_unique<SplitModel>();
    s->plan = alone_plan(o);
    s->plan.parallel.world_size = n;
    s->plan.parallel.tensor_parallel_degree = split;
    s->plan.parallel.sequence_parallel = true;
    s->mesh = mesh_of(s->plan.parallel);
    s->model = std::make_unique<ShardedModel>(s->plan, *s->mesh);
    s->mesh->tensor.set_observer(
        [inside = &s->inside_s](const char*, int64_t, Clock::time_point start, Clock::time_point end) {
          *inside += std::chrono::duration<double>(end - start).count();
        });
    split_models.push_back(std::move(s));
  }
}

// One pass's figures, in the same order on every rank, each measurement's under its name so
// that the figures kept are read back by name.
class Figures {
 public:
  void begin(std::string name) { starts_.emplace_back(std::move(name), values_.size()); }
  void add(double v) { values_.push_back(v); }
  const std::vector<double>& values() const { return values_; }
  // Where the measurement `name` starts (the same in every pass).
  size_t start(const std::string& name) const {
    for (const auto& [n, at] : starts_)
      if (n == name) return at;
    throw std::logic_error("calibration has no figures named " + name);
  }

 private:
  std::vector<double> values_;
  std::vector<std::pair<std::string, size_t>> starts_;
};

// -- The measurements of one pass, each adding its figures under its name.

void measure_gemms(Workload& x, Figures& f, OverheadProbe& overhead) {
  f.begin("gemm");
  for (const Gemm& g : x.gemms) {
    const torch::Tensor a = torch::randn({g.rows, g.inner}).to(measured_device, x.type);
    const torch::Tensor b = torch::randn({g.inner, g.cols}).to(measured_device, x.type);
    f.add(time_median(x.reps, [&] { (void)torch::mm(a, b); }));
    overhead.sample();
  }
}

// The attention sub-block (norm, attention of spec's heads, residual) on `in`, forward and
// backward.
std::pair<double, double> time_attention(const Workload& x, const ModelSpec& spec, const LayerWeights& w,
                                         const torch::Tensor& in) {
  return time_forward_backward(
      x.reps, [&] { return in + attention(spec, w, rms_norm(in, w.input_norm, x.m.rms_norm_eps), x.rope, x.mask); });
}

// The head on `in` (embedding, final norm, lm head over embed's rows of the vocabulary, the loss
// with the router losses of every layer), forward and backward together.
double time_head(const Workload& x, const torch::Tensor& embed, const torch::Tensor& lm_head, const torch::Tensor& in) {
  const ModelSpec& m = x.m;
  ModelSpec spec = m;
  spec.vocab_size = embed.size(0);
  const int64_t b = in.size(0);
  const torch::Tensor ids = torch::randint(spec.vocab_size, {b, x.t}, torch::kLong).to(measured_device);
  std::vector<torch::Tensor> router_logits;
  for (int64_t l = 0; l < m.num_layers; ++l)
    router_logits.push_back(torch::randn({b * x.t, m.num_experts}).to(measured_device, x.type).requires_grad_(true));
  return time_median(x.reps, [&] {
    ForwardResult out;
    out.logits = torch::matmul(rms_norm(in + torch::embedding(embed, ids), x.norm, m.rms_norm_eps), lm_head.t())
                     .to(torch::kFloat);
    out.router_logits = router_logits;
    mixtral_loss(spec, x.moe, out, ids).total.backward();
  });
}

// One expert's SwiGLU (w1, w3: [width, h], w2: [h, width]) per row count, forward and backward.
void time_experts(const Workload& x, const torch::Tensor& w1, const torch::Tensor& w2, const torch::Tensor& w3,
                  Figures& f, OverheadProbe& overhead) {
  for (int64_t r : x.expert_rows) {
    const torch::Tensor rows = torch::randn({r, x.h}).to(measured_device, x.type).requires_grad_(true);
    auto [ef, eb] = time_forward_backward(x.reps, [&] { return expert_ffn(rows, w1, w2, w3); });
    f.add(ef);
    f.add(eb);
    overhead.sample();
  }
}

// Attention, router and dispatch, head and loss per micro-batch size; one expert per row count.
void measure_ops(Workload& x, Figures& f, OverheadProbe& overhead) {
  const ModelSpec& m = x.m;
  const int64_t h = x.h, t = x.t;
  f.begin("ops");
  for (int64_t b : x.mbs) {
    const torch::Tensor in = torch::randn({b, t, h}).to(measured_device, x.type).requires_grad_(true);
    auto [af, ab] = time_attention(x, m, x.w, in);
    overhead.sample();
    // MoE sub-block without its experts: norm, router, routing, dispatch to rows grouped by
    // expert and the weighted combine back, residual.
    auto [rf, rb] = time_forward_backward(x.reps, [&] {
      const torch::Tensor tokens = in.reshape({-1, h});
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
    overhead.sample();
    const double head = time_head(x, x.embed, x.lm_head, in);
    overhead.sample();
    for (double v : {af, ab, rf, rb, head}) f.add(v);
  }
  f.begin("experts");
  time_experts(x, x.w1, x.w2, x.w3, f, overhead);
}

// The operations one rank runs under a tensor split, as the executor splits them: attention
// with its part of the heads over the whole sequence, the head with its part of the vocabulary
// (the loss over that part), each expert with its part of the width. The collectives between
// them are measured with the others.
void measure_splits(Workload& x, Figures& f, OverheadProbe& overhead) {
  const ModelSpec& m = x.m;
  const int64_t h = x.h, t = x.t;
  f.begin("splits");
  for (int64_t split : x.splits) {
    ModelSpec local = m;
    local.num_attention_heads /= split;
    local.num_key_value_heads /= split;
    LayerWeights w = x.w;
    w.q_proj = weight({local.num_attention_heads * m.head_dim, h}, x.type);
    w.k_proj = weight({local.num_key_value_heads * m.head_dim, h}, x.type);
    w.v_proj = weight({local.num_key_value_heads * m.head_dim, h}, x.type);
    w.o_proj = weight({h, local.num_attention_heads * m.head_dim}, x.type);
    const int64_t vocab = m.vocab_size / split, width = m.intermediate_size / split;
    const torch::Tensor embed = weight({vocab, h}, x.type), lm_head = weight({vocab, h}, x.type);
    for (int64_t b : x.mbs) {
      const torch::Tensor in = torch::randn({b, t, h}).to(measured_device, x.type).requires_grad_(true);
      auto [af, ab] = time_attention(x, local, w, in);
      overhead.sample();
      const double head = time_head(x, embed, lm_head, in);
      overhead.sample();
      for (double v : {af, ab, head}) f.add(v);
    }
    const torch::Tensor w1 = weight({width, h}, x.type), w2 = weight({h, width}, x.type), w3 = weight({width, h}, x.type);
    time_experts(x, w1, w2, w3, f, overhead);
  }
}

// Gradient clipping and AdamW on the shards of the model's flat units.
void measure_optimizer(Workload& x, Figures& f, OverheadProbe& overhead) {
  f.begin("optimizer");
  for (int64_t d : x.divisors) {
    std::vector<torch::Tensor> shards, grads, masks;
    for (int64_t numel : x.units) {
      const int64_t k = (numel + d - 1) / d;
      // Drawn where they are used: a GPU draws a large model's shards in milliseconds.
      const auto where = torch::TensorOptions().device(measured_device);
      shards.push_back(torch::randn({k}, where).to(x.master));
      grads.push_back((torch::randn({k}, where) * 1e-3).to(x.type));
      masks.push_back(torch::ones({k}, torch::dtype(torch::kBool).device(measured_device)));
    }
    AdamW adam = AdamW::with_decay_masks(shards, masks, AdamWSettings{});
    f.add(time_median(x.reps, [&] {
      clip_grad_norm(grads, 1.0);
      adam.step(grads, 1e-4);
    }));
    overhead.sample();
  }
}

// Memory copy bandwidth, and the offload file's write and read bandwidth for the blocks of the
// largest micro-batch.
void measure_copies(Workload& x, Figures& f, OverheadProbe& overhead) {
  f.begin("copies");
  if (measured_device.is_cuda()) {
    // On a GPU: a device-to-device copy (bytes read and written), and copies between pinned
    // host memory and the device each way (the activation offload's path).
    const int64_t n = int64_t{64} << 20;  // 256 MiB of fp32
    const torch::Tensor a = torch::randn({n}).to(measured_device), b = torch::empty_like(a);
    const double copy = time_median(x.reps, [&] { b.copy_(a); });
    f.add(2.0 * static_cast<double>(n) * 4 / copy);
    const torch::Tensor host = torch::empty({n}).pin_memory();
    const double down = time_median(x.reps, [&] { host.copy_(a, /*non_blocking=*/true); });
    const double up = time_median(x.reps, [&] { b.copy_(host, /*non_blocking=*/true); });
    f.add(static_cast<double>(n) * 4 / down);
    f.add(static_cast<double>(n) * 4 / up);
    overhead.sample();
    return;
  }
  const int64_t n = int64_t{16} << 20;  // 64 MiB of fp32
  const torch::Tensor a = torch::randn({n}), b = torch::empty({n});
  const double copy = time_median(x.reps, [&] { b.copy_(a); });
  f.add(2.0 * static_cast<double>(n) * 4 / copy);  // read and written
  overhead.sample();
  const torch::Tensor act = torch::randn({x.o.max_micro_batch * x.t * x.h}).to(x.type);  // one block input
  const int64_t blocks = x.m.num_layers;
  double write = 0, read = 0;
  for (int i = 0; i <= x.reps; ++i) {
    auto start = Clock::now();
    for (int64_t k = 0; k < blocks; ++k) x.store.put(k, act);
    const double w_s = seconds_since(start);
    start = Clock::now();
    for (int64_t k = blocks - 1; k >= 0; --k) (void)x.store.take(k);
    const double r_s = seconds_since(start);
    x.store.clear();
    if (i == 0) continue;
    write += w_s;
    read += r_s;
  }
  const double bytes = static_cast<double>(blocks * act.nbytes()) * x.reps;
  f.add(bytes / write);
  f.add(bytes / read);
}

// Each kind of gloo collective over the sweep of sizes and the model's units.
void measure_collectives(Workload& x, Figures& f, Progress& progress, const std::string& of) {
  f.begin("collectives");
  const int64_t n = x.n;
  for (const std::string& kind : x.kinds) {
    std::vector<int64_t> all = x.sizes;
    all.insert(all.end(), x.unit_sizes[kind].begin(), x.unit_sizes[kind].end());
    progress.say("gloo " + kind + ", " + std::to_string(all.size()) + " sizes" + of);
    for (int64_t bytes : all) {
      const int64_t elems = bytes / x.a / n * n;  // a multiple of the ranks
      const torch::Tensor full = torch::randn({elems}).to(x.a == 4 ? torch::kFloat : torch::kBFloat16);
      const torch::Tensor shard = torch::randn({elems / n}).to(full.scalar_type());
      const std::vector<int64_t> rows(static_cast<size_t>(n), elems / n);
      // Many calls: the mean has to see the tail.
      const int r = bytes <= (1 << 20) ? 60 / x.few : 15 / x.few;
      x.world.barrier();
      double s = 0;
      if (kind == "all_gather") s = time_mean(r, [&] { (void)x.world.all_gather(shard); });
      if (kind == "all_to_all") s = time_mean(r, [&] { (void)x.world.all_to_all(full.view({elems, 1}), rows, rows); });
      if (kind == "all_reduce") {
        torch::Tensor buffer = full.clone();
        s = time_mean(r, [&] { x.world.all_reduce_sum(buffer); });
      }
      if (kind == "reduce_scatter") s = time_mean(r, [&] { (void)x.world.reduce_scatter_sum(full); });
      f.add(s);
    }
  }
}

// On a GPU: optimizer steps of the one-rank trainer over one micro-batch, as `moeplan run`
// makes them; the medians of its forward span and of its backward span (which includes adding
// the gradients to the fp32 accumulators in mixed precision) after a warm-up step.
std::pair<double, double> time_trainer_step(int reps, ModelTrainer& trainer, const torch::Tensor& ids) {
  auto spans = [&trainer] {
    double forward = 0, backward = 0;
    for (const TraceEvent& e : trainer.clock().events()) {
      if (e.name == phase::kForward) forward += 1e-9 * static_cast<double>(e.duration_ns);
      if (e.name == phase::kBackward) backward += 1e-9 * static_cast<double>(e.duration_ns);
    }
    return std::pair{forward, backward};
  };
  trainer.step({ids});
  const auto [f0, b0] = spans();
  reps = repeats_for(reps, f0 + b0);
  std::vector<double> fwd, bwd;
  for (int i = 0; i < reps; ++i) {
    trainer.step({ids});
    const auto [f, b] = spans();
    fwd.push_back(f);
    bwd.push_back(b);
  }
  return {median(fwd), median(bwd)};
}

// The executor's whole micro-batch: forward with the loss, then backward, through its own
// model; what the operations above leave out shows here.
void measure_micro_batches(Workload& x, Figures& f) {
  f.begin("micro_batches");
  for (int64_t b : x.mbs) {
    const torch::Tensor ids = torch::randint(x.m.vocab_size, {b, x.t}, torch::kLong);
    if (x.trainer) {
      auto [mf, mb] = time_trainer_step(x.reps, *x.trainer, ids);
      f.add(mf);
      f.add(mb);
      continue;
    }
    auto [mf, mb] = time_forward_backward(x.reps, [&] { return x.micro_batch_loss(ids); });
    f.add(mf);
    f.add(mb);
  }
}

// The executor's whole micro-batch under each tensor split, on its mesh with its collectives
// (the same tokens on every rank): forward with the loss and backward, each as its compute
// (without the time inside the tensor group's collectives) and its whole time. Every rank
// makes the same calls. The meshes are formed at the first call, after the framework overhead
// was sampled: a run holds one mesh, not one per split.
void measure_split_micro_batches(Workload& x, Figures& f) {
  f.begin("split_micro_batches");
  if (x.split_models.empty() && x.mesh_of) x.form_split_models();
  for (const std::unique_ptr<SplitModel>& s : x.split_models) {
    for (int64_t b : x.mbs) {
      torch::Tensor ids = torch::randint(x.m.vocab_size, {b, x.t}, torch::kLong);
      x.world.broadcast(ids, 0);
      std::vector<double> forward, backward, forward_whole, backward_whole;
      x.world.barrier();
      for (int i = 0; i <= x.reps; ++i) {
        s->inside_s = 0;
        auto start = Clock::now();
        const torch::Tensor loss = s->model->loss(s->model->forward(ids, 1), ids).total;
        const double fwd = seconds_since(start), fwd_inside = s->inside_s;
        s->inside_s = 0;
        start = Clock::now();
        loss.backward();
        const double bwd = seconds_since(start), bwd_inside = s->inside_s;
        if (i == 0) continue;  // warm-up
        forward.push_back(fwd - fwd_inside);
        backward.push_back(bwd - bwd_inside);
        forward_whole.push_back(fwd);
        backward_whole.push_back(bwd);
      }
      // Compute by its median; the whole by its mean, the collectives' tail included (what a
      // step pays for many of them, as in measure_collectives). The collectives' share is read
      // back as the slowest rank's whole less the slowest rank's compute: the rank that computes
      // less waits longer inside, and the two ranks' longest of each would count that twice.
      f.add(median(forward));
      f.add(median(backward));
      for (const std::vector<double>* v : {&forward_whole, &backward_whole})
        f.add(std::accumulate(v->begin(), v->end(), 0.0) / static_cast<double>(v->size()));
    }
  }
}

// Each kind of collective back to back, then after stretches of compute of a few lengths in
// lockstep. What the pair takes beyond the stretch alone and the collective alone is what a
// collective costs in a step for following compute: a longer tail (its threads have to be
// woken), and the wait for the rank that fell behind. Per kind and stretch: the stretch's own
// time and that extra.
void measure_after_compute(Workload& x, Figures& f) {
  f.begin("after_compute");
  for (const auto& [kind, collective] : x.after_collectives) {
    x.world.barrier();
    const double alone = time_mean(60 / x.few, collective);
    for (const Stretch& stretch : x.stretches) {
      // Each call's stretch and collective timed apart on every rank, then gathered. A step
      // pays, beyond the stretch's own time and the collective back to back, how far the
      // slowest rank's stretch runs past it (the median over the calls) and how far the
      // collective on the rank that came last (it waited for nobody) runs past its
      // back-to-back time (the mean: the tail counts).
      std::vector<double> times(static_cast<size_t>(2 * stretch.calls + 1));
      x.world.barrier();
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
      const torch::Tensor all = x.world.all_gather(torch::tensor(times, torch::kDouble).unsqueeze(0));
      const int64_t calls = stretch.calls;
      const torch::Tensor work = all.narrow(1, 0, calls), after = all.narrow(1, calls, calls);
      double own = 0;
      for (int64_t rank = 0; rank < work.size(0); ++rank) own = std::max(own, median_of(work[rank]));
      const double behind = median_of(std::get<0>(work.max(0))) - own;
      const double longer =
          std::get<0>(after.min(0)).mean().item<double>() - all.select(1, 2 * calls).max().item<double>();
      f.add(own);
      f.add(behind + longer);
    }
  }
}

// One pass: every figure once, in the same order on every rank.
Figures measure_pass(Workload& x, Progress& progress, OverheadProbe& overhead, const std::string& of) {
  Figures f;
  progress.say("matrix multiplies at the shapes of " + x.m.name + of);
  x.world.barrier();
  measure_gemms(x, f, overhead);
  progress.say("attention, router and experts, head and loss, forward and backward" + of);
  torch::autograd::GradMode::set_enabled(true);
  x.world.barrier();
  measure_ops(x, f, overhead);
  if (!x.splits.empty()) progress.say("attention, experts and head under tensor splits" + of);
  measure_splits(x, f, overhead);
  progress.say("optimizer" + of);
  torch::autograd::GradMode::set_enabled(false);
  x.world.barrier();
  measure_optimizer(x, f, overhead);
  progress.say("memory copy and offload file" + of);
  measure_copies(x, f, overhead);
  if (x.n > 1) measure_collectives(x, f, progress, of);
  overhead.sample();
  progress.say("whole micro-batches of the executor's model" + of);
  {
    torch::AutoGradMode with_grad(true);
    x.world.barrier();
    measure_micro_batches(x, f);
    if (!x.split_models.empty()) progress.say("whole micro-batches under tensor splits" + of);
    measure_split_micro_batches(x, f);
    // The heap keeps what the whole model's backward freed; the overhead is what a rank holds
    // beyond its tensors before that.
    overhead.stop();
    if (x.n > 1) {
      progress.say("collectives after compute" + of);
      measure_after_compute(x, f);
    }
  }
  return f;
}

// The figures kept, over the ranks and passes (see calibrate), read back by name.
struct Kept {
  const Figures& layout;     // names and starts (of any pass)
  torch::Tensor slowest_rank;  // [passes, values]: per pass, the slowest rank's
  const double* times;       // the lower quartile over passes of the slowest rank's times
  const double* bandwidths;  // the upper quartile over passes of the lowest bandwidths
  const double* largest;     // the largest anywhere
  const double* at(const double* v, const std::string& name) const { return v + layout.start(name); }
};

void read_op_times(const Workload& x, const Kept& k, Calibration& cal) {
  const double* g = k.at(k.times, "gemm");
  for (const Gemm& gemm : x.gemms) {
    const double flops = 2.0 * static_cast<double>(gemm.rows * gemm.inner * gemm.cols);
    cal.gemm.emplace_back(flops, flops / *g++);
  }
  OpTimes& times = cal.op_times;
  times.hidden_size = x.h;
  times.intermediate_size = x.m.intermediate_size;
  times.num_attention_heads = x.m.num_attention_heads;
  times.num_key_value_heads = x.m.num_key_value_heads;
  times.head_dim = x.m.head_dim;
  times.num_experts = x.m.num_experts;
  times.experts_per_token = x.m.experts_per_token;
  times.vocab_size = x.m.vocab_size;
  times.seq_len = x.t;
  times.num_layers = x.m.num_layers;
  times.precision = std::string(name_of(kPrecisionNames, x.o.precision));
  const double* v = k.at(k.times, "ops");
  for (int64_t b : x.mbs) {
    const double tokens = static_cast<double>(b * x.t);
    times.attention_forward.emplace_back(tokens, *v++);
    times.attention_backward.emplace_back(tokens, *v++);
    times.router_forward.emplace_back(tokens, *v++);
    times.router_backward.emplace_back(tokens, *v++);
    times.head.emplace_back(tokens, *v++);
  }
  v = k.at(k.times, "experts");
  for (int64_t r : x.expert_rows) {
    times.expert_forward.emplace_back(static_cast<double>(r), *v++);
    times.expert_backward.emplace_back(static_cast<double>(r), *v++);
  }
  v = k.at(k.times, "splits");
  for (int64_t tp : x.splits) {
    TensorSplitTimes split;
    split.tensor_parallel_degree = tp;
    for (int64_t b : x.mbs) {
      const double tokens = static_cast<double>(b * x.t);
      split.attention_forward.emplace_back(tokens, *v++);
      split.attention_backward.emplace_back(tokens, *v++);
      split.head.emplace_back(tokens, *v++);
    }
    for (int64_t r : x.expert_rows) {
      split.expert_forward.emplace_back(static_cast<double>(r), *v++);
      split.expert_backward.emplace_back(static_cast<double>(r), *v++);
    }
    times.tensor_splits.push_back(std::move(split));
  }
  v = k.at(k.times, "split_micro_batches");
  for (const std::unique_ptr<SplitModel>& s : x.split_models) {
    TensorSplitTimes& split = *std::find_if(times.tensor_splits.begin(), times.tensor_splits.end(), [&](const auto& t) {
      return t.tensor_parallel_degree == s->plan.parallel.tensor_parallel_degree;
    });
    for (int64_t b : x.mbs) {
      const double tokens = static_cast<double>(b * x.t);
      const double forward = v[0], backward = v[1], forward_whole = v[2], backward_whole = v[3];
      v += 4;
      split.micro_batch_forward.emplace_back(tokens, forward);
      split.micro_batch_backward.emplace_back(tokens, backward);
      split.collectives_forward.emplace_back(tokens, std::max(0.0, forward_whole - forward));
      split.collectives_backward.emplace_back(tokens, std::max(0.0, backward_whole - backward));
    }
  }
  v = k.at(k.times, "optimizer");
  for (int64_t s : x.shard_sizes) times.optimizer.emplace_back(static_cast<double>(s), *v++);
  v = k.at(k.times, "micro_batches");
  for (int64_t b : x.mbs) {
    const double tokens = static_cast<double>(b * x.t);
    times.micro_batch_forward.emplace_back(tokens, *v++);
    times.micro_batch_backward.emplace_back(tokens, *v++);
  }
  const double* c = k.at(k.bandwidths, "copies");
  cal.copy_bandwidth_bytes_per_s = c[0];
  cal.offload_write_bytes_per_s = c[1];
  cal.offload_read_bytes_per_s = c[2];
}

void read_collectives(Workload& x, const Kept& k, Calibration& cal) {
  const double* v = k.at(k.times, "collectives");
  const int64_t n = x.n, a = x.a;
  for (const std::string& kind : x.kinds) {
    CollectiveSweep sweep;
    sweep.name = kind;
    for (int64_t bytes : x.sizes) {
      sweep.bytes.push_back(static_cast<double>(bytes / a / n * n * a));
      sweep.seconds.push_back(*v++);
    }
    for (int64_t bytes : x.unit_sizes[kind]) {
      sweep.unit_bytes.push_back(static_cast<double>(bytes / a / n * n * a));
      sweep.unit_seconds.push_back(*v++);
    }
    sweep.r_squared = fit_line_relative(sweep.bytes, sweep.seconds).r_squared;
    cal.collectives.push_back(std::move(sweep));
  }
}

// Per pass: what a collective took after a stretch beyond the two alone; over the passes the
// lower quartile, like every time here, at the stretch's own time (its lower quartile).
void read_after_compute(const Workload& x, const Kept& k, int passes, Calibration& cal) {
  const auto kinds_n = static_cast<int64_t>(x.after_collectives.size());
  const auto stretches_n = static_cast<int64_t>(x.stretches.size());
  const torch::Tensor pairs =
      k.slowest_rank.narrow(1, static_cast<int64_t>(k.layout.start("after_compute")), 2 * kinds_n * stretches_n)
          .reshape({passes, kinds_n, stretches_n, 2});
  const torch::Tensor own = pairs.select(3, 0), extra = pairs.select(3, 1);  // [passes, kinds, stretches]
  const torch::Tensor kept = undisturbed_quartile(extra.reshape({passes, -1}), false).reshape({kinds_n, stretches_n});
  const torch::Tensor own_kept = undisturbed_quartile(own.reshape({passes, -1}), false).reshape({kinds_n, stretches_n});
  for (int64_t i = 0; i < kinds_n; ++i) {
    const std::string& kind = x.after_collectives[static_cast<size_t>(i)].first;
    CurvePoints& curve = kind == "all_reduce"   ? cal.after_compute.all_reduce
                         : kind == "all_gather" ? cal.after_compute.all_gather
                                                : cal.after_compute.all_to_all;
    for (int64_t s = 0; s < stretches_n; ++s) {
      const double at = own_kept[i][s].item<double>();
      if (curve.empty() || at > curve.back().first) curve.emplace_back(at, std::max(0.0, kept[i][s].item<double>()));
    }
  }
  for (int p = 0; p < passes; ++p) {
    const torch::Tensor row = extra[p].reshape({-1}).contiguous();
    cal.after_compute_per_pass.emplace_back(row.data_ptr<double>(), row.data_ptr<double>() + row.numel());
  }
}

// Peak: the fastest multiply seen; the efficiency curve: each size's rate against it, one
// point per distinct size (the median where sizes repeat).
void read_efficiency(Calibration& cal) {
  for (const auto& [flops, rate] : cal.gemm) cal.peak_flops = std::max(cal.peak_flops, rate);
  std::map<double, std::vector<double>> by_size;
  for (const auto& [flops, rate] : cal.gemm) by_size[flops].push_back(rate / cal.peak_flops);
  for (const auto& [flops, eff] : by_size)
    if (cal.efficiency.size() < 64) cal.efficiency.push_back({flops, std::clamp(median(eff), 1e-6, 1.0)});
}

}  // namespace

Calibration calibrate(const CalibrateOptions& o, Communicator& world, const MeshMaker& mesh_of) {
  const auto started = Clock::now();
  if (o.device.is_cuda() && world.size() > 1)
    throw InputError("--ranks", {{"", std::to_string(world.size()) +
                                          " ranks: on a GPU, calibration measures one rank (--ranks 1)"}});
  measured_device = o.device;
  Progress progress(o.progress, world.rank() == 0);
  progress.say("measuring on " + o.device_name);
  torch::manual_seed(1234 + static_cast<uint64_t>(world.rank()));
  torch::NoGradGuard outer_no_grad;  // enabled again where a backward is timed
  const int passes = o.passes > 0 ? o.passes : (o.quick ? 1 : 5);
  Calibration cal;
  cal.ranks = world.size();
  cal.passes = passes;
  cal.baseline_rss_bytes = current_rss_bytes();
  Workload x(o, world, mesh_of);
  OverheadProbe overhead;

  // Every figure is measured once per pass, in the same order on every rank. A shared machine
  // has spells in which a core runs far slower (another tenant on it); the passes spread the
  // measurements over time and each figure keeps its lower quartile over them (below).
  std::vector<Figures> pass_figures;
  for (int pass = 1; pass <= passes; ++pass) {
    const std::string of = passes > 1 ? " (pass " + std::to_string(pass) + " of " + std::to_string(passes) + ")" : "";
    pass_figures.push_back(measure_pass(x, progress, overhead, of));
  }
  for (Figures& f : pass_figures) {
    f.begin("memory");
    f.add(static_cast<double>(overhead.most()));
    f.add(static_cast<double>(cal.baseline_rss_bytes));
  }

  // -- Over the ranks: in each pass the slowest rank's time (it sets the pace of a step) and
  // the lowest bandwidth. Over the passes: the lower quartile of the times (the upper of the
  // bandwidths), the machine as it runs when no other tenant slows it: a shared machine only
  // ever adds to a time, and the validation keeps each configuration's least disturbed run
  // just as well. The quartile, not the fastest pass, so that no single lucky measurement
  // decides. The overheads: the largest anywhere.
  const Figures& layout = pass_figures.front();
  const int64_t count = static_cast<int64_t>(layout.values().size());
  torch::Tensor mine = torch::empty({1, passes, count}, torch::kDouble);
  for (int p = 0; p < passes; ++p)
    mine[0][p].copy_(torch::tensor(pass_figures[static_cast<size_t>(p)].values(), torch::kDouble));
  const torch::Tensor all = world.all_gather(mine).to(torch::kDouble);  // [ranks, passes, values]
  const torch::Tensor slowest_rank = std::get<0>(all.max(0));           // [passes, values]
  const torch::Tensor fastest_rank = std::get<0>(all.min(0));
  const torch::Tensor largest = std::get<0>(slowest_rank.max(0)).contiguous();
  const torch::Tensor slowest = undisturbed_quartile(slowest_rank, false);
  const torch::Tensor least = undisturbed_quartile(fastest_rank, true);
  const Kept kept{layout, slowest_rank, slowest.data_ptr<double>(), least.data_ptr<double>(), largest.data_ptr<double>()};
  read_op_times(x, kept, cal);
  if (x.n > 1) {
    read_collectives(x, kept, cal);
    read_after_compute(x, kept, passes, cal);
  }
  const double* memory = kept.at(kept.largest, "memory");
  cal.overhead_bytes = static_cast<int64_t>(memory[0]);
  cal.baseline_rss_bytes = static_cast<int64_t>(memory[1]);
  // How much slower each pass ran than the figures kept, and how far apart the ranks were (the
  // slowest over the fastest): the medians over the compute times (GEMMs through the tensor splits).
  const int64_t compute = static_cast<int64_t>(layout.start("optimizer"));
  for (int p = 0; p < passes; ++p)
    cal.pass_slowdown.push_back(
        median_of(slowest_rank[p].narrow(0, 0, compute) / slowest.narrow(0, 0, compute)));
  cal.rank_spread = median_of(slowest_rank.narrow(1, 0, compute) / fastest_rank.narrow(1, 0, compute));
  read_efficiency(cal);
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

namespace {

// A GPU's profile: its base's datasheet rates, kernel model and collectives stay (what one GPU
// cannot measure of its node); the executor's operations at the model's shapes, the host copies
// and the memory beyond the caching allocator are what was measured.
ClusterSpec calibrated_gpu(ClusterSpec p, const Calibration& c, const CalibrateOptions& o, const std::string& how) {
  char text[512];
  auto say = [&](const std::string& field, const std::string& what) { p.sources[field] = what + "; " + how; };
  std::snprintf(text, sizeof text,
                "%s, its nodes and interconnect as %s says; one %s calibrated by moeplan calibrate in %.0f s",
                p.description.c_str(), "the base profile", o.device_name.c_str(), c.seconds);
  p.description = text;
  p.sources.erase("description");
  p.pcie_bandwidth_bytes_per_s = 2.0 / (1.0 / c.offload_write_bytes_per_s + 1.0 / c.offload_read_bytes_per_s);
  std::snprintf(text, sizeof text,
                "measured: 256 MiB copies between pinned host memory and the GPU, %.1f GB/s to the host and %.1f GB/s "
                "back (the mean time per byte of the two)",
                c.offload_write_bytes_per_s / 1e9, c.offload_read_bytes_per_s / 1e9);
  say("host.pcie_bandwidth_bytes_per_s", text);
  p.framework_overhead_bytes = c.overhead_bytes;
  say("framework.overhead_bytes",
      "measured: the most device memory in use beyond what the CUDA caching allocator reserved (the CUDA context, "
      "cuBLAS and cuDNN) while the executor's operations ran");
  // The executor runs LibTorch's operations one after another; its attention is flash.
  p.kernels = Kernels::kEager;
  p.attention = AttentionKernel::kFlash;
  say("framework.kernels", "moeplan's executor: LibTorch operations one after another (no fused RMSNorm or SwiGLU)");
  say("framework.attention", "moeplan's executor: LibTorch's scaled-dot-product attention (flash on the GPU)");
  p.op_times = c.op_times;
  say("framework.op_times",
      "measured on one " + o.device_name + ": medians of the executor's operations at these shapes, the device "
      "synchronised around each, routing by " + std::string(name_of(kLoadBalancingNames, o.load_balancing)) +
      ", a median within each of " + std::to_string(c.passes) + " passes, the lower quartile of the passes kept");
  return p;
}

}  // namespace

ClusterSpec calibrated_cluster(const ClusterSpec& base, const Calibration& c, const CalibrateOptions& o,
                               const std::string& name, const std::string& how) {
  ClusterSpec p = base;
  p.name = name;
  if (o.device.is_cuda()) return calibrated_gpu(p, c, o, how);
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
