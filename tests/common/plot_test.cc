#include "common/plot.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(LinePlotSvg, OnePolylinePerSeriesWithEveryFinitePoint) {
  PlotSeries a{"train <a&b>", {{1, 5.5}, {2, 4.0}, {3, std::nan("")}, {4, 3.0}}};
  PlotSeries b{"val", {{1, 5.0}, {4, 3.5}}};
  PlotOptions o;
  o.title = "loss";
  const std::string svg = LinePlotSvg({a, b}, o);
  EXPECT_THAT(svg, HasSubstr("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_EQ(Count(svg, "<polyline"), 2);
  EXPECT_THAT(svg, HasSubstr("train &lt;a&amp;b&gt;"));  // escaped legend
  EXPECT_THAT(svg, Not(HasSubstr("nan")));
  // Three finite points in the first series: three "x,y" pairs.
  const size_t first = svg.find("points=\"");
  const std::string points = svg.substr(first + 8, svg.find('"', first + 8) - first - 8);
  EXPECT_EQ(Count(points, ","), 3);
  EXPECT_TRUE(svg.size() > 100 && svg.substr(svg.size() - 7) == "</svg>\n");
}

TEST(LinePlotSvg, EmptyInputSaysSo) {
  const std::string svg = LinePlotSvg({}, PlotOptions());
  EXPECT_THAT(svg, HasSubstr("no data"));
  EXPECT_EQ(Count(svg, "<polyline"), 0);
}

TEST(LinePlotSvg, ConstantSeriesStillHasARange) {
  const std::string svg = LinePlotSvg({{"flat", {{0, 2.0}, {1, 2.0}}}}, PlotOptions());
  EXPECT_EQ(Count(svg, "<polyline"), 1);
  EXPECT_THAT(svg, Not(HasSubstr("inf")));
}

}  // namespace
}  // namespace detour
