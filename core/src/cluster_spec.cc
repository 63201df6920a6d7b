#include "moeplan/core/cluster_spec.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <stdexcept>
#include <type_traits>

#include "moeplan/core/parallel_config.h"

namespace moeplan {

OpTimesBlocks OpTimesBlocks::of(const ModelSpec& m) {
  OpTimesBlocks b;
  b.q_lora_rank = m.q_lora_rank;
  b.kv_lora_rank = m.kv_lora_rank;
  b.qk_rope_head_dim = m.qk_rope_head_dim;
  b.v_head_dim = m.v_head_dim;
  b.shared_expert_intermediate_size = m.shared_expert_intermediate_size;
  b.dense_intermediate_size = m.dense_intermediate_size;
  b.first_dense_layers = m.first_dense_layers;
  b.moe_layer_step = m.moe_layer_step;
  b.moe_layer_offset = m.moe_layer_offset;
  b.mtp_layers = m.mtp_layers;
  b.qk_norm = m.qk_norm;
  b.shared_expert_gate = m.shared_expert_gate;
  return b;
}

namespace {
constexpr int64_t kMaxGpusPerNode = 1024;
constexpr int64_t kMaxNodes = int64_t{1} << 20;
constexpr int64_t kMaxBytes = int64_t{1} << 50;  // 1 PiB
constexpr double kMaxRate = 1e18;
}  // namespace

double ClusterSpec::efficiency_at(double flops) const {
  const auto& pts = matmul_efficiency;
  if (pts.empty()) return 1.0;
  if (flops <= pts.front().flops) return pts.front().efficiency;
  if (flops >= pts.back().flops) return pts.back().efficiency;
  auto hi = std::upper_bound(pts.begin(), pts.end(), flops,
                             [](double f, const EfficiencyPoint& p) { return f < p.flops; });
  auto lo = hi - 1;
  const double t = (std::log(flops) - std::log(lo->flops)) / (std::log(hi->flops) - std::log(lo->flops));
  return lo->efficiency + t * (hi->efficiency - lo->efficiency);
}

double CollectiveFit::measured_at(double bytes) const {
  for (const auto& [b, seconds] : points)
    if (std::abs(b - bytes) <= 0.01 * b) return seconds;
  return -1;
}

const CurvePoints* AfterCompute::of(std::string_view category) const {
  if (category == "all_reduce") return &all_reduce;
  if (category == "all_gather") return &all_gather;
  if (category == "all_to_all" || category == "reduce_scatter") return &all_to_all;
  return nullptr;
}

double after_compute_seconds(const CurvePoints& curve, double compute_s) {
  if (curve.empty() || compute_s <= 0) return 0;
  const auto& [first_x, first_y] = curve.front();
  const auto& [last_x, last_y] = curve.back();
  if (compute_s <= first_x) return first_y * compute_s / first_x;
  if (compute_s >= last_x) return last_y * compute_s / last_x;
  return curve_at(curve, compute_s);
}

CurvePoints& op_time_curve(OpTimes& t, std::string_view name) {
  CurvePoints* curves[] = {&t.attention_forward,
                           &t.attention_backward,
                           &t.router_forward,
                           &t.router_backward,
                           &t.expert_forward,
                           &t.expert_backward,
                           &t.head,
                           &t.optimizer,
                           &t.micro_batch_forward,
                           &t.micro_batch_backward,
                           &t.recomputed_micro_batch_forward,
                           &t.recomputed_micro_batch_backward};
  static_assert(std::size(curves) == kOpTimeCurves.size());
  for (size_t i = 0; i < kOpTimeCurves.size(); ++i)
    if (kOpTimeCurves[i] == name) return *curves[i];
  throw std::logic_error("no op-time curve named " + std::string(name));
}

const CurvePoints& op_time_curve(const OpTimes& t, std::string_view name) {
  return op_time_curve(const_cast<OpTimes&>(t), name);
}

CurvePoints& split_curve(TensorSplitTimes& t, std::string_view name) {
  CurvePoints* curves[] = {&t.attention_forward,     &t.attention_backward,   &t.expert_forward,
                           &t.expert_backward,       &t.head,                 &t.micro_batch_forward,
                           &t.micro_batch_backward,  &t.collectives_forward,  &t.collectives_backward};
  for (size_t i = 0; i < kTensorSplitCurves.size(); ++i)
    if (kTensorSplitCurves[i] == name) return *curves[i];
  throw std::logic_error("no tensor-split curve named " + std::string(name));
}

const CurvePoints& split_curve(const TensorSplitTimes& t, std::string_view name) {
  return split_curve(const_cast<TensorSplitTimes&>(t), name);
}

const TensorSplitTimes* OpTimes::split(int64_t t) const {
  for (const TensorSplitTimes& s : tensor_splits)
    if (s.tensor_parallel_degree == t) return &s;
  return nullptr;
}

const ExpertSplitTimes* OpTimes::expert_split(int64_t e) const {
  for (const ExpertSplitTimes& s : expert_splits)
    if (s.expert_parallel_degree == e) return &s;
  return nullptr;
}

const ShardSplitTimes* OpTimes::shard_split(int64_t s) const {
  for (const ShardSplitTimes& split : shard_splits)
    if (split.hybrid_shard_degree == s) return &split;
  return nullptr;
}

namespace {

// A plain string "source" inside an object whose numbers are not wrapped one by one.
void read_plain_source(ObjectReader& o, const std::string& key_for) {
  const Json* source = o.child("source", true);
  if (source == nullptr) return;
  if (!source->is_string())
    o.diagnostics().error(o.path_of("source"), "expected a string, got " + describe_json(*source));
  else if (o.sources() != nullptr && !source->get<std::string>().empty())
    (*o.sources())[key_for] = source->get<std::string>();
}

void read_collective_fits(ObjectReader& c, const std::string& own_path, ClusterSpec& spec) {
  read_plain_source(c, own_path);
  const std::pair<const char*, CollectiveFit*> fits[] = {{"all_gather", &spec.all_gather_fit},
                                                         {"reduce_scatter", &spec.reduce_scatter_fit},
                                                         {"all_reduce", &spec.all_reduce_fit},
                                                         {"all_to_all", &spec.all_to_all_fit}};
  for (const auto& [name, fit] : fits) {
    if (auto f = c.object(name, true)) {
      fit->latency_s = f->number("latency_s", 0.0, 1.0);
      fit->bandwidth_bytes_per_s = f->number("bandwidth_bytes_per_s", 1.0, kMaxRate);
      if (const Json* points = f->child("points", true)) {
        const std::string path = f->path_of("points");
        if (!points->is_array() || points->size() > 64) {
          c.diagnostics().error(path, "expected an array of up to 64 [bytes, seconds] pairs");
        } else {
          for (size_t i = 0; i < points->size(); ++i) {
            const Json& q = (*points)[i];
            const std::string at = path + "[" + std::to_string(i) + "]";
            if (!q.is_array() || q.size() != 2 || !q[0].is_number() || !q[1].is_number() || !(q[0].get<double>() >= 1) ||
                !(q[1].get<double>() >= 0) || q[1].get<double>() > 1e6)
              c.diagnostics().error(at, "expected [bytes >= 1, seconds >= 0], got " + describe_json(q));
            else
              fit->points.emplace_back(q[0].get<double>(), q[1].get<double>());
          }
        }
      }
      f->finish();
    }
  }
  c.finish();
}

// A measured curve at `path`: 1 to 64 [x, y] pairs, x increasing. `x_ok` and `y_ok` say
// whether a value is in range; `x_range` and `y_range` how the error says the range.
struct CurveField {
  const char* x_name;
  const char* y_name;
  bool (*x_ok)(double);
  const char* x_range;
  bool (*y_ok)(double);
  const char* y_range;
};

void read_curve(Diagnostics& d, const Json& points, const std::string& path, const CurveField& f, CurvePoints& curve) {
  const std::string pair = std::string("[") + f.x_name + ", " + f.y_name + "]";
  if (!points.is_array() || points.empty() || points.size() > 64) {
    d.error(path, "expected an array of 1 to 64 " + pair + " pairs");
    return;
  }
  for (size_t i = 0; i < points.size(); ++i) {
    const Json& p = points[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number()) {
      d.error(at, "expected " + pair + ", got " + describe_json(p));
      continue;
    }
    const double x = p[0].get<double>(), y = p[1].get<double>();
    if (!f.x_ok(x))
      d.error(at, std::string(f.x_name) + " must be in " + f.x_range + ", got " + p[0].dump());
    else if (!f.y_ok(y))
      d.error(at, std::string(f.y_name) + " must be in " + f.y_range + ", got " + p[1].dump());
    else if (!curve.empty() && x <= curve.back().first)
      d.error(at, std::string(f.x_name) + " must increase from one point to the next");
    else
      curve.emplace_back(x, y);
  }
}

// An op-time curve's points: [x, seconds].
constexpr CurveField kOpTimeField{"x", "seconds", [](double x) { return x >= 1.0 && x <= 1e18; }, "[1, 1e18]",
                                  [](double y) { return y >= 0.0 && y <= 1e6; }, "[0, 1e6]"};

// op_times.expert_splits: [{"expert_parallel_degree": E, the four curves}, ...], and
// op_times.shard_splits: [{"hybrid_shard_degree": S, the two curves}, ...]: each a list of the
// whole micro-batch measured on one mesh, its degree `degree` listed once.
template <class Split, size_t N>
void read_splits(ObjectReader& o, OpTimes& t, const char* list, const char* degree, int64_t Split::*degree_field,
                 const std::array<std::string_view, N>& names, const std::array<CurvePoints Split::*, N>& fields,
                 std::vector<Split>& into) {
  const Json* splits = o.child(list, true);
  if (splits == nullptr) return;
  const std::string path = o.path_of(list);
  if (!splits->is_array() || splits->size() > 16) {
    o.diagnostics().error(path, "expected a list of at most 16 splits");
    return;
  }
  for (size_t i = 0; i < splits->size(); ++i) {
    ObjectReader r((*splits)[i], path + "[" + std::to_string(i) + "]", o.diagnostics());
    if (!r.ok()) continue;
    Split split;
    split.*degree_field = r.integer(degree, 2, 1 << 16);
    for (size_t c = 0; c < N; ++c)
      if (const Json* points = r.child(names[c]))
        read_curve(o.diagnostics(), *points, r.path_of(names[c]), kOpTimeField, split.*fields[c]);
    r.finish();
    const int64_t d = split.*degree_field;
    if (std::is_same_v<Split, ExpertSplitTimes> && t.num_experts > 0 && d > 0 && t.num_experts % d != 0)
      o.diagnostics().error(r.path_of(degree), "= " + std::to_string(d) + " does not divide shapes.num_experts = " +
                                                   std::to_string(t.num_experts));
    if (t.num_layers == 0)
      o.diagnostics().error(o.path_of("shapes") + ".num_layers",
                            std::string("is required with ") + list + ": the blocks of the model they ran");
    for (const Split& other : into)
      if (other.*degree_field == d)
        o.diagnostics().error(r.path_of(degree), "= " + std::to_string(d) + " is listed twice");
    into.push_back(std::move(split));
  }
}

void read_op_times(ObjectReader& o, const std::string& own_path, OpTimes& t) {
  read_plain_source(o, own_path);
  if (auto s = o.object("shapes")) {
    t.hidden_size = s->integer("hidden_size", 1, int64_t{1} << 20);
    t.intermediate_size = s->integer("intermediate_size", 1, int64_t{1} << 22);
    t.num_attention_heads = s->integer("num_attention_heads", 1, 4096);
    t.num_key_value_heads = s->integer("num_key_value_heads", 1, 4096);
    t.head_dim = s->integer("head_dim", 1, 1 << 16);
    t.num_experts = s->integer("num_experts", 1, 1 << 16);
    t.experts_per_token = s->integer("experts_per_token", 1, 1 << 16);
    t.vocab_size = s->integer("vocab_size", 1, int64_t{1} << 24);
    t.seq_len = s->integer("seq_len", 1, int64_t{1} << 24);
    if (s->child("num_layers", true) != nullptr) t.num_layers = s->integer("num_layers", 1, 1 << 16);
    for (const OpTimesBlockField& f : kOpTimesBlockFields)
      t.blocks.*f.field = s->integer(f.name, f.least, f.most, f.fallback);
    t.blocks.qk_norm = s->boolean("qk_norm", false);
    t.blocks.shared_expert_gate = s->boolean("shared_expert_gate", false);
    t.precision = s->string("precision");
    if (t.precision != "bf16" && t.precision != "mixed" && t.precision != "fp32")
      o.diagnostics().error(s->path_of("precision"), "expected \"bf16\", \"mixed\" or \"fp32\", got \"" + t.precision + "\"");
    s->finish();
  }
  for (size_t i = 0; i < kOpTimeCurves.size(); ++i) {
    const std::string_view name = kOpTimeCurves[i];
    const Json* points = o.child(name, i >= kRequiredOpTimeCurves);  // the whole micro-batches are optional
    if (points == nullptr) continue;
    read_curve(o.diagnostics(), *points, o.path_of(name), kOpTimeField, op_time_curve(t, name));
  }
  if ((t.recomputed_micro_batch_forward.empty() != t.recomputed_micro_batch_backward.empty()) ||
      (!t.recomputed_micro_batch_forward.empty() && t.micro_batch_forward.empty()))
    o.diagnostics().error(o.path_of("recomputed_micro_batch_forward"),
                          "comes with recomputed_micro_batch_backward, micro_batch_forward and micro_batch_backward: "
                          "it is priced against them");
  // The whole micro-batches are per model: without its depth they say nothing per block.
  if (!t.micro_batch_forward.empty() && t.num_layers == 0)
    o.diagnostics().error(o.path_of("shapes") + ".num_layers",
                          "is required with micro_batch_forward: the blocks of the model those micro-batches ran");
  if (const Json* splits = o.child("tensor_splits", true)) {
    const std::string path = o.path_of("tensor_splits");
    if (!splits->is_array() || splits->size() > 16) {
      o.diagnostics().error(path, "expected a list of at most 16 splits");
    } else {
      for (size_t i = 0; i < splits->size(); ++i) {
        ObjectReader r((*splits)[i], path + "[" + std::to_string(i) + "]", o.diagnostics());
        if (!r.ok()) continue;
        TensorSplitTimes split;
        split.tensor_parallel_degree = r.integer("tensor_parallel_degree", 2, 4096);
        size_t whole_micro_batch = 0;  // how many of the optional curves are there
        for (size_t c = 0; c < kTensorSplitCurves.size(); ++c) {
          const std::string_view name = kTensorSplitCurves[c];
          const bool optional = c >= kRequiredTensorSplitCurves;
          if (const Json* points = r.child(name, optional)) {
            read_curve(o.diagnostics(), *points, r.path_of(name), kOpTimeField, split_curve(split, name));
            if (optional) ++whole_micro_batch;
          }
        }
        r.finish();
        if (whole_micro_batch > 0 && whole_micro_batch < kTensorSplitCurves.size() - kRequiredTensorSplitCurves)
          o.diagnostics().error(r.path_of("micro_batch_forward"),
                                "micro_batch_forward, micro_batch_backward, collectives_forward and "
                                "collectives_backward come together");
        if (whole_micro_batch > 0 && t.num_layers == 0)
          o.diagnostics().error(o.path_of("shapes") + ".num_layers",
                                "is required with a split's micro_batch_forward: the blocks of the model it ran");
        const int64_t tp = split.tensor_parallel_degree;
        for (const auto& [field, size] : {std::pair<const char*, int64_t>{"num_attention_heads", t.num_attention_heads},
                                          {"num_key_value_heads", t.num_key_value_heads},
                                          {"intermediate_size", t.intermediate_size},
                                          {"vocab_size", t.vocab_size},
                                          {"seq_len", t.seq_len}})
          if (size > 0 && size % tp != 0)
            o.diagnostics().error(r.path_of("tensor_parallel_degree"), "= " + std::to_string(tp) + " does not divide shapes." +
                                                                          field + " = " + std::to_string(size));
        if (t.split(split.tensor_parallel_degree) != nullptr)
          o.diagnostics().error(r.path_of("tensor_parallel_degree"),
                                "= " + std::to_string(split.tensor_parallel_degree) + " is listed twice");
        t.tensor_splits.push_back(std::move(split));
      }
    }
  }
  read_splits(o, t, "expert_splits", "expert_parallel_degree", &ExpertSplitTimes::expert_parallel_degree,
              kExpertSplitCurves, kExpertSplitCurveFields, t.expert_splits);
  read_splits(o, t, "shard_splits", "hybrid_shard_degree", &ShardSplitTimes::hybrid_shard_degree, kShardSplitCurves,
              kShardSplitCurveFields, t.shard_splits);
  o.finish();
}

// framework.collective_after_compute: {"source": "...", "<kind>": [[seconds, extra seconds], ...]}.
void read_after_compute(ObjectReader& o, const std::string& own_path, AfterCompute& after) {
  read_plain_source(o, own_path);
  for (std::string_view kind : kAfterComputeKinds) {
    const Json* points = o.child(kind, true);
    if (points == nullptr) continue;
    CurvePoints& curve = const_cast<CurvePoints&>(*after.of(kind));
    static constexpr CurveField kField{"compute seconds", "extra seconds", [](double x) { return x > 0.0 && x <= 1e6; },
                                       "(0, 1e6]", [](double y) { return y >= 0.0 && y <= 1e6; }, "[0, 1e6]"};
    read_curve(o.diagnostics(), *points, o.path_of(kind), kField, curve);
  }
}

}  // namespace

static ClusterSpec read_cluster_fields(ObjectReader& r) {
  ClusterSpec c;
  c.name = r.string("name");
  c.description = r.string("description", "");
  c.gpus_per_node = r.integer("gpus_per_node", 1, kMaxGpusPerNode);
  r.integer("schema_version", 1, 1, 1);
  c.num_nodes = r.integer("num_nodes", 1, kMaxNodes, 1);
  if (auto gpu = r.object("gpu")) {
    c.gpu_name = gpu->string("name");
    c.device = gpu->choice<DeviceKind>("device", kDeviceKindNames, DeviceKind::kCuda);
    c.gpu_memory_bytes = gpu->integer("memory_bytes", 1, kMaxBytes);
    c.peak_bf16_flops = gpu->number("peak_bf16_flops", 1.0, kMaxRate);
    c.peak_fp32_flops = gpu->number("peak_fp32_flops", 1.0, kMaxRate);
    c.hbm_bandwidth_bytes_per_s = gpu->number("memory_bandwidth_bytes_per_s", 1.0, kMaxRate);
    // The kernel model's numbers: absent is 0 (no kernel model, or no FP8); given, each in a
    // range that keeps every time finite.
    c.peak_fp8_flops = gpu->number("peak_fp8_flops", 1.0, kMaxRate, 0.0);
    c.streaming_multiprocessors = gpu->integer("streaming_multiprocessors", 1, 1 << 16, 0);
    c.matmul_peak_efficiency = gpu->number("matmul_peak_efficiency", 0.01, 1.0, 0.0);
    c.fp8_matmul_peak_efficiency = gpu->number("fp8_matmul_peak_efficiency", 0.01, 1.0, 0.0);
    c.memory_bound_efficiency = gpu->number("memory_bound_efficiency", 0.01, 1.0, 1.0);
    c.kernel_overhead_s = gpu->number("kernel_overhead_s", 0.0, 1.0, 0.0);
    c.flash_attention_efficiency = gpu->number("flash_attention_efficiency", 0.01, 1.0, 0.0);
    if (auto eff = gpu->object("matmul_efficiency", true)) {
      // The curve's source is a plain string: the curve has no single value to wrap.
      if (const Json* source = eff->child("source", true)) {
        if (!source->is_string())
          r.diagnostics().error(eff->path_of("source"), "expected a string, got " + describe_json(*source));
        else if (r.sources() != nullptr && !source->get<std::string>().empty())
          (*r.sources())[eff->path_of("points")] = source->get<std::string>();
      }
      if (const Json* points = eff->child("points")) {
        const std::string path = eff->path_of("points");
        if (!points->is_array() || points->empty() || points->size() > 64) {
          r.diagnostics().error(path, "expected an array of 1 to 64 [flops, efficiency] pairs");
        } else {
          for (size_t i = 0; i < points->size(); ++i) {
            const Json& p = (*points)[i];
            const std::string at = path + "[" + std::to_string(i) + "]";
            if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number()) {
              r.diagnostics().error(at, "expected [flops, efficiency], got " + describe_json(p));
              continue;
            }
            const double f = p[0].get<double>();
            const double e = p[1].get<double>();
            if (!(f >= 1.0 && f <= 1e30)) {
              r.diagnostics().error(at, "flops must be in [1, 1e30], got " + p[0].dump());
            } else if (!(e >= 1e-6 && e <= 1.0)) {
              // Below a millionth of peak a GEMM's time leaves double's range for large models.
              r.diagnostics().error(at, "efficiency must be in [1e-6, 1], got " + p[1].dump());
            } else if (!c.matmul_efficiency.empty() && f <= c.matmul_efficiency.back().flops) {
              r.diagnostics().error(at, "flops must increase from one point to the next");
            } else {
              c.matmul_efficiency.push_back({f, e});
            }
          }
        }
      }
      eff->finish();
    }
    gpu->finish();
  }
  if (auto intra = r.object("intra_node")) {
    c.intra_node_fabric = intra->string("fabric");
    c.intra_node_bandwidth_bytes_per_s = intra->number("bandwidth_bytes_per_s", 1.0, kMaxRate);
    c.intra_node_latency_s = intra->number("latency_s", 0.0, 1.0);
    c.collective_base_latency_s = intra->number("collective_base_latency_s", 0.0, 1.0, 0.0);
    if (auto fits = intra->object("collectives", true)) read_collective_fits(*fits, intra->path_of("collectives"), c);
    intra->finish();
  }
  if (auto inter = r.object("inter_node")) {
    c.inter_node_fabric = inter->string("fabric");
    c.inter_node_bandwidth_bytes_per_s = inter->number("bandwidth_bytes_per_s", 1.0, kMaxRate);
    c.inter_node_latency_s = inter->number("latency_s", 0.0, 1.0);
    inter->finish();
  }
  if (auto host = r.object("host")) {
    c.host_memory_bytes = host->integer("memory_bytes", 1, kMaxBytes);
    c.pcie_bandwidth_bytes_per_s = host->number("pcie_bandwidth_bytes_per_s", 1.0, kMaxRate);
    c.host_processors = host->integer("processors", 0, int64_t{1} << 20, 0);
    host->finish();
  }
  if (auto cost = r.object("cost", true)) {
    c.instance_price_per_hour = cost->number("instance_price_per_hour", 0.0, 1e6, 0.0);
    c.node_failures_per_hour = cost->number("node_failures_per_hour", 0.0, 1.0, 0.0);
    cost->finish();
  }
  if (auto fw = r.object("framework")) {
    c.framework_overhead_bytes = fw->integer("overhead_bytes", 0, kMaxBytes);
    c.fragmentation_factor = fw->number("fragmentation_factor", 1.0, 4.0);
    c.kernels = fw->choice<Kernels>("kernels", kKernelNames, Kernels::kFused);
    c.attention = fw->choice<AttentionKernel>(
        "attention", kAttentionKernelNames,
        c.kernels == Kernels::kFused ? AttentionKernel::kFlash : AttentionKernel::kUnfused);
    c.overlap_slowdown = fw->number("overlap_slowdown", 0.0, 10.0, 0.0);
    c.memory_headroom_bytes = fw->integer("headroom_bytes", 0, kMaxBytes);
    c.comm_overlaps_compute = fw->boolean("comm_overlaps_compute", true);
    c.overlap_gradient_sync = fw->boolean("overlap_gradient_sync", true);
    if (auto times = fw->object("op_times", true)) read_op_times(*times, fw->path_of("op_times"), c.op_times);
    if (auto after = fw->object("collective_after_compute", true)) {
      read_after_compute(*after, fw->path_of("collective_after_compute"), c.after_compute);
      after->finish();
    }
    fw->finish();
  }
  r.finish();
  return c;
}

