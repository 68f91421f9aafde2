// Test helper: what a piece of code writes to the process's stderr (file
// descriptor 2, so C stdio, our logs and gRPC core's all count), captured
// through a temporary file.
#ifndef DETOUR_TESTS_CAPTURE_STDERR_H_
#define DETOUR_TESTS_CAPTURE_STDERR_H_

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace detour::testing {

// A number per capture in this process, for the file's name.
inline int NextCaptureNumber() {
  static std::atomic<int> n{0};
  return ++n;
}

// Runs `fn` with stderr going to a file of its own; returns what was
// written, and gives stderr back whatever `fn` did.
template <typename Fn>
std::string CaptureStderr(Fn fn) {
  const std::string path = ::testing::TempDir() + "/stderr." + std::to_string(::getpid()) + "." +
                           std::to_string(NextCaptureNumber());
  std::fflush(stderr);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(fd, STDERR_FILENO);
  ::close(fd);
  fn();
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path.c_str());
  return text.str();
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_CAPTURE_STDERR_H_
