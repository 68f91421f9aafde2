// The job store's records in etcd, so that they outlive the coordinator's
// machine. Keys under a prefix (default "/detour/"):
//   <prefix>jobs/<job id>   the job's record (JSON, as the files hold it)
//   <prefix>job_counter     the highest job number given out (decimal)
//   <prefix>leader          the elected coordinator (LeaderElection); the
//                           revision that created it is the leader's term
//   <prefix>workers/<id>    the leader's worker records, for the next leader
//                           (EtcdWorkerDirectory; not this class's)
// Every write is a transaction on the mod_revision its writer read: a record
// changed by someone else is an error (ABORTED), never overwritten. Once
// fenced (FenceWrites), the same transaction also compares that
// <prefix>leader was created at the writer's term: a deposed leader's write
// is refused by etcd itself (FAILED_PRECONDITION), however late it arrives. A new job
// takes its number from the counter and is created in the same transaction,
// so ids stay unique across coordinators sharing the prefix. Records larger
// than etcd's request limit are refused before they are sent. Checkpoints
// and other blobs stay out: only the record (with its checkpoint index and
// events) is stored. Thread-safe.
#ifndef DETOUR_COORDINATOR_ETCD_ETCD_JOB_BACKEND_H_
#define DETOUR_COORDINATOR_ETCD_ETCD_JOB_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/etcd/etcd_client.h"
#include "coordinator/job_backend.h"

namespace detour {

class EtcdJobBackend : public JobBackend {
 public:
  // The most jobs LoadAll takes.
  static constexpr size_t kMaxJobs = 1000000;

  // INVALID_ARGUMENT unless `prefix` starts and ends with '/' (and is not
  // "/" alone, nor over 256 bytes).
  static absl::Status CheckPrefix(const std::string& prefix);
  // `prefix` as CheckPrefix wants it.
  static absl::StatusOr<std::unique_ptr<EtcdJobBackend>> Create(std::unique_ptr<EtcdClient> client,
                                                                std::string prefix);

  std::string Describe() const override;
  // Reads every record under <prefix>jobs/ at one revision, in pages.
  // Records that do not parse, or whose id is not their key's, are reported
  // and left where they are.
  absl::StatusOr<std::vector<JobRecord>> LoadAll() override;
  absl::StatusOr<JobRecord> Create(const std::function<v1::Job(uint64_t number)>& make) override;
  absl::StatusOr<int64_t> Write(const v1::Job& job, int64_t read_revision) override;
  void FenceWrites(int64_t term) override;
  bool Replicated() const override { return true; }

  std::string JobKey(const std::string& id) const;
  std::string CounterKey() const { return prefix_ + "job_counter"; }
  // The election's key, whose create_revision fenced writes compare.
  std::string LeaderKey() const { return prefix_ + "leader"; }
  EtcdClient& client() { return *client_; }

 private:
  EtcdJobBackend(std::unique_ptr<EtcdClient> client, std::string prefix);
  // One page of LoadAll: keys from `from` on, at `revision` (0 = now).
  absl::StatusOr<EtcdClient::RangeResult> LoadPage(const std::string& from, int64_t revision);
  // A write whose transaction failed its compare: ABORTED or NOT_FOUND, or
  // the new revision when the record holds our own earlier write whose
  // answer was lost (then written again on that revision).
  absl::StatusOr<int64_t> ResolveConflict(const v1::Job& job, const std::string& value,
                                          const etcdserverpb::TxnResponse& failed);
  absl::StatusOr<int64_t> TryWrite(const std::string& key, const std::string& value,
                                   int64_t read_revision, etcdserverpb::TxnResponse* response);
  // The fence's term (0 = none). With one, adds its compare to `txn` and a
  // read of the leader key as the failure's last operation.
  int64_t AddFence(etcdserverpb::TxnRequest* txn);
  // OK unless `failed` (a transaction AddFence fenced with `term`) failed
  // because the leader key is no longer that term's: then FAILED_PRECONDITION
  // naming `what`.
  absl::Status CheckFence(const etcdserverpb::TxnResponse& failed, int64_t term,
                          absl::string_view what) const;

  const std::unique_ptr<EtcdClient> client_;
  const std::string prefix_;
  absl::Mutex mu_;
  // Job id -> the value of a write whose outcome is unknown (no answer in
  // time): if it landed after all, the next write finds it there.
  std::map<std::string, std::string> unknown_writes_ ABSL_GUARDED_BY(mu_);
  int64_t fence_term_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_ETCD_ETCD_JOB_BACKEND_H_
