#include "common/plot.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace detour {
namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string Escape(const std::string& text) {
  return absl::StrReplaceAll(text,
                             {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}, {"\"", "&quot;"}});
}

// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks.
double TickStep(double span, int target) {
  if (!(span > 0)) return 1;
  const double raw = span / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * magnitude) return m * magnitude;
  }
  return 10 * magnitude;
}

}  // namespace

std::string LinePlotSvg(const std::vector<PlotSeries>& series, const PlotOptions& o) {
  // The legend is a row between the title and the plot, so it never hides
  // data nor gets cut at the edge.
  const double left = 70, right = 20, top = 58, bottom = 55;
  const double w = o.width - left - right, h = o.height - top - bottom;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const PlotSeries& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  }
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">%s</text>\n",
      o.width, o.height, o.width / 2, Escape(o.title));
  if (!std::isfinite(x0)) {
    return svg + absl::StrFormat(
                     "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">no data</text>\n</svg>\n",
                     o.width / 2, o.height / 2);
  }
  if (o.max_y_span > 0) y1 = std::min(y1, y0 + o.max_y_span);
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    y0 -= 0.5;
    y1 += 0.5;
  }
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * w; };
  auto py = [&](double y) {
    y = std::min(std::max(y, y0), y1);
    return top + (1 - (y - y0) / (y1 - y0)) * h;
  };

  absl::StrAppendFormat(&svg,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                        "stroke=\"#444\"/>\n",
                        left, top, w, h);
  const double xs = TickStep(x1 - x0, 8), ys = TickStep(y1 - y0, 6);
  for (double x = std::ceil(x0 / xs) * xs; x <= x1 + 1e-9; x += xs) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                          px(x), top, px(x), top + h, px(x), top + h + 16, x);
  }
  for (double y = std::ceil(y0 / ys) * ys; y <= y1 + 1e-9; y += ys) {
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                          left, py(y), left + w, py(y), left - 6, py(y) + 4, y);
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n"
                        "<text x=\"16\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 16 %.1f)\">%s</text>\n",
                        left + w / 2, o.height - 12, Escape(o.x_label), top + h / 2, top + h / 2,
                        Escape(o.y_label));
  double legend_x = left;
  const size_t palette = sizeof(kColors) / sizeof(kColors[0]);
  for (size_t i = 0; i < series.size(); ++i) {
    const int index = series[i].color >= 0 ? series[i].color : static_cast<int>(i);
    const char* color = kColors[static_cast<size_t>(index) % palette];
    if (series[i].markers) {
      for (const auto& [x, y] : series[i].points) {
        if (!std::isfinite(x) || !std::isfinite(y)) continue;
        absl::StrAppendFormat(&svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                              px(x), py(y), color);
      }
    } else {
      std::string points;
      for (const auto& [x, y] : series[i].points) {
        if (!std::isfinite(x) || !std::isfinite(y)) continue;
        absl::StrAppendFormat(&points, "%.1f,%.1f ", px(x), py(y));
      }
      absl::StrAppendFormat(&svg,
                            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
                            "points=\"%s\"/>\n",
                            color, points);
    }
    if (series[i].name.empty()) continue;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"42\" x2=\"%.1f\" y2=\"42\" stroke=\"%s\" "
                          "stroke-width=\"3\"/><text x=\"%.1f\" y=\"46\">%s</text>\n",
                          legend_x, legend_x + 22, color, legend_x + 27, Escape(series[i].name));
    // About 7 px per character of 12 px sans-serif.
    legend_x += 45 + 7.0 * static_cast<double>(series[i].name.size());
  }
  return svg + "</svg>\n";
}

}  // namespace detour
