// Where tests find the source tree (spec examples) and the build tree (the
// daemons' binaries): $DETOUR_SOURCE_DIR / $DETOUR_BUILD_DIR when set, else
// the paths compiled in by detour_add_test. And where a test process keeps
// its scratch files.
#ifndef DETOUR_TESTS_TEST_PATHS_H_
#define DETOUR_TESTS_TEST_PATHS_H_

#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace detour::testing {

inline std::string SourceDir() {
  const char* dir = std::getenv("DETOUR_SOURCE_DIR");
  return dir != nullptr ? dir : DETOUR_SOURCE_DIR_DEFAULT;
}

inline std::string BuildDir() {
  const char* dir = std::getenv("DETOUR_BUILD_DIR");
  return dir != nullptr ? dir : DETOUR_BUILD_DIR_DEFAULT;
}

// A fresh directory under $TMPDIR (or /tmp) for one test, `prefix-XXXXXX`.
// Throws std::runtime_error (the test fails, naming it) when none can be
// made: never hands back a shared directory that a clean-up would empty.
inline std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("cannot make a test directory " + pattern + ": " +
                             std::strerror(errno));
  }
  return pattern;
}

// Whether a test's directories stay after it: DETOUR_E2E_KEEP_DIRS=1.
inline bool KeepTestDirs() {
  const char* keep = std::getenv("DETOUR_E2E_KEEP_DIRS");
  return keep != nullptr && std::string(keep) == "1";
}

// A directory of this test process's own (MakeTempDir, `detour-test-XXXXXX`),
// made on first use and removed with what is in it when the process exits
// (unless KeepTestDirs(), for whoever reads a failure). For files a test
// makes and forgets (certificates, specs, plans); an e2e test's daemons each
// get a TempDir (tests/e2e/process.h).
inline const std::string& ProcessTempDir() {
  struct Dir {
    std::string path = MakeTempDir("detour-test");
    ~Dir() {
      if (KeepTestDirs()) return;
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_TEST_PATHS_H_
