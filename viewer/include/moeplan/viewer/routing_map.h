#pragma once
// A run's routing as a heat map (`moeplan view run/ --routing-png map.png`): a band per MoE
// layer, a row per expert, a column per step, each cell the expert's share of the step's slots
// over the mean share: white at the mean, red towards twice it and beyond, blue towards none.

#include <vector>

#include <QColor>
#include <QImage>

#include "moeplan/core/step_record.h"

namespace moeplan::viewer {

// The colour of a load over the mean: white at 1, red at 2 and above, blue at 0.
QColor load_colour(double load);

struct RoutingMapLayout {
  int label_width = 90;
  int title_height = 24;
  int legend_height = 28;
  int band_gap = 3;  // between layers
};

// Where each step's and expert's cell is drawn, for a picture `width` wide of `steps`.
struct RoutingMapGeometry {
  int cell_width = 1, row_height = 1;
  int plot_left = 0, plot_top = 0;
  int band_height = 0;  // one layer's rows
  QRect cell(size_t step, size_t layer, size_t expert, const RoutingMapLayout& layout) const;
};

// Needs a QGuiApplication (fonts). An empty image when no step counts experts.
QImage render_routing_map(const std::vector<StepRecord>& steps, int width, RoutingMapGeometry* geometry = nullptr,
                          RoutingMapLayout layout = {});

}  // namespace moeplan::viewer
