// Where tests find the source tree (spec examples) and the build tree (the
// daemons' binaries): $DETOUR_SOURCE_DIR / $DETOUR_BUILD_DIR when set, else
// the paths compiled in by detour_add_test. And where a test process keeps
// its scratch files (tests/temp_dirs.h).
#ifndef DETOUR_TESTS_TEST_PATHS_H_
#define DETOUR_TESTS_TEST_PATHS_H_

#include <cstdlib>
#include <string>

#include "tests/temp_dirs.h"

namespace detour::testing {

inline std::string SourceDir() {
  const char* dir = std::getenv("DETOUR_SOURCE_DIR");
  return dir != nullptr ? dir : DETOUR_SOURCE_DIR_DEFAULT;
}

inline std::string BuildDir() {
  const char* dir = std::getenv("DETOUR_BUILD_DIR");
  return dir != nullptr ? dir : DETOUR_BUILD_DIR_DEFAULT;
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_TEST_PATHS_H_
