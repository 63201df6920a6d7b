// `moeplan calibrate`'s passes: every figure measured once a pass on every rank (measure.h),
// then kept over the ranks and passes, and read into the calibration by name.
#include "moeplan/executor/calibration/calibrate.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "measure.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor {

using namespace calibration;

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

// One pass: every figure once, in the same order on every rank.
PassFigures measure_pass(Workload& x, Progress& progress, OverheadProbe& overhead, const std::string& of) {
  PassFigures f;
  progress.say("matrix multiplies at the shapes of " + x.m.name + of);
  x.world.barrier();
  f.gemms = measure_gemms(x, overhead);
  progress.say("attention, router and experts, head and loss, forward and backward" + of);
  torch::autograd::GradMode::set_enabled(true);
  x.world.barrier();
  f.ops = measure_ops(x, overhead);
  f.experts = measure_experts(x, x.w1, x.w2, x.w3, overhead);
  if (!x.splits.empty()) progress.say("attention, experts and head under tensor splits" + of);
  f.splits = measure_splits(x, overhead);
  progress.say("optimizer" + of);
  torch::autograd::GradMode::set_enabled(false);
  x.world.barrier();
  f.optimizer = measure_optimizer(x, overhead);
  progress.say("memory copy and offload file" + of);
  f.copies = measure_copies(x, overhead);
  if (x.n > 1) f.collectives = measure_collectives(x, progress, of);
  overhead.sample();
  progress.say("whole micro-batches of the executor's model" + of);
  {
    torch::AutoGradMode with_grad(true);
    x.world.barrier();
    f.micro_batches = measure_micro_batches(x);
    f.recomputed_micro_batches = measure_micro_batches(x, /*recompute=*/true);
    if (!x.split_models.empty()) progress.say("whole micro-batches under tensor and expert splits" + of);
    f.split_micro_batches = measure_split_micro_batches(x);
    // A GPU's device memory beyond tensors is sampled up to here.
    overhead.stop();
    if (x.n > 1) {
      progress.say("collectives after compute" + of);
      f.after_compute = measure_after_compute(x);
    }
  }
  return f;
}

void for_both(ForwardBackward& fb, const std::function<void(double&)>& f) {
  f(fb.forward);
  f(fb.backward);
}

// Every figure of a pass, in one order: how the ranks exchange their figures as one row of
// numbers, and how the figures kept are read back into a pass's names.
void for_each_figure(PassFigures& p, const std::function<void(double&)>& f) {
  for (double& v : p.gemms) f(v);
  for (OpFigures& op : p.ops) {
    for_both(op.attention, f);
    for_both(op.router, f);
    f(op.head);
  }
  for (ForwardBackward& e : p.experts) for_both(e, f);
  for (SplitFigures& split : p.splits) {
    for (SplitFigures::Ops& op : split.ops) {
      for_both(op.attention, f);
      f(op.head);
    }
    for (ForwardBackward& e : split.experts) for_both(e, f);
  }
  for (double& v : p.optimizer) f(v);
  f(p.copies.copy_bytes_per_s);
  f(p.copies.offload_write_bytes_per_s);
  f(p.copies.offload_read_bytes_per_s);
  for (CollectiveFigures& c : p.collectives) {
    for (double& v : c.sweep) f(v);
    for (double& v : c.units) f(v);
  }
  for (ForwardBackward& m : p.micro_batches) for_both(m, f);
  for (ForwardBackward& m : p.recomputed_micro_batches) for_both(m, f);
  for (std::vector<SplitMicroBatchFigures>& split : p.split_micro_batches)
    for (SplitMicroBatchFigures& m : split) {
      for_both(m.compute, f);
      for_both(m.whole, f);
    }
  for (std::vector<AfterComputeFigures>& kind : p.after_compute)
    for (AfterComputeFigures& a : kind) {
      f(a.stretch);
      f(a.extra);
    }
  f(p.memory.overhead_bytes);
  f(p.memory.baseline_rss_bytes);
}

