// `moeplan validate`: plan, run and compare a matrix of configurations on this machine, and
// say how far the predictions were from what was measured.
#include "moeplan/validation/validate.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/core/run_report.h"
#include "moeplan/core/step_record.h"
#include "moeplan/validation/matrix.h"
#include "moeplan/validation/routing_check.h"

namespace moeplan::validation {

namespace fs = std::filesystem;

namespace {

// How long each processor this process may run on takes for the same fixed integer work,
// one after another (pinned to each in turn), in seconds. On a shared machine a processor
// can run much slower for a while (another tenant on its core); the ranks then run slower.
std::vector<double> processor_probe() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  std::vector<double> seconds;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) continue;
    double best = 1e30;
    for (int k = 0; k < 3; ++k) {
      const auto start = std::chrono::steady_clock::now();
      volatile uint64_t x = 1;
      for (int i = 0; i < 2'000'000; ++i) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    seconds.push_back(best);
  }
  ::sched_setaffinity(0, sizeof allowed, &allowed);
  return seconds;
}

// One run of a configuration.
struct Round {
  double measured_s = 0, measured_tps = 0, measured_bytes = 0;
  double slowest_processor = 1;  // the probe before the run: slowest processor / fastest seen
  double steal = 0;  // the machine's share a hypervisor took over the run's steps (RunReport::mean_steal)
  // The median over the same steps of each step predicted from its measured expert loads
  // (routing_check.h): the plan's prediction with the run's own routing in it.
  double routed_s = 0;
};

struct Row {
  MatrixConfig config;
  std::string parallel;
  double predicted_s = 0, predicted_tps = 0, predicted_bytes = 0;
  std::vector<Round> rounds;
  // Over the rounds: the fastest round's step time and tokens/s (the machine least
  // disturbed), the median round's step time, the largest peak memory.
  double measured_s = 0, measured_tps = 0, median_s = 0, measured_bytes = 0, routed_s = 0;
  void summarize() {
    std::vector<double> times;
    for (const Round& r : rounds) {
      times.push_back(r.measured_s);
      if (measured_s == 0 || r.measured_s < measured_s) {
        measured_s = r.measured_s;
        measured_tps = r.measured_tps;
        routed_s = r.routed_s;
      }
      measured_bytes = std::max(measured_bytes, r.measured_bytes);
    }
    median_s = median(times);
  }
  double median_error() const { return relative_error(median_s, predicted_s); }
  double step_error() const { return relative_error(measured_s, predicted_s); }
  double routed_error() const { return relative_error(measured_s, routed_s); }
  double memory_error() const { return relative_error(measured_bytes, predicted_bytes); }
};

