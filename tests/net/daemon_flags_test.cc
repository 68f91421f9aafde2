// The daemons' shared flags: --log_format, and gRPC core's own log lines
// written through ours (they were printed by gRPC, in its own format, among
// the daemon's lines).
#include "common/net/daemon_flags.h"

#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "common/json.h"
#include "common/log.h"
#include "common/log_format.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"
#include "tests/capture_stderr.h"

namespace detour {
namespace {

using testing::CaptureStderr;

TEST(DaemonFlagsTest, LogFormatJsonAndGrpcLinesThroughOurs) {
  DaemonFlags common;
  FlagSet flags("test", "test");
  common.Register(&flags, "nothing");
  const char* argv[] = {"test", "--log_format=json"};
  auto args = flags.Parse(2, const_cast<char**>(argv));
  ASSERT_EQ(common.Apply(flags, args, "test", "coordinator"), -1);
  const std::string out = CaptureStderr([] {
    LogWarning("worker w2 lost");
    gpr_log(GPR_ERROR, "handshake failed with %s", "peer 127.0.0.1:5");
  });
  SetLogFormat(LogFormat::kText);
  std::istringstream lines(out);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    auto parsed = ParseJson(line);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << line;
    EXPECT_EQ(parsed->Find("component")->string_value(), "coordinator");
    if (count == 2) {
      EXPECT_EQ(parsed->Find("level")->string_value(), "ERROR");
      const std::string message = parsed->Find("message")->string_value();
      EXPECT_TRUE(absl::StartsWith(message, "grpc: handshake failed with peer 127.0.0.1:5 ("))
          << message;
      EXPECT_TRUE(absl::StrContains(message, "daemon_flags_test.cc:")) << message;
    }
  }
  EXPECT_EQ(count, 2) << out;

  DaemonFlags bad;
  FlagSet bad_flags("test", "test");
  bad.Register(&bad_flags, "nothing");
  const char* bad_argv[] = {"test", "--log_format=yaml"};
  auto bad_args = bad_flags.Parse(2, const_cast<char**>(bad_argv));
  const std::string refused =
      CaptureStderr([&] { EXPECT_EQ(bad.Apply(bad_flags, bad_args, "test", "coordinator"), 2); });
  EXPECT_TRUE(absl::StrContains(refused, "--log_format: \"yaml\" is not text or json")) << refused;
}

}  // namespace
}  // namespace detour
