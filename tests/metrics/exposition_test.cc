#include "common/metrics/exposition.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

TEST(MetricsExpositionTest, FormatsValuesShortestAndSpecial) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(123456789), "123456789");
  EXPECT_EQ(FormatValue(1e300), "1e+300");
  EXPECT_EQ(FormatValue(0.0005), "0.0005");
  EXPECT_EQ(FormatValue(0.000015), "0.000015");
  EXPECT_EQ(FormatValue(1.5e-7), "1.5e-07");
  EXPECT_EQ(FormatValue(1e20), "100000000000000000000");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(1234567), "1234567");
  EXPECT_EQ(FormatValue(9007199254740993.0), "9007199254740992");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
}

TEST(MetricsExpositionTest, FormattedValuesRoundTrip) {
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<uint64_t> bits;
  for (int i = 0; i < 10000; ++i) {
    uint64_t raw = bits(rng);
    double value;
    std::memcpy(&value, &raw, sizeof(value));
    if (!std::isfinite(value)) continue;
    const std::string text = FormatValue(value);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), value) << text;
  }
  const double third = 1.0 / 3;
  EXPECT_EQ(std::strtod(FormatValue(third).c_str(), nullptr), third);
}

TEST(MetricsExpositionTest, EscapesHelpText) {
  EXPECT_EQ(EscapeHelp("plain"), "plain");
  EXPECT_EQ(EscapeHelp("a\\b\nc \"q\""), "a\\\\b\\nc \"q\"");
}

TEST(MetricsExpositionTest, EscapesLabelValues) {
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\\b\nc \"q\""), "a\\\\b\\nc \\\"q\\\"");
}

TEST(MetricsExpositionTest, AppendsSampleLines) {
  std::string out;
  AppendSample(&out, "x", {}, {}, "", "", 1);
  AppendSample(&out, "y", {"a", "b"}, {"1", "\""}, "", "", 2);
  AppendSample(&out, "z_bucket", {"a"}, {"v"}, "le", "0.5", 3);
  AppendSample(&out, "z_bucket", {}, {}, "le", "+Inf", 4);
  EXPECT_EQ(out,
            "x 1\n"
            "y{a=\"1\",b=\"\\\"\"} 2\n"
            "z_bucket{a=\"v\",le=\"0.5\"} 3\n"
            "z_bucket{le=\"+Inf\"} 4\n");
}

}  // namespace
}  // namespace detour::metrics
