// `moeplan compare-profiles`: how far apart two hardware profiles are, figure by figure and in
// what they predict for the validation matrix. Two calibrations of the same machine a few
// minutes apart should differ little in both.
#include "moeplan/validation/compare_profiles.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <unistd.h>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/validation/matrix.h"

namespace moeplan::validation {

namespace fs = std::filesystem;

namespace {

struct Figure {
  std::string group, name;
  double a = 0, b = 0;
  double difference() const { return b / a - 1; }
};

class Figures {
 public:
  void add(const std::string& group, const std::string& name, double a, double b) {
    if (a > 0 && b > 0) list_.push_back({group, name, a, b});
  }
  // The points of two curves at the same x (measured at the same size).
  void add_curve(const std::string& group, const std::string& name, const CurvePoints& a, const CurvePoints& b) {
    for (const auto& [x, y] : a)
      for (const auto& [bx, by] : b)
        if (std::abs(bx - x) <= 1e-9 * std::max(std::abs(x), 1.0)) add(group, name + " at " + number(x), y, by);
  }
  void add_fit(const std::string& name, const CollectiveFit& a, const CollectiveFit& b) {
    add("collectives", name + " latency", a.latency_s, b.latency_s);
    add("collectives", name + " bandwidth", a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s);
    add_curve("collectives", name + " measured", a.points, b.points);
  }
  const std::vector<Figure>& list() const { return list_; }

