#include "moeplan/viewer/render.h"

#include <algorithm>
#include <array>
#include <cmath>

#include <QFont>
#include <QFontMetrics>
#include <QPen>
#include <QPolygonF>

namespace moeplan::viewer {

namespace {

// Tableau 10, one colour per kind of op.
constexpr std::array<std::array<int, 3>, kKindCount> kKindRgb = {{
    {76, 120, 168},   // compute
    {245, 133, 24},   // all_to_all
    {84, 162, 75},    // all_gather
    {228, 87, 86},    // reduce_scatter
    {178, 121, 162},  // all_reduce
    {114, 183, 178},  // copy
    {157, 157, 157},  // other
}};
const QColor kLabelColumn{240, 240, 240};
const QColor kSecondSource{246, 246, 250};  // the background of the second trace's lanes
const QColor kMemoryFill{200, 214, 232};
const QColor kMemoryLine{56, 92, 140};
const QColor kText{20, 20, 20};
const QColor kPhaseLine{0, 0, 0, 40};
const QColor kWaitColour{90, 20, 20};  // a collective's wait for the group's last rank

QFont small_font(int pixels) {
  QFont f;
  f.setPixelSize(pixels);
  return f;
}

// 1, 2 or 5 times a power of ten, at least `raw`.
int64_t nice_step(double raw) {
  double power = std::pow(10.0, std::floor(std::log10(std::max(raw, 1.0))));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * power >= raw) return std::max<int64_t>(1, std::llround(m * power));
  return std::max<int64_t>(1, std::llround(10 * power));
}

}  // namespace

QColor kind_colour(Kind kind) {
  const auto& c = kKindRgb[static_cast<size_t>(kind)];
  return QColor(c[0], c[1], c[2]);
}

Renderer::Renderer(const Timeline& timeline, Layout layout) : timeline_(timeline), layout_(layout) {
  tops_.reserve(timeline.lanes().size() + 1);
  int y = 0;
  for (size_t i = 0; i < timeline.lanes().size(); ++i) {
    tops_.push_back(y);
    y += lane_height(i) + layout_.gap;
  }
  tops_.push_back(y);
}

int Renderer::lane_height(size_t lane) const {
  return timeline_.lanes()[lane].type == Lane::Type::kMemory ? layout_.memory_height : layout_.lane_height;
}

std::optional<size_t> Renderer::lane_at(int y, const View& view) const {
  const int inside = y - layout_.axis_height + view.scroll_y;
  if (y < layout_.axis_height || inside < 0 || inside >= lanes_height()) return std::nullopt;
  auto it = std::upper_bound(tops_.begin(), tops_.end(), inside);
  const auto lane = static_cast<size_t>(std::distance(tops_.begin(), it) - 1);
  if (lane >= timeline_.lanes().size() || inside >= tops_[lane] + lane_height(lane)) return std::nullopt;
  return lane;
}

double Renderer::x_of(int64_t t, const View& view, int width) const {
  const double plot = std::max(1, width - layout_.label_width);
  return layout_.label_width + static_cast<double>(t - view.t0) * plot / static_cast<double>(view.t1 - view.t0);
}

int64_t Renderer::time_at(double x, const View& view, int width) const {
  const double plot = std::max(1, width - layout_.label_width);
  return view.t0 + std::llround((x - layout_.label_width) * static_cast<double>(view.t1 - view.t0) / plot);
}

std::optional<Pick> Renderer::pick(QPoint at, const View& view, int width) const {
  if (at.x() < layout_.label_width) return std::nullopt;
  const auto lane = lane_at(at.y(), view);
  if (!lane || timeline_.lanes()[*lane].type != Lane::Type::kOps) return std::nullopt;
  const Lane& l = timeline_.lanes()[*lane];
  const int64_t slack = std::max<int64_t>(0, time_at(at.x() + 3, view, width) - time_at(at.x(), view, width));
  const Box* box = timeline_.hit(l, time_at(at.x(), view, width), slack);
  if (box == nullptr) return std::nullopt;
  return Pick{*lane, static_cast<size_t>(box - l.boxes.data())};
}