std::vector<double> figures_in_a_row(PassFigures p) {
  std::vector<double> row;
  for_each_figure(p, [&](double& v) { row.push_back(v); });
  return row;
}

// `row` (as figures_in_a_row orders it) under the names of `shape`.
PassFigures figures_of_row(PassFigures shape, const torch::Tensor& row) {
  const torch::Tensor values = row.contiguous();
  const double* next = values.data_ptr<double>();
  for_each_figure(shape, [&](double& v) { v = *next++; });
  return shape;
}

// The compute times (the multiplies through the tensor splits), for how far passes and ranks
// were apart.
std::vector<double> compute_times(const PassFigures& p) {
  std::vector<double> times = p.gemms;
  for (const OpFigures& op : p.ops)
    times.insert(times.end(),
                 {op.attention.forward, op.attention.backward, op.router.forward, op.router.backward, op.head});
  for (const ForwardBackward& e : p.experts) times.insert(times.end(), {e.forward, e.backward});
  for (const SplitFigures& split : p.splits) {
    for (const SplitFigures::Ops& op : split.ops)
      times.insert(times.end(), {op.attention.forward, op.attention.backward, op.head});
    for (const ForwardBackward& e : split.experts) times.insert(times.end(), {e.forward, e.backward});
  }
  return times;
}

// Per column of [passes, values], the lower quartile of the passes (the smaller of two, the
// second smallest of five); with `higher_is_better`, the upper quartile.
torch::Tensor undisturbed_quartile(const torch::Tensor& per_pass, bool higher_is_better) {
  const torch::Tensor sorted = std::get<0>(per_pass.sort(0, higher_is_better));
  return sorted[(per_pass.size(0) - 1) / 4].contiguous();
}

// The figures kept over the ranks and passes (see calibrate), each under a pass's names.
struct KeptFigures {
  PassFigures times;       // the lower quartile over passes of the slowest rank's
  PassFigures bandwidths;  // the upper quartile over passes of the lowest (the slowest rank's)
  PassFigures largest;     // the largest anywhere
  std::vector<PassFigures> slowest_rank, fastest_rank;  // per pass
};

// Over the ranks: in each pass the slowest rank's time (it sets the pace of a step) and the
// lowest bandwidth. Over the passes: the lower quartile of the times (the upper of the
// bandwidths), the machine as it runs when no other tenant slows it: a shared machine only ever
// adds to a time, and the validation keeps each configuration's least disturbed run just as
// well. The quartile, not the fastest pass, so that no single lucky measurement decides. The
// overheads: the largest anywhere.
KeptFigures keep(Communicator& world, const std::vector<PassFigures>& passes) {
  const PassFigures& shape = passes.front();
  const auto n = static_cast<int64_t>(passes.size());
  const auto count = static_cast<int64_t>(figures_in_a_row(shape).size());
  torch::Tensor mine = torch::empty({1, n, count}, torch::kDouble);
  for (int64_t p = 0; p < n; ++p)
    mine[0][p].copy_(torch::tensor(figures_in_a_row(passes[static_cast<size_t>(p)]), torch::kDouble));
  const torch::Tensor all = world.all_gather(mine).to(torch::kDouble);  // [ranks, passes, values]
  const torch::Tensor slowest_rank = std::get<0>(all.max(0));           // [passes, values]
  const torch::Tensor fastest_rank = std::get<0>(all.min(0));
  KeptFigures kept;
  kept.times = figures_of_row(shape, undisturbed_quartile(slowest_rank, false));
  kept.bandwidths = figures_of_row(shape, undisturbed_quartile(fastest_rank, true));
  kept.largest = figures_of_row(shape, std::get<0>(slowest_rank.max(0)));
  for (int64_t p = 0; p < n; ++p) {
    kept.slowest_rank.push_back(figures_of_row(shape, slowest_rank[p]));
    kept.fastest_rank.push_back(figures_of_row(shape, fastest_rank[p]));
  }
  return kept;
}

