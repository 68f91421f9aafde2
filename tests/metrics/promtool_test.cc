// Checks the registry's output with Prometheus' own parser and linter,
// `promtool check metrics`, so that format mistakes our hand-written
// expectations share with the code are still caught.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "common/metrics/process_metrics.h"
#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

constexpr char kPromtool[] = "/usr/bin/promtool";

struct CheckResult {
  int exit_code = -1;
  std::string output;
};

// Writes `text` to a temporary file and runs `promtool check metrics < file`.
CheckResult RunPromtool(const std::string& text) {
  CheckResult result;
  char path[] = "/tmp/detour_metrics_promtool_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) {
    result.output = "mkstemp failed";
    return result;
  }
  close(fd);
  std::ofstream(path) << text;
  const std::string command = absl::StrCat(kPromtool, " check metrics < ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    result.output = "popen failed";
    unlink(path);
    return result;
  }
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) {
    result.output.append(buffer, n);
  }
  const int status = pclose(pipe);
  unlink(path);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

bool PromtoolInstalled() {
  if (access(kPromtool, X_OK) == 0) return true;
  ADD_FAILURE() << kPromtool
                << " is missing: run tools/install_deps.sh to install "
                   "promtool (Debian package prometheus).";
  return false;
}

TEST(MetricsPromtoolTest, RichRegistryPassesPromtool) {
  if (!PromtoolInstalled()) return;
  Registry registry;
  CounterFamily* requests = registry
                                .AddCounter("detour_requests",
                                            "Requests served.\nSecond line "
                                            "with a back\\slash.",
                                            {"method", "code"})
                                .value();
  requests->WithLabels({"GET", "200"}).value()->Increment();
  ASSERT_TRUE(requests->WithLabels({"POST", "500"}).value()->IncrementBy(3.5).ok());
  GaugeFamily* paths = registry.AddGauge("detour_path_bytes", "Bytes per path.", {"path"}).value();
  paths->WithLabels({"C:\\tmp \"quoted\"\nnewline"}).value()->Set(1e20);
  paths->WithLabels({"unicode \xe2\x9c\x93"}).value()->Set(-0.25);
  paths->WithLabels({"inf"}).value()->Set(std::numeric_limits<double>::infinity());
  paths->WithLabels({"nan"}).value()->Set(std::numeric_limits<double>::quiet_NaN());
  HistogramFamily* latency = registry
                                 .AddHistogram("detour_rpc_latency_seconds", "RPC latency.",
                                               DefaultLatencyBuckets(), {"method", "stage"})
                                 .value();
  Histogram* h = latency->WithLabels({"/detour.v1.JobService/Get", "0"}).value();
  for (double v : {0.0001, 0.003, 0.2, 7.0, 120.0}) h->Observe(v);
  latency->WithLabels({"/detour.v1.JobService/List", "1"}).value();
  registry.AddHistogram("detour_plain_seconds", "No labels.", {1, 2})
      .value()
      ->WithLabels({})
      .value()
      ->Observe(1.5);
  ASSERT_TRUE(RegisterProcessMetrics(registry).ok());
  ASSERT_TRUE(RegisterBuildInfo(registry, "worker", "0.1.0", "abc123").ok());

  const std::string text = registry.Serialize();
  const CheckResult result = RunPromtool(text);
  EXPECT_EQ(result.exit_code, 0) << "promtool says:\n" << result.output << "\nfor input:\n" << text;
  EXPECT_EQ(result.output, "") << "promtool lint findings for:\n" << text;
}

// The check above is only meaningful if promtool rejects broken input.
TEST(MetricsPromtoolTest, PromtoolRejectsBrokenText) {
  if (!PromtoolInstalled()) return;
  const CheckResult result =
      RunPromtool("# TYPE broken_total counter\nbroken_total{label=\"unterminated} 1\n");
  EXPECT_NE(result.exit_code, 0) << result.output;
}

}  // namespace
}  // namespace detour::metrics
