#pragma once
// Draws a time window of a Timeline with QPainter: a time axis on top, a label column on the
// left, a lane per rank and stream with each op a box coloured by kind, a memory curve per
// rank, and the first trace's phase starts as faint lines. The window and the headless PNG
// renderer share it.
//
// Level of detail: boxes narrower than a pixel are merged, per lane, into one run per pixel
// column (coloured by the kind that takes most of its time), so a picture costs at most one
// rectangle per lane and pixel column however many events the window holds.

#include <cstdint>
#include <optional>
#include <string>

#include <QColor>
#include <QImage>
#include <QPainter>
#include <QSize>

#include "moeplan/viewer/timeline.h"

namespace moeplan::viewer {

QColor kind_colour(Kind kind);
inline const QColor kBackground{255, 255, 255};

struct Layout {
  int label_width = 210;
  int axis_height = 24;
  int lane_height = 16;    // an ops lane
  int memory_height = 36;  // a memory lane
  int gap = 2;             // between lanes
  int legend_height = 20;  // the kinds' colours, at the bottom
};

// The time window shown and how far the lanes are scrolled.
struct View {
  int64_t t0 = 0;
  int64_t t1 = 1;
  int scroll_y = 0;  // pixels of lanes scrolled out at the top
};

// An op picked in the picture.
struct Pick {
  size_t lane = 0;
  size_t box = 0;  // index into the lane's boxes
  bool operator==(const Pick&) const = default;
};

struct PaintStats {
  int64_t boxes_seen = 0;   // boxes in the window
  int64_t rects_drawn = 0;  // rectangles drawn for them after merging
  int lanes_drawn = 0;
};

class Renderer {
 public:
  explicit Renderer(const Timeline& timeline, Layout layout = {});

  const Layout& layout() const { return layout_; }
  // Lanes' vertical positions, before scrolling, from the top of the lane area.
  int lane_top(size_t lane) const { return tops_[lane]; }
  int lane_height(size_t lane) const;
  int lanes_height() const { return tops_.back(); }
  // The height that shows every lane.
  int full_height() const { return layout_.axis_height + lanes_height() + layout_.legend_height; }
  // The lane at a widget y, if any.
  std::optional<size_t> lane_at(int y, const View& view) const;
  // Horizontal mapping of the plot area [label_width, width).
  double x_of(int64_t t, const View& view, int width) const;
  int64_t time_at(double x, const View& view, int width) const;
  // Which box is at a point, within 3 pixels.
  std::optional<Pick> pick(QPoint at, const View& view, int width) const;

  PaintStats paint(QPainter& painter, QSize size, const View& view, const std::optional<Pick>& selected = {}) const;

 private:
  void paint_axis(QPainter& p, QSize size, const View& view) const;
  void paint_ops(QPainter& p, const Lane& lane, int y, int width, const View& view, PaintStats& stats) const;
  void paint_memory(QPainter& p, const Lane& lane, int y, int width, const View& view) const;
  void paint_legend(QPainter& p, QSize size) const;

  const Timeline& timeline_;
  Layout layout_;
  std::vector<int> tops_;  // lanes + 1 entries
};

// The whole step in a picture `width` wide; `height` 0: tall enough for every lane (lanes
// shrink to fit 8,192 pixels). Needs a QGuiApplication (fonts); without a display, start it
// with the offscreen platform.
QImage render_image(const Timeline& timeline, int width, int height = 0, PaintStats* stats = nullptr);

}  // namespace moeplan::viewer