// The median over the compute times of `slower`'s over `faster`'s, over every pair given.
double median_ratio(const std::vector<const PassFigures*>& slower, const std::vector<const PassFigures*>& faster) {
  std::vector<double> ratios;
  for (size_t i = 0; i < slower.size(); ++i) {
    const std::vector<double> s = compute_times(*slower[i]), f = compute_times(*faster[i]);
    for (size_t k = 0; k < s.size(); ++k) ratios.push_back(s[k] / f[k]);
  }
  return median(ratios);
}

// The shapes the operation times were measured at.
void read_shapes(const Workload& x, OpTimes& times) {
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
  times.blocks = OpTimesBlocks::of(x.m);
  times.precision = std::string(name_of(kPrecisionNames, x.o.precision));
}

void read_op_times(const Workload& x, const PassFigures& kept, OpTimes& times) {
  read_shapes(x, times);
  for (size_t i = 0; i < x.mbs.size(); ++i) {
    const double tokens = static_cast<double>(x.mbs[i] * x.t);
    const OpFigures& op = kept.ops[i];
    times.attention_forward.emplace_back(tokens, op.attention.forward);
    times.attention_backward.emplace_back(tokens, op.attention.backward);
    times.router_forward.emplace_back(tokens, op.router.forward);
    times.router_backward.emplace_back(tokens, op.router.backward);
    times.head.emplace_back(tokens, op.head);
  }
  for (size_t i = 0; i < x.expert_rows.size(); ++i) {
    times.expert_forward.emplace_back(static_cast<double>(x.expert_rows[i]), kept.experts[i].forward);
    times.expert_backward.emplace_back(static_cast<double>(x.expert_rows[i]), kept.experts[i].backward);
  }
  for (size_t i = 0; i < x.shard_sizes.size(); ++i)
    times.optimizer.emplace_back(static_cast<double>(x.shard_sizes[i]), kept.optimizer[i]);
  for (size_t i = 0; i < x.mbs.size(); ++i) {
    const double tokens = static_cast<double>(x.mbs[i] * x.t);
    times.micro_batch_forward.emplace_back(tokens, kept.micro_batches[i].forward);
    times.micro_batch_backward.emplace_back(tokens, kept.micro_batches[i].backward);
    if (i < kept.recomputed_micro_batches.size()) {
      times.recomputed_micro_batch_forward.emplace_back(tokens, kept.recomputed_micro_batches[i].forward);
      times.recomputed_micro_batch_backward.emplace_back(tokens, kept.recomputed_micro_batches[i].backward);
    }
  }
}

