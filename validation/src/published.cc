// `moeplan compare-published`: moeplan's prediction for published training runs, in their
// own parallel layout and framework's kernels, beside the published step time; the fit part
// and the held-out part of the set summarised on their own.
#include "moeplan/validation/published.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/core/units.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"

namespace moeplan::validation {

namespace fs = std::filesystem;

namespace {

constexpr std::array<std::string_view, 2> kParts = {"fit", "held-out"};

}  // namespace

std::vector<PublishedCase> read_published_cases(const std::string& path) {
  const Json json = read_json_file(path);
  Diagnostics d;
  ObjectReader top(json, "", d);
  std::vector<PublishedCase> out;
  if (top.ok()) {
    top.integer("schema_version", 1, 1);
    top.string("description", "");
    const Json* cases = top.child("cases");
    if (cases != nullptr && (!cases->is_array() || cases->empty() || cases->size() > 1000))
      d.error("cases", "expected an array of 1 to 1000 cases, got " + describe_json(*cases));
    else if (cases != nullptr)
      for (size_t i = 0; i < cases->size(); ++i) {
        ObjectReader r((*cases)[i], "cases[" + std::to_string(i) + "]", d);
        if (!r.ok()) continue;
        PublishedCase c;
        c.name = r.string("name");
        c.part = r.string("part");
        if (std::find(kParts.begin(), kParts.end(), c.part) == kParts.end())
          d.error(r.path_of("part"), "expected \"fit\" or \"held-out\", got \"" + c.part + "\"");
        c.source = r.string("source");
        c.note = r.string("note", "");
        c.model = r.string("model");
        c.instance = r.string("instance");
        c.gpus = r.integer("gpus", 1, int64_t{1} << 20);
        c.seq_len = r.integer("seq_len", 1, int64_t{1} << 24);
        c.global_batch_sequences = r.integer("global_batch_sequences", 1, int64_t{1} << 30);
        c.precision = r.choice<Precision>("precision", kPrecisionNames);
        c.published_step_s = r.number("published_step_s", 1e-6, 1e9);
        if (auto memory = r.object("published_memory", true)) {
          c.published_states_gib = memory->number("parameters_and_optimizer_gib", 0.0, 1e6, 0.0);
          c.published_activations_gib = memory->number("activations_gib", 0.0, 1e6, 0.0);
          memory->string("source");
          memory->finish();
        }
        if (auto layout = r.object("layout")) {
          auto pin = [&](const char* key, std::optional<int64_t>& to) {
            if (layout->has(key)) to = layout->integer(key, 1, int64_t{1} << 20);
          };
          pin("expert_parallel_degree", c.pins.expert_parallel_degree);
          pin("hybrid_shard_degree", c.pins.hybrid_shard_degree);
          pin("tensor_parallel_degree", c.pins.tensor_parallel_degree);
          pin("expert_tensor_parallel_degree", c.pins.expert_tensor_parallel_degree);
          pin("pipeline_parallel_degree", c.pins.pipeline_parallel_degree);
          pin("context_parallel_degree", c.pins.context_parallel_degree);
          if (layout->has("context_exchange"))
            c.context_exchange = layout->choice<ContextExchange>("context_exchange", kContextExchangeNames);
          pin("virtual_pipeline_degree", c.pins.virtual_pipeline_degree);
          pin("micro_batch_size", c.pins.micro_batch_size);
          pin("first_stage_layers", c.pins.first_stage_layers);
          pin("last_stage_layers", c.pins.last_stage_layers);
          if (layout->has("sequence_parallel")) c.pins.sequence_parallel = layout->boolean("sequence_parallel");
          if (layout->has("distributed_optimizer"))
            c.pins.distributed_optimizer = layout->boolean("distributed_optimizer");
          c.pins.dense_shard_spans_experts = layout->boolean("dense_shard_spans_experts", false);
          if (layout->has("placement")) c.pins.placement = layout->string("placement");
          if (layout->has("activation_checkpointing"))
            c.pins.checkpointing = layout->choice<Checkpointing>("activation_checkpointing", kCheckpointingNames);
          // The framework's kernels: what it runs, not what the hardware profile assumes.
          if (layout->has("kernels")) c.kernels = layout->choice<Kernels>("kernels", kKernelNames);
          if (layout->has("attention"))
            c.attention = layout->choice<AttentionKernel>("attention", kAttentionKernelNames);
          if (layout->has("overlap_gradient_sync"))
            c.overlap_gradient_sync = layout->boolean("overlap_gradient_sync");
          c.fp8 = layout->boolean("fp8", false);
          c.overlap_exchange = layout->boolean("overlap_exchange", false);
          c.overlap_shared_expert = layout->boolean("overlap_shared_expert", false);
          c.dispatcher = layout->choice<Dispatcher>("dispatcher", kDispatcherNames, Dispatcher::kAllToAll);
          c.fp32_gradients = layout->boolean("fp32_gradients", true);
          layout->finish();
        }
        // What the published runs did not use: no offloading, expert parallelism of 1 for
        // dense models, no sequence parallelism, distributed optimizer or uneven stages unless
        // given. What was used but not published (micro-batch, interleaved chunks, checkpointing
        // where left out) is moeplan's choice.
        c.pins.offloading = false;
        if (!c.pins.expert_parallel_degree) c.pins.expert_parallel_degree = 1;
        if (!c.pins.sequence_parallel) c.pins.sequence_parallel = false;
        if (!c.pins.distributed_optimizer) c.pins.distributed_optimizer = false;
        if (!c.pins.tensor_parallel_degree) c.pins.tensor_parallel_degree = 1;
        // Megatron-LM's expert tensor split is T unless set.
        if (!c.pins.expert_tensor_parallel_degree) c.pins.expert_tensor_parallel_degree = c.pins.tensor_parallel_degree;
        if (!c.pins.pipeline_parallel_degree) c.pins.pipeline_parallel_degree = 1;
        if (!c.pins.context_parallel_degree) c.pins.context_parallel_degree = 1;
        if (!c.pins.first_stage_layers && !c.pins.last_stage_layers) c.pins.first_stage_layers = c.pins.last_stage_layers = 0;
        r.finish();
        out.push_back(std::move(c));
      }
    top.finish();
  }
  d.throw_if_any(path);
  return out;
}

namespace {

std::string layout_text(const ParallelConfig& p) {
  std::string s = "T" + std::to_string(p.tensor_parallel_degree) + (p.sequence_parallel ? "sp" : "") + " P" +
                  std::to_string(p.pipeline_parallel_degree) +
                  (p.virtual_pipeline_degree > 1 ? "x" + std::to_string(p.virtual_pipeline_degree) : "") +
                  (p.first_stage_layers > 0 || p.last_stage_layers > 0
                       ? "(" + std::to_string(p.first_stage_layers) + "/" + std::to_string(p.last_stage_layers) + ")"
                       : "") +
                  (p.context_parallel_degree > 1 ? " C" + std::to_string(p.context_parallel_degree) : "") +
                  " E" + std::to_string(p.expert_parallel_degree) +
                  (p.expert_tensor_fold() > 1 ? "/ETP" + std::to_string(p.expert_tensor_degree()) : "") + " S" +
                  std::to_string(p.hybrid_shard_degree) +
                  (p.dense_shard_spanning() ? " dense-S" + std::to_string(p.dense_shard_degree()) : "") + " R" + std::to_string(p.replica_degree()) + (p.distributed_optimizer ? " dopt" : "") + " " +
                  std::string(name_of(kCheckpointingNames, p.activation_checkpointing)) + " mbs " +
                  std::to_string(p.micro_batch_size);
  return s;
}

struct PublishedRow {
  const PublishedCase* c = nullptr;
  std::optional<planner::Candidate> best;
  std::string why_not;
  std::string over_memory;  // not empty: the memory model puts the published layout over the device
  double error = 0;  // predicted / published - 1
  // The memory model for a stage that holds blocks only: model states, and the activations
  // kept for backward (without the recomputed block's working set).
  double states_gib = 0, activations_gib = 0;
};

struct PublishedSummary {
  size_t cases = 0, predicted = 0;
  double median = 0, worst = 0, mean = 0;  // |error|, the worst signed, the mean signed
  std::string worst_name;
};

PublishedSummary summarise(const std::vector<PublishedRow>& rows, std::string_view part) {
  PublishedSummary s;
  std::vector<double> magnitudes;
  double sum = 0;
  for (const PublishedRow& r : rows) {
    if (!part.empty() && r.c->part != part) continue;
    ++s.cases;
    if (!r.best) continue;
    ++s.predicted;
    magnitudes.push_back(std::abs(r.error));
    sum += r.error;
    if (std::abs(r.error) >= std::abs(s.worst)) {
      s.worst = r.error;
      s.worst_name = r.c->name;
    }
  }
  s.median = median(magnitudes);
  s.mean = s.predicted > 0 ? sum / static_cast<double>(s.predicted) : 0.0;
  return s;
}

// A published case ready to predict: its model and its cluster as the profile gives them.
struct Loaded {
  const PublishedCase* c = nullptr;
  ModelSpec model;
  ClusterSpec cluster;
};

// The chip a profile's GPU is (A100 for A100-SXM4-40GB and -80GB): fitted numbers are the
// chip's, shared by every profile with it.
std::string chip_of(const ClusterSpec& c) { return c.gpu_name.substr(0, c.gpu_name.find('-')); }

// The kernel-model numbers `compare-published --fit` may fit, as factors on the profile's
// values (overlap_slowdown, which profiles leave at 0, as its value).
struct FitParameter {
  std::string_view name;
  double ClusterSpec::*field;
  bool factor;
  double lo, hi;
};
constexpr std::array<FitParameter, 6> kFitParameters{{
    {"matmul_peak_efficiency", &ClusterSpec::matmul_peak_efficiency, true, 0.4, 1.2},
    {"fp8_matmul_peak_efficiency", &ClusterSpec::fp8_matmul_peak_efficiency, true, 0.4, 1.2},
    {"memory_bound_efficiency", &ClusterSpec::memory_bound_efficiency, true, 0.3, 1.1},
    {"flash_attention_efficiency", &ClusterSpec::flash_attention_efficiency, true, 0.4, 2.5},
    {"kernel_overhead_s", &ClusterSpec::kernel_overhead_s, true, 0.0, 5.0},
    {"overlap_slowdown", &ClusterSpec::overlap_slowdown, false, 0.0, 1.0},
}};

}  // namespace

std::vector<std::string> fit_parameter_names() {
  std::vector<std::string> names;
  for (const FitParameter& p : kFitParameters) names.emplace_back(p.name);
  return names;
}

namespace {

// Values per (chip, parameter); absent ones leave the profile's.
using FitValues = std::map<std::pair<std::string, std::string_view>, double>;

ClusterSpec apply(ClusterSpec c, const FitValues& values) {
  for (const FitParameter& p : kFitParameters) {
    auto it = values.find({chip_of(c), p.name});
    if (it == values.end()) continue;
    c.*(p.field) = p.factor ? c.*(p.field) * it->second : it->second;
  }
  return c;
}

PublishedRow predict(const Loaded& l, const FitValues& values) {
  const PublishedCase& c = *l.c;
  const ClusterSpec cluster = apply(l.cluster, values);
  planner::SearchOptions options;
  options.gpus = c.gpus;
  options.training.seq_len = c.seq_len;
  options.training.global_batch_tokens = c.global_batch_sequences * c.seq_len;
  options.training.precision = c.precision;
  options.training.fp8 = c.fp8;
  options.training.fp32_gradients = c.fp32_gradients;
  options.moe.aux_loss_coef = l.model.router_aux_loss_coef;
  options.moe.overlap_exchange = c.overlap_exchange;
  options.moe.overlap_shared_expert = c.overlap_shared_expert;
  options.moe.dispatcher = c.dispatcher;
  options.context_exchange = c.context_exchange;
  options.max_micro_batch = 16;
  options.keep = 1;
  options.pins = c.pins;
  planner::SearchResult result = planner::search(l.model, cluster, options);
  PublishedRow row;
  row.c = &c;
  if (result.ranked.empty() && result.stats.rule_valid > 0) {
    // The layout ran, whatever moeplan's memory model says: time it, and say so.
    const std::vector<std::string> why = planner::explain_no_plan(result, cluster);
    row.over_memory = why.empty() ? "" : why.front();
    options.ignore_memory_limits = true;
    result = planner::search(l.model, cluster, options);
  }
  if (result.ranked.empty()) {
    const std::vector<std::string> why = planner::explain_no_plan(result, cluster);
    row.why_not = why.empty() ? "" : why.front();
  } else {
    row.best = result.ranked.front();
    row.error = row.best->estimate.step_time_s / c.published_step_s - 1;
    const RunConfig config{l.model, cluster, row.best->parallel, options.moe, options.training};
    const planner::MemoryEstimate m = planner::estimate_memory(config, planner::StageView::kBlocksOnly);
    const double gib = static_cast<double>(kGiB);
    row.states_gib = static_cast<double>(m.model_states()) / gib;
    row.activations_gib = static_cast<double>(m.activations - m.activation_working_set) / gib;
  }
  return row;
}

// Mean squared log(predicted / published) over the fit part's cases on `chip` (smooth, so that
// one parameter at a time finds its best value; a sum of absolute values has kinks where one
// case is exact and holds the search there).
double fit_loss(const std::vector<Loaded>& loaded, const std::string& chip, const FitValues& values) {
  double sum = 0;
  int n = 0;
  for (const Loaded& l : loaded) {
    if (l.c->part != kParts[0] || chip_of(l.cluster) != chip) continue;
    const PublishedRow r = predict(l, values);
    if (!r.best) continue;
    sum += std::log1p(r.error) * std::log1p(r.error);
    ++n;
  }
  return n > 0 ? sum / n : 0.0;
}

// Coordinate descent: each parameter in turn by golden-section search over its range, six
// rounds, chip by chip, on the fit part alone.
FitValues fit(const std::vector<Loaded>& loaded, const std::vector<std::string>& names) {
  FitValues values;
  std::set<std::string> chips;
  for (const Loaded& l : loaded)
    if (l.c->part == kParts[0]) chips.insert(chip_of(l.cluster));
  std::vector<const FitParameter*> params;
  for (const std::string& name : names)
    for (const FitParameter& p : kFitParameters)
      if (p.name == name) params.push_back(&p);
  for (const std::string& chip : chips) {
    for (const FitParameter* p : params) values[{chip, p->name}] = p->factor ? 1.0 : 0.0;
    for (int round = 0; round < 6; ++round)
      for (const FitParameter* p : params) {
        double lo = p->lo, hi = p->hi;
        const double g = (std::sqrt(5.0) - 1) / 2;
        auto loss_at = [&](double x) {
          FitValues v = values;
          v[{chip, p->name}] = x;
          return fit_loss(loaded, chip, v);
        };
        double a = hi - g * (hi - lo), b = lo + g * (hi - lo);
        double fa = loss_at(a), fb = loss_at(b);
        for (int i = 0; i < 24; ++i) {
          if (fa <= fb) {
            hi = b;
            b = a;
            fb = fa;
            a = hi - g * (hi - lo);
            fa = loss_at(a);
          } else {
            lo = a;
            a = b;
            fa = fb;
            b = lo + g * (hi - lo);
            fb = loss_at(b);
          }
        }
        values[{chip, p->name}] = (lo + hi) / 2;
      }
  }
  return values;
}

}  // namespace

int compare_published(const ComparePublishedOptions& options) {
  try {
    const std::vector<PublishedCase> cases = read_published_cases(options.cases);
    const fs::path base = fs::path(options.cases).parent_path();
    const std::string dir = profile_dir(options.profiles);
    std::vector<Loaded> loaded;
    for (const PublishedCase& c : cases) {
      const std::string model_ref =
          c.model.find('/') != std::string::npos || c.model.ends_with(".json") ? (base / c.model).string() : c.model;
      Loaded l{&c, load_model(model_ref, dir), planner::size_cluster(load_hardware(c.instance, dir), c.gpus)};
      if (c.kernels) l.cluster.kernels = *c.kernels;
      l.cluster.attention = c.attention.value_or(l.cluster.kernels == Kernels::kFused ? AttentionKernel::kFlash
                                                                                     : AttentionKernel::kUnfused);
      if (c.overlap_gradient_sync) l.cluster.overlap_gradient_sync = *c.overlap_gradient_sync;
      loaded.push_back(std::move(l));
    }
    FitValues values;
    if (!options.fit.empty()) {
      values = fit(loaded, options.fit);
      std::printf("fitted on the fit part (%zu cases), least squares of log errors, per chip:\n",
                  static_cast<size_t>(std::count_if(cases.begin(), cases.end(),
                                                    [](const PublishedCase& c) { return c.part == kParts[0]; })));
      for (const auto& [key, value] : values)
        std::printf("  %s %s %s %.4f\n", key.first.c_str(), std::string(key.second).c_str(),
                    key.second == "overlap_slowdown" ? "=" : "x", value);
      std::printf("\n");
    }
    std::vector<PublishedRow> rows;
    for (const Loaded& l : loaded) rows.push_back(predict(l, values));

    std::printf("| case | part | layout (moeplan's choice where not published) | published step (s) | moeplan step (s) | "
                "error | moeplan MFU | GiB per GPU |\n|---|---|---|---:|---:|---:|---:|---:|\n");
    for (const PublishedRow& r : rows) {
      if (!r.best) {
        std::printf("| %s | %s | no plan: %s | %.2f | - | - | - | - |\n", r.c->name.c_str(), r.c->part.c_str(),
                    r.why_not.c_str(), r.c->published_step_s);
        continue;
      }
      const sim::StepEstimate& e = r.best->estimate;
      std::printf("| %s | %s | %s | %.3f | %.3f | %+.1f%% | %.1f%% | %.1f%s |\n", r.c->name.c_str(), r.c->part.c_str(),
                  layout_text(r.best->parallel).c_str(), r.c->published_step_s, e.step_time_s, 100 * r.error,
                  100 * e.mfu, static_cast<double>(r.best->memory.device_total) / static_cast<double>(int64_t{1} << 30),
                  r.over_memory.empty() ? "" : " (over the device)");
    }

    // Where moeplan says each step's time goes (busiest rank, share of the predicted step).
    std::printf("\n| case | GEMMs | attention | memory-bound | recompute | optimizer | exposed communication | of which "
                "pipeline bubble |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const PublishedRow& r : rows) {
      if (!r.best) continue;
      const sim::StepEstimate& e = r.best->estimate;
      auto share = [&](double s) { return 100.0 * s / e.step_time_s; };
      std::printf("| %s | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% |\n", r.c->name.c_str(),
                  share(e.gemm_s), share(e.attention_s), share(e.memory_bound_s), share(e.recompute_s),
                  share(e.optimizer_s), share(e.exposed_comm_s), share(e.pipeline_bubble_s));
    }

    // Memory where the source gives it.
    double worst_memory = 0;
    bool memory_header = false;
    for (const PublishedRow& r : rows) {
      if (!r.best || (r.c->published_states_gib <= 0 && r.c->published_activations_gib <= 0)) continue;
      if (!memory_header)
        std::printf("\n| case | published states (GiB) | moeplan | error | published activations (GiB) | moeplan | "
                    "error |\n|---|---:|---:|---:|---:|---:|---:|\n");
      memory_header = true;
      auto cell = [&](double published, double predicted) {
        if (published <= 0) return std::string("- | - | -");
        const double error = predicted / published - 1;
        worst_memory = std::max(worst_memory, std::abs(error));
        char text[64];
        std::snprintf(text, sizeof text, "%.2f | %.2f | %+.1f%%", published, predicted, 100 * error);
        return std::string(text);
      };
      std::printf("| %s | %s | %s |\n", r.c->name.c_str(), cell(r.c->published_states_gib, r.states_gib).c_str(),
                  cell(r.c->published_activations_gib, r.activations_gib).c_str());
    }
    if (memory_header) std::printf("\nmemory: worst |error| %.1f%%\n", 100 * worst_memory);
    for (const PublishedRow& r : rows)
      if (!r.over_memory.empty()) std::printf("\n%s: moeplan's memory model: %s", r.c->name.c_str(), r.over_memory.c_str());
    std::printf("\n\n");
    const PublishedSummary all = summarise(rows, "");
    for (std::string_view part : {std::string_view(), kParts[0], kParts[1]}) {
      const PublishedSummary s = summarise(rows, part);
      std::printf("%-9s %zu cases, %zu predicted: median |error| %.1f%%, worst %+.1f%% (%s), mean %+.1f%%\n",
                  part.empty() ? "all:" : (std::string(part) + ":").c_str(), s.cases, s.predicted, 100 * s.median,
                  100 * s.worst, s.worst_name.c_str(), 100 * s.mean);
    }
    if (!options.check) return kExitOk;
    const PublishedSummary held = summarise(rows, kParts[1]);
    bool ok = true;
    for (const PublishedSummary* s : {&all, &held}) {
      const char* which = s == &all ? "all cases" : "held-out part";
      if (s->predicted < s->cases || s->median > options.max_median_error || std::abs(s->worst) > options.max_worst_error ||
          std::abs(s->mean) > options.max_mean_error) {
        std::fprintf(stderr,
                     "moeplan: compare-published: %s: bound broken: median |error| %.1f%% (bound %.1f%%), worst "
                     "%.1f%% (bound %.1f%%), mean %+.1f%% (bound +-%.1f%%), %zu without a plan\n",
                     which, 100 * s->median, 100 * options.max_median_error, 100 * std::abs(s->worst),
                     100 * options.max_worst_error, 100 * s->mean, 100 * options.max_mean_error, s->cases - s->predicted);
        ok = false;
      }
    }
    return ok ? kExitOk : kExitNoPlan;
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", l.c_str());
    return kExitBadInput;
  }
}

}  // namespace moeplan::validation
