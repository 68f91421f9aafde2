// Line plots as standalone SVG (loss curves of the launcher, the training
// driver and benchmarks). No dependencies; the SVG opens in any browser.
#ifndef DETOUR_COMMON_PLOT_H_
#define DETOUR_COMMON_PLOT_H_

#include <string>
#include <utility>
#include <vector>

namespace detour {

struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), x increasing
  // Dots instead of a line (e.g. validation measurements).
  bool markers = false;
  // Colour index into the palette; -1 = the series' position. Lets a line
  // and its markers share a colour.
  int color = -1;
};

struct PlotOptions {
  std::string title;
  std::string x_label = "iteration";
  std::string y_label = "loss";
  int width = 800;
  int height = 480;
  // Upper end of the y axis at most this far above the lowest value (0 = no
  // cap): early losses would otherwise squash the rest; points above are
  // drawn at the edge.
  double max_y_span = 0;
};

// Axes with ticks, one polyline per series in distinct colours, a legend.
// Non-finite points are skipped. Empty input gives an empty plot with a note.
std::string LinePlotSvg(const std::vector<PlotSeries>& series, const PlotOptions& options);

}  // namespace detour

#endif  // DETOUR_COMMON_PLOT_H_
