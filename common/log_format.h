// The format of common/log.h's lines: text, as
//   2026-11-30T10:01:02.123Z INFO coordinator: worker w1 registered (Oregon)
// or JSON, one object per line (--log_format=json):
//   {"time":"2026-11-30T10:01:02.123Z","level":"INFO","component":"coordinator",
//    "message":"worker w1 registered (Oregon)","job":"","worker":"w1"}
// Thread-safe. Apart from log.h so that the many files that only log do not
// depend on it.
#ifndef DETOUR_COMMON_LOG_FORMAT_H_
#define DETOUR_COMMON_LOG_FORMAT_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace detour {

enum class LogFormat { kText = 0, kJson = 1 };

// The format of the lines written from now on; text by default.
void SetLogFormat(LogFormat format);
// Parses "text" or "json". False on anything else.
bool ParseLogFormat(absl::string_view text, LogFormat* format);

// One log line, newline included. In JSON every value is a string, valid
// UTF-8 (a byte that is not is written as U+FFFD); `job` is the first job id
// ("job-" and digits) in the message, `worker` the word after the first
// "worker " that holds a digit (worker ids do: "w3", "gpu-node-2"), else the
// id in a component "worker ID" (the worker daemon's own lines); "" when
// neither is found.
std::string FormatLogLine(LogFormat format, absl::Time time, LogLevel level,
                          absl::string_view component, absl::string_view message);

}  // namespace detour

#endif  // DETOUR_COMMON_LOG_FORMAT_H_