// The operations under each tensor split, and the whole micro-batch on each split's mesh.
void read_split_times(const Workload& x, const PassFigures& kept, OpTimes& times) {
  for (size_t s = 0; s < x.splits.size(); ++s) {
    const SplitFigures& figures = kept.splits[s];
    TensorSplitTimes split;
    split.tensor_parallel_degree = x.splits[s];
    for (size_t i = 0; i < x.mbs.size(); ++i) {
      const double tokens = static_cast<double>(x.mbs[i] * x.t);
      split.attention_forward.emplace_back(tokens, figures.ops[i].attention.forward);
      split.attention_backward.emplace_back(tokens, figures.ops[i].attention.backward);
      split.head.emplace_back(tokens, figures.ops[i].head);
    }
    for (size_t i = 0; i < x.expert_rows.size(); ++i) {
      split.expert_forward.emplace_back(static_cast<double>(x.expert_rows[i]), figures.experts[i].forward);
      split.expert_backward.emplace_back(static_cast<double>(x.expert_rows[i]), figures.experts[i].backward);
    }
    times.tensor_splits.push_back(std::move(split));
  }
  for (size_t s = 0; s < x.split_models.size(); ++s) {
    const ParallelConfig& parallel = x.split_models[s]->plan.parallel;
    // Per micro-batch size: the compute, and the time inside the split's group beyond it.
    auto read_whole = [&](CurvePoints& forward, CurvePoints& backward, CurvePoints& inside_forward,
                          CurvePoints& inside_backward) {
      for (size_t i = 0; i < x.mbs.size(); ++i) {
        const double tokens = static_cast<double>(x.mbs[i] * x.t);
        const SplitMicroBatchFigures& m = kept.split_micro_batches[s][i];
        forward.emplace_back(tokens, m.compute.forward);
        backward.emplace_back(tokens, m.compute.backward);
        inside_forward.emplace_back(tokens, std::max(0.0, m.whole.forward - m.compute.forward));
        inside_backward.emplace_back(tokens, std::max(0.0, m.whole.backward - m.compute.backward));
      }
    };
    if (parallel.hybrid_shard_degree > 1) {  // the states sharded: the whole micro-batch as it ran
      ShardSplitTimes& split = times.shard_splits.emplace_back();
      split.hybrid_shard_degree = parallel.hybrid_shard_degree;
      for (size_t i = 0; i < x.mbs.size(); ++i) {
        const double tokens = static_cast<double>(x.mbs[i] * x.t);
        const SplitMicroBatchFigures& m = kept.split_micro_batches[s][i];
        split.micro_batch_forward.emplace_back(tokens, m.whole.forward);
        split.micro_batch_backward.emplace_back(tokens, m.whole.backward);
      }
      continue;
    }
    if (parallel.expert_parallel_degree > 1) {  // the experts split, not the tensors
      ExpertSplitTimes& split = times.expert_splits.emplace_back();
      split.expert_parallel_degree = parallel.expert_parallel_degree;
      read_whole(split.micro_batch_forward, split.micro_batch_backward, split.exchange_forward, split.exchange_backward);
      continue;
    }
    const int64_t degree = parallel.tensor_parallel_degree;
    TensorSplitTimes& split = *std::find_if(times.tensor_splits.begin(), times.tensor_splits.end(),
                                            [&](const auto& t) { return t.tensor_parallel_degree == degree; });
    read_whole(split.micro_batch_forward, split.micro_batch_backward, split.collectives_forward,
               split.collectives_backward);
  }
}

void read_collectives(Workload& x, const PassFigures& kept, Calibration& cal) {
  const int64_t n = x.n, a = x.a;
  for (size_t k = 0; k < x.kinds.size(); ++k) {
    const std::string& kind = x.kinds[k];
    const CollectiveFigures& figures = kept.collectives[k];
    CollectiveSweep sweep;
    sweep.name = kind;
    for (size_t i = 0; i < x.sizes.size(); ++i) {
      sweep.bytes.push_back(static_cast<double>(x.sizes[i] / a / n * n * a));
      sweep.seconds.push_back(figures.sweep[i]);
    }
    const std::vector<int64_t>& units = x.unit_sizes[kind];
    for (size_t i = 0; i < units.size(); ++i) {
      sweep.unit_bytes.push_back(static_cast<double>(units[i] / a / n * n * a));
      sweep.unit_seconds.push_back(figures.units[i]);
    }
    sweep.r_squared = fit_line_relative(sweep.bytes, sweep.seconds).r_squared;
    cal.collectives.push_back(std::move(sweep));
  }
}

