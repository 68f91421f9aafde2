// Small file helpers with clear errors.
#ifndef DETOUR_COMMON_FILES_H_
#define DETOUR_COMMON_FILES_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detour {

absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Writes via a temporary file, fsync, rename and an fsync of the directory,
// so readers see the old or the new content, never a torn file, and the new
// content survives a crash once this returns OK. Creates missing parent
// directories. RESOURCE_EXHAUSTED when the disk is full, UNAVAILABLE for
// other write errors; the temporary file is removed on failure.
absl::Status WriteFileAtomically(const std::string& path, const std::string& content);

// fsync of a directory: makes renames and new entries in it durable.
absl::Status SyncDirectory(const std::string& dir);

// Creates `dir` (and parents) if missing and checks it is writable.
absl::Status EnsureWritableDirectory(const std::string& dir, const std::string& what);

}  // namespace detour

#endif  // DETOUR_COMMON_FILES_H_