PaintStats Renderer::paint(QPainter& p, QSize size, const View& view, const std::optional<Pick>& selected) const {
  PaintStats stats;
  const int width = size.width(), height = size.height();
  p.fillRect(QRect(QPoint(0, 0), size), kBackground);
  const int lanes_bottom = height - layout_.legend_height;

  // Lanes that show, between the axis and the legend.
  const auto& lanes = timeline_.lanes();
  const int first_y = view.scroll_y, last_y = view.scroll_y + (lanes_bottom - layout_.axis_height);
  auto it = std::upper_bound(tops_.begin(), tops_.end() - 1, first_y);
  size_t first = static_cast<size_t>(std::max<ptrdiff_t>(0, std::distance(tops_.begin(), it) - 1));
  p.setClipRect(QRect(0, layout_.axis_height, width, std::max(0, lanes_bottom - layout_.axis_height)));
  p.fillRect(QRect(0, layout_.axis_height, layout_.label_width, lanes_bottom - layout_.axis_height), kLabelColumn);
  p.setFont(small_font(std::clamp(layout_.lane_height - 4, 8, 12)));
  const QFontMetrics metrics(p.font());
  int last_label_bottom = -1000;
  for (size_t i = first; i < lanes.size() && tops_[i] < last_y; ++i) {
    const Lane& lane = lanes[i];
    const int y = layout_.axis_height + tops_[i] - view.scroll_y;
    const int h = lane_height(i);
    if (lane.source == 1)
      p.fillRect(QRect(layout_.label_width, y, width - layout_.label_width, h), kSecondSource);
    // A label where it fits: every lane when lanes are tall enough, else now and then.
    if (h >= metrics.height() - 2 || y - last_label_bottom >= metrics.height() + 2) {
      p.setPen(kText);
      const QRect box(4, y, layout_.label_width - 8, std::max(h, metrics.height()));
      p.drawText(box, Qt::AlignLeft | Qt::AlignVCenter,
                 metrics.elidedText(QString::fromStdString(lane.label), Qt::ElideRight, box.width()));
      last_label_bottom = y + std::max(h, metrics.height());
    }
    p.save();
    p.setClipRect(QRect(layout_.label_width, std::max(y, layout_.axis_height), width - layout_.label_width, h));
    if (lane.type == Lane::Type::kOps) paint_ops(p, lane, y, width, view, stats);
    else paint_memory(p, lane, y, width, view);
    p.restore();
    ++stats.lanes_drawn;
  }

  // Phase starts of the first trace, across the lanes.
  p.setClipRect(QRect(layout_.label_width, layout_.axis_height, width - layout_.label_width,
                      std::max(0, lanes_bottom - layout_.axis_height)));
  p.setPen(QPen(kPhaseLine, 1, Qt::DashLine));
  double last_x = -1e9;
  for (const TracePhase& phase : timeline_.phases()) {
    const double x = x_of(phase.start_ns, view, width);
    if (x - last_x < 3) continue;
    p.drawLine(QPointF(x, layout_.axis_height), QPointF(x, lanes_bottom));
    last_x = x;
  }

  // The selected op, outlined.
  if (selected && selected->lane < lanes.size() && selected->box < lanes[selected->lane].boxes.size()) {
    const Box& b = lanes[selected->lane].boxes[selected->box];
    const double x0 = x_of(b.start_ns, view, width), x1 = x_of(b.end_ns, view, width);
    const int y = layout_.axis_height + tops_[selected->lane] - view.scroll_y;
    p.setPen(QPen(Qt::black, 2));
    p.setBrush(Qt::NoBrush);
    p.drawRect(QRectF(x0 - 1, y - 1, std::max(1.0, x1 - x0) + 2, lane_height(selected->lane) + 2));
  }
  p.setClipping(false);
  paint_axis(p, size, view);
  paint_legend(p, size);
  return stats;
}

