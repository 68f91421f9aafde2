// Log lines: the format, and the component name changing while other threads
// log (the worker sets it at registration, on its control thread, while the
// runtime logs; TSan found the unguarded string — tools/checks.sh runs this
// test under TSan).
#include "common/log.h"
#include "common/log_format.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/capture_stderr.h"

namespace detour {
namespace {

using testing::CaptureStderr;

TEST(LogTest, LinesNameTheComponentAndLevel) {
  SetLogComponent("worker w3");
  const std::string out = CaptureStderr([] {
    LogInfo("registered in ", "Oregon");
    LogDebug("dropped below the level");
  });
  EXPECT_TRUE(absl::StrContains(out, " INFO worker w3: registered in Oregon\n")) << out;
  EXPECT_FALSE(absl::StrContains(out, "dropped")) << out;
}

TEST(LogTest, TheComponentMayChangeWhileOtherThreadsLog) {
  SetLogComponent("worker");
  const std::string out = CaptureStderr([] {
    std::atomic<bool> stop{false};
    std::thread renamer([&stop] {
      for (int i = 0; !stop.load(); ++i) {
        SetLogComponent(i % 2 == 0 ? "worker w-even-with-a-long-name" : "worker w1");
      }
    });
    std::vector<std::thread> loggers;
    for (int t = 0; t < 2; ++t) {
      loggers.emplace_back([] {
        for (int i = 0; i < 300; ++i) LogInfo("line ", i);
      });
    }
    for (std::thread& t : loggers) t.join();
    stop = true;
    renamer.join();
  });
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    ++lines;
    EXPECT_TRUE(absl::StrContains(line, " INFO worker: line ") ||
                absl::StrContains(line, " INFO worker w1: line ") ||
                absl::StrContains(line, " INFO worker w-even-with-a-long-name: line "))
        << line;
  }
  EXPECT_EQ(lines, 600);
}

// --log_format=json: every line one JSON object with the six fields, whatever
// the message holds (quotes, backslashes, newlines, control characters,
// invalid UTF-8), and the job and worker it names.
TEST(LogTest, JsonLinesParseAndNameTheJobAndWorker) {
  const absl::Time t = absl::FromUnixSeconds(1764583262) + absl::Milliseconds(123);
  struct Case {
    std::string component, message, job, worker;
  };
  const std::vector<Case> cases = {
      {"coordinator", "worker w1 registered (Oregon)", "", "w1"},
      {"coordinator", "job job-000007: worker gpu-node-2 lost; rerouted", "job-000007",
       "gpu-node-2"},
      {"coordinator", "refused a registration without a worker certificate", "", ""},
      {"worker w3", "stage 1 of job-000012 built", "job-000012", "w3"},
      {"worker w3", "sent to worker w4.", "", "w4"},
      {"coordinator", std::string("quote \" backslash \\ newline\n tab\t nul") + '\0' + "\x7f", "",
       ""},
      {"coordinator", "bad utf-8 \xff\xc3 and good \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "", ""},
      {"coordinator", "overlong \xc0\xaf surrogate \xed\xa0\x80 too big \xf4\x90\x80\x80", "", ""},
      {"coordinator", "not a job: ajob-1, job-, job-x; a coworker 7", "", ""},
  };
  for (const Case& c : cases) {
    const std::string line =
        FormatLogLine(LogFormat::kJson, t, LogLevel::kWarning, c.component, c.message);
    ASSERT_TRUE(absl::EndsWith(line, "}\n")) << line;
    EXPECT_EQ(line.find('\n'), line.size() - 1) << line;  // one line
    auto parsed = ParseJson(line);
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << line;
    ASSERT_TRUE(parsed->is_object()) << line;
    EXPECT_EQ(parsed->keys().size(), 6u) << line;
    auto field = [&](const std::string& key) {
      const JsonValue* v = parsed->Find(key);
      return v != nullptr && v->is_string() ? v->string_value() : std::string("<missing>");
    };
    EXPECT_EQ(field("time"), "2025-12-01T10:01:02.123Z");
    EXPECT_EQ(field("level"), "WARN");
    EXPECT_EQ(field("component"), c.component);
    EXPECT_EQ(field("job"), c.job) << c.message;
    EXPECT_EQ(field("worker"), c.worker) << c.message;
    if (c.message.find('\xff') == std::string::npos &&
        c.message.find('\xc0') == std::string::npos) {
      EXPECT_EQ(field("message"), c.message);
    }
  }
  // Invalid bytes become U+FFFD, valid sequences stay.
  auto bad = ParseJson(FormatLogLine(LogFormat::kJson, t, LogLevel::kInfo, "c", "a\xff\xc3\xa9"));
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->Find("message")->string_value(), "a\xef\xbf\xbd\xc3\xa9");
  // Text is unchanged.
  EXPECT_EQ(FormatLogLine(LogFormat::kText, t, LogLevel::kInfo, "coordinator", "up"),
            "2025-12-01T10:01:02.123Z INFO coordinator: up\n");
  LogFormat format;
  EXPECT_TRUE(ParseLogFormat("json", &format));
  EXPECT_EQ(format, LogFormat::kJson);
  EXPECT_FALSE(ParseLogFormat("yaml", &format));
}

TEST(LogTest, SetLogFormatSwitchesWhatLinesAreWritten) {
  SetLogComponent("coordinator");
  SetLogFormat(LogFormat::kJson);
  const std::string out = CaptureStderr([] { LogInfo("job job-000001 submitted by alice"); });
  SetLogFormat(LogFormat::kText);
  auto parsed = ParseJson(out);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << out;
  EXPECT_EQ(parsed->Find("job")->string_value(), "job-000001");
  EXPECT_EQ(parsed->Find("level")->string_value(), "INFO");
}

}  // namespace
}  // namespace detour
