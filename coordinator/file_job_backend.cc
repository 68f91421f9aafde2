#include "coordinator/file_job_backend.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace detour {
namespace {

namespace fs = std::filesystem;

// Renames `path` to the first free `<path>.corrupt[.N]`; returns the name
// (or `path` when the rename fails: then it stays where it is).
std::string KeepAside(const std::string& path) {
  std::error_code ec;
  for (int n = 0; n < 1000; ++n) {
    const std::string aside = n == 0 ? path + ".corrupt" : absl::StrCat(path, ".corrupt.", n);
    if (fs::exists(aside, ec)) continue;
    fs::rename(path, aside, ec);
    return ec ? path : aside;
  }
  return path;
}

}  // namespace

FileJobBackend::FileJobBackend(const std::string& data_dir, FileWriter writer)
    : dir_((fs::path(data_dir) / "jobs").string()), writer_(std::move(writer)) {}

absl::StatusOr<std::vector<JobRecord>> FileJobBackend::LoadAll() {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create job directory ", dir_, ": ", ec.message()));
  }
  std::vector<JobRecord> records;
  absl::MutexLock lock(&mu_);
  for (const auto& file : fs::directory_iterator(dir_, ec)) {
    const std::string path = file.path().string();
    if (file.path().extension() != ".json") continue;
    // Numbering continues after every file, readable or not, so a new job
    // never takes the name of one kept aside.
    const std::string stem = file.path().stem().string();
    uint64_t number = 0;
    if (absl::StartsWith(stem, "job-") && absl::SimpleAtoi(stem.substr(4), &number)) {
      next_number_ = std::max(next_number_, number + 1);
    }
    auto text = ReadFileToString(path);
    v1::Job job;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;  // written by a newer version
    std::string problem;
    if (!text.ok()) {
      problem = std::string(text.status().message());
    } else if (auto status = google::protobuf::util::JsonStringToMessage(*text, &job, options);
               !status.ok()) {
      problem = std::string(status.message());
    } else if (job.id() != stem) {
      problem = absl::StrCat("it holds job id \"", job.id(), "\", not ", stem);
    }
    if (!problem.empty()) {
      // Kept aside, never overwritten, never silently hiding another job.
      const std::string aside = KeepAside(path);
      LogWarning("job file ", path, " is unreadable (", problem, "); kept as ", aside);
      continue;
    }
    revisions_[job.id()] = 1;
    records.push_back(JobRecord{std::move(job), 1});
  }
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot list ", dir_, ": ", ec.message()));
  }
  return records;
}

absl::Status FileJobBackend::Persist(const v1::Job& job) const {
  return writer_((fs::path(dir_) / (job.id() + ".json")).string(), ToJson(job));
}

absl::StatusOr<JobRecord> FileJobBackend::Create(
    const std::function<v1::Job(uint64_t number)>& make) {
  absl::MutexLock lock(&mu_);
  JobRecord record{make(next_number_), 1};
  if (revisions_.count(record.job.id()) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("job ", record.job.id(), " is already stored"));
  }
  // A refused write takes no number: the next job gets the same one.
  if (absl::Status persisted = Persist(record.job); !persisted.ok()) return persisted;
  ++next_number_;
  revisions_[record.job.id()] = 1;
  return record;
}

absl::StatusOr<int64_t> FileJobBackend::Write(const v1::Job& job, int64_t read_revision) {
  absl::MutexLock lock(&mu_);
  auto it = revisions_.find(job.id());
  if (it == revisions_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job.id(), " has no record in ", dir_));
  }
  if (it->second != read_revision) {
    return absl::AbortedError(absl::StrCat("job ", job.id(), ": its record in ", dir_,
                                           " is at revision ", it->second, ", not ", read_revision,
                                           " as read; not overwritten"));
  }
  RETURN_IF_ERROR(Persist(job));
  return ++it->second;
}

}  // namespace detour
