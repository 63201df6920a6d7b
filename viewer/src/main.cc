// moeplan-view: `moeplan view` runs here, in a process with Qt and nothing of LibTorch.
//
//   moeplan view trace.json                      the window
//   moeplan view sim.json measured.json          both, the second aligned phase by phase
//   moeplan view run/                            a run folder: its simulated.json and trace.json
//   moeplan view trace.json --png out.png        the whole step as a picture, without a display
//   moeplan view run/ --routing-png map.png      the run's routing as a heat map

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <QApplication>
#include <QGuiApplication>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/core/step_record.h"
#include "moeplan/core/trace.h"
#include "moeplan/viewer/render.h"
#include "moeplan/viewer/routing_map.h"
#include "moeplan/viewer/timeline.h"
#include "moeplan/viewer/viewer_window.h"

namespace {

bool has_display() {
  for (const char* name : {"DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') return true;
  }
  return false;
}

// Reads the traces, saying how far it got for large files.
std::vector<moeplan::Trace> read_traces(const std::vector<std::string>& paths) {
  std::vector<moeplan::Trace> traces;
  for (const std::string& path : paths) {
    bool said = false;
    traces.push_back(moeplan::read_trace_file(path, [&](const moeplan::TraceReadProgress& p) {
      if (p.file_bytes < (int64_t{16} << 20)) return;  // read in a blink
      std::fprintf(stderr, "\rview: %s: %lld events read (%.0f MB)", path.c_str(), static_cast<long long>(p.events),
                   static_cast<double>(p.file_bytes) / 1e6);
      said = true;
    }));
    if (said) std::fprintf(stderr, "\n");
  }
  return traces;
}

void print_differences(const moeplan::viewer::Timeline& timeline) {
  if (timeline.sources() < 2) return;
  const auto& d = timeline.differences();
  if (d.empty()) {
    std::printf("the traces share no phase (mb<k> forward/backward, optimizer)\n");
    return;
  }
  std::printf("phases that differ most (%s against %s, slowest rank):\n", std::string(timeline.source_name(1)).c_str(),
              std::string(timeline.source_name(0)).c_str());
  for (size_t i = 0; i < d.size() && i < 10; ++i)
    std::printf("  %-16s %10s %10s  %+8.1f%%\n", d[i].phase.c_str(),
                moeplan::viewer::format_duration(std::llround(d[i].first_s * 1e9)).c_str(),
                moeplan::viewer::format_duration(std::llround(d[i].second_s * 1e9)).c_str(),
                d[i].first_s > 0 ? 100.0 * (d[i].second_s - d[i].first_s) / d[i].first_s : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moeplan view: a step's timeline, simulated and measured"};
  app.name("moeplan view");
  std::vector<std::string> paths;
  std::string png;
  int width = 1600, height = 0;
  app.add_option("traces", paths,
                 "trace.json, a simulated and a measured trace of the same plan, or a run folder (moeplan run --out)")
      ->required()->expected(1, 2);
  app.add_option("--png", png, "Draw the whole step into this PNG file instead of opening a window");
  app.add_option("--width", width, "Picture width in pixels")->capture_default_str()->check(CLI::Range(200, 32768));
  app.add_option("--height", height, "Picture height in pixels (default: every lane, at most 8192)")
      ->check(CLI::Range(0, 32768));
  std::string routing_png;
  app.add_option("--routing-png", routing_png,
                 "With a run folder: draw its routing (each expert's slots over the mean, per layer and step, from "
                 "metrics.jsonl) into this PNG file");
  CLI11_PARSE(app, argc, argv);

  if (!routing_png.empty()) {
    if (paths.size() != 1 || !std::filesystem::is_directory(paths[0])) {
      std::fprintf(stderr, "moeplan: error: --routing-png: draws a run folder's routing; give one folder\n");
      return moeplan::kExitBadInput;
    }
    std::vector<moeplan::StepRecord> steps;
    try {
      steps = moeplan::read_step_records(paths[0] + "/metrics.jsonl");
    } catch (const moeplan::InputError& e) {
      for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
      return moeplan::kExitBadInput;
    }
    if (std::getenv("QT_QPA_PLATFORM") == nullptr) qputenv("QT_QPA_PLATFORM", "offscreen");
    QGuiApplication gui(argc, argv);
    const QImage image = moeplan::viewer::render_routing_map(steps, width);
    if (image.isNull()) {
      std::fprintf(stderr, "moeplan: error: %s/metrics.jsonl: no step counts its experts\n", paths[0].c_str());
      return moeplan::kExitBadInput;
    }
    if (!image.save(QString::fromStdString(routing_png), "PNG")) {
      std::fprintf(stderr, "moeplan: error: --routing-png: cannot write %s\n", routing_png.c_str());
      return moeplan::kExitBadInput;
    }
    std::printf("wrote %s (%d x %d)\n", routing_png.c_str(), image.width(), image.height());
    return 0;
  }

  if (paths.size() == 1 && std::filesystem::is_directory(paths[0])) {
    // A run folder: the plan's simulated step beside the measured one.
    const std::string dir = paths[0];
    paths = {dir + "/simulated.json", dir + "/trace.json"};
    for (const std::string& p : paths)
      if (!std::filesystem::exists(p)) {
        std::fprintf(stderr, "moeplan: error: %s: missing; a folder `moeplan run --out` wrote holds simulated.json "
                     "and trace.json\n", p.c_str());
        return moeplan::kExitBadInput;
      }
  }
  std::vector<moeplan::Trace> traces;
  try {
    traces = read_traces(paths);
  } catch (const moeplan::InputError& e) {
    for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
    return moeplan::kExitBadInput;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "moeplan: error: view: not enough memory to hold the traces\n");
    return moeplan::kExitBadInput;
  }
  for (size_t i = 0; i < traces.size(); ++i) {
    if (traces[i].events.empty()) {
      std::fprintf(stderr, "moeplan: error: %s: traceEvents: no complete (\"ph\": \"X\") events to show\n",
                   paths[i].c_str());
      return moeplan::kExitBadInput;
    }
  }
  if (traces.size() > 1) {
    const std::string differ = moeplan::plan_difference(traces[0], traces[1]);
    if (!differ.empty())
      std::fprintf(stderr, "view: warning: %s; their phases are put side by side by name only\n", differ.c_str());
  }
  std::optional<moeplan::Trace> second;
  if (traces.size() > 1) second = std::move(traces[1]);
  const moeplan::viewer::Timeline timeline(std::move(traces[0]), std::move(second));
  print_differences(timeline);

  if (!png.empty()) {
    // No display needed: Qt's offscreen platform, unless the caller chose one.
    if (std::getenv("QT_QPA_PLATFORM") == nullptr) qputenv("QT_QPA_PLATFORM", "offscreen");
    QGuiApplication gui(argc, argv);
    const QImage image = moeplan::viewer::render_image(timeline, width, height);
    if (!image.save(QString::fromStdString(png), "PNG")) {
      std::fprintf(stderr, "moeplan: error: --png: cannot write %s\n", png.c_str());
      return moeplan::kExitBadInput;
    }
    std::printf("wrote %s (%d x %d)\n", png.c_str(), image.width(), image.height());
    return 0;
  }

  if (!has_display()) {
    std::fprintf(stderr,
                 "moeplan: error: view: no display (DISPLAY is not set); draw a picture with --png out.png, "
                 "or set QT_QPA_PLATFORM\n");
    return moeplan::kExitBadInput;
  }
  QApplication qt(argc, argv);
  std::string title = "moeplan view: " + paths[0];
  if (paths.size() > 1) title += " and " + paths[1];
  moeplan::viewer::ViewerWindow window(timeline, QString::fromStdString(title));
  window.resize(1400, 800);
  window.show();
  return QApplication::exec();
}