// Predicted against measured step time, log-log, with the diagonal and a +-10% band.
std::string scatter_svg(const std::vector<Row>& rows, const std::string& title) {
  double lo = 1e30, hi = 0;
  for (const Row& r : rows) {
    lo = std::min({lo, r.predicted_s, r.measured_s});
    hi = std::max({hi, r.predicted_s, r.measured_s});
  }
  lo = std::log10(lo / 1.3);
  hi = std::log10(hi * 1.3);
  const double size = 420, margin = 60;
  auto px = [&](double v) { return margin + (std::log10(v) - lo) / (hi - lo) * size; };
  auto py = [&](double v) { return margin + size - (std::log10(v) - lo) / (hi - lo) * size; };
  std::string svg;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
                "font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                size + 2 * margin, size + 2 * margin);
  svg += buf;
  std::snprintf(buf, sizeof buf, "<text x=\"%.0f\" y=\"20\" text-anchor=\"middle\" font-size=\"13\">%s</text>\n",
                margin + size / 2, title.c_str());
  svg += buf;
  const double a = std::pow(10, lo), b = std::pow(10, hi);
  std::snprintf(buf, sizeof buf,
                "<polygon points=\"%.1f,%.1f %.1f,%.1f %.1f,%.1f %.1f,%.1f\" fill=\"#e8f0ff\"/>\n"
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\" stroke-dasharray=\"4\"/>\n",
                px(a), py(a * 1.1), px(b / 1.1), py(b), px(b), py(b * 0.9), px(a / 0.9), py(a), px(a), py(a), px(b),
                py(b));
  svg += buf;
  std::snprintf(buf, sizeof buf,
                "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"black\"/>\n"
                "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">predicted step time (s)</text>\n"
                "<text x=\"15\" y=\"%.0f\" transform=\"rotate(-90 15 %.0f)\" text-anchor=\"middle\">measured step time "
                "(s)</text>\n",
                margin, margin, size, size, margin + size / 2, margin + size + 40, margin + size / 2, margin + size / 2);
  svg += buf;
  for (double t = std::pow(10, std::floor(lo)); t <= b; t *= 10)
    for (double k : {1.0, 2.0, 5.0}) {
      const double v = t * k;
      if (v < a || v > b) continue;
      std::snprintf(buf, sizeof buf,
                    "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n<text x=\"%.0f\" y=\"%.1f\" "
                    "text-anchor=\"end\">%g</text>\n",
                    px(v), margin + size + 16, v, margin - 6, py(v) + 4, v);
      svg += buf;
    }
  for (const Row& r : rows) {
    std::snprintf(buf, sizeof buf,
                  "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#c03030\"><title>%s: predicted %.3f s, measured "
                  "%.3f s</title></circle>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"9\">%s</text>\n",
                  px(r.predicted_s), py(r.measured_s), r.config.name.c_str(), r.predicted_s, r.measured_s,
                  px(r.predicted_s) + 6, py(r.measured_s) - 4, r.config.name.c_str());
    svg += buf;
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace

namespace {

// The matrix over its configurations: step-time and memory errors, and the order.
struct Summary {
  double median_error = 0, worst_error = 0, worst_memory = 0, median_round_median_error = 0,
         median_round_worst_error = 0, tau = 0;
  size_t best_predicted = 0, best_measured = 0;
  // The same with each run's own per-micro-batch routing in its prediction.
  double routed_median_error = 0, routed_worst_error = 0, routed_tau = 0;
};

Summary summarize(const std::vector<Row>& rows) {
  std::vector<double> errors, median_errors, memory_errors, predicted, measured, routed_errors, routed;
  for (const Row& r : rows) {
    routed_errors.push_back(std::abs(r.routed_error()));
    routed.push_back(r.routed_s);
    errors.push_back(std::abs(r.step_error()));
    median_errors.push_back(std::abs(r.median_error()));
    memory_errors.push_back(std::abs(r.memory_error()));
    predicted.push_back(r.predicted_s);
    measured.push_back(r.measured_s);
  }
  Summary s;
  s.median_error = median(errors);
  s.worst_error = *std::max_element(errors.begin(), errors.end());
  s.worst_memory = *std::max_element(memory_errors.begin(), memory_errors.end());
  s.median_round_median_error = median(median_errors);
  s.median_round_worst_error = *std::max_element(median_errors.begin(), median_errors.end());
  s.tau = kendall_tau(predicted, measured);
  s.routed_median_error = median(routed_errors);
  s.routed_worst_error = *std::max_element(routed_errors.begin(), routed_errors.end());
  s.routed_tau = kendall_tau(routed, measured);
  s.best_predicted = static_cast<size_t>(std::min_element(predicted.begin(), predicted.end()) - predicted.begin());
  s.best_measured = static_cast<size_t>(std::min_element(measured.begin(), measured.end()) - measured.begin());
  return s;
}

// The layouts' families: experts, shards and replicas; a tensor split; a pipeline.
std::string family_of(const MatrixConfig& c) { return c.t > 1 ? "tensor split" : c.p > 1 ? "pipeline" : "[R, S, E]"; }

// Per family with configurations: its count, median and worst |step-time error| (fastest round).
struct FamilyErrors {
  std::string family;
  size_t count = 0;
  double median_error = 0, worst_error = 0;
};

std::vector<FamilyErrors> family_errors(const std::vector<Row>& rows) {
  std::vector<FamilyErrors> out;
  for (const char* family : {"[R, S, E]", "tensor split", "pipeline"}) {
    std::vector<double> errors;
    for (const Row& r : rows)
      if (family_of(r.config) == family) errors.push_back(std::abs(r.step_error()));
    if (errors.empty()) continue;
    out.push_back({family, errors.size(), median(errors), *std::max_element(errors.begin(), errors.end())});
  }
  return out;
}

// validation.md (the table), validation.svg (the scatter) and validation.json in options.out; the
// summary line on stdout.
void write_validation(const ValidateOptions& options, const std::vector<Row>& rows, const Summary& s, int64_t ranks,
                      int64_t rounds) {
  // The table, as Markdown.
  std::string md = "| configuration | plan | predicted step (s) | measured step (s) | error | with its routing (s) | "
                   "error | each round (s) | slowest processor | steal | predicted tokens/s | measured tokens/s | "
                   "predicted memory (MiB) | measured peak RSS (MiB) | error |\n"
                   "|---|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|\n";
  char line[1024];
  for (const Row& r : rows) {
    std::string each, probe, steal;
    for (const Round& x : r.rounds) {
      char v[32];
      std::snprintf(v, sizeof v, "%s%.3f", each.empty() ? "" : " ", x.measured_s);
      each += v;
      std::snprintf(v, sizeof v, "%s%.2f", probe.empty() ? "" : " ", x.slowest_processor);
      probe += v;
      std::snprintf(v, sizeof v, "%s%.1f%%", steal.empty() ? "" : " ", 100 * x.steal);
      steal += v;
    }
    std::snprintf(line, sizeof line,
                  "| %s | %s | %.3f | %.3f | %+.1f%% | %.3f | %+.1f%% | %s | %s | %s | %.0f | %.0f | %.0f | %.0f | %+.1f%% |\n",
                  r.config.name.c_str(), r.parallel.c_str(), r.predicted_s, r.measured_s, 100 * r.step_error(),
                  r.routed_s, 100 * r.routed_error(), each.c_str(), probe.c_str(), steal.c_str(), r.predicted_tps, r.measured_tps, r.predicted_bytes / (1 << 20),
                  r.measured_bytes / (1 << 20), 100 * r.memory_error());
    md += line;
  }
  std::snprintf(line, sizeof line,
                "\nstep time (fastest of %lld rounds): median |error| %.1f%%, worst %.1f%%; peak memory: worst "
                "|error| %.1f%%; Kendall tau (predicted vs measured order) %.2f; best predicted %s, best measured "
                "%s\n",
                static_cast<long long>(rounds), 100 * s.median_error, 100 * s.worst_error, 100 * s.worst_memory, s.tau,
                rows[s.best_predicted].config.name.c_str(), rows[s.best_measured].config.name.c_str());
  md += line;
  {
    char more[256];
    std::snprintf(more, sizeof more,
                  "with each run's measured routing (every step predicted from its micro-batches' expert loads): "
                  "median |error| %.1f%%, worst %.1f%%, Kendall tau %.2f\n",
                  100 * s.routed_median_error, 100 * s.routed_worst_error, s.routed_tau);
    md += more;
  }
  for (const FamilyErrors& f : family_errors(rows)) {
    char more[256];
    std::snprintf(more, sizeof more, "%s layouts (%zu): median |error| %.1f%%, worst %.1f%%\n", f.family.c_str(), f.count,
                  100 * f.median_error, 100 * f.worst_error);
    md += more;
  }
  if (rounds > 1) {
    char more[256];
    std::snprintf(more, sizeof more, "step time (median round): median |error| %.1f%%, worst %.1f%%\n",
                  100 * s.median_round_median_error, 100 * s.median_round_worst_error);
    md += more;
  }
  write_file_atomic(options.out + "/validation.md", md);
  write_file_atomic(options.out + "/validation.svg",
                    scatter_svg(rows, options.model + " on " + std::to_string(ranks) + " CPU ranks: step time"));
  Json j;
  j["schema_version"] = 1;
  j["profile"] = options.profile;
  j["model"] = options.model;
  j["ranks"] = ranks;
  j["steps"] = options.steps;
  j["rounds"] = rounds;
  Json list = Json::array();
  for (const Row& r : rows) {
    Json each = Json::array();
    for (const Round& x : r.rounds)
      each.push_back({{"measured_step_time_s", x.measured_s},
                      {"measured_tokens_per_s", x.measured_tps},
                      {"measured_peak_rss_bytes", x.measured_bytes},
                      {"slowest_processor", x.slowest_processor},
                      {"steal", x.steal},
                      {"routed_step_time_s", x.routed_s}});
    list.push_back({{"name", r.config.name},
                    {"parallel", r.parallel},
                    {"predicted_step_time_s", r.predicted_s},
                    {"measured_step_time_s", r.measured_s},
                    {"step_time_error", r.step_error()},
                    {"routed_step_time_s", r.routed_s},
                    {"routed_step_time_error", r.routed_error()},
                    {"median_round_step_time_s", r.median_s},
                    {"median_round_step_time_error", r.median_error()},
                    {"predicted_tokens_per_s", r.predicted_tps},
                    {"measured_tokens_per_s", r.measured_tps},
                    {"predicted_bytes_per_rank", r.predicted_bytes},
                    {"measured_peak_rss_bytes", r.measured_bytes},
                    {"memory_error", r.memory_error()},
                    {"rounds", each}});
  }
  j["configurations"] = list;
  Json families = Json::array();
  for (const FamilyErrors& f : family_errors(rows))
    families.push_back({{"layouts", f.family},
                        {"configurations", f.count},
                        {"median_abs_step_time_error", f.median_error},
                        {"worst_abs_step_time_error", f.worst_error}});
  j["by_layout"] = families;
  j["summary"] = {{"median_abs_step_time_error", s.median_error},
                  {"worst_abs_step_time_error", s.worst_error},
                  {"worst_abs_memory_error", s.worst_memory},
                  {"median_round_median_abs_step_time_error", s.median_round_median_error},
                  {"median_round_worst_abs_step_time_error", s.median_round_worst_error},
                  {"kendall_tau", s.tau},
                  {"routed_median_abs_step_time_error", s.routed_median_error},
                  {"routed_worst_abs_step_time_error", s.routed_worst_error},
                  {"routed_kendall_tau", s.routed_tau},
                  {"best_predicted", rows[s.best_predicted].config.name},
                  {"best_measured", rows[s.best_measured].config.name}};
  write_file_atomic(options.out + "/validation.json", j.dump(2) + "\n");
  std::fputs(line, stdout);
  std::printf("wrote %s/validation.md, validation.svg, validation.json\n", options.out.c_str());

}

// The median over a run's warm steps (all but the first, as the run's report takes them) of
// each step predicted from its own measured routing.
double routed_step_s(const std::string& plan_path, const std::string& metrics) {
  const std::vector<StepRecord> steps = read_step_records(metrics);
  const int64_t from = steps.size() > 1 ? steps.front().step + 1 : 1;
  const RoutingCheck check = predict_steps_from_routing(read_plan_file(plan_path), steps, from, metrics);
  std::vector<double> predicted;
  for (const PredictedStep& p : check.steps) predicted.push_back(p.predicted_s);
  return median(predicted);
}

// Each broken bound of --check on stderr; the exit code.
int check_bounds(const ValidateOptions& options, const Summary& s) {
  // Each broken bound gets a line; errors in percent, s.tau as is.
  int broken = 0;
  auto bound = [&](bool ok, const char* what, double value, const char* op, double limit, double scale) {
    if (ok) return;
    std::fprintf(stderr, "moeplan: validate: bound broken: %s %.2f %s %.2f\n", what, scale * value, op, scale * limit);
    ++broken;
  };
  bound(s.median_error <= options.max_median_error, "median step-time error (%)", s.median_error, ">", options.max_median_error, 100);
  bound(s.worst_error <= options.max_worst_error, "worst step-time error (%)", s.worst_error, ">", options.max_worst_error, 100);
  bound(s.worst_memory <= options.max_memory_error, "worst memory error (%)", s.worst_memory, ">", options.max_memory_error, 100);
  bound(s.tau >= options.min_kendall, "Kendall tau", s.tau, "<", options.min_kendall, 1);
  return broken == 0 ? kExitOk : kExitNoPlan;
}

}  // namespace

int run_validation(const ValidateOptions& options) {
  try {
    if (!fs::exists(options.data + "/manifest.json"))
      throw InputError("--data", {{"", options.data + " has no manifest.json; prepare it with `moeplan data prepare`"}});
    const std::string self = self_path();
    fs::create_directories(options.out);
    // The profile decides how many ranks a node has: the matrix fills one node.
    const Json profile = read_json_file(options.profile);
    int64_t ranks = options.ranks;
    if (ranks == 0) {
      const Json& g = profile.at("gpus_per_node");
      ranks = g.is_object() ? g.at("value").get<int64_t>() : g.get<int64_t>();
    }
    const ModelSpec model = load_model(options.model, profile_dir(options.profiles));
    const std::vector<MatrixConfig> configs = validation_matrix(ranks, model, options.seq_len, options.quick);
    const MatrixSetting setting{ranks, options.model, options.profiles, options.seq_len, options.global_batch_tokens, options.precision};
    const int64_t rounds = options.rounds > 0 ? options.rounds : (options.quick ? 1 : 3);
    std::vector<Row> rows(configs.size());
    std::printf("validate: %zu configurations of %s on %lld ranks, profile %s, %lld steps each, %lld round%s\n",
                configs.size(), options.model.c_str(), static_cast<long long>(ranks), options.profile.c_str(),
                static_cast<long long>(options.steps), static_cast<long long>(rounds), rounds == 1 ? "" : "s");
    for (size_t i = 0; i < configs.size(); ++i) {
      const MatrixConfig& c = configs[i];
      rows[i].config = c;
      const std::string dir = options.out + "/" + c.name;
      fs::remove_all(dir);
      fs::create_directories(dir);
      pinned_plan(setting, c, options.profile, dir + "/plan.json");
    }
    // Every round runs the whole matrix, every other round in reverse order, so that a slow
    // spell of the machine falls on different configurations each time.
    double fastest_probe = 1e30;
    for (int64_t round = 1; round <= rounds; ++round) {
      for (size_t k = 0; k < configs.size(); ++k) {
        const size_t i = round % 2 == 1 ? k : configs.size() - 1 - k;
        const MatrixConfig& c = configs[i];
        Row& row = rows[i];
        const std::string dir = options.out + "/" + c.name;
        const std::string out = dir + "/run-" + std::to_string(round);
        const std::vector<double> probe = processor_probe();
        Round r;
        if (!probe.empty()) {
          fastest_probe = std::min(fastest_probe, *std::min_element(probe.begin(), probe.end()));
          r.slowest_processor = *std::max_element(probe.begin(), probe.end()) / fastest_probe;
        }
        const std::vector<std::string> run{self, "run", dir + "/plan.json", "--data", options.data, "--out", out,
                                           "--steps", std::to_string(options.steps)};
        if (run_logged(run, out + ".log") != 0)
          throw std::runtime_error(c.name + ": run failed: " + last_line(out + ".log"));
        const RunReport report = read_run_report(out + "/report.json");
        row.parallel = report.parallel;
        row.predicted_s = report.predicted_step_time_s;
        row.predicted_tps = report.predicted_tokens_per_s;
        row.predicted_bytes = static_cast<double>(report.predicted_bytes_per_rank);
        r.measured_s = report.step_time_s;
        r.measured_tps = report.tokens_per_s;
        r.measured_bytes = static_cast<double>(report.peak_rss_bytes);
        r.steal = report.mean_steal();
        r.routed_s = routed_step_s(dir + "/plan.json", out + "/metrics.jsonl");
        row.rounds.push_back(r);
        std::printf("  round %lld [%2zu/%zu] %-30s predicted %7.3f s  measured %7.3f s  %+5.0f%%   memory %+4.0f%%"
                    "   slowest processor %.2f   steal %4.1f%%\n",
                    static_cast<long long>(round), k + 1, configs.size(), c.name.c_str(), row.predicted_s,
                    r.measured_s, 100 * relative_error(r.measured_s, row.predicted_s),
                    100 * relative_error(r.measured_bytes, row.predicted_bytes), r.slowest_processor, 100 * r.steal);
        std::fflush(stdout);
      }
    }
    for (Row& row : rows) row.summarize();

    const Summary summary = summarize(rows);
    write_validation(options, rows, summary, ranks, rounds);
    if (!options.check) return kExitOk;
    return check_bounds(options, summary);
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", l.c_str());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: validate: %s\n", e.what());
    return 1;
  }
}

}  // namespace moeplan::validation
