// Where tests find the source tree (spec examples) and the build tree (the
// daemons' binaries): $DETOUR_SOURCE_DIR / $DETOUR_BUILD_DIR when set, else
// the paths configured into the build's one generated source
// (tests/test_paths.cc.in, the detour_test_paths library every test links).
// No test compiles a path in, so a clone in another folder hits the compiler
// cache a build here filled. And where a test process keeps its scratch
// files (tests/temp_dirs.h).
#ifndef DETOUR_TESTS_TEST_PATHS_H_
#define DETOUR_TESTS_TEST_PATHS_H_

#include <string>

#include "tests/temp_dirs.h"

namespace detour::testing {

std::string SourceDir();
std::string BuildDir();

}  // namespace detour::testing

#endif  // DETOUR_TESTS_TEST_PATHS_H_
