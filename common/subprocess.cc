#include "common/subprocess.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace detour {

ChildProcess::~ChildProcess() {
  CloseInput();
  if (running()) {
    ::kill(pid_, SIGKILL);
    Wait(absl::Seconds(5));
  }
}

absl::Status ChildProcess::Start(const std::vector<std::string>& argv, const std::string& log_path,
                                 bool own_group) {
  return Spawn(argv, log_path, own_group, /*pipe_input=*/false, "");
}

absl::Status ChildProcess::StartWithInput(const std::vector<std::string>& argv,
                                          const std::string& log_path,
                                          const std::string& working_dir) {
  return Spawn(argv, log_path, /*own_group=*/false, /*pipe_input=*/true, working_dir);
}

absl::Status ChildProcess::Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                                 bool own_group, bool pipe_input, const std::string& working_dir) {
  log_path_ = log_path;
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int input[2] = {-1, -1};
  if (pipe_input && ::pipe2(input, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    if (pipe_input) {
      ::close(input[0]);
      ::close(input[1]);
    }
    return absl::InternalError("fork failed");
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (own_group) ::setpgid(0, 0);
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::close(fd);
    }
    // dup2 clears close-on-exec on the copy: the read end survives exec as
    // standard input, both originals do not.
    if (pipe_input) ::dup2(input[0], STDIN_FILENO);
    if (!working_dir.empty() && ::chdir(working_dir.c_str()) != 0) ::_exit(127);
    // Signals blocked by the test runner must not stay blocked in the child.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  if (pipe_input) {
    ::close(input[0]);
    input_fd_ = input[1];
  }
  pid_ = pid;
  return absl::OkStatus();
}

absl::Status ChildProcess::WriteInput(absl::string_view data) {
  if (input_fd_ < 0) return absl::FailedPreconditionError("the child has no input pipe");
  // A write to a pipe nobody reads raises SIGPIPE, which would end this
  // process: block it in this thread, and take back the one a failed write
  // left pending, so only the EPIPE status remains.
  sigset_t pipe_only, old;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  sigset_t pending;
  sigemptyset(&pending);
  ::sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  ::pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
  absl::Status status;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(input_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      if (err == EPIPE && !was_pending) {
        const timespec zero = {0, 0};
        ::sigtimedwait(&pipe_only, nullptr, &zero);
      }
      status = absl::UnavailableError(absl::StrCat(
          "writing to ", log_path_.empty() ? "the child" : "the child logging to " + log_path_,
          ": ", std::strerror(err)));
      break;
    }
    done += static_cast<size_t>(n);
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return status;
}

void ChildProcess::CloseInput() {
  if (input_fd_ >= 0) ::close(input_fd_);
  input_fd_ = -1;
}

void ChildProcess::Signal(int sig) {
  if (running()) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(absl::Duration timeout) {
  if (exit_code_.has_value()) return exit_code_;
  if (pid_ <= 0) return std::nullopt;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (absl::Now() > deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

int ChildProcess::Stop(absl::Duration grace) {
  if (!running()) return exit_code_.value_or(-1);
  Signal(SIGTERM);
  if (auto code = Wait(grace)) return *code;
  Signal(SIGKILL);
  return Wait(absl::Seconds(5)).value_or(-1);
}

std::string ChildProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::string> WaitForReadyField(const std::string& path, const std::string& key,
                                              absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      const std::string needle = absl::StrCat("\"", key, "\": ");
      const size_t at = s.find(needle);
      if (at != std::string::npos) {
        size_t begin = at + needle.size();
        size_t end = begin;
        if (s[begin] == '"') {
          ++begin;
          end = s.find('"', begin);
        } else {
          end = s.find_first_of(",}", begin);
        }
        if (end != std::string::npos) return s.substr(begin, end - begin);
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("no \"", key, "\" in ", path, " after ", absl::FormatDuration(timeout)));
}

}  // namespace detour