 private:
  static std::string number(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", x);
    return text;
  }
  std::vector<Figure> list_;
};

Figures figures_of(const ClusterSpec& a, const ClusterSpec& b) {
  Figures f;
  f.add("compute", "peak bf16 FLOP/s", a.peak_bf16_flops, b.peak_bf16_flops);
  f.add("compute", "peak fp32 FLOP/s", a.peak_fp32_flops, b.peak_fp32_flops);
  CurvePoints ea, eb;
  for (const EfficiencyPoint& p : a.matmul_efficiency) ea.emplace_back(p.flops, p.efficiency);
  for (const EfficiencyPoint& p : b.matmul_efficiency) eb.emplace_back(p.flops, p.efficiency);
  f.add_curve("compute", "matmul efficiency", ea, eb);
  for (std::string_view name : kOpTimeCurves)
    f.add_curve("operations", std::string(name), op_time_curve(a.op_times, name), op_time_curve(b.op_times, name));
  for (const TensorSplitTimes& split : a.op_times.tensor_splits)
    if (const TensorSplitTimes* other = b.op_times.split(split.tensor_parallel_degree))
      for (std::string_view name : kTensorSplitCurves)
        f.add_curve("operations", "T" + std::to_string(split.tensor_parallel_degree) + " " + std::string(name),
                    split_curve(split, name), split_curve(*other, name));
  f.add_fit("all_gather", a.all_gather_fit, b.all_gather_fit);
  f.add_fit("all_to_all", a.all_to_all_fit, b.all_to_all_fit);
  f.add_fit("all_reduce", a.all_reduce_fit, b.all_reduce_fit);
  f.add_fit("reduce_scatter", a.reduce_scatter_fit, b.reduce_scatter_fit);
  f.add("memory", "memory bandwidth", a.hbm_bandwidth_bytes_per_s, b.hbm_bandwidth_bytes_per_s);
  f.add("memory", "offload bandwidth", a.pcie_bandwidth_bytes_per_s, b.pcie_bandwidth_bytes_per_s);
  f.add("memory", "framework overhead", static_cast<double>(a.framework_overhead_bytes),
        static_cast<double>(b.framework_overhead_bytes));
  return f;
}

}  // namespace

int compare_profiles(const CompareProfilesOptions& options) {
  try {
    const ClusterSpec a = read_cluster_file(options.first);
    const ClusterSpec b = read_cluster_file(options.second);
    std::printf("compare-profiles: %s against %s (differences: second / first - 1)\n", options.first.c_str(),
                options.second.c_str());

    // Figure by figure.
    const Figures figures = figures_of(a, b);
    if (figures.list().empty()) throw std::runtime_error("the two profiles have no figure in common");
    std::vector<std::string> groups;
    for (const Figure& f : figures.list())
      if (std::find(groups.begin(), groups.end(), f.group) == groups.end()) groups.push_back(f.group);
    for (const std::string& group : groups) {
      std::vector<double> d;
      const Figure* worst = nullptr;
      for (const Figure& f : figures.list()) {
        if (f.group != group) continue;
        d.push_back(std::abs(f.difference()));
        if (worst == nullptr || std::abs(f.difference()) > std::abs(worst->difference())) worst = &f;
      }
      std::printf("  %-11s %3zu figures: median |difference| %5.1f%%, worst %+6.1f%% (%s)\n", group.c_str(), d.size(),
                  100 * median(d), 100 * worst->difference(), worst->name.c_str());
    }
    std::vector<Figure> sorted = figures.list();
    std::sort(sorted.begin(), sorted.end(),
              [](const Figure& x, const Figure& y) { return std::abs(x.difference()) > std::abs(y.difference()); });
    std::vector<double> all;
    for (const Figure& f : sorted) all.push_back(std::abs(f.difference()));
    std::printf("  all         %3zu figures: median |difference| %5.1f%%; the largest:\n", all.size(), 100 * median(all));
    for (size_t i = 0; i < std::min<size_t>(sorted.size(), static_cast<size_t>(options.top)); ++i)
      std::printf("    %+7.1f%%  %s: %.4g -> %.4g\n", 100 * sorted[i].difference(), sorted[i].name.c_str(), sorted[i].a,
                  sorted[i].b);

    // What they predict: the validation matrix planned on each.
    const ModelSpec model = load_model(options.model, profile_dir(options.profiles));
    const int64_t ranks = options.ranks > 0 ? options.ranks : a.gpus_per_node;
    const std::vector<MatrixConfig> configs = validation_matrix(ranks, model, options.seq_len, options.quick);
    const MatrixSetting setting{ranks, options.model, options.profiles, options.seq_len, options.global_batch_tokens, options.precision};
    const fs::path dir =
        options.out.empty() ? fs::temp_directory_path() / ("moeplan-compare-" + std::to_string(::getpid())) : fs::path(options.out);
    fs::create_directories(dir);
    std::printf("predicted step time of the validation matrix, %s on %lld ranks:\n", options.model.c_str(),
                static_cast<long long>(ranks));
    std::vector<double> d;
    std::string worst_name;
    double worst = 0;
    for (const MatrixConfig& c : configs) {
      double step[2] = {0, 0};
      for (int k = 0; k < 2; ++k) {
        const std::string plan = (dir / (c.name + (k == 0 ? "-first" : "-second") + ".json")).string();
        step[k] = pinned_plan(setting, c, k == 0 ? options.first : options.second, plan).prediction.step_time_s;
      }
      const double diff = step[1] / step[0] - 1;
      d.push_back(std::abs(diff));
      if (std::abs(diff) >= std::abs(worst)) {
        worst = diff;
        worst_name = c.name;
      }
      std::printf("  %-32s %8.3f s %8.3f s  %+6.1f%%\n", c.name.c_str(), step[0], step[1], 100 * diff);
    }
    if (options.out.empty()) fs::remove_all(dir);
    const double median_d = median(d);
    std::printf("predicted step time: median |difference| %.1f%%, worst %+.1f%% (%s)\n", 100 * median_d, 100 * worst,
                worst_name.c_str());
    if (!options.check) return kExitOk;
    if (std::abs(worst) <= options.max_difference) return kExitOk;
    std::fprintf(stderr, "moeplan: compare-profiles: bound broken: predicted step time of %s differs by %.1f%% > %.1f%%\n",
                 worst_name.c_str(), 100 * std::abs(worst), 100 * options.max_difference);
    return kExitNoPlan;
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", l.c_str());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: compare-profiles: %s\n", e.what());
    return 1;
  }
}

}  // namespace moeplan::validation