ClusterSpec read_cluster(const Json& json, const std::string& path, Diagnostics& d) {
  SourceMap sources;
  ObjectReader r(json, path, d, &sources);
  if (!r.ok()) return {};
  ClusterSpec c = read_cluster_fields(r);
  // Sources are kept relative to the cluster object, wherever it was read from.
  const std::string prefix = path.empty() ? "" : path + ".";
  for (auto& [key, source] : sources)
    c.sources[key.substr(key.rfind(prefix, 0) == 0 ? prefix.size() : 0)] = source;
  return c;
}

void check_cluster(const ClusterSpec& c, Diagnostics& d, const std::string& prefix) {
  auto at = [&](const char* field) { return prefix.empty() ? std::string(field) : prefix + "." + field; };
  if (c.memory_headroom_bytes + c.framework_overhead_bytes >= c.gpu_memory_bytes)
    d.error(at("framework"), "headroom_bytes + overhead_bytes (" +
                                 std::to_string(c.memory_headroom_bytes + c.framework_overhead_bytes) +
                                 ") leave no device memory of gpu.memory_bytes = " +
                                 std::to_string(c.gpu_memory_bytes));
  if (c.peak_fp32_flops > c.peak_bf16_flops)
    d.error(at("gpu.peak_fp32_flops"), "exceeds gpu.peak_bf16_flops; the two are probably swapped");
  if ((c.streaming_multiprocessors > 0) != (c.matmul_peak_efficiency > 0))
    d.error(at(c.streaming_multiprocessors > 0 ? "gpu.matmul_peak_efficiency" : "gpu.streaming_multiprocessors"),
            "is missing: the kernel model needs both gpu.streaming_multiprocessors and gpu.matmul_peak_efficiency");
  else if (!c.has_kernel_model() && c.matmul_efficiency.empty())
    d.error(at("gpu.matmul_efficiency"),
            "is missing: a profile without the kernel model (gpu.streaming_multiprocessors) times GEMMs by this curve");
  if (c.has_kernel_model() && c.flash_attention_efficiency <= 0)
    d.error(at("gpu.flash_attention_efficiency"), "is missing: the kernel model times flash attention by it");
  if (c.peak_fp8_flops > 0 && c.has_kernel_model() && c.fp8_matmul_peak_efficiency <= 0)
    d.error(at("gpu.fp8_matmul_peak_efficiency"), "is missing: gpu.peak_fp8_flops is given");
}

