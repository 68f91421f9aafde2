#include "common/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace detour {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return text.str();
}

namespace {

std::string Errno(int err) { return std::strerror(err); }

// Writes all of `content` to `fd`; RESOURCE_EXHAUSTED when the disk is full.
absl::Status WriteAll(int fd, const std::string& content, const std::string& what) {
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      const std::string message = absl::StrCat("cannot write ", what, ": ", Errno(err));
      return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(message)
                                            : absl::UnavailableError(message);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot open ", dir, ": ", Errno(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return absl::UnavailableError(absl::StrCat("cannot sync ", dir, ": ", Errno(err)));
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& content) {
  std::error_code ec;
  const fs::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat("cannot create ", tmp, ": ", Errno(err));
    return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(message)
                                          : absl::UnavailableError(message);
  }
  absl::Status s = WriteAll(fd, content, tmp);
  if (s.ok() && ::fsync(fd) != 0) {
    s = absl::UnavailableError(absl::StrCat("cannot sync ", tmp, ": ", Errno(errno)));
  }
  if (::close(fd) != 0 && s.ok()) {
    s = absl::UnavailableError(absl::StrCat("cannot close ", tmp, ": ", Errno(errno)));
  }
  if (s.ok()) {
    fs::rename(tmp, target, ec);
    if (ec) s = absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ",
                                                    ec.message()));
  }
  if (!s.ok()) {
    fs::remove(tmp, ec);
    return s;
  }
  // The rename is durable once the directory entry is.
  return SyncDirectory(dir);
}

absl::Status EnsureWritableDirectory(const std::string& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": cannot create directory ", dir, ": ", ec.message()));
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": directory ", dir,
                                                      " is not writable"));
  }
  return absl::OkStatus();
}

}  // namespace detour
