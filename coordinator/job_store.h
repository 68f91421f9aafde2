// Jobs the coordinator has accepted, persisted through a JobBackend so the
// job list survives a restart: by default one JSON file per job under
// <data_dir>/jobs/ (FileJobBackend). Thread-safe. Listeners are told about
// every change of a job (Watch streams use this).
#ifndef DETOUR_COORDINATOR_JOB_STORE_H_
#define DETOUR_COORDINATOR_JOB_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/file_job_backend.h"
#include "coordinator/job_backend.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

class JobStore {
 public:
  using Listener = std::function<void(const v1::Job&)>;

  using FileWriter = FileJobBackend::FileWriter;

  // Files: `data_dir` is created if missing; jobs live in <data_dir>/jobs.
  explicit JobStore(std::string data_dir);
  JobStore(std::string data_dir, FileWriter writer);
  // Any backend (not null).
  explicit JobStore(std::unique_ptr<JobBackend> backend);

  const JobBackend& backend() const { return *backend_; }

  // Reads every stored job. Unreadable records are reported and skipped,
  // never deleted. Returns how many jobs were loaded.
  absl::StatusOr<int> Load();

  // The newest events a job's history keeps.
  static constexpr int kMaxHistory = 200;

  // Stores a new PENDING job for an already validated spec, owned by
  // `owner` (who submitted it; "" = no one in particular).
  absl::StatusOr<v1::Job> Create(const v1::JobSpec& spec, absl::Time now,
                                 const std::string& message, const std::string& owner = "");
  absl::StatusOr<v1::Job> Get(const std::string& id) const;
  // Newest first; `state` JOB_STATE_UNSPECIFIED = all.
  std::vector<v1::Job> List(v1::JobState state) const;

  // One page of List: jobs older than `after_id` ("" = from the newest) and
  // owned by `owner` ("" = anyone's), at most `max_jobs` (>= 1) of them, and stopping before the
  // job that would take the page's serialized size past `max_bytes` (the first job is always
  // taken). `more` says whether a matching job follows the page. Copies only
  // the page.
  struct Page {
    std::vector<v1::Job> jobs;
    bool more = false;
  };
  Page ListPage(v1::JobState state, const std::string& after_id, size_t max_jobs, size_t max_bytes,
                const std::string& owner = "") const;

  // Moves a job that has not ended to CANCELLED with `message`.
  // FAILED_PRECONDITION when it already ended, NOT_FOUND when unknown.
  absl::StatusOr<v1::Job> Cancel(const std::string& id, absl::Time now,
                                 const std::string& message = "cancelled by request");

  // Appends `event` to the job's history (the newest kMaxHistory stay).
  absl::StatusOr<v1::Job> AddEvent(const std::string& id, const v1::JobHistoryEvent& event);
  // Appends `event` to `job`'s history as AddEvent does to a stored job's.
  static void AppendEvent(v1::Job* job, const v1::JobHistoryEvent& event);

  // Applies `mutate` to a stored job, persists it and tells listeners. When
  // the backend refuses the write (a full disk: RESOURCE_EXHAUSTED; the
  // record changed since it was read: ABORTED) the change still takes effect
  // in memory, is logged, and the error is returned.
  absl::StatusOr<v1::Job> Update(const std::string& id,
                                 const std::function<void(v1::Job*)>& mutate);

  // Called after every change of job `id` (outside the store's lock, on the
  // changing thread); an empty `id` listens to every job. Returns a handle
  // for RemoveListener.
  uint64_t AddListener(const std::string& id, Listener listener);
  // Calls `listener` at once with job `id` as it is now, then after every
  // change of it, in the order the changes were made: no change falls
  // between the first call and the next, and none arrives before the first.
  // NOT_FOUND (and no listener added) when the job is unknown.
  absl::StatusOr<uint64_t> Follow(const std::string& id, Listener listener);
  void RemoveListener(uint64_t handle);

  // Jobs per state, for metrics.
  std::map<v1::JobState, int> CountByState() const;

  static bool IsFinal(v1::JobState state);

 private:
  void Notify(const v1::Job& job);

  const std::unique_ptr<JobBackend> backend_;
  // Serialises Create/Update's backend writes (taken before mu_, never
  // under it).
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  // Each job and the revision of its record as last read or written.
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);

  absl::Mutex listeners_mu_;
  struct ListenerEntry {
    std::string job_id;
    Listener fn;
  };
  std::map<uint64_t, ListenerEntry> listeners_ ABSL_GUARDED_BY(listeners_mu_);
  uint64_t next_listener_ ABSL_GUARDED_BY(listeners_mu_) = 1;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_STORE_H_
