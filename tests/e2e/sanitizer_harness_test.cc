// The e2e harness's sanitizer plumbing (local_cluster.h): a report written by
// a process a test started reaches the test, so a race or a leak in a daemon
// fails the e2e test that ran it. tools/checks.sh tsan-full runs this with
// $DETOUR_TSAN_CANARY (tests/tsan/tsan_canary, whose deliberate race TSan
// reports) and TSAN_OPTIONS set; elsewhere only the routing is checked.
#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"

namespace detour::testing {
namespace {

class SanitizerHarnessTest : public E2eTest {};

TEST_F(SanitizerHarnessTest, AReportFromAChildProcessReachesTheTest) {
  const char* canary = std::getenv("DETOUR_TSAN_CANARY");
  if (canary == nullptr || std::getenv("TSAN_OPTIONS") == nullptr) {
    // Without the canary: a report file where the harness routes reports
    // is what the harness collects, and nothing else is.
    EXPECT_EQ(SanitizerReports(dir_), "");
    std::ofstream(dir_ + "/unrelated.log") << "not a report";
    std::ofstream(dir_ + "/sanitizer.4242") << "WARNING: ThreadSanitizer: data race (fake)";
    EXPECT_TRUE(absl::StrContains(SanitizerReports(dir_), "data race (fake)"));
    EXPECT_FALSE(absl::StrContains(SanitizerReports(dir_), "not a report"));
    std::remove((dir_ + "/sanitizer.4242").c_str());
    GTEST_SKIP() << "DETOUR_TSAN_CANARY/TSAN_OPTIONS unset: the real canary runs in "
                    "tools/checks.sh tsan-full";
  }
  // The canary exits non-zero (TSan's exitcode) after reporting its race.
  ChildProcess child;
  ASSERT_TRUE(child.Start({canary}, dir_ + "/canary.log").ok());
  const std::optional<int> code = child.Wait(absl::Seconds(120));
  ASSERT_TRUE(code.has_value());
  const std::string reports = SanitizerReports(dir_);
  EXPECT_TRUE(absl::StrContains(reports, "data race")) << reports << child.Log();
  EXPECT_TRUE(absl::StrContains(reports, "RacySink::Allocate")) << reports;
  // Collected: the harness would fail the test on them. Expected here.
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    if (entry.path().filename().string().rfind("sanitizer.", 0) == 0) {
      std::filesystem::remove(entry.path());
    }
  }
}

}  // namespace
}  // namespace detour::testing
