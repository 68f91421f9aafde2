#include "common/metrics/process_metrics.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

using ::testing::HasSubstr;

// The value of the unlabelled sample `name` in `text`, or NaN.
double SampleValue(const std::string& text, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
    double value;
    if (parts.size() == 2 && parts[0] == name && absl::SimpleAtod(parts[1], &value)) {
      return value;
    }
  }
  ADD_FAILURE() << "no sample " << name << " in:\n" << text;
  return std::nan("");
}

TEST(MetricsProcessTest, ExposesPlausibleProcessMetrics) {
  Registry registry;
  ASSERT_TRUE(RegisterProcessMetrics(registry).ok());
  // Burn a little CPU so that the CPU counter is visibly positive.
  volatile double sink = 0;
  for (int i = 0; i < 20000000; ++i) sink = sink + i * 0.5;
  const std::string text = registry.Serialize();

  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_open_fds gauge\n"));
  EXPECT_GT(SampleValue(text, "process_cpu_seconds_total"), 0);
  const double resident = SampleValue(text, "process_resident_memory_bytes");
  EXPECT_GT(resident, 1 << 20);
  EXPECT_GE(SampleValue(text, "process_virtual_memory_bytes"), resident);
  EXPECT_GE(SampleValue(text, "process_open_fds"), 3);  // stdin/out/err
  EXPECT_GE(SampleValue(text, "process_max_fds"), SampleValue(text, "process_open_fds"));
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const double start = SampleValue(text, "process_start_time_seconds");
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 600);  // this test binary started moments ago
}

TEST(MetricsProcessTest, SecondRegistrationIsRefused) {
  Registry registry;
  ASSERT_TRUE(RegisterProcessMetrics(registry).ok());
  EXPECT_EQ(RegisterProcessMetrics(registry).code(), absl::StatusCode::kAlreadyExists);
}

TEST(MetricsProcessTest, BuildInfoIsAConstantGauge) {
  Registry registry;
  ASSERT_TRUE(RegisterBuildInfo(registry, "coordinator", "0.1.0", "c948df0").ok());
  const std::string text = registry.Serialize();
  EXPECT_THAT(text, HasSubstr("# TYPE detour_build_info gauge\n"));
  EXPECT_THAT(text, HasSubstr("detour_build_info{component=\"coordinator\","
                              "version=\"0.1.0\",revision=\"c948df0\"} 1\n"));
}

}  // namespace
}  // namespace detour::metrics
