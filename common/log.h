// Minimal structured logging to stderr for the daemons and tools. Our abseil
// has no logging library; this is the one place lines are formatted:
//   2026-11-30T10:01:02.123Z INFO coordinator: worker w1 registered (Oregon)
// Thread-safe: one write(2) per line.
#ifndef DETOUR_COMMON_LOG_H_
#define DETOUR_COMMON_LOG_H_

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace detour {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Component name printed on each line ("coordinator", "worker w3"). May be
// called while other threads log (the worker sets its id once registered).
void SetLogComponent(absl::string_view component);
// Lines below `level` are dropped. Default kInfo.
void SetLogLevel(LogLevel level);
// Parses "debug", "info", "warning", "error". False on anything else.
bool ParseLogLevel(absl::string_view text, LogLevel* level);

void LogLine(LogLevel level, absl::string_view message);

template <typename... Args>
void LogInfo(const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrCat(args...));
}
template <typename... Args>
void LogWarning(const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrCat(args...));
}
template <typename... Args>
void LogError(const Args&... args) {
  LogLine(LogLevel::kError, absl::StrCat(args...));
}
template <typename... Args>
void LogDebug(const Args&... args) {
  LogLine(LogLevel::kDebug, absl::StrCat(args...));
}

}  // namespace detour

#endif  // DETOUR_COMMON_LOG_H_
