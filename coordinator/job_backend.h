// Where the job store keeps its records: the interface JobStore writes
// through, so that the records can live in files on one machine
// (FileJobBackend, the default) or in a replicated store. Every write names
// the revision its writer read, and a record changed since is an error, never
// overwritten.
#ifndef DETOUR_COORDINATOR_JOB_BACKEND_H_
#define DETOUR_COORDINATOR_JOB_BACKEND_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

// One stored job and the revision it was read at. Revisions are positive and
// grow with every write of the record; what they count is the backend's own
// (a counter per file, the store's revision in etcd).
struct JobRecord {
  v1::Job job;
  int64_t revision = 0;
};

// Implementations are thread-safe; JobStore still calls the writes one at a
// time.
class JobBackend {
 public:
  virtual ~JobBackend() = default;

  // Names where the records are, for logs ("<dir>", "etcd://h1:2379 /detour/").
  virtual std::string Describe() const = 0;

  // Every readable stored job. Unreadable records are reported and kept
  // aside, never deleted; a new job never takes the id of one of them.
  virtual absl::StatusOr<std::vector<JobRecord>> LoadAll() = 0;

  // Stores a new job built by `make` for a job number that no job of this
  // backend ever had (ids are made from it; see JobStore::Create). Nothing is
  // stored when it fails.
  virtual absl::StatusOr<JobRecord> Create(const std::function<v1::Job(uint64_t number)>& make) = 0;

  // Replaces the record of `job.id()` if its revision is still
  // `read_revision`, and returns the new revision. ABORTED when the record
  // was written since (by another writer), NOT_FOUND when there is none;
  // other codes when the store refused or could not be reached.
  virtual absl::StatusOr<int64_t> Write(const v1::Job& job, int64_t read_revision) = 0;

  // Binds every later Create and Write to the leader's term `term` (> 0):
  // each lands only while the store still holds this writer's election of
  // that term, in the same atomic step as the write, so a deposed leader's
  // last write cannot land after a new leader took over. A fenced write
  // fails with FAILED_PRECONDITION and stores nothing. 0 lifts the fence.
  // Backends without an election (the files: one coordinator) ignore it.
  virtual void FenceWrites(int64_t term) { (void)term; }

  // True when several coordinators share the records and one of them leads
  // (etcd): a job whose record cannot be written then holds and writes again
  // instead of failing, since a new leader takes over from the stored record
  // when this one cannot keep its lease (RunnerRecord::Hold).
  virtual bool Replicated() const { return false; }
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_BACKEND_H_
