// `moeplan compare-published`: moeplan's prediction for published training runs, in their
// own parallel layout, beside the published step time.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "commands.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/planner/search.h"
#include "profiles.h"

namespace moeplan::cli {

namespace fs = std::filesystem;

namespace {

struct PublishedCase {
  std::string name, source, note;
  std::string model, instance;
  int64_t gpus = 0, seq_len = 0, global_batch_sequences = 0;
  Precision precision = Precision::kBf16;
  planner::SearchOptions::Pins pins;
  double published_step_s = 0;
};

std::vector<PublishedCase> read_cases(const std::string& path) {
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
        c.source = r.string("source");
        c.note = r.string("note", "");
        c.model = r.string("model");
        c.instance = r.string("instance");
        c.gpus = r.integer("gpus", 1, int64_t{1} << 20);
        c.seq_len = r.integer("seq_len", 1, int64_t{1} << 24);
        c.global_batch_sequences = r.integer("global_batch_sequences", 1, int64_t{1} << 30);
        c.precision = r.choice<Precision>("precision", kPrecisionNames);
        c.published_step_s = r.number("published_step_s", 1e-6, 1e9);
        if (auto layout = r.object("layout")) {
          auto pin = [&](const char* key, std::optional<int64_t>& to) {
            if (layout->has(key)) to = layout->integer(key, 1, int64_t{1} << 20);
          };
          pin("expert_parallel_degree", c.pins.expert_parallel_degree);
          pin("hybrid_shard_degree", c.pins.hybrid_shard_degree);
          pin("tensor_parallel_degree", c.pins.tensor_parallel_degree);
          pin("pipeline_parallel_degree", c.pins.pipeline_parallel_degree);
          pin("virtual_pipeline_degree", c.pins.virtual_pipeline_degree);
          pin("micro_batch_size", c.pins.micro_batch_size);
          if (layout->has("sequence_parallel")) c.pins.sequence_parallel = layout->boolean("sequence_parallel");
          if (layout->has("placement")) c.pins.placement = layout->string("placement");
          c.pins.checkpointing = layout->choice<Checkpointing>("activation_checkpointing", kCheckpointingNames);
          layout->finish();
        }
        // What the published runs did not use: no offloading, expert parallelism of 1 for
        // dense models, no sequence parallelism unless given.
        c.pins.offloading = false;
        if (!c.pins.expert_parallel_degree) c.pins.expert_parallel_degree = 1;
        if (!c.pins.sequence_parallel) c.pins.sequence_parallel = false;
        if (!c.pins.tensor_parallel_degree) c.pins.tensor_parallel_degree = 1;
        if (!c.pins.pipeline_parallel_degree) c.pins.pipeline_parallel_degree = 1;
        if (!c.pins.virtual_pipeline_degree) c.pins.virtual_pipeline_degree = 1;
        r.finish();
        out.push_back(std::move(c));
      }
    top.finish();
  }
  d.throw_if_any(path);
  return out;
}

std::string layout_text(const ParallelConfig& p) {
  std::string s = "T" + std::to_string(p.tensor_parallel_degree) + (p.sequence_parallel ? "sp" : "") + " P" +
                  std::to_string(p.pipeline_parallel_degree) +
                  (p.virtual_pipeline_degree > 1 ? "x" + std::to_string(p.virtual_pipeline_degree) : "") + " E" + std::to_string(p.expert_parallel_degree) +
                  " S" + std::to_string(p.hybrid_shard_degree) + " R" + std::to_string(p.replica_degree()) + " " +
                  std::string(name_of(kCheckpointingNames, p.activation_checkpointing)) + " mbs " +
                  std::to_string(p.micro_batch_size);
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int run_compare_published(const ComparePublishedArgs& args) {
  try {
    const std::vector<PublishedCase> cases = read_cases(args.cases);
    const fs::path base = fs::path(args.cases).parent_path();
    const std::string dir = profile_dir(args.profiles);
    std::printf("| case | layout (moeplan's micro-batch where not published) | published step (s) | moeplan step (s) | "
                "error | moeplan MFU | GiB per GPU |\n|---|---|---:|---:|---:|---:|---:|\n");
    std::vector<double> errors;
    std::string worst_name;
    double worst = 0;
    int no_plan = 0;
    for (const PublishedCase& c : cases) {
      const std::string model_ref =
          c.model.find('/') != std::string::npos || c.model.ends_with(".json") ? (base / c.model).string() : c.model;
      const ModelSpec model = load_model(model_ref, dir);
      const ClusterSpec cluster = planner::size_cluster(load_hardware(c.instance, dir), c.gpus);
      planner::SearchOptions options;
      options.gpus = c.gpus;
      options.training.seq_len = c.seq_len;
      options.training.global_batch_tokens = c.global_batch_sequences * c.seq_len;
      options.training.precision = c.precision;
      options.moe.aux_loss_coef = model.router_aux_loss_coef;
      options.max_micro_batch = 16;
      options.keep = 1;
      options.pins = c.pins;
      const planner::SearchResult result = planner::search(model, cluster, options);
      if (result.ranked.empty()) {
        // The published layout breaks a rule or, by moeplan's memory model, does not fit.
        const std::vector<std::string> why = planner::explain_no_plan(result, cluster);
        std::printf("| %s | no plan: %s | %.2f | - | - | - | - |\n", c.name.c_str(),
                    why.empty() ? "" : why.front().c_str(), c.published_step_s);
        ++no_plan;
        continue;
      }
      const planner::Candidate& best = result.ranked.front();
      const double step = best.estimate.step_time_s;
      const double error = step / c.published_step_s - 1;
      errors.push_back(std::abs(error));
      if (std::abs(error) >= std::abs(worst)) {
        worst = error;
        worst_name = c.name;
      }
      std::printf("| %s | %s | %.2f | %.2f | %+.1f%% | %.1f%% | %.1f |\n", c.name.c_str(), layout_text(best.parallel).c_str(),
                  c.published_step_s, step, 100 * error, 100 * best.estimate.mfu,
                  static_cast<double>(best.memory.device_total) / static_cast<double>(int64_t{1} << 30));
    }
    const double median_error = median(errors);
    std::printf("\n%zu cases, %zu predicted: median |error| %.1f%%, worst %+.1f%% (%s)%s\n", cases.size(), errors.size(),
                100 * median_error, 100 * worst, worst_name.c_str(),
                no_plan > 0 ? (", " + std::to_string(no_plan) + " without a plan").c_str() : "");
    if (!args.check) return kExitOk;
    if (no_plan == 0 && median_error <= args.max_median_error && std::abs(worst) <= args.max_worst_error) return kExitOk;
    std::fprintf(stderr,
                 "moeplan: compare-published: bound broken: median |error| %.1f%% (bound %.1f%%), worst %.1f%% "
                 "(bound %.1f%%), %d without a plan\n",
                 100 * median_error, 100 * args.max_median_error, 100 * std::abs(worst), 100 * args.max_worst_error,
                 no_plan);
    return kExitNoPlan;
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", l.c_str());
    return kExitBadInput;
  }
}

}  // namespace moeplan::cli
