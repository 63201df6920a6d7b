#include "moeplan/viewer/timeline_widget.h"

#include <algorithm>
#include <cmath>

#include <QHelpEvent>
#include <QKeyEvent>
#include <QMouseEvent>
#include <QPainter>
#include <QToolTip>
#include <QWheelEvent>

namespace moeplan::viewer {

namespace {
constexpr int64_t kNarrowest = 1000;  // ns: the deepest zoom
}

TimelineWidget::TimelineWidget(const Timeline& timeline, QWidget* parent)
    : QWidget(parent), timeline_(timeline), renderer_(timeline) {
  setMouseTracking(true);
  setFocusPolicy(Qt::StrongFocus);
  setMinimumSize(renderer_.layout().label_width + 100, 120);
  view_.t0 = timeline.begin_ns();
  view_.t1 = timeline.end_ns();
}

QSize TimelineWidget::sizeHint() const {
  return {1280, std::clamp(renderer_.full_height(), 240, 800)};
}

void TimelineWidget::show_window(int64_t t0, int64_t t1) {
  const int64_t span = timeline_.end_ns() - timeline_.begin_ns();
  int64_t width = std::clamp<int64_t>(t1 - t0, std::min<int64_t>(kNarrowest, span), span);
  t0 = std::clamp<int64_t>(t0, timeline_.begin_ns(), timeline_.end_ns() - width);
  view_.t0 = t0;
  view_.t1 = t0 + width;
  update();
  emit view_changed();
}

void TimelineWidget::zoom(double factor, double anchor) {
  if (factor <= 0) return;
  const int64_t at = renderer_.time_at(anchor, view_, width());
  const double span = static_cast<double>(view_.t1 - view_.t0) / factor;
  const double left = static_cast<double>(at - view_.t0) / factor;
  const auto t0 = at - std::llround(left);
  show_window(t0, t0 + std::llround(span));
}

void TimelineWidget::pan(int dx, int dy) {
  const double plot = std::max(1, width() - renderer_.layout().label_width);
  const auto shift = std::llround(static_cast<double>(dx) * static_cast<double>(view_.t1 - view_.t0) / plot);
  view_.scroll_y += dy;
  clamp_scroll();
  show_window(view_.t0 - shift, view_.t1 - shift);
}

void TimelineWidget::fit() {
  view_.scroll_y = 0;
  show_window(timeline_.begin_ns(), timeline_.end_ns());
}

void TimelineWidget::clamp_scroll() {
  const Layout& l = renderer_.layout();
  const int room = height() - l.axis_height - l.legend_height;
  view_.scroll_y = std::clamp(view_.scroll_y, 0, std::max(0, renderer_.lanes_height() - room));
}

QString TimelineWidget::describe_at(QPoint at) const {
  const auto pick = renderer_.pick(at, view_, width());
  if (!pick) return {};
  const Lane& lane = timeline_.lanes()[pick->lane];
  return QString::fromStdString(describe(timeline_, lane, lane.boxes[pick->box]));
}

void TimelineWidget::paintEvent(QPaintEvent*) {
  QPainter p(this);
  last_paint_ = renderer_.paint(p, size(), view_, selected_);
}

void TimelineWidget::wheelEvent(QWheelEvent* event) {
  const double steps = event->angleDelta().y() / 120.0;
  if (event->modifiers() & Qt::ControlModifier) {
    zoom(std::pow(1.25, steps), event->position().x());
  } else if (event->modifiers() & Qt::ShiftModifier) {
    pan(static_cast<int>(std::lround(steps * 60)), 0);
  } else {
    pan(0, static_cast<int>(std::lround(-steps * 3 * renderer_.layout().lane_height)));
  }
  event->accept();
}

void TimelineWidget::mousePressEvent(QMouseEvent* event) {
  if (event->button() != Qt::LeftButton) return;
  drag_from_ = event->position().toPoint();
  dragged_ = false;
}

void TimelineWidget::mouseMoveEvent(QMouseEvent* event) {
  if (!drag_from_ || !(event->buttons() & Qt::LeftButton)) return;
  const QPoint now = event->position().toPoint();
  const QPoint d = now - *drag_from_;
  if (!dragged_ && d.manhattanLength() < 3) return;
  dragged_ = true;
  pan(d.x(), -d.y());
  drag_from_ = now;
}

void TimelineWidget::mouseReleaseEvent(QMouseEvent* event) {
  if (event->button() != Qt::LeftButton) return;
  if (!dragged_) {
    selected_ = renderer_.pick(event->position().toPoint(), view_, width());
    update();
    emit selection_changed(selected_ ? describe_at(event->position().toPoint()) : QString());
  }
  drag_from_.reset();
  dragged_ = false;
}

void TimelineWidget::keyPressEvent(QKeyEvent* event) {
  const double middle = renderer_.layout().label_width + (width() - renderer_.layout().label_width) / 2.0;
  switch (event->key()) {
    case Qt::Key_Plus:
    case Qt::Key_Equal: zoom(1.5, middle); break;
    case Qt::Key_Minus: zoom(1 / 1.5, middle); break;
    case Qt::Key_Left: pan(width() / 8, 0); break;
    case Qt::Key_Right: pan(-width() / 8, 0); break;
    case Qt::Key_Up: pan(0, -renderer_.layout().lane_height * 3); break;
    case Qt::Key_Down: pan(0, renderer_.layout().lane_height * 3); break;
    case Qt::Key_0: fit(); break;
    default: QWidget::keyPressEvent(event); return;
  }
  event->accept();
}

bool TimelineWidget::event(QEvent* event) {
  if (event->type() == QEvent::ToolTip) {
    auto* help = static_cast<QHelpEvent*>(event);
    const QString text = describe_at(help->pos());
    if (text.isEmpty()) QToolTip::hideText();
    else QToolTip::showText(help->globalPos(), text, this);
    return true;
  }
  return QWidget::event(event);
}

}  // namespace moeplan::viewer
