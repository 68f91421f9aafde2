#include "common/flags.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Fixture {
  std::string listen = "127.0.0.1:7070";
  int64_t port = 9470;
  double speed = 1.0;
  bool json = false;
  absl::Duration silence = absl::Seconds(10);
  FlagSet flags{"prog", "Does things."};
  Fixture() {
    flags.String("listen", &listen, "address");
    flags.Int("port", &port, "port");
    flags.Double("speed", &speed, "speed");
    flags.Bool("json", &json, "json output");
    flags.Duration("silence", &silence, "silence");
  }
};

TEST(FlagSet, ParsesAllForms) {
  Fixture f;
  auto rest = f.flags.Parse({"--listen=0.0.0.0:1", "--port", "80", "-speed=2.5", "--json", "pos",
                             "--silence=1500ms", "--", "--not-a-flag"});
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(f.listen, "0.0.0.0:1");
  EXPECT_EQ(f.port, 80);
  EXPECT_DOUBLE_EQ(f.speed, 2.5);
  EXPECT_TRUE(f.json);
  EXPECT_EQ(f.silence, absl::Milliseconds(1500));
  EXPECT_THAT(*rest, ElementsAre("pos", "--not-a-flag"));
  EXPECT_TRUE(f.flags.WasSet("port"));
  EXPECT_FALSE(Fixture().flags.WasSet("port"));
}

TEST(FlagSet, NegatedBoolAndDefaults) {
  Fixture f;
  f.json = true;
  ASSERT_TRUE(f.flags.Parse({"--nojson"}).ok());
  EXPECT_FALSE(f.json);
  EXPECT_EQ(f.port, 9470);
}

TEST(FlagSet, StopsAtPositionalForSubcommands) {
  Fixture f;
  auto rest = f.flags.Parse({"--json", "submit", "--watch", "x.json"}, true);
  ASSERT_TRUE(rest.ok());
  EXPECT_THAT(*rest, ElementsAre("submit", "--watch", "x.json"));
}

TEST(FlagSet, ErrorsNameTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const Case cases[] = {
      {{"--lisen=x"}, "unknown flag --lisen (did you mean --listen?)"},
      {{"--zzzzzz"}, "unknown flag --zzzzzz"},
      {{"--port=eighty"}, "--port: \"eighty\" is not an integer"},
      {{"--speed=fast"}, "--speed: \"fast\" is not a number"},
      {{"--json=maybe"}, "--json: \"maybe\" is not true or false"},
      {{"--silence=soon"}, "--silence: \"soon\" is not a duration"},
      {{"--silence=-1s"}, "--silence: \"-1s\" is not a duration"},
      {{"--port"}, "--port: missing value"},
  };
  for (const Case& c : cases) {
    Fixture f;
    auto rest = f.flags.Parse(c.args);
    ASSERT_FALSE(rest.ok()) << c.args[0];
    EXPECT_EQ(rest.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(rest.status().message(), HasSubstr(c.expect));
    EXPECT_EQ(FlagSet::ExitCode(rest.status()), 2);
  }
}

TEST(FlagSet, HelpListsFlagsAndExitsZero) {
  Fixture f;
  f.flags.SetEpilog("Commands: x");
  const std::string usage = f.flags.Usage();
  EXPECT_THAT(usage, HasSubstr("--listen (string, default 127.0.0.1:7070)"));
  EXPECT_THAT(usage, HasSubstr("--silence (duration, default 10s)"));
  EXPECT_THAT(usage, HasSubstr("Commands: x"));
  testing::internal::CaptureStdout();
  auto rest = f.flags.Parse({"--help"});
  testing::internal::GetCapturedStdout();
  ASSERT_FALSE(rest.ok());
  EXPECT_EQ(FlagSet::ExitCode(rest.status()), 0);
}

TEST(FlagSet, UsageNamesPositionalArguments) {
  Fixture f;
  f.flags.Positional("JOB_ID", "the job to show");
  const std::string usage = f.flags.Usage();
  EXPECT_THAT(usage, HasSubstr("Usage: prog [flags] JOB_ID\n"));
  EXPECT_THAT(usage, HasSubstr("Arguments:\n  JOB_ID\n      the job to show\n"));
  EXPECT_THAT(Fixture().flags.Usage(), ::testing::Not(HasSubstr("Arguments:")));
}

// Every value flag takes both forms, wherever it stands among positionals.
TEST(FlagSet, ValueFlagsTakeBothFormsAfterPositionals) {
  Fixture f;
  auto rest = f.flags.Parse({"cmd", "--listen", "10.0.0.1:7070", "arg", "--silence", "2s"});
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(f.listen, "10.0.0.1:7070");
  EXPECT_EQ(f.silence, absl::Seconds(2));
  EXPECT_THAT(*rest, ElementsAre("cmd", "arg"));
  Fixture g;
  auto missing = g.flags.Parse({"--listen"});
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("--listen: missing value"));
}

// The range checks programs make after parsing name the flag, the value
// and the range.
TEST(FlagRange, NamesTheFlagTheValueAndTheRange) {
  EXPECT_TRUE(CheckFlagRange("mib", 1, 1, 64).ok());
  EXPECT_TRUE(CheckFlagRange("mib", 64, 1, 64).ok());
  absl::Status s = CheckFlagRange("mib", 65, 1, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--mib: 65 is not in [1, 64]");
  EXPECT_TRUE(
      CheckFlagRange("budget", absl::Seconds(600), absl::Seconds(1), absl::Seconds(600)).ok());
  s = CheckFlagRange("budget", absl::Milliseconds(500), absl::Seconds(1), absl::Seconds(600));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--budget: 500ms is not in [1s, 10m]");
  EXPECT_TRUE(CheckFlagNotNegative("every", 0).ok());
  EXPECT_EQ(CheckFlagNotNegative("every", -3).message(), "--every: -3 is negative");
  EXPECT_TRUE(CheckFlagNotNegative("interval", absl::ZeroDuration()).ok());
  EXPECT_EQ(CheckFlagNotNegative("interval", absl::Seconds(-1)).message(),
            "--interval: -1s is negative");
}

TEST(ClosestMatch, SuggestsOnlyNearCandidates) {
  const std::vector<std::string> commands = {"list", "links", "get", "cancel"};
  EXPECT_EQ(EditDistance("lsit", "list"), 2u);
  EXPECT_EQ(ClosestMatch("lsit", commands), "list");
  EXPECT_EQ(ClosestMatch("cancle", commands), "cancel");
  EXPECT_EQ(ClosestMatch("list", commands), "");  // already one
  EXPECT_EQ(ClosestMatch("submitt-everything", commands), "");
  EXPECT_EQ(ClosestMatch(std::string(300, 'l'), commands, 1000), "");  // too long to compare
}

}  // namespace
}  // namespace detour
