// Log lines: the format, and the component name changing while other threads
// log (the worker sets it at registration, on its control thread, while the
// runtime logs; TSan found the unguarded string — tools/checks.sh runs this
// test under TSan).
#include "common/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

// Runs `fn` with stderr going to a file; returns what was written.
template <typename Fn>
std::string CaptureStderr(Fn fn) {
  const std::string path = ::testing::TempDir() + "/log_test." + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  ::close(fd);
  fn();
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path.c_str());
  return text.str();
}

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

}  // namespace
}  // namespace detour
