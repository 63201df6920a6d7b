// The viewer drawn without a display (Qt's offscreen platform): pictures checked pixel by
// pixel, the window driven with Qt Test, and `moeplan view` run as a user would.

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <QApplication>
#include <QImage>
#include <QKeyEvent>
#include <QMouseEvent>
#include <QSignalSpy>
#include <QTest>
#include <QTreeWidget>
#include <QWheelEvent>

#include "moeplan/core/trace.h"
#include "moeplan/viewer/render.h"
#include "moeplan/viewer/routing_map.h"
#include "moeplan/core/step_record.h"
#include "moeplan/viewer/timeline.h"
#include "moeplan/viewer/timeline_widget.h"
#include "moeplan/viewer/viewer_window.h"
#include "test_support.h"

namespace moeplan::viewer {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
constexpr auto op = test::trace_op;

constexpr int64_t kMs = 1'000'000;

// Two ranks: rank 0 computes from 1 to 3 ms and all-reduces from 3 to 4 ms; rank 1 exchanges
// tokens from 0 to 2 ms. Rank 0's memory: 1 MB, 4 MB from 2 ms, 1 MB from 3 ms.
Trace known_trace() {
  Trace t;
  t.source = "simulated";
  t.ranks = 2;
  t.events.push_back(op("mb0.L0.attn_fwd", "compute", 0, TraceStream::kCompute, 1 * kMs, 2 * kMs));
  t.events.push_back(op("grads.all_reduce", "all_reduce", 0, TraceStream::kGradComm, 3 * kMs, 1 * kMs));
  t.events.back().bytes = 3 << 20;
  t.events.push_back(op("mb0.L0.dispatch", "all_to_all", 1, TraceStream::kExpertComm, 0, 2 * kMs));
  t.memory = {{0, 0, 1e6}, {0, 2 * kMs, 4e6}, {0, 3 * kMs, 1e6}};
  return t;
}

size_t lane_index(const Timeline& t, const std::string& label) {
  for (size_t i = 0; i < t.lanes().size(); ++i)
    if (t.lanes()[i].label == label) return i;
  ADD_FAILURE() << "no lane " << label;
  return 0;
}

// The middle of a lane at time t in a picture of the whole step.
QPoint at(const Renderer& r, const Timeline& t, size_t lane, int64_t time, int width) {
  View v;
  v.t0 = t.begin_ns();
  v.t1 = t.end_ns();
  return {static_cast<int>(r.x_of(time, v, width)), r.layout().axis_height + r.lane_top(lane) + r.lane_height(lane) / 2};
}

QColor pixel(const QImage& image, QPoint p) { return image.pixelColor(p); }

// Pixels darker than mid-grey in a rectangle: text is there.
int dark_pixels(const QImage& image, QRect area) {
  int n = 0;
  for (int y = area.top(); y <= area.bottom(); ++y)
    for (int x = area.left(); x <= area.right(); ++x)
      if (image.pixelColor(x, y).lightness() < 110) ++n;
  return n;
}

TEST(Render, BoxesOfTheirKindsColourAtTheirTimes) {
  const Timeline t(known_trace());
  const QImage image = render_image(t, 1000);
  const Renderer r(t);
  ASSERT_EQ(image.height(), r.full_height());
  const size_t compute = lane_index(t, "rank 0 compute"), grads = lane_index(t, "rank 0 grad_comm");
  const size_t exchange = lane_index(t, "rank 1 expert_comm");
  EXPECT_EQ(pixel(image, at(r, t, compute, 2 * kMs, 1000)), kind_colour(Kind::kCompute));
  EXPECT_EQ(pixel(image, at(r, t, grads, 3500'000, 1000)), kind_colour(Kind::kAllReduce));
  EXPECT_EQ(pixel(image, at(r, t, exchange, 1 * kMs, 1000)), kind_colour(Kind::kAllToAll));
  // Where nothing runs, the background.
  EXPECT_EQ(pixel(image, at(r, t, compute, 500'000, 1000)), kBackground);
  EXPECT_EQ(pixel(image, at(r, t, exchange, 3 * kMs, 1000)), kBackground);
  // The compute box starts at 1 ms: the pixel column before it is background, the next one not.
  const QPoint edge = at(r, t, compute, 1 * kMs, 1000);
  EXPECT_EQ(pixel(image, edge - QPoint(2, 0)), kBackground);
  EXPECT_EQ(pixel(image, edge + QPoint(1, 0)), kind_colour(Kind::kCompute));
}

// Two ranks of expert group 0 in two all-to-alls. The first: rank 0 from 0 to 4 ms, rank 1
// from 3 to 4 ms, so rank 0 waited 3 ms for rank 1. The second: rank 0 took 1 ms, rank 1 1.5 ms.
// An all-reduce without a group and a group whose ranks recorded different counts get no wait.
Trace exchange_trace() {
  Trace t;
  t.source = "measured";
  t.ranks = 2;
  auto exchange = [&](int64_t rank, int64_t start, int64_t duration, const char* name = "expert.all_to_all") {
    t.events.push_back(op(name, "all_to_all", rank, TraceStream::kExpertComm, start, duration));
    t.events.back().group = 0;
  };
  exchange(0, 0, 4 * kMs);
  exchange(1, 3 * kMs, 1 * kMs);
  exchange(0, 5 * kMs, 1 * kMs);
  exchange(1, 5 * kMs - kMs / 2, 3 * kMs / 2);
  t.events.push_back(op("world.all_reduce", "all_reduce", 0, TraceStream::kGradComm, 7 * kMs, 2 * kMs));
  t.events.push_back(op("world.all_reduce", "all_reduce", 1, TraceStream::kGradComm, 8 * kMs, 1 * kMs));
  exchange(0, 7 * kMs, 1 * kMs, "expert.all_gather");
  exchange(0, 8 * kMs, 1 * kMs, "expert.all_gather");
  exchange(1, 8 * kMs, 1 * kMs, "expert.all_gather");
  return t;
}

TEST(Render, WaitsForTheGroupsLastRankAreMarked) {
  const Trace trace = exchange_trace();
  EXPECT_EQ(collective_waits(trace), (std::vector<int64_t>{3 * kMs, 0, 0, kMs / 2, 0, 0, 0, 0, 0}));
  const Timeline t(trace);
  const size_t lane0 = lane_index(t, "rank 0 expert_comm");
  ASSERT_EQ(t.lanes()[lane0].boxes.front().wait_ns, 3 * kMs);
  EXPECT_NE(describe(t, t.lanes()[lane0], t.lanes()[lane0].boxes.front()).find("of it 3 ms waiting for the group's last rank"),
            std::string::npos)
      << describe(t, t.lanes()[lane0], t.lanes()[lane0].boxes.front());
  const QImage image = render_image(t, 1000);
  const Renderer r(t);
  const int bottom = r.layout().axis_height + r.lane_top(lane0) + r.lane_height(lane0) - 2;
  const auto x = [&](int64_t time) {
    View v;
    v.t0 = t.begin_ns();
    v.t1 = t.end_ns();
    return static_cast<int>(r.x_of(time, v, 1000));
  };
  // Rank 0's first exchange: dark along its bottom while it waits, the exchange's colour after.
  EXPECT_LT(image.pixelColor(x(1 * kMs), bottom).lightness(), 80);
  EXPECT_EQ(image.pixelColor(x(3 * kMs + kMs / 2), bottom), kind_colour(Kind::kAllToAll));
  EXPECT_EQ(image.pixelColor(x(1 * kMs), r.layout().axis_height + r.lane_top(lane0) + 1), kind_colour(Kind::kAllToAll));
  // Rank 1 waited for nobody.
  const size_t lane1 = lane_index(t, "rank 1 expert_comm");
  const int bottom1 = r.layout().axis_height + r.lane_top(lane1) + r.lane_height(lane1) - 2;
  EXPECT_EQ(image.pixelColor(x(3 * kMs + kMs / 2), bottom1), kind_colour(Kind::kAllToAll));
}

TEST(Render, EveryLaneIsLabelled) {
  const Timeline t(known_trace());
  const QImage image = render_image(t, 1000);
  const Renderer r(t);
  ASSERT_EQ(t.lanes().size(), 4u);  // rank 0 compute, grad_comm, memory; rank 1 expert_comm
  for (size_t i = 0; i < t.lanes().size(); ++i) {
    const QRect label(4, r.layout().axis_height + r.lane_top(i), 120, r.lane_height(i));
    EXPECT_GT(dark_pixels(image, label), 20) << t.lanes()[i].label;
  }
  // Below the last lane, above the legend: no label, no text.
  const int below = r.layout().axis_height + r.lanes_height() + 1;
  EXPECT_EQ(dark_pixels(image, QRect(4, below, 120, image.height() - r.layout().legend_height - below)), 0);
}

TEST(Render, MemoryCurveFollowsTheSamples) {
  const Timeline t(known_trace());
  const QImage image = render_image(t, 1000);
  const Renderer r(t);
  const size_t memory = lane_index(t, "rank 0 memory");
  const int top = r.layout().axis_height + r.lane_top(memory);
  const int h = r.lane_height(memory);
  View v{t.begin_ns(), t.end_ns(), 0};
  // Near the top of the lane: filled while 4 MB are in use (the peak), empty at 1 MB.
  const int x_peak = static_cast<int>(r.x_of(2500'000, v, 1000));
  const int x_low = static_cast<int>(r.x_of(3500'000, v, 1000));
  const int y_high = top + h / 4;
  EXPECT_NE(image.pixelColor(x_peak, y_high), kBackground);
  EXPECT_EQ(image.pixelColor(x_low, y_high), kBackground);
  // Near the bottom: filled in both.
  EXPECT_NE(image.pixelColor(x_low, top + h - 3), kBackground);
}

TEST(Render, BoxesNarrowerThanAPixelAreMerged) {
  // 200,000 ops of 10 ns, 20 ns apart, on one lane: 4 ms, about 5,000 ops per pixel column.
  Trace trace;
  trace.ranks = 1;
  for (int64_t i = 0; i < 200'000; ++i)
    trace.events.push_back(op("tiny", i % 4 == 0 ? "copy" : "compute", 0, TraceStream::kCompute, i * 20, 10));
  const Timeline t(std::move(trace));
  PaintStats stats;
  const QImage image = render_image(t, 1000, 0, &stats);
  EXPECT_EQ(stats.boxes_seen, 200'000);
  EXPECT_LE(stats.rects_drawn, 1000 - Layout{}.label_width + 2);
  EXPECT_GE(stats.rects_drawn, 1);
  const Renderer r(t);
  // Merged runs take the colour of the kind with most of their time: compute, three in four.
  EXPECT_EQ(pixel(image, at(r, t, 0, 2 * kMs, 1000)), kind_colour(Kind::kCompute));
}

TEST(Render, ManyLanesShrinkToFitThePicture) {
  Trace trace;
  trace.ranks = 2000;
  for (int64_t rank = 0; rank < 2000; ++rank)
    trace.events.push_back(op("x", "compute", rank, TraceStream::kCompute, rank * 1000, 1000));
  const Timeline t(std::move(trace));
  const QImage tall = render_image(t, 800);
  EXPECT_LE(tall.height(), 8192);
  const QImage fixed = render_image(t, 800, 600);
  EXPECT_EQ(fixed.height(), 600);
  EXPECT_EQ(fixed.width(), 800);
}

// A simulated and a measured step of the same plan (names as the simulator and the executor
// write them), the measured one slower in its second micro-batch's backward.
Trace simulated() {
  Trace t;
  t.source = "simulated";
  t.ranks = 1;
  for (int mb = 0; mb < 2; ++mb) {
    const std::string p = "mb" + std::to_string(mb) + ".";
    const int64_t at = mb * 3 * kMs;
    t.events.push_back(op(p + "L0.attn_fwd", "compute", 0, TraceStream::kCompute, at, 1 * kMs));
    t.events.push_back(op(p + "L0.attn_bwd", "compute", 0, TraceStream::kCompute, at + 1 * kMs, 2 * kMs));
  }
  t.events.push_back(op("optimizer", "compute", 0, TraceStream::kCompute, 6 * kMs, 1 * kMs));
  return t;
}
Trace measured() {
  Trace t;
  t.source = "measured";
  t.ranks = 1;
  const int64_t start[] = {0, 1'100'000, 3'200'000, 4'300'000, 8'300'000};
  const int64_t length[] = {1'100'000, 2'100'000, 1'100'000, 4'000'000, 1'000'000};
  const char* name[] = {"forward", "backward", "forward", "backward", "optimizer"};
  for (int i = 0; i < 5; ++i) t.events.push_back(op(name[i], "compute", 0, TraceStream::kCompute, start[i], length[i]));
  return t;
}

TEST(Overlay, MeasuredLanesFollowTheSimulatedAlignedPerPhase) {
  const Timeline t(simulated(), measured());
  ASSERT_EQ(t.lanes().size(), 2u);
  EXPECT_EQ(t.lanes()[0].label, "rank 0 compute (simulated)");
  EXPECT_EQ(t.lanes()[1].label, "rank 0 compute (measured)");
  // Each measured phase starts where the simulated one does.
  const auto sim = step_phases(t.trace(0), 0), meas = step_phases(t.trace(1), 0);
  ASSERT_EQ(sim.size(), meas.size());
  for (size_t i = 0; i < sim.size(); ++i) EXPECT_EQ(meas[i].start_ns, sim[i].start_ns) << sim[i].name;
  ASSERT_FALSE(t.differences().empty());
  EXPECT_EQ(t.differences().front().phase, "mb1 backward");  // 4 ms against 2
  // In the picture: the measured mb1 backward box begins at the simulated one's pixel.
  const QImage image = render_image(t, 1200);
  const Renderer r(t);
  const QPoint begin = at(r, t, 1, 4 * kMs, 1200);
  EXPECT_EQ(pixel(image, begin + QPoint(2, 0)), kind_colour(Kind::kCompute));
  EXPECT_EQ(pixel(image, at(r, t, 0, 4 * kMs, 1200) + QPoint(2, 0)), kind_colour(Kind::kCompute));
}

// -- The window, driven as a user would --------------------------------------------------------

void send_wheel(QWidget& w, QPoint where, int delta, Qt::KeyboardModifiers modifiers) {
  QWheelEvent e(QPointF(where), QPointF(w.mapToGlobal(where)), QPoint(), QPoint(0, delta), Qt::NoButton, modifiers,
                Qt::NoScrollPhase, false);
  QApplication::sendEvent(&w, &e);
}

void send_mouse(QWidget& w, QEvent::Type type, QPoint where, Qt::MouseButtons buttons) {
  QMouseEvent e(type, QPointF(where), QPointF(w.mapToGlobal(where)), Qt::LeftButton, buttons, Qt::NoModifier);
  QApplication::sendEvent(&w, &e);
}

TEST(Window, ClickSelectsTheOpUnderThePointer) {
  const Timeline t(known_trace());
  TimelineWidget w(t);
  w.resize(1000, 200);
  w.show();
  QSignalSpy selected(&w, &TimelineWidget::selection_changed);
  const size_t lane = lane_index(t, "rank 0 grad_comm");
  const QPoint target = at(w.renderer(), t, lane, 3500'000, w.width());
  QTest::mouseClick(&w, Qt::LeftButton, Qt::NoModifier, target);
  ASSERT_TRUE(w.selected().has_value());
  EXPECT_EQ(w.selected()->lane, lane);
  EXPECT_EQ(w.selected()->box, 0u);
  ASSERT_EQ(selected.count(), 1);
  const QString text = selected.takeFirst().at(0).toString();
  EXPECT_TRUE(text.contains("grads.all_reduce")) << text.toStdString();
  EXPECT_TRUE(text.contains("3 MiB")) << text.toStdString();
  // The tooltip says the same; empty space says nothing and clears the selection.
  EXPECT_EQ(w.describe_at(target), text);
  const QPoint empty = at(w.renderer(), t, lane, 500'000, w.width());
  EXPECT_TRUE(w.describe_at(empty).isEmpty());
  QTest::mouseClick(&w, Qt::LeftButton, Qt::NoModifier, empty);
  EXPECT_FALSE(w.selected().has_value());
  // The selected op is drawn outlined: the widget's own painting shows a black frame.
  QTest::mouseClick(&w, Qt::LeftButton, Qt::NoModifier, target);
  const QImage shot = w.grab().toImage();
  const QPoint inside = at(w.renderer(), t, lane, 3500'000, w.width());
  EXPECT_EQ(shot.pixelColor(inside), kind_colour(Kind::kAllReduce));
  const int top = w.renderer().layout().axis_height + w.renderer().lane_top(lane);
  EXPECT_LT(shot.pixelColor(inside.x(), top - 1).lightness(), 60);
}

TEST(Window, CtrlWheelZoomsAroundThePointerAndDragPans) {
  const Timeline t(known_trace());
  TimelineWidget w(t);
  w.resize(1000, 200);
  w.show();
  const QPoint pointer(600, 60);
  const int64_t under = w.renderer().time_at(pointer.x(), w.view(), w.width());
  const int64_t span = w.view().t1 - w.view().t0;
  send_wheel(w, pointer, 120, Qt::ControlModifier);
  const int64_t zoomed = w.view().t1 - w.view().t0;
  EXPECT_NEAR(static_cast<double>(zoomed), span / 1.25, span * 0.01);
  EXPECT_NEAR(static_cast<double>(w.renderer().time_at(pointer.x(), w.view(), w.width())), static_cast<double>(under),
              span * 0.005);
  // Without Ctrl the wheel scrolls lanes, not time.
  send_wheel(w, pointer, -120, Qt::NoModifier);
  EXPECT_EQ(w.view().t1 - w.view().t0, zoomed);

  // Dragging 100 pixels to the right shows earlier time, by 100 pixels' worth.
  const int64_t t0 = w.view().t0;
  const double per_pixel = static_cast<double>(zoomed) / (w.width() - w.renderer().layout().label_width);
  send_mouse(w, QEvent::MouseButtonPress, QPoint(500, 60), Qt::LeftButton);
  send_mouse(w, QEvent::MouseMove, QPoint(550, 60), Qt::LeftButton);
  send_mouse(w, QEvent::MouseMove, QPoint(600, 60), Qt::LeftButton);
  send_mouse(w, QEvent::MouseButtonRelease, QPoint(600, 60), Qt::NoButton);
  const int64_t expected = std::max<int64_t>(t.begin_ns(), t0 - static_cast<int64_t>(100 * per_pixel));
  EXPECT_NEAR(static_cast<double>(w.view().t0), static_cast<double>(expected), per_pixel * 2);
  EXPECT_FALSE(w.selected().has_value());  // a drag is not a click

  // Keys: + zooms in, 0 shows the whole step again.
  QTest::keyClick(&w, Qt::Key_Plus);
  EXPECT_LT(w.view().t1 - w.view().t0, zoomed);
  QTest::keyClick(&w, Qt::Key_0);
  EXPECT_EQ(w.view().t0, t.begin_ns());
  EXPECT_EQ(w.view().t1, t.end_ns());
}

TEST(Window, ZoomStopsAtAMicrosecondAndPanStopsAtTheStep) {
  const Timeline t(known_trace());
  TimelineWidget w(t);
  w.resize(1000, 200);
  w.show();
  for (int i = 0; i < 200; ++i) send_wheel(w, QPoint(600, 60), 120, Qt::ControlModifier);
  EXPECT_EQ(w.view().t1 - w.view().t0, 1000);
  w.pan(10'000'000, 0);  // far more than the step at this zoom
  EXPECT_EQ(w.view().t0, t.begin_ns());
  w.pan(-10'000'000, 0);
  EXPECT_EQ(w.view().t1, t.end_ns());
}

TEST(Window, OverlayListsTheDifferingPhasesAndZoomsToOne) {
  const Timeline t(simulated(), measured());
  ViewerWindow window(t, "test");
  window.resize(1200, 400);
  window.show();
  QTreeWidget* list = window.phase_list();
  ASSERT_NE(list, nullptr);
  ASSERT_EQ(list->topLevelItemCount(), static_cast<int>(t.differences().size()));
  QTreeWidgetItem* first = list->topLevelItem(0);
  EXPECT_EQ(first->text(0), "mb1 backward");
  EXPECT_TRUE(first->text(3).startsWith("+100%")) << first->text(3).toStdString();
  emit list->itemDoubleClicked(first, 0);
  const View& v = window.timeline_widget()->view();
  EXPECT_LE(v.t0, 4 * kMs);
  EXPECT_GE(v.t1, 6 * kMs);
  EXPECT_LT(v.t1 - v.t0, 3 * kMs);
}

// -- `moeplan view` ---------------------------------------------------------------------------

struct Outcome {
  int exit_code = -1;
  std::string out, err;
};

Outcome moeplan(const TempDir& dir, const std::string& args, const std::string& env = "") {
  const std::string out = dir.file(".out"), err = dir.file(".err");
  const std::string command = "cd '" + dir.path().string() + "' && env " + env + " '" + MOEPLAN_BINARY + "' " + args +
                              " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(command.c_str());
  Outcome o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.out = test::read_text(out);
  o.err = test::read_text(err);
  return o;
}

class ViewCommand : public testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(MOEPLAN_BINARY)) GTEST_SKIP() << "moeplan not built: " << MOEPLAN_BINARY;
  }
};

TEST_F(ViewCommand, DrawsAPictureOfTwoTracesAndListsTheirPhases) {
  TempDir dir;
  dir.write("sim.json", to_json(simulated()).dump());
  dir.write("measured.json", to_json(measured()).dump());
  const Outcome o = moeplan(dir, "view sim.json measured.json --png out.png --width 900");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("mb1 backward"), std::string::npos) << o.out;
  QImage image(QString::fromStdString(dir.file("out.png")));
  ASSERT_FALSE(image.isNull());
  EXPECT_EQ(image.width(), 900);
  // The file holds the picture drawn here, whose pixels the tests above check.
  const QImage here = render_image(Timeline(simulated(), measured()), 900);
  EXPECT_TRUE(image.convertToFormat(QImage::Format_RGB32) == here.convertToFormat(QImage::Format_RGB32));
}

// `moeplan view run/` opens a run folder's simulated.json and trace.json; traces of different
// plans are shown with a warning that says how they differ.
TEST_F(ViewCommand, ARunFolderOpensBothStepsAndOtherPlansAreNamed) {
  TempDir dir;
  fs::create_directories(dir.file("run"));
  Trace sim = simulated(), real = measured();
  sim.plan = real.plan = "E1 S1 R1 RSE ckpt=none mbs=1 ga=2";
  sim.world_size = real.world_size = 1;
  dir.write("run/simulated.json", to_json(sim).dump());
  dir.write("run/trace.json", to_json(real).dump());
  const Outcome o = moeplan(dir, "view run --png out.png --width 900");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("mb1 backward"), std::string::npos) << o.out;
  EXPECT_EQ(o.err.find("warning"), std::string::npos) << o.err;
  EXPECT_TRUE(fs::exists(dir.file("out.png")));

  sim.plan = "E4 S1 R1 T2 sp P2 V8 RSE ckpt=none mbs=1 ga=512";
  sim.world_size = 16;
  dir.write("other.json", to_json(sim).dump());
  const Outcome other = moeplan(dir, "view other.json run/trace.json --png out2.png --width 900");
  ASSERT_EQ(other.exit_code, 0) << other.err;
  EXPECT_NE(other.err.find("view: warning: the simulated trace is of E4 S1 R1 T2 sp P2 V8 RSE ckpt=none mbs=1 ga=512 on "
                           "16 ranks, the measured one of E1 S1 R1 RSE ckpt=none mbs=1 ga=2 on 1 rank"),
            std::string::npos)
      << other.err;

  fs::remove(dir.file("run/simulated.json"));
  const Outcome missing = moeplan(dir, "view run --png out3.png");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("run/simulated.json: missing"), std::string::npos) << missing.err;
}

TEST_F(ViewCommand, MalformedTraceIsAClearErrorNamingTheEvent) {
  TempDir dir;
  dir.write("bad.json", std::string(R"({"traceEvents": [{"name": "a", "ph": "X", "ts": "x", "dur": 1, "pid": 0}]})"));
  const Outcome bad = moeplan(dir, "view bad.json --png out.png");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("bad.json: traceEvents[0].ts: expected a number"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(dir.file("out.png")));

  dir.write("cut.json", std::string(R"({"traceEvents": [{"name": "a", "ph": "X", "ts": 1,)"));
  const Outcome cut = moeplan(dir, "view cut.json --png out.png");
  EXPECT_EQ(cut.exit_code, 2);
  EXPECT_NE(cut.err.find("not valid JSON"), std::string::npos) << cut.err;

  dir.write("empty.json", std::string(R"({"traceEvents": []})"));
  const Outcome empty = moeplan(dir, "view empty.json --png out.png");
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_NE(empty.err.find("no complete"), std::string::npos) << empty.err;

  // Larger than the reader takes: refused before anything is read (a sparse file, no disk used).
  {
    std::ofstream huge(dir.file("huge.json"));
    huge.seekp(kMaxTraceFileBytes + 1);
    huge.put('}');
  }
  const Outcome huge = moeplan(dir, "view huge.json --png out.png");
  EXPECT_EQ(huge.exit_code, 2);
  EXPECT_NE(huge.err.find("huge.json: too large"), std::string::npos) << huge.err;
  fs::remove(dir.file("huge.json"));

  const Outcome missing = moeplan(dir, "view nothing.json --png out.png");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("nothing.json: cannot open file"), std::string::npos) << missing.err;
}

TEST_F(ViewCommand, WithoutADisplayTheWindowIsRefusedNotCrashed) {
  TempDir dir;
  dir.write("sim.json", to_json(simulated()).dump());
  const Outcome o = moeplan(dir, "view sim.json", "-u DISPLAY -u WAYLAND_DISPLAY -u QT_QPA_PLATFORM");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("no display"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace moeplan::viewer

int main(int argc, char** argv) {
  // No display here: Qt's offscreen platform draws in memory.
  qputenv("QT_QPA_PLATFORM", "offscreen");
  QApplication app(argc, argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

namespace moeplan::viewer {
namespace {

// One step, one layer of four experts with 200, 100, 100 and 0 of 400 slots: the first at twice
// the mean (red), two at the mean (white), the last at none (blue).
std::vector<StepRecord> one_routed_step() {
  StepRecord r;
  r.step = 1;
  r.tokens = 200;
  r.tokens_per_expert = {{200, 100, 100, 0}};
  return {r};
}

TEST(RoutingMap, EachCellIsItsExpertsLoadOverTheMean) {
  EXPECT_EQ(load_colour(1.0), QColor(255, 255, 255));
  EXPECT_EQ(load_colour(2.0), QColor(255, 0, 0));
  EXPECT_EQ(load_colour(3.5), QColor(255, 0, 0));
  EXPECT_EQ(load_colour(0.0), QColor(0, 0, 255));
  EXPECT_EQ(load_colour(1.5), QColor(255, 128, 128));
  RoutingMapGeometry g;
  const RoutingMapLayout layout;
  const QImage image = render_routing_map(one_routed_step(), 400, &g, layout);
  ASSERT_FALSE(image.isNull());
  const auto centre = [&](size_t expert) { return g.cell(0, 0, expert, layout).center(); };
  EXPECT_EQ(image.pixelColor(centre(0)), QColor(255, 0, 0));
  EXPECT_EQ(image.pixelColor(centre(1)), QColor(255, 255, 255));
  EXPECT_EQ(image.pixelColor(centre(3)), QColor(0, 0, 255));
  EXPECT_TRUE(render_routing_map({}, 400).isNull());
}

TEST_F(ViewCommand, DrawsARunsRoutingFromItsMetrics) {
  TempDir dir;
  fs::create_directories(dir.file("run"));
  dir.write("run/metrics.jsonl", to_json_line(one_routed_step().front()) + "\n");
  const Outcome o = moeplan(dir, "view run --routing-png map.png --width 500");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  QImage image(QString::fromStdString(dir.file("map.png")));
  ASSERT_FALSE(image.isNull());
  EXPECT_TRUE(image.convertToFormat(QImage::Format_RGB32) ==
              render_routing_map(one_routed_step(), 500).convertToFormat(QImage::Format_RGB32));
  fs::create_directories(dir.file("empty"));
  const Outcome missing = moeplan(dir, "view empty --routing-png map2.png");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("empty/metrics.jsonl: cannot be read"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace moeplan::viewer
