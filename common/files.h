// Small file helpers with clear errors.
#ifndef DETOUR_COMMON_FILES_H_
#define DETOUR_COMMON_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detour {

absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Writes via a temporary file and rename, so readers see the old or the new
// content, never a torn file. Creates missing parent directories.
absl::Status WriteFileAtomically(const std::string& path, const std::string& content);

// Creates `dir` (and parents) if missing and checks it is writable.
absl::Status EnsureWritableDirectory(const std::string& dir, const std::string& what);

}  // namespace detour

#endif  // DETOUR_COMMON_FILES_H_
