#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace detour {
namespace {

// The component name, which may change while other threads log: the worker
// learns its id at registration, on its control thread (TSan found the
// unguarded string).
struct ComponentName {
  absl::Mutex mu;
  std::string name ABSL_GUARDED_BY(mu) = "detour";
};

ComponentName& Component() {
  static ComponentName* const component = new ComponentName;
  return *component;
}

std::string CurrentComponent() {
  ComponentName& c = Component();
  absl::MutexLock lock(&c.mu);
  return c.name;
}

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

void SetLogComponent(absl::string_view component) {
  ComponentName& c = Component();
  absl::MutexLock lock(&c.mu);
  c.name = std::string(component);
}

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool ParseLogLevel(absl::string_view text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warning" || text == "warn")
    *level = LogLevel::kWarning;
  else if (text == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

void LogLine(LogLevel level, absl::string_view message) {
  if (static_cast<int>(level) < g_level.load()) return;
  std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   LevelName(level), " ", CurrentComponent(), ": ", message, "\n");
  // One write per line so concurrent lines do not interleave.
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

}  // namespace detour