void Renderer::paint_ops(QPainter& p, const Lane& lane, int y, int width, const View& view, PaintStats& stats) const {
  const int h = layout_.lane_height;
  const double left = layout_.label_width;
  // A run of boxes narrower than a pixel: the pixel columns it covers and its time per kind.
  int run_begin = 0, run_end = -1;
  std::array<int64_t, kKindCount> run_time{};
  auto flush = [&] {
    if (run_end < run_begin) return;
    const auto kind = static_cast<Kind>(std::max_element(run_time.begin(), run_time.end()) - run_time.begin());
    p.fillRect(QRect(run_begin, y, run_end - run_begin, h), kind_colour(kind));
    ++stats.rects_drawn;
    run_end = run_begin - 1;
    run_time.fill(0);
  };
  p.setFont(small_font(std::clamp(h - 5, 8, 11)));
  const QFontMetrics metrics(p.font());
  for (const Box& b : timeline_.visible(lane, view.t0, view.t1)) {
    if (b.end_ns < view.t0) continue;
    ++stats.boxes_seen;
    const double x0 = std::max(left - 1, x_of(b.start_ns, view, width));
    const double x1 = std::min(static_cast<double>(width) + 1, x_of(b.end_ns, view, width));
    if (x1 - x0 < 1.0) {
      const int column = static_cast<int>(std::floor(x0));
      if (run_end >= run_begin && column > run_end) flush();
      if (run_end < run_begin) run_begin = column;
      run_end = std::max(run_end, static_cast<int>(std::floor(x1)) + 1);
      run_time[static_cast<size_t>(b.kind)] += std::max<int64_t>(1, b.end_ns - b.start_ns);
      continue;
    }
    flush();
    const int a = static_cast<int>(std::floor(x0)), e = static_cast<int>(std::floor(x1));
    const int w = std::max(1, e - a);
    // A white pixel between neighbours once boxes are wide enough to tell apart.
    p.fillRect(QRect(a, y, w >= 4 ? w - 1 : w, h), kind_colour(b.kind));
    ++stats.rects_drawn;
    // The wait for the group's last rank: a dark band along the bottom of the collective's start.
    if (b.wait_ns > 0) {
      const double wait_end = std::min(static_cast<double>(width) + 1, x_of(b.start_ns + b.wait_ns, view, width));
      const int ww = static_cast<int>(std::floor(wait_end)) - a;
      if (ww >= 1) p.fillRect(QRect(a, y + h - std::max(3, h / 3), ww, std::max(3, h / 3)), kWaitColour);
    }
    if (w > 40 && h >= 10) {
      p.setPen(Qt::white);
      const QRect text(std::max(a, static_cast<int>(left)) + 3, y, std::min(e, width) - std::max(a, static_cast<int>(left)) - 6, h);
      if (text.width() > 20) {
        const TraceEvent& event = timeline_.event(lane, b);
        p.drawText(text, Qt::AlignLeft | Qt::AlignVCenter,
                   metrics.elidedText(QString::fromStdString(event.name), Qt::ElideRight, text.width()));
      }
    }
  }
  flush();
}

void Renderer::paint_memory(QPainter& p, const Lane& lane, int y, int width, const View& view) const {
  const int h = layout_.memory_height;
  // Each lane from its least (a fifth of the height) to its peak, so that what changes in a
  // step shows beside what is held throughout; a curve that hardly moves is drawn from zero.
  const double low = lane.peak_bytes - lane.low_bytes < 0.01 * lane.peak_bytes ? 0.0 : lane.low_bytes;
  const double floor_px = low > 0 ? 0.2 * (h - 3) : 0.0;
  const double scale = lane.peak_bytes > low ? (h - 3 - floor_px) / (lane.peak_bytes - low) : 0.0;
  const double bottom = y + h - 1;
  // The samples that show: from the last one before the window to the first after it, one
  // point per pixel column (its largest value).
  const auto& m = lane.memory;
  auto it = std::upper_bound(m.begin(), m.end(), view.t0, [](int64_t t, const auto& s) { return t < s.first; });
  if (it != m.begin()) --it;
  QPolygonF curve;
  curve << QPointF(std::max<double>(layout_.label_width, x_of(it == m.end() ? view.t0 : it->first, view, width)), bottom);
  double previous = 0;
  int last_column = INT32_MIN;
  for (; it != m.end(); ++it) {
    const double x = std::max<double>(layout_.label_width - 1, x_of(it->first, view, width));
    const auto column = static_cast<int>(std::floor(x));
    const double v = bottom - floor_px - (it->second - low) * scale;
    if (column == last_column) {
      // Same pixel column: keep the highest point of the two.
      QPointF& top = curve.last();
      top.setY(std::min(top.y(), v));
      previous = std::min(previous, v);
      continue;
    }
    curve << QPointF(x, curve.size() > 1 ? previous : bottom) << QPointF(x, v);
    previous = v;
    last_column = column;
    if (x > width) break;
  }
  const double end_x = std::min<double>(width, x_of(timeline_.end_ns(), view, width));
  curve << QPointF(end_x, previous) << QPointF(end_x, bottom);
  p.setPen(QPen(kMemoryLine, 1));
  p.setBrush(kMemoryFill);
  p.drawPolygon(curve);
  if (h >= 14) {
    p.setPen(kText);
    p.setFont(small_font(10));
    const std::string range = low > 0 ? format_bytes(low) + " to " + format_bytes(lane.peak_bytes)
                                      : "peak " + format_bytes(lane.peak_bytes);
    p.drawText(QRect(layout_.label_width + 4, y + 1, 300, 12), Qt::AlignLeft | Qt::AlignTop,
               QString::fromStdString(range));
  }
}