// What a collective took after a stretch beyond the two alone, at the stretch's own time; both
// kept like every time here (the lower quartile over the passes of the slowest rank's). And per
// pass, the figures before the quartile.
void read_after_compute(const Workload& x, const KeptFigures& kept, Calibration& cal) {
  for (size_t k = 0; k < x.after_collectives.size(); ++k) {
    const std::string& kind = x.after_collectives[k].first;
    CurvePoints& curve = kind == "all_reduce"   ? cal.after_compute.all_reduce
                         : kind == "all_gather" ? cal.after_compute.all_gather
                                                : cal.after_compute.all_to_all;
    for (const AfterComputeFigures& a : kept.times.after_compute[k])
      if (curve.empty() || a.stretch > curve.back().first) curve.emplace_back(a.stretch, std::max(0.0, a.extra));
  }
  for (const PassFigures& pass : kept.slowest_rank) {
    std::vector<double> extras;
    for (const std::vector<AfterComputeFigures>& kind : pass.after_compute)
      for (const AfterComputeFigures& a : kind) extras.push_back(a.extra);
    cal.after_compute_per_pass.push_back(std::move(extras));
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
  Progress progress(o.progress, world.rank() == 0);
  progress.say("measuring on " + o.device_name);
  torch::manual_seed(1234 + static_cast<uint64_t>(world.rank()));
  torch::NoGradGuard outer_no_grad;  // enabled again where a backward is timed
  const int passes = o.passes > 0 ? o.passes : (o.quick ? 1 : 5);
  Calibration cal;
  cal.ranks = world.size();
  cal.passes = passes;
  cal.baseline_rss_bytes = current_rss_bytes();
  if (!o.device.is_cuda()) progress.say("three training steps of the executor's trainer, for its memory beyond tensors");
  const int64_t step_overhead = o.device.is_cuda() ? 0 : measure_step_overhead(o, world, mesh_of);
  Workload x(o, world, mesh_of);
  OverheadProbe overhead(o.device);

  // Every figure is measured once per pass, in the same order on every rank. A shared machine
  // has spells in which a core runs far slower (another tenant on it); the passes spread the
  // measurements over time and each figure keeps its lower quartile over them (keep).
  std::vector<PassFigures> pass_figures;
  for (int pass = 1; pass <= passes; ++pass) {
    const std::string of = passes > 1 ? " (pass " + std::to_string(pass) + " of " + std::to_string(passes) + ")" : "";
    const std::optional<ProcessorTimes> before = processor_times();
    pass_figures.push_back(measure_pass(x, progress, overhead, of));
    if (const std::optional<double> steal = steal_share(before, processor_times())) cal.pass_steal.push_back(*steal);
  }
  if (cal.pass_steal.size() != pass_figures.size()) cal.pass_steal.clear();
  for (PassFigures& f : pass_figures)
    f.memory = {static_cast<double>(o.device.is_cuda() ? overhead.most() : step_overhead),
                static_cast<double>(cal.baseline_rss_bytes)};

  const KeptFigures kept = keep(world, pass_figures);
  for (size_t i = 0; i < x.gemms.size(); ++i) {
    const Gemm& gemm = x.gemms[i];
    const double flops = 2.0 * static_cast<double>(gemm.rows * gemm.inner * gemm.cols);
    cal.gemm.emplace_back(flops, flops / kept.times.gemms[i]);
  }
  read_op_times(x, kept.times, cal.op_times);
  read_split_times(x, kept.times, cal.op_times);
  cal.copy_bandwidth_bytes_per_s = kept.bandwidths.copies.copy_bytes_per_s;
  cal.offload_write_bytes_per_s = kept.bandwidths.copies.offload_write_bytes_per_s;
  cal.offload_read_bytes_per_s = kept.bandwidths.copies.offload_read_bytes_per_s;
  if (x.n > 1) {
    read_collectives(x, kept.times, cal);
    read_after_compute(x, kept, cal);
  }
  cal.overhead_bytes = static_cast<int64_t>(kept.largest.memory.overhead_bytes);
  cal.baseline_rss_bytes = static_cast<int64_t>(kept.largest.memory.baseline_rss_bytes);
  // How much slower each pass ran than the figures kept, and how far apart the ranks were (the
  // slowest over the fastest): the medians over the compute times.
  for (const PassFigures& pass : kept.slowest_rank) cal.pass_slowdown.push_back(median_ratio({&pass}, {&kept.times}));
  std::vector<const PassFigures*> slowest, fastest;
  for (size_t p = 0; p < kept.slowest_rank.size(); ++p) {
    slowest.push_back(&kept.slowest_rank[p]);
    fastest.push_back(&kept.fastest_rank[p]);
  }
  cal.rank_spread = median_ratio(slowest, fastest);
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
  if (!c.pass_steal.empty()) j["pass_steal"] = c.pass_steal;
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

}  // namespace moeplan::executor
