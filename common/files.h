// Small file helpers with clear errors.
#ifndef DETOUR_COMMON_FILES_H_
#define DETOUR_COMMON_FILES_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detour {

absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Reads a regular file of at most `max_bytes`: NOT_FOUND when missing,
// INVALID_ARGUMENT when not a regular file, RESOURCE_EXHAUSTED naming the
// path when larger (checked before reading and while reading).
absl::StatusOr<std::string> ReadFileBounded(const std::string& path, uint64_t max_bytes);

// A regular file mapped read-only into memory for the life of the object.
// The bytes are what the file held when mapped; a file truncated under a
// mapping would fault, so map only files this process's users don't rewrite
// in place (detour's data files are replaced by rename). Thread-safe.
class MappedFile {
 public:
  // NOT_FOUND when missing, INVALID_ARGUMENT when not a regular file.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  std::string path_;
};

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

// A file holding a secret (a bearer token) must not be readable or writable
// by others, as ssh requires of private keys: when this process's user owns
// `path` and its mode has any group or other bit, PERMISSION_DENIED naming
// `what`, the file, its mode and the `chmod 600` that fixes it. A file owned
// by someone else (root, with group read for a service account, as a
// Kubernetes Secret is mounted) is left to its owner. NOT_FOUND when missing.
absl::Status CheckPrivateFile(const std::string& path, const std::string& what);

}  // namespace detour

#endif  // DETOUR_COMMON_FILES_H_
