#include "common/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
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

}  // namespace

absl::StatusOr<std::string> ReadFileBounded(const std::string& path, uint64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::UnavailableError(absl::StrCat("cannot stat ", path, ": ", Errno(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": ", st.st_size, " bytes, more than the limit ", max_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string out;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    if (out.size() + static_cast<uint64_t>(n) > max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path, ": more than the limit of ", max_bytes, " bytes (it grew)"));
    }
    out.append(buf, static_cast<size_t>(n));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return out;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", Errno(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot map ", path, ": ", Errno(err)));
    }
    f->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return std::shared_ptr<const MappedFile>(std::move(f));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

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
    if (ec)
      s = absl::UnavailableError(
          absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
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
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": directory ", dir, " is not writable"));
  }
  return absl::OkStatus();
}

absl::Status CheckPrivateFile(const std::string& path, const std::string& what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat(what, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  if (st.st_uid == ::geteuid() && (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", path, " has mode ", mode,
                     ": others may read or change this secret, so it is refused (as ssh refuses "
                     "such keys); run: chmod 600 ",
                     path));
  }
  return absl::OkStatus();
}

}  // namespace detour
