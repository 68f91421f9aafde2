// Where tests find the source tree (spec examples) and the build tree (the
// daemons' binaries): $DETOUR_SOURCE_DIR / $DETOUR_BUILD_DIR when set, else
// the paths compiled in by detour_add_test. And where a test process keeps
// its scratch files.
#ifndef DETOUR_TESTS_TEST_PATHS_H_
#define DETOUR_TESTS_TEST_PATHS_H_

#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

// A directory of this test process's own under $TMPDIR (or /tmp),
// `detour-test.XXXXXX`, made on first use and removed with what is in it
// when the process exits (unless DETOUR_E2E_KEEP_DIRS=1, for whoever reads
// a failure). Aborts, naming the path, when none can be made: it never
// hands back a shared directory. For files a test makes and forgets
// (certificates, specs, plans); an e2e test's daemons each get a TempDir
// (tests/e2e/process.h).
inline const std::string& ProcessTempDir() {
  struct Dir {
    std::string path;
    Dir() {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern =
          std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/detour-test.XXXXXX";
      if (::mkdtemp(pattern.data()) == nullptr) {
        std::fprintf(stderr, "cannot make a test directory %s: %s\n", pattern.c_str(),
                     std::strerror(errno));
        std::abort();
      }
      path = pattern;
    }
    ~Dir() {
      const char* keep = std::getenv("DETOUR_E2E_KEEP_DIRS");
      if (keep != nullptr && std::string(keep) == "1") return;
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Dir dir;
  return dir.path;
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_TEST_PATHS_H_