ClusterSpec cluster_from_json(const Json& json, const std::string& origin) {
  Diagnostics d;
  ClusterSpec c = read_cluster(json, "", d);
  if (d.empty()) check_cluster(c, d, "");
  d.throw_if_any(origin);
  return c;
}

ClusterSpec read_cluster_file(const std::string& path) {
  return cluster_from_json(read_json_file(path), path);
}

namespace {

// `value`, or {"value": value, "source": ...} where the profile gave the field at `path` a
// source.
Json sourced(const ClusterSpec& c, const std::string& path, const Json& value) {
  auto it = c.sources.find(path);
  if (it == c.sources.end()) return value;
  Json j;
  j["value"] = value;
  j["source"] = it->second;
  return j;
}

// A measured curve as [[x, y], ...].
Json curve_json(const CurvePoints& curve) {
  Json points = Json::array();
  for (const auto& [x, y] : curve) points.push_back({x, y});
  return points;
}

Json gpu_json(const ClusterSpec& c) {
  Json gpu;
  gpu["name"] = sourced(c, "gpu.name", c.gpu_name);
  if (c.device != DeviceKind::kCuda || c.sources.contains("gpu.device"))
    gpu["device"] = sourced(c, "gpu.device", std::string(name_of(kDeviceKindNames, c.device)));
  gpu["memory_bytes"] = sourced(c, "gpu.memory_bytes", c.gpu_memory_bytes);
  gpu["peak_bf16_flops"] = sourced(c, "gpu.peak_bf16_flops", c.peak_bf16_flops);
  gpu["peak_fp32_flops"] = sourced(c, "gpu.peak_fp32_flops", c.peak_fp32_flops);
  gpu["memory_bandwidth_bytes_per_s"] = sourced(c, "gpu.memory_bandwidth_bytes_per_s", c.hbm_bandwidth_bytes_per_s);
  // The kernel model's numbers, where given (absent reads back as the same default).
  auto optional = [&](const char* name, double value, double absent) {
    const std::string path = std::string("gpu.") + name;
    if (value != absent || c.sources.contains(path)) gpu[name] = sourced(c, path, value);
  };
  optional("peak_fp8_flops", c.peak_fp8_flops, 0.0);
  if (c.streaming_multiprocessors > 0 || c.sources.contains("gpu.streaming_multiprocessors"))
    gpu["streaming_multiprocessors"] = sourced(c, "gpu.streaming_multiprocessors", c.streaming_multiprocessors);
  optional("matmul_peak_efficiency", c.matmul_peak_efficiency, 0.0);
  optional("fp8_matmul_peak_efficiency", c.fp8_matmul_peak_efficiency, 0.0);
  optional("memory_bound_efficiency", c.memory_bound_efficiency, 1.0);
  optional("kernel_overhead_s", c.kernel_overhead_s, 0.0);
  optional("flash_attention_efficiency", c.flash_attention_efficiency, 0.0);
  if (!c.matmul_efficiency.empty()) {
    Json eff;
    Json points = Json::array();
    for (const auto& p : c.matmul_efficiency) points.push_back({p.flops, p.efficiency});
    eff["points"] = points;
    if (auto it = c.sources.find("gpu.matmul_efficiency.points"); it != c.sources.end())
      eff["source"] = it->second;
    gpu["matmul_efficiency"] = eff;
  }
  return gpu;
}

// A link's fabric, bandwidth and latency, under `section` (intra_node or inter_node).
Json link_json(const ClusterSpec& c, const std::string& section, const std::string& fabric,
               double bandwidth_bytes_per_s, double latency_s) {
  Json link;
  link["fabric"] = sourced(c, section + ".fabric", fabric);
  link["bandwidth_bytes_per_s"] = sourced(c, section + ".bandwidth_bytes_per_s", bandwidth_bytes_per_s);
  link["latency_s"] = sourced(c, section + ".latency_s", latency_s);
  return link;
}

// The fitted collectives, where any is given (else an object with none of them).
Json collectives_json(const ClusterSpec& c) {
  const std::pair<const char*, const CollectiveFit*> fits[] = {{"all_gather", &c.all_gather_fit},
                                                               {"reduce_scatter", &c.reduce_scatter_fit},
                                                               {"all_reduce", &c.all_reduce_fit},
                                                               {"all_to_all", &c.all_to_all_fit}};
  Json collectives;
  if (auto it = c.sources.find("intra_node.collectives"); it != c.sources.end()) collectives["source"] = it->second;
  for (const auto& [name, fit] : fits)
    if (fit->given()) {
      collectives[name] = {{"latency_s", fit->latency_s}, {"bandwidth_bytes_per_s", fit->bandwidth_bytes_per_s}};
      if (!fit->points.empty()) collectives[name]["points"] = curve_json(fit->points);
    }
  return collectives;
}

Json intra_node_json(const ClusterSpec& c) {
  Json intra = link_json(c, "intra_node", c.intra_node_fabric, c.intra_node_bandwidth_bytes_per_s,
                         c.intra_node_latency_s);
  intra["collective_base_latency_s"] = sourced(c, "intra_node.collective_base_latency_s", c.collective_base_latency_s);
  const Json collectives = collectives_json(c);
  if (collectives.contains("all_gather") || collectives.contains("all_to_all") || collectives.contains("all_reduce") ||
      collectives.contains("reduce_scatter"))
    intra["collectives"] = collectives;
  return intra;
}

// The cost object where given (absent reads back as zeros).
Json cost_json(const ClusterSpec& c) {
  Json cost = Json::object();
  for (const auto& [name, value] : {std::pair<const char*, double>{"instance_price_per_hour", c.instance_price_per_hour},
                                    {"node_failures_per_hour", c.node_failures_per_hour}}) {
    const std::string path = std::string("cost.") + name;
    if (value != 0 || c.sources.contains(path)) cost[name] = sourced(c, path, value);
  }
  return cost;
}

// The lists read_splits reads: each split's degree and its curves.
template <class Split, size_t N>
void put_splits(Json& times, const char* list, const char* degree, int64_t Split::*degree_field,
                const std::array<std::string_view, N>& names, const std::array<CurvePoints Split::*, N>& fields,
                const std::vector<Split>& splits) {
  for (const Split& split : splits) {
    Json entry;
    entry[degree] = split.*degree_field;
    for (size_t c = 0; c < N; ++c) entry[std::string(names[c])] = curve_json(split.*fields[c]);
    times[list].push_back(entry);
  }
}

Json op_times_json(const ClusterSpec& c) {
  const OpTimes& t = c.op_times;
  Json times;
  if (auto it = c.sources.find("framework.op_times"); it != c.sources.end()) times["source"] = it->second;
  times["shapes"] = {{"hidden_size", t.hidden_size},
                     {"intermediate_size", t.intermediate_size},
                     {"num_attention_heads", t.num_attention_heads},
                     {"num_key_value_heads", t.num_key_value_heads},
                     {"head_dim", t.head_dim},
                     {"num_experts", t.num_experts},
                     {"experts_per_token", t.experts_per_token},
                     {"vocab_size", t.vocab_size},
                     {"seq_len", t.seq_len},
                     {"precision", t.precision}};
  if (t.num_layers > 0) times["shapes"]["num_layers"] = t.num_layers;
  for (const OpTimesBlockField& f : kOpTimesBlockFields)
    if (t.blocks.*f.field != f.fallback) times["shapes"][std::string(f.name)] = t.blocks.*f.field;
  if (t.blocks.qk_norm) times["shapes"]["qk_norm"] = true;
  if (t.blocks.shared_expert_gate) times["shapes"]["shared_expert_gate"] = true;
  for (std::string_view name : kOpTimeCurves)
    if (const CurvePoints& curve = op_time_curve(t, name); !curve.empty()) times[std::string(name)] = curve_json(curve);
  for (const TensorSplitTimes& split : t.tensor_splits) {
    Json entry;
    entry["tensor_parallel_degree"] = split.tensor_parallel_degree;
    for (std::string_view name : kTensorSplitCurves)
      if (const CurvePoints& curve = split_curve(split, name); !curve.empty())
        entry[std::string(name)] = curve_json(curve);
    times["tensor_splits"].push_back(entry);
  }
  put_splits(times, "expert_splits", "expert_parallel_degree", &ExpertSplitTimes::expert_parallel_degree,
             kExpertSplitCurves, kExpertSplitCurveFields, t.expert_splits);
  put_splits(times, "shard_splits", "hybrid_shard_degree", &ShardSplitTimes::hybrid_shard_degree, kShardSplitCurves,
             kShardSplitCurveFields, t.shard_splits);
  return times;
}

Json after_compute_json(const ClusterSpec& c) {
  Json after;
  if (auto it = c.sources.find("framework.collective_after_compute"); it != c.sources.end())
    after["source"] = it->second;
  for (std::string_view kind : kAfterComputeKinds)
    if (const CurvePoints& curve = *c.after_compute.of(kind); !curve.empty())
      after[std::string(kind)] = curve_json(curve);
  return after;
}

Json framework_json(const ClusterSpec& c) {
  Json fw;
  fw["overhead_bytes"] = sourced(c, "framework.overhead_bytes", c.framework_overhead_bytes);
  fw["fragmentation_factor"] = sourced(c, "framework.fragmentation_factor", c.fragmentation_factor);
  fw["kernels"] = sourced(c, "framework.kernels", std::string(name_of(kKernelNames, c.kernels)));
  fw["attention"] = sourced(c, "framework.attention", std::string(name_of(kAttentionKernelNames, c.attention)));
  fw["overlap_slowdown"] = sourced(c, "framework.overlap_slowdown", c.overlap_slowdown);
  fw["headroom_bytes"] = sourced(c, "framework.headroom_bytes", c.memory_headroom_bytes);
  fw["comm_overlaps_compute"] = sourced(c, "framework.comm_overlaps_compute", c.comm_overlaps_compute);
  fw["overlap_gradient_sync"] = sourced(c, "framework.overlap_gradient_sync", c.overlap_gradient_sync);
  if (!c.op_times.empty()) fw["op_times"] = op_times_json(c);
  if (!c.after_compute.empty()) fw["collective_after_compute"] = after_compute_json(c);
  return fw;
}

}  // namespace

Json to_json(const ClusterSpec& c) {
  Json j;
  j["name"] = sourced(c, "name", c.name);
  j["description"] = sourced(c, "description", c.description);
  j["gpus_per_node"] = sourced(c, "gpus_per_node", c.gpus_per_node);
  j["num_nodes"] = sourced(c, "num_nodes", c.num_nodes);
  j["gpu"] = gpu_json(c);
  j["intra_node"] = intra_node_json(c);
  j["inter_node"] = link_json(c, "inter_node", c.inter_node_fabric, c.inter_node_bandwidth_bytes_per_s,
                              c.inter_node_latency_s);
  Json host;
  host["memory_bytes"] = sourced(c, "host.memory_bytes", c.host_memory_bytes);
  host["pcie_bandwidth_bytes_per_s"] = sourced(c, "host.pcie_bandwidth_bytes_per_s", c.pcie_bandwidth_bytes_per_s);
  if (c.host_processors > 0) host["processors"] = sourced(c, "host.processors", c.host_processors);
  j["host"] = host;
  if (Json cost = cost_json(c); !cost.empty()) j["cost"] = cost;
  j["framework"] = framework_json(c);
  return j;
}

}  // namespace moeplan
