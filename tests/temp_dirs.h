// Scratch directories of tests and fuzz targets: one per test, or one per
// process removed when it exits. Apart from tests/test_paths.h, whose paths
// need detour_add_test's definitions, so that the fuzz targets can use it.
#ifndef DETOUR_TESTS_TEMP_DIRS_H_
#define DETOUR_TESTS_TEMP_DIRS_H_

#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace detour::testing {

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

#endif  // DETOUR_TESTS_TEMP_DIRS_H_
