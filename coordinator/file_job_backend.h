// The job store's default backend: one JSON file per job under
// <data_dir>/jobs, written durably (temporary file, fsync, rename). Meant for
// one coordinator per directory: revisions are counted in memory from 1 at
// load, so the compare-and-swap guards this process's own writers only.
// Thread-safe.
#ifndef DETOUR_COORDINATOR_FILE_JOB_BACKEND_H_
#define DETOUR_COORDINATOR_FILE_JOB_BACKEND_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/job_backend.h"

namespace detour {

class FileJobBackend : public JobBackend {
 public:
  // Writes one record file durably; WriteFileAtomically (common/files.h)
  // unless a test passes its own.
  using FileWriter =
      std::function<absl::Status(const std::string& path, const std::string& content)>;

  // `data_dir` is created at LoadAll if missing; jobs live in <data_dir>/jobs.
  FileJobBackend(const std::string& data_dir, FileWriter writer);

  std::string Describe() const override { return dir_; }
  // Files that cannot be read or parsed, or that hold another job's id, are
  // renamed to <name>.corrupt[.N] and reported.
  absl::StatusOr<std::vector<JobRecord>> LoadAll() override;
  absl::StatusOr<JobRecord> Create(const std::function<v1::Job(uint64_t number)>& make) override;
  absl::StatusOr<int64_t> Write(const v1::Job& job, int64_t read_revision) override;

 private:
  absl::Status Persist(const v1::Job& job) const;

  const std::string dir_;
  const FileWriter writer_;
  absl::Mutex mu_;
  // Job id -> revision of its file, for every job loaded or created.
  std::map<std::string, int64_t> revisions_ ABSL_GUARDED_BY(mu_);
  // Numbering continues after every file, readable or not.
  uint64_t next_number_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_FILE_JOB_BACKEND_H_
