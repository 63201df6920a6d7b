// Speed of the timeline viewer on simulated steps of Mixtral 8x7B on p4d.24xlarge nodes, every
// rank simulated: 16, 256 and 1,024 ranks. Opening is reading the trace file, building the
// lanes and the first paint of a 1600 x 900 window; panning is one repaint of a zoomed window.
// Drawn on Qt's offscreen platform (no display needed).

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>

#include <QGuiApplication>
#include <QImage>
#include <QPainter>

#include "moeplan/core/plan.h"
#include "moeplan/planner/search.h"
#include "moeplan/simulator/step.h"
#include "moeplan/viewer/render.h"
#include "moeplan/viewer/timeline.h"
#include "test_support.h"

namespace moeplan::viewer {
namespace {

const QSize kWindow(1600, 900);

// The trace file of the best plan for this many GPUs, written once per run of the program.
const std::string& trace_file(int64_t gpus) {
  static std::map<int64_t, std::string> files;
  auto it = files.find(gpus);
  if (it != files.end()) return it->second;
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", gpus);
  const planner::SearchOptions o = test::search_options(gpus);
  const planner::SearchResult r = planner::search(model, cluster, o);
  const RunConfig config{model, cluster, r.ranked.front().parallel, o.moe, o.training};
  sim::StepSimOptions sim_options;
  sim_options.all_ranks = true;
  const std::string path = "/tmp/moeplan-bench-trace-" + std::to_string(gpus) + ".json";
  write_file_atomic(path, to_json(sim::step_trace(sim::simulate_step(config, sim_options))).dump());
  return files.emplace(gpus, path).first->second;
}

void describe_trace(benchmark::State& state, const Timeline& t, const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  long bytes = 0;
  if (f != nullptr) {
    std::fseek(f, 0, SEEK_END);
    bytes = std::ftell(f);
    std::fclose(f);
  }
  state.counters["events"] = static_cast<double>(t.event_count());
  state.counters["lanes"] = static_cast<double>(t.lanes().size());
  state.counters["MB"] = static_cast<double>(bytes) / 1e6;
}

// Open: read, build the lanes, paint the first window.
void BM_Open(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  QImage window(kWindow, QImage::Format_RGB32);
  int64_t events = 0;
  for (auto _ : state) {
    const Timeline t(read_trace_file(path));
    QPainter p(&window);
    const Renderer r(t);
    const PaintStats s = r.paint(p, window.size(), View{t.begin_ns(), t.end_ns(), 0});
    benchmark::DoNotOptimize(s.rects_drawn);
    events = t.event_count();
  }
  state.counters["events"] = static_cast<double>(events);
}
BENCHMARK(BM_Open)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(2.0);

// The parts of opening apart.
void BM_ReadTraceFile(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(read_trace_file(path).events.size());
}
BENCHMARK(BM_ReadTraceFile)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_BuildLanes(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  const Trace trace = read_trace_file(path);
  for (auto _ : state) benchmark::DoNotOptimize(Timeline(trace).lanes().size());
}
BENCHMARK(BM_BuildLanes)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_FirstPaint(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  const Timeline t(read_trace_file(path));
  const Renderer r(t);
  QImage window(kWindow, QImage::Format_RGB32);
  PaintStats s;
  for (auto _ : state) {
    QPainter p(&window);
    s = r.paint(p, window.size(), View{t.begin_ns(), t.end_ns(), 0});
  }
  describe_trace(state, t, path);
  state.counters["boxes_seen"] = static_cast<double>(s.boxes_seen);
  state.counters["rects"] = static_cast<double>(s.rects_drawn);
}
BENCHMARK(BM_FirstPaint)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond);

// Panning a window that shows a tenth of the step, scrolled half-way down the lanes: one
// repaint per pan step of 40 pixels.
void BM_PanRepaint(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  const Timeline t(read_trace_file(path));
  const Renderer r(t);
  QImage window(kWindow, QImage::Format_RGB32);
  const int64_t span = (t.end_ns() - t.begin_ns()) / 10;
  View v{t.begin_ns(), t.begin_ns() + span, std::max(0, r.lanes_height() / 2)};
  const int64_t step = span * 40 / (kWindow.width() - r.layout().label_width);
  PaintStats s;
  for (auto _ : state) {
    v.t0 += step;
    v.t1 += step;
    if (v.t1 > t.end_ns()) {
      v.t0 = t.begin_ns();
      v.t1 = t.begin_ns() + span;
    }
    QPainter p(&window);
    s = r.paint(p, window.size(), v);
  }
  state.counters["rects"] = static_cast<double>(s.rects_drawn);
}
BENCHMARK(BM_PanRepaint)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond);

// The headless picture of the whole step, every lane (`moeplan view --png`).
void BM_RenderWholeStep(benchmark::State& state) {
  const std::string& path = trace_file(state.range(0));
  const Timeline t(read_trace_file(path));
  for (auto _ : state) benchmark::DoNotOptimize(render_image(t, 1600).height());
}
BENCHMARK(BM_RenderWholeStep)->Arg(16)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moeplan::viewer

int main(int argc, char** argv) {
  qputenv("QT_QPA_PLATFORM", "offscreen");
  QGuiApplication app(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
