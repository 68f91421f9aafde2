#include "common/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log_format.h"

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
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

// Length of the UTF-8 sequence at `s[i]`, or 0 when it is not a valid one
// (overlong forms, surrogates and values past U+10FFFF included).
size_t Utf8Length(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  size_t n = 0;
  uint32_t min = 0;
  uint32_t value = 0;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
    min = 0x80;
    value = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    min = 0x800;
    value = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    min = 0x10000;
    value = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    value = (value << 6) | (byte(i + k) & 0x3f);
  }
  if (value < min || value > 0x10ffff || (value >= 0xd800 && value <= 0xdfff)) return 0;
  return n;
}

// `s` as a JSON string: quote, backslash and control characters escaped,
// invalid UTF-8 replaced by U+FFFD.
void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
      ++i;
    } else if (c < 0x20 || c == 0x7f) {
      absl::StrAppend(out, "\\u00", absl::Hex(static_cast<unsigned>(c), absl::kZeroPad2));
      ++i;
    } else if (const size_t n = Utf8Length(s, i); n > 0) {
      out->append(s.data() + i, n);
      i += n;
    } else {
      out->append("\\ufffd");
      ++i;
    }
  }
  out->push_back('"');
}

bool IdChar(char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.'; }

// The first job id in `message`: "job-" followed by digits.
absl::string_view FindJob(absl::string_view message) {
  for (size_t at = message.find("job-"); at != absl::string_view::npos;
       at = message.find("job-", at + 1)) {
    size_t end = at + 4;
    while (end < message.size() && absl::ascii_isdigit(message[end])) ++end;
    if (end > at + 4 && (at == 0 || !IdChar(message[at - 1]))) {
      return message.substr(at, end - at);
    }
  }
  return {};
}

// The word after the first "worker " that holds a digit (a worker id).
absl::string_view FindWorker(absl::string_view message) {
  for (size_t at = message.find("worker "); at != absl::string_view::npos;
       at = message.find("worker ", at + 1)) {
    if (at > 0 && IdChar(message[at - 1])) continue;  // "coworker "
    size_t begin = at + 7;
    size_t end = begin;
    while (end < message.size() && IdChar(message[end])) ++end;
    // A trailing '.' ends a sentence, not the id.
    while (end > begin && message[end - 1] == '.') --end;
    const absl::string_view word = message.substr(begin, end - begin);
    if (std::any_of(word.begin(), word.end(), [](char c) { return absl::ascii_isdigit(c); })) {
      return word;
    }
  }
  return {};
}

}  // namespace

std::string FormatLogLine(LogFormat format, absl::Time time, LogLevel level,
                          absl::string_view component, absl::string_view message) {
  const std::string when = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", time, absl::UTCTimeZone());
  if (format == LogFormat::kText) {
    return absl::StrCat(when, " ", LevelName(level), " ", component, ": ", message, "\n");
  }
  absl::string_view worker = FindWorker(message);
  if (worker.empty() && absl::StartsWith(component, "worker ")) worker = component.substr(7);
  std::string line = "{\"time\":\"";
  absl::StrAppend(&line, when, "\",\"level\":\"", LevelName(level), "\",\"component\":");
  AppendJsonString(&line, component);
  line.append(",\"message\":");
  AppendJsonString(&line, message);
  line.append(",\"job\":");
  AppendJsonString(&line, FindJob(message));
  line.append(",\"worker\":");
  AppendJsonString(&line, worker);
  line.append("}\n");
  return line;
}

void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format)); }

bool ParseLogFormat(absl::string_view text, LogFormat* format) {
  if (text == "text") {
    *format = LogFormat::kText;
  } else if (text == "json") {
    *format = LogFormat::kJson;
  } else {
    return false;
  }
  return true;
}

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
  const std::string line = FormatLogLine(static_cast<LogFormat>(g_format.load()), absl::Now(),
                                         level, CurrentComponent(), message);
  // One write per line so concurrent lines do not interleave.
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

}  // namespace detour
