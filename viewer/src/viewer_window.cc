#include "moeplan/viewer/viewer_window.h"

#include <cmath>
#include <cstdio>

#include <QDockWidget>
#include <QHeaderView>
#include <QStatusBar>
#include <QTreeWidget>

#include "moeplan/viewer/timeline_widget.h"

namespace moeplan::viewer {

namespace {

QString seconds(double s) { return QString::fromStdString(format_duration(std::llround(s * 1e9))); }

}  // namespace

ViewerWindow::ViewerWindow(const Timeline& timeline, const QString& title, QWidget* parent)
    : QMainWindow(parent), model_(timeline) {
  setWindowTitle(title);
  timeline_ = new TimelineWidget(timeline, this);
  setCentralWidget(timeline_);
  statusBar()->showMessage(QString("%1 events on %2 lanes; Ctrl+wheel zooms, drag pans, click selects, 0 fits")
                               .arg(timeline.event_count())
                               .arg(timeline.lanes().size()));
  connect(timeline_, &TimelineWidget::selection_changed, this, [this](const QString& text) {
    QString line = text;
    line.replace('\n', QStringLiteral("; "));
    statusBar()->showMessage(line);
  });

  if (timeline.sources() > 1) {
    auto* dock = new QDockWidget(tr("Phases that differ most"), this);
    dock->setObjectName("phases");
    phases_ = new QTreeWidget(dock);
    phases_->setRootIsDecorated(false);
    phases_->setHeaderLabels({tr("phase"), QString::fromStdString(std::string(timeline.source_name(0))),
                              QString::fromStdString(std::string(timeline.source_name(1))), tr("difference")});
    for (const PhaseDifference& d : timeline.differences()) {
      auto* item = new QTreeWidgetItem(phases_);
      item->setText(0, QString::fromStdString(d.phase));
      item->setText(1, seconds(d.first_s));
      item->setText(2, seconds(d.second_s));
      char diff[64];
      if (d.first_s > 0)
        std::snprintf(diff, sizeof diff, "%+.0f%% (%s)", 100.0 * (d.second_s - d.first_s) / d.first_s,
                      format_duration(std::llround((d.second_s - d.first_s) * 1e9)).c_str());
      else
        std::snprintf(diff, sizeof diff, "%s", format_duration(std::llround(d.second_s * 1e9)).c_str());
      item->setText(3, diff);
      for (int c = 1; c < 4; ++c) item->setTextAlignment(c, Qt::AlignRight | Qt::AlignVCenter);
    }
    phases_->header()->setSectionResizeMode(QHeaderView::ResizeToContents);
    connect(phases_, &QTreeWidget::itemDoubleClicked, this,
            [this](QTreeWidgetItem* item, int) { zoom_to_phase(item->text(0)); });
    dock->setWidget(phases_);
    addDockWidget(Qt::RightDockWidgetArea, dock);
  }
}

void ViewerWindow::zoom_to_phase(const QString& name) {
  const std::string wanted = name.toStdString();
  for (const TracePhase& p : model_.phases()) {
    if (p.name != wanted) continue;
    const int64_t margin = (p.end_ns - p.start_ns) / 20;
    timeline_->show_window(p.start_ns - margin, p.end_ns + margin);
    return;
  }
}

}  // namespace moeplan::viewer
