// Helpers for end-to-end tests: HTTP scrapes, temporary directories, busy
// ports. Child processes come from common/subprocess.h.
#ifndef DETOUR_TESTS_E2E_PROCESS_H_
#define DETOUR_TESTS_E2E_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/subprocess.h"
#include "tests/test_paths.h"

namespace detour::testing {

using ::detour::ChildProcess;
using ::detour::WaitForReadyField;

// A TCP connection to 127.0.0.1:port (close-on-exec), or -1. From `from`
// when given: another loopback address (127.0.0.2 ...), which the daemons'
// connection admission counts as another source.
int ConnectLoopback(int port, const std::string& from = "");

// GET http://127.0.0.1:port/path; returns status line + headers + body.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// The value of `series` (a metric name, with its labels if it has any, e.g.
// `name{peer="w2"}`) in a Prometheus text scrape, or -1 when it is absent or
// unparseable.
double MetricValue(const std::string& scrape, const std::string& series);

// A directory of a test's own (MakeTempDir), removed with what is in it when
// the object goes, unless the test has failed or DETOUR_E2E_KEEP_DIRS=1:
// then it stays and its path is printed, for whoever reads the failure.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) : path_(MakeTempDir(prefix)) {}
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Binds a TCP listener on 127.0.0.1 and returns (fd, port); the caller closes.
std::pair<int, int> OccupyPort();

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_PROCESS_H_