void Renderer::paint_axis(QPainter& p, QSize size, const View& view) const {
  const int width = size.width();
  p.fillRect(QRect(0, 0, width, layout_.axis_height), kBackground);
  p.setPen(QColor(150, 150, 150));
  p.drawLine(layout_.label_width, layout_.axis_height - 1, width, layout_.axis_height - 1);
  p.setFont(small_font(11));
  p.setPen(kText);
  const double plot = std::max(1, width - layout_.label_width);
  const int64_t step = nice_step(static_cast<double>(view.t1 - view.t0) * 110.0 / plot);
  int64_t t = view.t0 >= 0 ? (view.t0 + step - 1) / step * step : view.t0 / step * step;
  for (; t <= view.t1; t += step) {
    const double x = x_of(t, view, width);
    p.drawLine(QPointF(x, layout_.axis_height - 6), QPointF(x, layout_.axis_height - 1));
    p.drawText(QRectF(x + 2, 2, 100, layout_.axis_height - 8), Qt::AlignLeft | Qt::AlignVCenter,
               QString::fromStdString(format_duration(t)));
  }
  p.fillRect(QRect(0, 0, layout_.label_width, layout_.axis_height), kBackground);
  const std::string what = timeline_.sources() > 1
                               ? std::string(timeline_.source_name(0)) + " and " + std::string(timeline_.source_name(1))
                               : std::string(timeline_.source_name(0));
  p.drawText(QRect(4, 2, layout_.label_width - 8, layout_.axis_height - 6), Qt::AlignLeft | Qt::AlignVCenter,
             QString::fromStdString(what));
}

void Renderer::paint_legend(QPainter& p, QSize size) const {
  const int y = size.height() - layout_.legend_height;
  p.fillRect(QRect(0, y, size.width(), layout_.legend_height), kBackground);
  p.setFont(small_font(11));
  const QFontMetrics metrics(p.font());
  int x = 4;
  for (int k = 0; k < kKindCount; ++k) {
    const auto kind = static_cast<Kind>(k);
    p.fillRect(QRect(x, y + 5, 10, 10), kind_colour(kind));
    x += 14;
    const QString name = QString::fromUtf8(kind_name(kind).data(), static_cast<int>(kind_name(kind).size()));
    p.setPen(kText);
    p.drawText(QPoint(x, y + 14), name);
    x += metrics.horizontalAdvance(name) + 14;
  }
  p.fillRect(QRect(x, y + 10, 10, 5), kWaitColour);
  x += 14;
  p.setPen(kText);
  p.drawText(QPoint(x, y + 14), QStringLiteral("waiting for the group's last rank"));
}

QImage render_image(const Timeline& timeline, int width, int height, PaintStats* stats) {
  constexpr int kTallest = 8192;
  Layout layout;
  const Renderer full(timeline, layout);
  const int wanted = height > 0 ? height : std::min(full.full_height(), kTallest);
  if (full.full_height() > wanted) {
    // Lanes shrink to fit: memory lanes stay twice as tall as ops lanes.
    int ops = 0, memory = 0;
    for (const Lane& lane : timeline.lanes()) (lane.type == Lane::Type::kMemory ? memory : ops) += 1;
    const int room = wanted - layout.axis_height - layout.legend_height;
    const int per = std::max(1, room / std::max(1, ops + 2 * memory));
    layout.gap = per >= 8 ? 1 : 0;
    layout.lane_height = std::max(1, per - layout.gap);
    layout.memory_height = 2 * layout.lane_height + layout.gap;
  }
  QImage image(std::max(width, layout.label_width + 10), std::max(wanted, layout.axis_height + layout.legend_height + 1),
               QImage::Format_RGB32);
  QPainter painter(&image);
  const Renderer renderer(timeline, layout);
  View view;
  view.t0 = timeline.begin_ns();
  view.t1 = timeline.end_ns();
  const PaintStats s = renderer.paint(painter, image.size(), view);
  if (stats != nullptr) *stats = s;
  return image;
}

}  // namespace moeplan::viewer
