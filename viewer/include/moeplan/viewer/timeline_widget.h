#pragma once
// The timeline as an interactive widget: Ctrl+wheel (or +/-) zooms around the pointer, the
// wheel scrolls the lanes, dragging pans, a click selects an op, hovering shows its details,
// 0 shows the whole step again.

#include <optional>

#include <QWidget>

#include "moeplan/viewer/render.h"
#include "moeplan/viewer/timeline.h"

namespace moeplan::viewer {

class TimelineWidget : public QWidget {
  Q_OBJECT

 public:
  explicit TimelineWidget(const Timeline& timeline, QWidget* parent = nullptr);

  const View& view() const { return view_; }
  const Renderer& renderer() const { return renderer_; }
  const std::optional<Pick>& selected() const { return selected_; }
  const PaintStats& last_paint() const { return last_paint_; }

  // Shows [t0, t1); kept within the step and at least a microsecond wide.
  void show_window(int64_t t0, int64_t t1);
  // factor > 1 zooms in, around the widget x `anchor`.
  void zoom(double factor, double anchor);
  void pan(int dx, int dy);
  void fit();
  // The details of the op at a point, empty if none.
  QString describe_at(QPoint at) const;

 signals:
  void selection_changed(const QString& description);
  void view_changed();

 protected:
  void paintEvent(QPaintEvent* event) override;
  void wheelEvent(QWheelEvent* event) override;
  void mousePressEvent(QMouseEvent* event) override;
  void mouseMoveEvent(QMouseEvent* event) override;
  void mouseReleaseEvent(QMouseEvent* event) override;
  void keyPressEvent(QKeyEvent* event) override;
  bool event(QEvent* event) override;
  QSize sizeHint() const override;

 private:
  void clamp_scroll();

  const Timeline& timeline_;
  Renderer renderer_;
  View view_;
  std::optional<Pick> selected_;
  std::optional<QPoint> drag_from_;
  bool dragged_ = false;
  PaintStats last_paint_;
};

}  // namespace moeplan::viewer
