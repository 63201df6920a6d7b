#include "moeplan/viewer/routing_map.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <QPainter>

namespace moeplan::viewer {

QColor load_colour(double load) {
  if (!(load >= 0)) load = 0;
  if (load >= 1.0) {
    const double t = std::min(1.0, load - 1.0);  // 1 -> white, 2 -> red
    const int other = static_cast<int>(std::lround(255.0 * (1.0 - t)));
    return {255, other, other};
  }
  const int other = static_cast<int>(std::lround(255.0 * load));  // 0 -> blue, 1 -> white
  return {other, other, 255};
}

QRect RoutingMapGeometry::cell(size_t step, size_t layer, size_t expert, const RoutingMapLayout& layout) const {
  const int x = plot_left + static_cast<int>(step) * cell_width;
  const int y = plot_top + static_cast<int>(layer) * (band_height + layout.band_gap) + static_cast<int>(expert) * row_height;
  return {x, y, cell_width, row_height};
}

QImage render_routing_map(const std::vector<StepRecord>& steps, int width, RoutingMapGeometry* geometry,
                          RoutingMapLayout layout) {
  if (steps.empty() || steps.front().tokens_per_expert.empty() || steps.front().tokens_per_expert.front().empty())
    return {};
  const size_t layers = steps.front().tokens_per_expert.size();
  const size_t experts = steps.front().tokens_per_expert.front().size();
  RoutingMapGeometry g;
  g.plot_left = layout.label_width;
  g.plot_top = layout.title_height;
  g.cell_width = std::max(1, (width - layout.label_width - 8) / static_cast<int>(steps.size()));
  // Rows tall enough to see, the whole map within about 1,200 pixels.
  g.row_height = std::clamp(1200 / static_cast<int>(layers * experts), 1, 12);
  g.band_height = g.row_height * static_cast<int>(experts);
  const int height = g.plot_top + static_cast<int>(layers) * (g.band_height + layout.band_gap) + layout.legend_height;
  QImage image(width, height, QImage::Format_RGB32);
  image.fill(Qt::white);
  QPainter p(&image);
  p.setPen(Qt::black);
  p.drawText(QRect(4, 0, width - 8, layout.title_height), Qt::AlignVCenter | Qt::AlignLeft,
             QString::fromStdString("each expert's slots over the mean, steps " + std::to_string(steps.front().step) +
                                    " to " + std::to_string(steps.back().step) + " (rows: experts)"));
  for (size_t l = 0; l < layers; ++l) {
    const QRect band(0, g.cell(0, l, 0, layout).y(), layout.label_width - 4, g.band_height);
    p.setPen(Qt::black);
    p.drawText(band, Qt::AlignVCenter | Qt::AlignRight, QString("layer %1").arg(l));
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto& table = steps[s].tokens_per_expert;
    for (size_t l = 0; l < layers && l < table.size(); ++l) {
      double total = 0;
      for (int64_t c : table[l]) total += static_cast<double>(c);
      for (size_t e = 0; e < experts && e < table[l].size(); ++e) {
        const double load = total > 0 ? static_cast<double>(table[l][e]) * static_cast<double>(experts) / total : 1.0;
        p.fillRect(g.cell(s, l, e, layout), load_colour(load));
      }
    }
  }
  // The legend: the colour ramp from 0 to 2 times the mean.
  const int y = height - layout.legend_height + 6;
  p.setPen(Qt::black);
  p.drawText(QRect(4, y, layout.label_width - 8, 16), Qt::AlignVCenter | Qt::AlignRight, "load / mean");
  for (int i = 0; i <= 200; ++i) p.fillRect(QRect(layout.label_width + i, y, 1, 16), load_colour(i / 100.0));
  p.drawText(QRect(layout.label_width + 206, y, 200, 16), Qt::AlignVCenter | Qt::AlignLeft, "0 ... 1 ... 2 and above");
  p.end();
  if (geometry != nullptr) *geometry = g;
  return image;
}

}  // namespace moeplan::viewer
