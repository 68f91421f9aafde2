// A fuzz target's scratch folder: made once per process under the temporary
// directory ($TMPDIR, else /tmp) as `detour-fuzz-<name>.XXXXXX`, and removed
// when the process exits normally (libFuzzer at the end of its time or runs,
// the corpus replay test at its end). A crash leaves it, with the input that
// caused it beside the artifacts.
#ifndef DETOUR_TESTS_FUZZ_SCRATCH_DIR_H_
#define DETOUR_TESTS_FUZZ_SCRATCH_DIR_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace detour::fuzz {

inline std::string& ScratchDirPath() {
  static std::string path;
  return path;
}

inline void RemoveScratchDir() {
  std::error_code ignored;
  if (!ScratchDirPath().empty()) std::filesystem::remove_all(ScratchDirPath(), ignored);
}

// Aborts when the folder cannot be made: a fuzz target without it would
// report every input as a failure.
inline const std::string& ScratchDir(const std::string& name) {
  static const std::string& dir = [&]() -> const std::string& {
    std::string pattern =
        (std::filesystem::temp_directory_path() / ("detour-fuzz-" + name + ".XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    ScratchDirPath() = pattern;
    std::atexit(RemoveScratchDir);
    return ScratchDirPath();
  }();
  return dir;
}

}  // namespace detour::fuzz

#endif  // DETOUR_TESTS_FUZZ_SCRATCH_DIR_H_
