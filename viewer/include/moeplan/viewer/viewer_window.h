#pragma once
// The viewer's main window: the timeline, the selected op in the status bar and, with two
// traces, the phases that differ most beside it (double-click one to zoom to it).

#include <QMainWindow>

#include "moeplan/viewer/timeline.h"

class QTreeWidget;

namespace moeplan::viewer {

class TimelineWidget;

class ViewerWindow : public QMainWindow {
  Q_OBJECT

 public:
  ViewerWindow(const Timeline& timeline, const QString& title, QWidget* parent = nullptr);

  TimelineWidget* timeline_widget() const { return timeline_; }
  QTreeWidget* phase_list() const { return phases_; }  // nullptr with one trace

 private:
  void zoom_to_phase(const QString& name);

  const Timeline& model_;
  TimelineWidget* timeline_ = nullptr;
  QTreeWidget* phases_ = nullptr;
};

}  // namespace moeplan::viewer
