// Child processes for end-to-end tests: start a real daemon, signal it, wait
// for its exit with a timeout, read its log. The destructor kills what is
// still running, so a failing test leaves no process behind.
#ifndef DETOUR_TESTS_E2E_PROCESS_H_
#define DETOUR_TESTS_E2E_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace detour::testing {

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Runs argv[0] with stdout and stderr appended to `log_path`.
  absl::Status Start(const std::vector<std::string>& argv, const std::string& log_path);
  void Signal(int sig);
  // Exit status (or 128+signal) once the process ended within `timeout`.
  std::optional<int> Wait(absl::Duration timeout);
  bool running() const { return pid_ > 0 && !exit_code_.has_value(); }
  pid_t pid() const { return pid_; }
  std::string Log() const;

 private:
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// Polls for `path` to exist and parse as a flat JSON object of numbers and
// strings; returns the value of `key` as text.
absl::StatusOr<std::string> WaitForReadyField(const std::string& path, const std::string& key,
                                              absl::Duration timeout);

// GET http://127.0.0.1:port/path; returns status line + headers + body.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// A fresh directory under $TMPDIR (or /tmp) for one test.
std::string MakeTempDir(const std::string& prefix);

// Binds a TCP listener on 127.0.0.1 and returns (fd, port); the caller closes.
std::pair<int, int> OccupyPort();

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_PROCESS_H_
