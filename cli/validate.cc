// `moeplan validate`: plan, run and compare a matrix of configurations on this machine, and
// say how far the predictions were from what was measured.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "commands.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/fit.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "profiles.h"

extern char** environ;

namespace moeplan::cli {

namespace fs = std::filesystem;

namespace {

std::string self_path() {
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n <= 0) throw std::runtime_error("cannot find this program (/proc/self/exe)");
  self.resize(static_cast<size_t>(n));
  return self;
}

// Runs argv with its output into log; the exit code (or 128 + signal).
int run_logged(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return 127;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

struct Config {
  std::string name;
  int64_t e = 1, s = 1, mbs = 1;
  std::string checkpointing = "none";
  bool offload = false;
};

// Layouts of `ranks` ranks (every degree a power of two here), each with a different mix of
// checkpointing, offloading and micro-batch size.
std::vector<Config> matrix(int64_t ranks, int64_t experts, bool quick) {
  std::vector<std::pair<int64_t, int64_t>> layouts;  // (E, S)
  layouts.emplace_back(1, 1);
  if (ranks > 1 && experts % ranks == 0) layouts.emplace_back(ranks, 1);
  if (ranks > 1) layouts.emplace_back(1, ranks);
  if (ranks >= 4 && experts % 2 == 0) layouts.emplace_back(2, ranks / 2);
  struct Variant {
    const char* ckpt;
    bool offload;
    int64_t mbs;
  };
  const std::vector<Variant> variants{{"none", false, 1}, {"none", false, 4},     {"full", false, 2},
                                      {"selective", true, 2}, {"selective", false, 4}, {"full", true, 2}};
  std::vector<Config> out;
  const size_t count = quick ? 4 : 10;
  for (size_t i = 0; out.size() < count && i < layouts.size() * variants.size(); ++i) {
    const auto& [e, s] = layouts[i % layouts.size()];
    const Variant& v = variants[(i + i / layouts.size()) % variants.size()];
    Config c;
    c.e = e;
    c.s = s;
    c.mbs = v.mbs;
    c.checkpointing = v.ckpt;
    c.offload = v.offload;
    char name[64];
    std::snprintf(name, sizeof name, "E%lldS%lldR%lld-%s%s-mbs%lld", static_cast<long long>(e),
                  static_cast<long long>(s), static_cast<long long>(ranks / (e * s)), v.ckpt, v.offload ? "-offload" : "",
                  static_cast<long long>(v.mbs));
    c.name = name;
    if (std::none_of(out.begin(), out.end(), [&](const Config& o) { return o.name == c.name; })) out.push_back(c);
  }
  return out;
}

struct Row {
  Config config;
  std::string parallel;
  double predicted_s = 0, measured_s = 0, predicted_tps = 0, measured_tps = 0;
  double predicted_bytes = 0, measured_bytes = 0;
  double step_error() const { return (measured_s - predicted_s) / predicted_s; }
  double memory_error() const { return (measured_bytes - predicted_bytes) / predicted_bytes; }
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

int run_validate(const ValidateArgs& args) {
  try {
    if (!fs::exists(args.data + "/manifest.json"))
      throw InputError("--data", {{"", args.data + " has no manifest.json; prepare it with `moeplan data prepare`"}});
    const std::string self = self_path();
    fs::create_directories(args.out);
    // The profile decides how many ranks a node has: the matrix fills one node.
    const Json profile = read_json_file(args.profile);
    int64_t ranks = args.ranks;
    if (ranks == 0) {
      const Json& g = profile.at("gpus_per_node");
      ranks = g.is_object() ? g.at("value").get<int64_t>() : g.get<int64_t>();
    }
    const ModelSpec model = load_model(args.model, profile_dir(args.profiles));
    const std::vector<Config> configs = matrix(ranks, model.num_experts, args.quick);
    std::vector<Row> rows;
    std::printf("validate: %zu configurations of %s on %lld ranks, profile %s, %lld steps each\n", configs.size(),
                args.model.c_str(), static_cast<long long>(ranks), args.profile.c_str(),
                static_cast<long long>(args.steps));
    for (size_t i = 0; i < configs.size(); ++i) {
      const Config& c = configs[i];
      const std::string dir = args.out + "/" + c.name;
      fs::remove_all(dir);
      fs::create_directories(dir);
      std::vector<std::string> search{self,
                                      "search",
                                      "--gpus",
                                      std::to_string(ranks),
                                      "--instance",
                                      args.profile,
                                      "--model",
                                      args.model,
                                      "--seq-len",
                                      std::to_string(args.seq_len),
                                      "--global-batch-tokens",
                                      std::to_string(args.global_batch_tokens),
                                      "--precision",
                                      args.precision,
                                      "--max-micro-batch",
                                      "64",
                                      "--expert-parallel-degree",
                                      std::to_string(c.e),
                                      "--hybrid-shard-degree",
                                      std::to_string(c.s),
                                      "--checkpointing",
                                      c.checkpointing,
                                      "--offload",
                                      c.offload ? "on" : "off",
                                      "--micro-batch",
                                      std::to_string(c.mbs),
                                      "--out",
                                      dir + "/plan.json"};
      if (!args.profiles.empty()) search.insert(search.end(), {"--profiles", args.profiles});
      if (run_logged(search, dir + "/search.log") != 0)
        throw std::runtime_error(c.name + ": search found no plan: " + last_line(dir + "/search.log"));
      const std::vector<std::string> run{self, "run", dir + "/plan.json", "--data", args.data, "--out", dir + "/run",
                                         "--steps", std::to_string(args.steps)};
      if (run_logged(run, dir + "/run.log") != 0)
        throw std::runtime_error(c.name + ": run failed: " + last_line(dir + "/run.log"));
      const Json report = read_json_file(dir + "/run/report.json");
      Row r;
      r.config = c;
      r.parallel = report.at("plan").at("parallel").get<std::string>();
      r.predicted_s = report.at("predicted").at("step_time_s").get<double>();
      r.measured_s = report.at("measured").at("step_time_s").get<double>();
      r.predicted_tps = report.at("predicted").at("tokens_per_s").get<double>();
      r.measured_tps = report.at("measured").at("tokens_per_s").get<double>();
      r.predicted_bytes = report.at("predicted").at("device_bytes_per_rank").get<double>();
      r.measured_bytes = report.at("measured").at("peak_rss_bytes").get<double>();
      rows.push_back(r);
      std::printf("  [%2zu/%zu] %-34s predicted %7.3f s  measured %7.3f s  %+5.0f%%   memory %+4.0f%%\n", i + 1,
                  configs.size(), c.name.c_str(), r.predicted_s, r.measured_s, 100 * r.step_error(),
                  100 * r.memory_error());
      std::fflush(stdout);
    }

    std::vector<double> errors, memory_errors, predicted, measured;
    for (const Row& r : rows) {
      errors.push_back(std::abs(r.step_error()));
      memory_errors.push_back(std::abs(r.memory_error()));
      predicted.push_back(r.predicted_s);
      measured.push_back(r.measured_s);
    }
    const double median_error = median(errors);
    const double worst_error = *std::max_element(errors.begin(), errors.end());
    const double worst_memory = *std::max_element(memory_errors.begin(), memory_errors.end());
    const double tau = kendall_tau(predicted, measured);
    const size_t best_predicted = static_cast<size_t>(std::min_element(predicted.begin(), predicted.end()) - predicted.begin());
    const size_t best_measured = static_cast<size_t>(std::min_element(measured.begin(), measured.end()) - measured.begin());

    // The table, as Markdown.
    std::string md = "| configuration | plan | predicted step (s) | measured step (s) | error | predicted tokens/s | "
                     "measured tokens/s | predicted memory (MiB) | measured peak RSS (MiB) | error |\n"
                     "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    char line[512];
    for (const Row& r : rows) {
      std::snprintf(line, sizeof line, "| %s | %s | %.3f | %.3f | %+.1f%% | %.0f | %.0f | %.0f | %.0f | %+.1f%% |\n",
                    r.config.name.c_str(), r.parallel.c_str(), r.predicted_s, r.measured_s, 100 * r.step_error(),
                    r.predicted_tps, r.measured_tps, r.predicted_bytes / (1 << 20), r.measured_bytes / (1 << 20),
                    100 * r.memory_error());
      md += line;
    }
    std::snprintf(line, sizeof line,
                  "\nstep time: median |error| %.1f%%, worst %.1f%%; peak memory: worst |error| %.1f%%; Kendall tau "
                  "(predicted vs measured order) %.2f; best predicted %s, best measured %s\n",
                  100 * median_error, 100 * worst_error, 100 * worst_memory, tau, rows[best_predicted].config.name.c_str(),
                  rows[best_measured].config.name.c_str());
    md += line;
    write_file_atomic(args.out + "/validation.md", md);
    write_file_atomic(args.out + "/validation.svg",
                      scatter_svg(rows, args.model + " on " + std::to_string(ranks) + " CPU ranks: step time"));
    OrderedJson j;
    j["schema_version"] = 1;
    j["profile"] = args.profile;
    j["model"] = args.model;
    j["ranks"] = ranks;
    j["steps"] = args.steps;
    OrderedJson list = OrderedJson::array();
    for (const Row& r : rows)
      list.push_back({{"name", r.config.name},
                      {"parallel", r.parallel},
                      {"predicted_step_time_s", r.predicted_s},
                      {"measured_step_time_s", r.measured_s},
                      {"step_time_error", r.step_error()},
                      {"predicted_tokens_per_s", r.predicted_tps},
                      {"measured_tokens_per_s", r.measured_tps},
                      {"predicted_bytes_per_rank", r.predicted_bytes},
                      {"measured_peak_rss_bytes", r.measured_bytes},
                      {"memory_error", r.memory_error()}});
    j["configurations"] = list;
    j["summary"] = {{"median_abs_step_time_error", median_error},
                    {"worst_abs_step_time_error", worst_error},
                    {"worst_abs_memory_error", worst_memory},
                    {"kendall_tau", tau},
                    {"best_predicted", rows[best_predicted].config.name},
                    {"best_measured", rows[best_measured].config.name}};
    write_file_atomic(args.out + "/validation.json", j.dump(2) + "\n");
    std::fputs(line, stdout);
    std::printf("wrote %s/validation.md, validation.svg, validation.json\n", args.out.c_str());

    if (!args.check) return kExitOk;
    // Each broken bound gets a line; errors in percent, tau as is.
    int broken = 0;
    auto bound = [&](bool ok, const char* what, double value, const char* op, double limit, double scale) {
      if (ok) return;
      std::fprintf(stderr, "moeplan: validate: bound broken: %s %.2f %s %.2f\n", what, scale * value, op, scale * limit);
      ++broken;
    };
    bound(median_error <= args.max_median_error, "median step-time error (%)", median_error, ">", args.max_median_error, 100);
    bound(worst_error <= args.max_worst_error, "worst step-time error (%)", worst_error, ">", args.max_worst_error, 100);
    bound(worst_memory <= args.max_memory_error, "worst memory error (%)", worst_memory, ">", args.max_memory_error, 100);
    bound(tau >= args.min_kendall, "Kendall tau", tau, "<", args.min_kendall, 1);
    return broken == 0 ? kExitOk : kExitNoPlan;
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", l.c_str());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: validate: %s\n", e.what());
    return 1;
  }
}

}  // namespace moeplan::cli
