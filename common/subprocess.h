// Child processes for the local launcher and the end-to-end tests: start a
// program with its output appended to a log file, signal it, wait for its
// exit with a timeout. The destructor kills what is still running, so no
// child outlives its owner. Thread-compatible.
#ifndef DETOUR_COMMON_SUBPROCESS_H_
#define DETOUR_COMMON_SUBPROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace detour {

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Runs argv[0] (a path) with stdout and stderr appended to `log_path`. The
  // child dies with its parent (PR_SET_PDEATHSIG). With `own_group` it gets
  // its own process group, so a terminal's Ctrl-C reaches only the parent,
  // which then stops its children in order.
  absl::Status Start(const std::vector<std::string>& argv, const std::string& log_path,
                     bool own_group = false);
  // Same, with the child's standard input a pipe that WriteInput feeds and
  // CloseInput ends, and run in `working_dir` when it is not empty.
  absl::Status StartWithInput(const std::vector<std::string>& argv, const std::string& log_path,
                              const std::string& working_dir = "");
  // Writes all of `data` to the child's standard input. UNAVAILABLE when the
  // child closed it or died (EPIPE, reported as a status: this process gets
  // no SIGPIPE for it), FAILED_PRECONDITION without an input pipe.
  absl::Status WriteInput(absl::string_view data);
  // Closes the input pipe (the child reads end-of-file); no-op without one.
  void CloseInput();
  void Signal(int sig);
  // Exit status (or 128+signal) once the process ended within `timeout`.
  std::optional<int> Wait(absl::Duration timeout);
  // SIGTERM, then SIGKILL after `grace`; returns the exit status.
  int Stop(absl::Duration grace);
  bool running() const { return pid_ > 0 && !exit_code_.has_value(); }
  pid_t pid() const { return pid_; }
  std::string Log() const;

 private:
  absl::Status Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                     bool own_group, bool pipe_input, const std::string& working_dir);

  pid_t pid_ = -1;
  int input_fd_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// Polls `path` (a daemon's --ready_file, a flat JSON object) until it holds
// `key`; returns the value as text (numbers as written, strings unquoted).
// DEADLINE_EXCEEDED after `timeout`.
absl::StatusOr<std::string> WaitForReadyField(const std::string& path, const std::string& key,
                                              absl::Duration timeout);

}  // namespace detour

#endif  // DETOUR_COMMON_SUBPROCESS_H_
